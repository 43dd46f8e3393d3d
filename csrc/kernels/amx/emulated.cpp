// AMX GEMM through a plain C++ emulation of the tile instructions it uses (ldtilecfg, tilezero, tileloadd,
// tilestored, tdpbf16ps, tdpbsud, tdpbssd), following the pseudocode of the Intel SDM. Portable (baseline x86-64
// flags): it lets the tests run the AMX loop/layout logic of gemm.h on any machine; far too slow for real work. A tile
// operation whose shapes do not match the configuration throws, where the hardware would fault.
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "kernels/amx/gemm.h"
#include "kernels/dispatch.h"

namespace hetmoe {
namespace amx {
namespace {

struct TileState {
  alignas(64) uint8_t t[8][1024];
  int rows[8];
  int colsb[8];
  bool configured = false;
};
thread_local TileState st;

inline float bf16_daz(uint16_t v) {  // tdpbf16ps treats denormal inputs as zero
  if ((v & 0x7f80) == 0) v &= 0x8000;
  uint32_t bits = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float ftz(float f) { return std::fabs(f) < 1.17549435e-38f ? std::copysign(0.f, f) : f; }

void need(bool ok, const char* what) {
  if (!ok) throw std::logic_error(std::string("emulated AMX: ") + what);
}

template <bool kSigned>
struct EmulatedT : PlainEpilogue {
  static constexpr bool kSignedB = kSigned;
  static void configure(int a_colsb, int b_rows) {
    need(a_colsb > 0 && a_colsb <= 64 && a_colsb % 4 == 0 && b_rows > 0 && b_rows <= 16, "invalid tile config");
    for (int i = 0; i < 8; ++i) {
      st.rows[i] = i < 6 ? 16 : b_rows;
      st.colsb[i] = i == 4 || i == 5 ? a_colsb : 64;
    }
    std::memset(st.t, 0, sizeof(st.t));  // ldtilecfg zeroes every tile
    st.configured = true;
  }
  static void release() { st.configured = false; }

  static void load(int tile, const void* p, size_t stride) {
    need(st.configured, "tileloadd without a tile configuration");
    std::memset(st.t[tile], 0, 1024);
    for (int r = 0; r < st.rows[tile]; ++r)
      std::memcpy(st.t[tile] + 64 * r, static_cast<const uint8_t*>(p) + r * stride, st.colsb[tile]);
  }
  template <int I, int J>
  static void zero_c() {
    need(st.configured, "tilezero without a tile configuration");
    std::memset(st.t[2 * I + J], 0, 1024);
  }
  template <int I>
  static void load_a(const void* p) {
    load(4 + I, p, 64);
  }
  template <int J>
  static void load_b(const void* p) {
    load(6 + J, p, 64);
  }
  template <int I, int J>
  static void load_c(const void* p, size_t stride) {
    load(2 * I + J, p, stride);
  }

  // Shapes every tdp* checks: C is rows(A) x colsb(B), and A's K (colsb / 4 dwords) is B's rows.
  static void check_dp(int c, int a, int b) {
    need(st.configured, "tdp* without a tile configuration");
    need(st.rows[c] == st.rows[a] && st.colsb[c] == st.colsb[b] && st.colsb[a] / 4 == st.rows[b],
         "tdp* operand shapes do not match");
  }
  template <int I, int J>
  static void dp_bf16() {
    const int c = 2 * I + J, a = 4 + I, b = 6 + J;
    check_dp(c, a, b);
    for (int m = 0; m < st.rows[c]; ++m) {
      float* crow = reinterpret_cast<float*>(st.t[c] + 64 * m);
      const uint16_t* arow = reinterpret_cast<const uint16_t*>(st.t[a] + 64 * m);
      for (int k = 0; k < st.colsb[a] / 4; ++k) {
        const uint16_t* brow = reinterpret_cast<const uint16_t*>(st.t[b] + 64 * k);
        for (int n = 0; n < st.colsb[c] / 4; ++n) {
          // bf16 x bf16 products are exact in fp32; each sum is rounded (to nearest even), output denormals flushed.
          crow[n] = ftz(crow[n] + bf16_daz(arow[2 * k]) * bf16_daz(brow[2 * n]));
          crow[n] = ftz(crow[n] + bf16_daz(arow[2 * k + 1]) * bf16_daz(brow[2 * n + 1]));
        }
      }
    }
  }
  template <int I, int J>
  static void dp_int8() {  // tdpbsud: signed A bytes x unsigned B bytes (tdpbssd: signed B), int32 sums (wrapping)
    const int c = 2 * I + J, a = 4 + I, b = 6 + J;
    check_dp(c, a, b);
    for (int m = 0; m < st.rows[c]; ++m) {
      uint32_t* crow = reinterpret_cast<uint32_t*>(st.t[c] + 64 * m);
      const int8_t* arow = reinterpret_cast<const int8_t*>(st.t[a] + 64 * m);
      for (int k = 0; k < st.colsb[a] / 4; ++k) {
        const uint8_t* brow = st.t[b] + 64 * k;
        for (int n = 0; n < st.colsb[c] / 4; ++n) {
          int32_t s = 0;
          for (int i = 0; i < 4; ++i)
            s += (int32_t)arow[4 * k + i] * (kSigned ? (int32_t)(int8_t)brow[4 * n + i] : (int32_t)brow[4 * n + i]);
          crow[n] += (uint32_t)s;
        }
      }
    }
  }
  template <int I, int J>
  static void store_c(void* p, size_t stride) {
    const int c = 2 * I + J;
    need(st.configured, "tilestored without a tile configuration");
    for (int r = 0; r < st.rows[c]; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, st.t[c] + 64 * r, st.colsb[c]);
  }
  static void unpack_int4(const uint8_t* src, int n_lines, uint8_t* dst) {
    for (int l = 0; l < n_lines; ++l)
      for (int b = 0; b < 64; ++b) {
        dst[128 * l + b] = (uint8_t)((src[64 * l + b] & 0x0f) - (kSigned ? 8 : 0));
        dst[128 * l + 64 + b] = (uint8_t)((src[64 * l + b] >> 4) - (kSigned ? 8 : 0));
      }
  }
  static void unpack_lut4(const uint8_t* src, int n_lines, const int8_t* codebook, uint8_t* dst) {
    for (int l = 0; l < n_lines; ++l)
      for (int b = 0; b < 64; ++b) {
        dst[128 * l + b] = (uint8_t)codebook[src[64 * l + b] & 0x0f];
        dst[128 * l + 64 + b] = (uint8_t)codebook[src[64 * l + b] >> 4];
      }
  }
  static void unpack_fp8(const uint8_t* src, int n_lines, uint8_t* dst) {
    scalar::fp8_to_bf16_lines(src, n_lines, dst);
  }
  static void prefetch_l2(const void*) {}
};
using Emulated = EmulatedT<false>;

// The GEMM whose grouped int8 calls of up to kTwoSetMax tokens take the two-set loop (bf16 has no grouped loop;
// int4 and lut4 take the two-set loop at every length).
template <int kTwoSetMax>
GemmKernel emulated_with(WeightFormat f, bool int4_signed) {
  switch (f) {
    case WeightFormat::bf16: return Gemm<Emulated>::bf16;
    case WeightFormat::int8: return Gemm<Emulated, kTwoSetMax>::int8;
    case WeightFormat::int4:
      return int4_signed ? int4_gemm<Emulated, EmulatedT<true>, kTwoSetMax> : Gemm<Emulated, kTwoSetMax>::int4;
    case WeightFormat::lut4: return Gemm<EmulatedT<true>, kTwoSetMax>::lut4;
    case WeightFormat::fp8: return Gemm<Emulated>::fp8;
    case WeightFormat::int6: return Gemm<Emulated, kTwoSetMax>::template planes<WeightFormat::int6>;
    case WeightFormat::int5: return Gemm<Emulated, kTwoSetMax>::template planes<WeightFormat::int5>;
    case WeightFormat::int3: return Gemm<Emulated, kTwoSetMax>::template planes<WeightFormat::int3>;
    case WeightFormat::int2: return Gemm<Emulated, kTwoSetMax>::template planes<WeightFormat::int2>;
    case WeightFormat::grid: return Gemm<EmulatedT<true>, kTwoSetMax>::grid;
  }
  return nullptr;
}

}  // namespace

GemmKernel emulated_gemm(WeightFormat f, const GemmVariant& v) {
  switch (v.loop) {
    case GroupedLoop::engine: return emulated_with<kTwoSetMaxTokens>(f, v.int4_signed);
    case GroupedLoop::two_set: return emulated_with<INT_MAX>(f, v.int4_signed);
    case GroupedLoop::one_set: return emulated_with<0>(f, v.int4_signed);
  }
  return nullptr;
}

}  // namespace amx
}  // namespace hetmoe
