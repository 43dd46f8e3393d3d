// AMX GEMM with the real tile instructions (compiled with -mamx-* and AVX-512 flags, called only after CPUID,
// XCR0 and the kernel's arch_prctl permission said yes; see runtime/cpu_features.h). The tile instructions are
// written as inline asm with the tile number as an immediate: GCC's _tile_* macros stringize their tile
// argument (so it cannot be a template parameter) and declare no memory access (so stores to a buffer a tile
// then loads could be reordered around them).
#include <immintrin.h>

#include "kernels/amx/gemm.h"
#include "kernels/dispatch.h"

namespace hetmoe {
namespace amx {
namespace {

#define HETMOE_AI inline __attribute__((always_inline))

template <bool kSigned>
struct NativeT {
  static constexpr bool kSignedB = kSigned;
  static void configure(int a_colsb, int b_rows) {
    alignas(64) uint8_t cfg[64] = {};
    cfg[0] = 1;  // palette 1
    for (int i = 0; i < 8; ++i) {
      const uint16_t colsb = i == 4 || i == 5 ? (uint16_t)a_colsb : 64;
      std::memcpy(cfg + 16 + 2 * i, &colsb, 2);
      cfg[48 + i] = (uint8_t)(i < 6 ? 16 : b_rows);
    }
    asm volatile("ldtilecfg %0" ::"m"(*reinterpret_cast<const uint8_t(*)[64]>(cfg)));
  }
  static void release() { asm volatile("tilerelease" ::: "memory"); }
  template <int I, int J>
  static HETMOE_AI void zero_c() {
    asm volatile("tilezero %%tmm%c0" ::"i"(2 * I + J));
  }
  template <int I>
  static HETMOE_AI void load_a(const void* p) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"((size_t)64), "i"(4 + I) : "memory");
  }
  template <int J>
  static HETMOE_AI void load_b(const void* p) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"((size_t)64), "i"(6 + J) : "memory");
  }
  template <int I, int J>
  static HETMOE_AI void load_c(const void* p, size_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(2 * I + J) : "memory");
  }
  template <int I, int J>
  static HETMOE_AI void dp_bf16() {
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(2 * I + J), "i"(4 + I), "i"(6 + J));
  }
  template <int I, int J>
  static HETMOE_AI void dp_int8() {
    if constexpr (kSigned)
      asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(2 * I + J), "i"(4 + I), "i"(6 + J));
    else
      asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(2 * I + J), "i"(4 + I), "i"(6 + J));
  }
  template <int I, int J>
  static HETMOE_AI void store_c(void* p, size_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(2 * I + J) : "memory");
  }
  static void unpack_int4(const uint8_t* src, int n_lines, uint8_t* dst) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), bias = _mm512_set1_epi8(kSigned ? 8 : 0);
    for (int l = 0; l < n_lines; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(src) + 64 * l + 1024, _MM_HINT_T0);
      const __m512i v = _mm512_load_si512(src + 64 * l);
      _mm512_store_si512(dst + 128 * l, _mm512_sub_epi8(_mm512_and_si512(v, low4), bias));
      _mm512_store_si512(dst + 128 * l + 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), bias));
    }
  }
  static void unpack_lut4(const uint8_t* src, int n_lines, const int8_t* codebook, uint8_t* dst) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i cb = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codebook)));
    for (int l = 0; l < n_lines; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(src) + 64 * l + 1024, _MM_HINT_T0);
      const __m512i v = _mm512_load_si512(src + 64 * l);
      _mm512_store_si512(dst + 128 * l, _mm512_shuffle_epi8(cb, _mm512_and_si512(v, low4)));
      _mm512_store_si512(dst + 128 * l + 64, _mm512_shuffle_epi8(cb, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)));
    }
  }
  static void unpack_fp8(const uint8_t* src, int n_lines, uint8_t* dst) {
    avx512::fp8_to_bf16_lines(src, n_lines, dst);
  }
  static HETMOE_AI void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T2); }
  // gemm.h epilogue_rows with intrinsics: the same operations per output (so the same bits), the block scales
  // (and mins) of the group loaded once, and each 16 outputs one load of the sums, a subtract, a convert, a multiply,
  // an fma with `out` and a store.
  template <bool kAffine, int NB>
  static void epilogue_rows(float* out, const int32_t* c, const float* const* ws, const float* const* wm,
                            const AmxPanel& x, int m0, int rows, int g, int32_t offset) {
    __m512 w[NB], m[NB] = {};
    for (int j = 0; j < NB; ++j) {
      w[j] = _mm512_loadu_ps(ws[j]);
      if constexpr (kAffine) m[j] = _mm512_loadu_ps(wm[j]);
    }
    for (int t = 0; t < rows; ++t) {
      const __m512 xs = _mm512_set1_ps(x.scales(m0 + t)[g]);
      const int32_t xsum = x.sums(m0 + t)[g];
      float* o = out + (size_t)t * kOutStride;
      const int32_t* ct = c + (size_t)t * kOutStride;
      for (int j = 0; j < NB; ++j) {  // (maskz_cvt: GCC 12 warns on the unmasked form's undefined pass-through here)
        __m512i isum = _mm512_loadu_si512(ct + 16 * j);
        if constexpr (!kAffine) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset * xsum));
        __m512 acc = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xffff, isum), _mm512_mul_ps(w[j], xs),
                                     _mm512_loadu_ps(o + 16 * j));
        if constexpr (kAffine) acc = _mm512_fmadd_ps(_mm512_set1_ps((float)(-xsum)), _mm512_mul_ps(m[j], xs), acc);
        _mm512_storeu_ps(o + 16 * j, acc);
      }
    }
  }
};
using Native = NativeT<false>;

}  // namespace

uint64_t peak_loop(bool bf16, int64_t rounds) {
  Native::configure(64, 16);
  asm volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3\n\t"
               "tilezero %%tmm4\n\ttilezero %%tmm5\n\ttilezero %%tmm6\n\ttilezero %%tmm7" ::);
  for (int64_t i = 0; i < rounds; ++i) {
    if (bf16) {
      Native::dp_bf16<0, 0>(), Native::dp_bf16<0, 1>(), Native::dp_bf16<1, 0>(), Native::dp_bf16<1, 1>();
    } else {
      Native::dp_int8<0, 0>(), Native::dp_int8<0, 1>(), Native::dp_int8<1, 0>(), Native::dp_int8<1, 1>();
    }
  }
  Native::release();
  return (uint64_t)rounds * 4 * 16 * 16 * (bf16 ? 32 : 64);
}

GemmKernel gemm(WeightFormat f) {
  static constexpr GemmKernel kByFormat[kWeightFormats] = {Gemm<Native>::bf16,
                                                           Gemm<Native>::int8,
                                                           int4_gemm<Native, NativeT<true>>,
                                                           Gemm<NativeT<true>>::lut4,
                                                           Gemm<Native>::fp8,
                                                           Gemm<Native>::planes<WeightFormat::int6>,
                                                           Gemm<Native>::planes<WeightFormat::int5>,
                                                           Gemm<Native>::planes<WeightFormat::int3>,
                                                           Gemm<Native>::planes<WeightFormat::int2>,
                                                           Gemm<NativeT<true>>::grid};
  return kByFormat[(int)f];
}

}  // namespace amx
}  // namespace hetmoe
