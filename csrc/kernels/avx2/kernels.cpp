// AVX2 + FMA micro-kernels (compiled with -mavx2 -mfma; called only when CPUID reports them).
// Tokens are processed in tiles of NT so each weight line loaded from memory serves NT tokens.
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cstring>

#include "formats/activation.h"
#include "formats/grid.h"
#include "kernels/dispatch.h"
#include "kernels/row_ops.h"
#include "kernels/tiles.h"

namespace hetmoe {
namespace avx2 {

namespace {

// bf16 weights x fp32 activations: even and odd k accumulate in separate registers (two independent fma
// chains per row, so one token is not latency-bound), summed at the end.
template <int NT>
struct Bf16Tile {
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout&, float* out) {
    const int lines = w.kp / 2;
    const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);
    const float* x[NT];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const float*>(rows[i]);
    __m256 even[NT][2], odd[NT][2];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) even[i][0] = even[i][1] = odd[i][0] = odd[i][1] = _mm256_setzero_ps();
    const uint8_t* p = w.data;
    for (int j = 0; j < lines; ++j, p += kLineBytes) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
        __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        __m256 o = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) {
          even[i][half] = _mm256_fmadd_ps(e, _mm256_broadcast_ss(x[i] + 2 * j), even[i][half]);
          odd[i][half] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(x[i] + 2 * j + 1), odd[i][half]);
        }
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) {
      _mm256_storeu_ps(out + i * kRowsPerBlock, _mm256_add_ps(even[i][0], odd[i][0]));
      _mm256_storeu_ps(out + i * kRowsPerBlock + 8, _mm256_add_ps(even[i][1], odd[i][1]));
    }
  }
};

// 8 stored values of a one-level float type (f32, f16, bf16) at p as fp32: one load and one conversion.
inline __m256 plain8(ScaleType t, const uint8_t* p) {
  if (t == ScaleType::f16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (t == ScaleType::bf16) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
  return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}

// Values 8 * half .. 8 * half + 7 of group g of a scale set of w (its scales, or its mins) as fp32 (formats/layout.h:
// one load and one conversion, k8 / k4 two and a multiply, e4m3 a multiply by the block's factor, zero-point mins the
// scales times the converted bytes; exact, the bits of RowBlock::value).
inline __m256 widen8(const RowBlock& w, const uint8_t* set, int g, int half) {
  if (zero_points(w.scale_type)) {  // the base type's scales; the mins fl(scale * z) of the int8 zero points
    const ScaleType base = zp_base(w.scale_type);
    const __m256 sc = plain8(base, w.group_of(w.scales, g) + 8 * half * scale_width(base));
    if (set != w.mins) return sc;
    const __m128i z8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.group_of(w.mins, g) + 8 * half));
    return _mm256_mul_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(z8)));
  }
  const uint8_t* p = w.group_of(set, g) + 8 * half * scale_width(w.scale_type);
  switch (w.scale_type) {
    case ScaleType::f16:
    case ScaleType::bf16: return plain8(w.scale_type, p);
    case ScaleType::f32_zp:
    case ScaleType::f16_zp:
    case ScaleType::bf16_zp: break;  // above
    case ScaleType::e8m0: {          // 2^(e - 128): exponent field e - 1, or for e < 2 the subnormal 2^-128 << e
      const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
      const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
      return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
    }
    case ScaleType::k8: {  // int8 sub-scale x fp16 super scale
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
      const uint8_t* d = w.super_of(set, g) + 16 * half;
      return _mm256_mul_ps(sc, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d))));
    }
    case ScaleType::k4: {  // 4-bit sub-scale (low nibble) or sub-min (high) x fp16 super scale / min
      __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      if (w.sub_shift(set)) b = _mm256_srli_epi32(b, 4);
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
      const uint8_t* d = w.super_of(set, g) + 16 * half;
      return _mm256_mul_ps(sc, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d))));
    }
    case ScaleType::e4m3:
    case ScaleType::e4m3_div: {  // E4M3 byte -> half of e4m3 * 2^-8 -> fp32, times (or over) the block's factor
      const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16((short)0x8000)),
                                     _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
      const __m256 v = _mm256_cvtph_ps(h), f = _mm256_set1_ps(w.factor);
      return w.scale_type == ScaleType::e4m3 ? _mm256_mul_ps(v, f) : _mm256_div_ps(v, f);
    }
    case ScaleType::f32: break;
  }
  return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}
inline __m256 scales8(const RowBlock& w, int g, int half) { return widen8(w, w.scales, g, half); }
// Mins 8 * half .. of group g (affine kernels only; zeros otherwise, unused).
template <bool kAffine>
inline __m256 mins8(const RowBlock& w, int g, int half) {
  if constexpr (kAffine) return widen8(w, w.mins, g, half);
  return _mm256_setzero_ps();
}

// acc += float(isum - offset * xsum) * (w_scale * x_scale), for 8 rows; affine (offset 0): then
// acc += float(-xsum) * (w_min * x_scale) (formats/layout.h). As on AVX-512, a kernel body per scaling (kAffine).
// wscale / wmin: the 8 rows' weight scales and mins (scales8, mins8).
template <bool kAffine>
inline __m256 epilogue8(__m256 acc, __m256i isum, int32_t offset, int32_t xsum, __m256 wscale, __m256 wmin,
                        float xscale) {
  if constexpr (kAffine) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(wscale, _mm256_set1_ps(xscale)), acc);
    return _mm256_fmadd_ps(_mm256_set1_ps((float)(-xsum)), _mm256_mul_ps(wmin, _mm256_set1_ps(xscale)), acc);
  }
  isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset * xsum));
  __m256 s = _mm256_mul_ps(wscale, _mm256_set1_ps(xscale));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, acc);
}

// int8 weights (unsigned, offset 128, or affine) x int16 activations. A 16-byte chunk is 4 rows x 4 k; madd gives
// per-row pairs that one hadd + permute turns into 8 row sums.
template <int NT>
struct Int8Tile {
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    w.mins ? body<true>(w, rows, a, out) : body<false>(w, rows, a, out);
  }
  template <bool kAffine>
  static void body(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    const int lines_per_group = w.group / 4, n_groups = w.kp / w.group;
    const int16_t* x[NT];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const int16_t*>(rows[i]);
    __m256 facc[NT][2];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
    const uint8_t* p = w.data;
    for (int g = 0; g < n_groups; ++g) {
      __m256i acc[NT][4];
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i)
#pragma GCC unroll 8
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm256_setzero_si256();
      for (int jj = 0; jj < lines_per_group; ++jj, p += kLineBytes) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        const int j = g * lines_per_group + jj;
        __m256i xb[NT];
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) {
          int64_t q4;
          std::memcpy(&q4, x[i] + 4 * j, 8);
          xb[i] = _mm256_set1_epi64x(q4);
        }
#pragma GCC unroll 8
        for (int c = 0; c < 4; ++c) {
          __m256i w16 = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(p + 16 * c)));
#pragma GCC unroll 8
          for (int i = 0; i < NT; ++i) acc[i][c] = _mm256_add_epi32(acc[i][c], _mm256_madd_epi16(w16, xb[i]));
        }
      }
      const __m256 ws0 = scales8(w, g, 0), ws1 = scales8(w, g, 1);
      const __m256 wm0 = mins8<kAffine>(w, g, 0), wm1 = mins8<kAffine>(w, g, 1);
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) {
        const float xs = act_scales(rows[i], a)[g];
        const int32_t xsum = act_sums(rows[i], a)[g];
        __m256i lo = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[i][0], acc[i][1]), 0xD8);
        __m256i hi = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[i][2], acc[i][3]), 0xD8);
        facc[i][0] = epilogue8<kAffine>(facc[i][0], lo, 128, xsum, ws0, wm0, xs);
        facc[i][1] = epilogue8<kAffine>(facc[i][1], hi, 128, xsum, ws1, wm1, xs);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) {
      _mm256_storeu_ps(out + i * kRowsPerBlock, facc[i][0]);
      _mm256_storeu_ps(out + i * kRowsPerBlock + 8, facc[i][1]);
    }
  }
};

// int4 weights (unsigned nibbles, offset 8, or affine) x int8 activations. maddubs sums stay in int16 for 4 lines
// (|sum| <= 4 * 2 * 2 * 15 * 127 = 30480), then widen to int32.
template <int NT>
struct Int4Tile {
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    w.mins ? body<true>(w, rows, a, out) : body<false>(w, rows, a, out);
  }
  template <bool kAffine>
  static void body(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    const int lines_per_group = w.group / 8, n_groups = w.kp / w.group;
    const int step = lines_per_group < 4 ? lines_per_group : 4;  // lines summed in int16 (group 16: 2)
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int8_t* x[NT];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const int8_t*>(rows[i]);
    __m256 facc[NT][2];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
    const uint8_t* p = w.data;
    for (int g = 0; g < n_groups; ++g) {
      __m256i acc[NT][2];
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
      for (int j4 = 0; j4 < lines_per_group; j4 += step) {
        __m256i acc16[NT][2];
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) acc16[i][0] = acc16[i][1] = _mm256_setzero_si256();
        for (int jj = 0; jj < step; ++jj, p += kLineBytes) {
          _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
          const int j = g * lines_per_group + j4 + jj;
          __m256i xl[NT], xh[NT];
#pragma GCC unroll 8
          for (int i = 0; i < NT; ++i) {
            int32_t l, h;
            std::memcpy(&l, x[i] + 8 * j, 4);
            std::memcpy(&h, x[i] + 8 * j + 4, 4);
            xl[i] = _mm256_set1_epi32(l);
            xh[i] = _mm256_set1_epi32(h);
          }
#pragma GCC unroll 8
          for (int half = 0; half < 2; ++half) {
            __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
            __m256i lo = _mm256_and_si256(v, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
            for (int i = 0; i < NT; ++i) {
              __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[i]), _mm256_maddubs_epi16(hi, xh[i]));
              acc16[i][half] = _mm256_add_epi16(acc16[i][half], s);
            }
          }
        }
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i)
#pragma GCC unroll 8
          for (int half = 0; half < 2; ++half)
            acc[i][half] = _mm256_add_epi32(acc[i][half], _mm256_madd_epi16(acc16[i][half], ones));
      }
      const __m256 ws0 = scales8(w, g, 0), ws1 = scales8(w, g, 1);
      const __m256 wm0 = mins8<kAffine>(w, g, 0), wm1 = mins8<kAffine>(w, g, 1);
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) {
        const float xs = act_scales(rows[i], a)[g];
        const int32_t xsum = act_sums(rows[i], a)[g];
        facc[i][0] = epilogue8<kAffine>(facc[i][0], acc[i][0], 8, xsum, ws0, wm0, xs);
        facc[i][1] = epilogue8<kAffine>(facc[i][1], acc[i][1], 8, xsum, ws1, wm1, xs);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) {
      _mm256_storeu_ps(out + i * kRowsPerBlock, facc[i][0]);
      _mm256_storeu_ps(out + i * kRowsPerBlock + 8, facc[i][1]);
    }
  }
};

// One token (decode), the same sums as Int4Tile<NT> written for a weight stream at DRAM speed. The int16 sums use
// saturating adds, which never saturate here (the bound above) and give the same bits, but which the compiler may
// not reassociate: with wrapping adds it rebalances the 4 lines' sums into a tree that spills 16 ymm registers.
// The line is loaded once (not once more inside each `and`), and prefetched further ahead than the tiles do: one
// token's lines pass quickly, and 512 bytes ahead did not cover DRAM latency (BENCHMARKS.md#cpu-only).
constexpr int kInt4RowPrefetchBytes = 1024;

template <>
struct Int4Tile<1> {
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    w.mins ? body<true>(w, rows[0], a, out) : body<false>(w, rows[0], a, out);
  }
  // The 16 rows' partial sums of one 32-byte half of a line (8 rows x 8 k): int16, two per row.
  static __m256i half_line(const uint8_t* p, int32_t xl, int32_t xh, __m256i low4) {
    __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
    asm("" : "+x"(v));  // one load, kept in a register for both nibbles
    const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    return _mm256_adds_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)),
                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
  }
  template <bool kAffine>
  static void body(const RowBlock& w, const uint8_t* row, const ActLayout& a, float* out) {
    const int lines_per_group = w.group / 8, n_groups = w.kp / w.group;
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int8_t* x = reinterpret_cast<const int8_t*>(row);
    const float* xscales = act_scales(row, a);
    const int32_t* xsums = act_sums(row, a);
    __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
    const uint8_t* p = w.data;
    for (int g = 0; g < n_groups; ++g) {
      __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
      for (int j4 = 0; j4 < lines_per_group; j4 += 4) {
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        if (lines_per_group == 2) {  // group 16: one pair of lines
          for (int jj = 0; jj < 2; ++jj, p += kLineBytes, x += 8) {
            _mm_prefetch(reinterpret_cast<const char*>(p) + kInt4RowPrefetchBytes, _MM_HINT_T0);
            int32_t xl, xh;
            std::memcpy(&xl, x, 4);
            std::memcpy(&xh, x + 4, 4);
            s0 = _mm256_adds_epi16(s0, half_line(p, xl, xh, low4));
            s1 = _mm256_adds_epi16(s1, half_line(p + 32, xl, xh, low4));
          }
          a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(s0, ones));
          a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(s1, ones));
          break;
        }
#pragma GCC unroll 4
        for (int jj = 0; jj < 4; ++jj, p += kLineBytes, x += 8) {
          _mm_prefetch(reinterpret_cast<const char*>(p) + kInt4RowPrefetchBytes, _MM_HINT_T0);
          int32_t xl, xh;
          std::memcpy(&xl, x, 4);
          std::memcpy(&xh, x + 4, 4);
          s0 = _mm256_adds_epi16(s0, half_line(p, xl, xh, low4));
          s1 = _mm256_adds_epi16(s1, half_line(p + 32, xl, xh, low4));
        }
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(s0, ones));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(s1, ones));
      }
      f0 = epilogue8<kAffine>(f0, a0, 8, xsums[g], scales8(w, g, 0), mins8<kAffine>(w, g, 0), xscales[g]);
      f1 = epilogue8<kAffine>(f1, a1, 8, xsums[g], scales8(w, g, 1), mins8<kAffine>(w, g, 1), xscales[g]);
    }
    _mm256_storeu_ps(out, f0);
    _mm256_storeu_ps(out + 8, f1);
  }
};

// lut4 weights x int8 activations: each nibble looked up (vpshufb) into its signed codebook value q, multiplied by
// the activation with the sign trick (maddubs(|x|, sign(q, x)) = q * x pairwise, |x| <= 127 and |q| <= 127 keep
// each pair within int16) and widened to int32 per line. The sum is the exact sum of q * x: no offset to undo. A
// codebook of |q| <= 64 (E2M1's 12) keeps the low and high nibbles' pairs summed within int16 too (2 * 2 * 127 * 64
// < 32768): one widening per half line instead of two (kSmall; the same integers).
inline bool small_codebook(const int8_t* cb) {
  for (int i = 0; i < 16; ++i)
    if (cb[i] > 64 || cb[i] < -64) return false;
  return true;
}

template <int NT>
struct Lut4Tile {
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    small_codebook(w.codebook) ? body<true>(w, rows, a, out) : body<false>(w, rows, a, out);
  }
  template <bool kSmall>
  static void body(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    const int lines_per_group = w.group / 8, n_groups = w.kp / w.group;
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codebook)));
    const int8_t* x[NT];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const int8_t*>(rows[i]);
    __m256 facc[NT][2];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
    const uint8_t* p = w.data;
    for (int g = 0; g < n_groups; ++g) {
      __m256i acc[NT][2];
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
      for (int jj = 0; jj < lines_per_group; ++jj, p += kLineBytes) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        const int j = g * lines_per_group + jj;
        __m256i xl[NT], xh[NT];
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) {
          int32_t l, h;
          std::memcpy(&l, x[i] + 8 * j, 4);
          std::memcpy(&h, x[i] + 8 * j + 4, 4);
          xl[i] = _mm256_set1_epi32(l);
          xh[i] = _mm256_set1_epi32(h);
        }
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
          const __m256i ql = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low4));
          const __m256i qh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
#pragma GCC unroll 8
          for (int i = 0; i < NT; ++i) {
            const __m256i pl = _mm256_maddubs_epi16(_mm256_abs_epi8(xl[i]), _mm256_sign_epi8(ql, xl[i]));
            const __m256i ph = _mm256_maddubs_epi16(_mm256_abs_epi8(xh[i]), _mm256_sign_epi8(qh, xh[i]));
            const __m256i wide = kSmall ? _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones)
                                        : _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones));
            acc[i][half] = _mm256_add_epi32(acc[i][half], wide);
          }
        }
      }
      const __m256 ws0 = scales8(w, g, 0), ws1 = scales8(w, g, 1);
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) {
        const float xs = act_scales(rows[i], a)[g];
        const int32_t xsum = act_sums(rows[i], a)[g];
        facc[i][0] = epilogue8<false>(facc[i][0], acc[i][0], 0, xsum, ws0, _mm256_setzero_ps(), xs);
        facc[i][1] = epilogue8<false>(facc[i][1], acc[i][1], 0, xsum, ws1, _mm256_setzero_ps(), xs);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) {
      _mm256_storeu_ps(out + i * kRowsPerBlock, facc[i][0]);
      _mm256_storeu_ps(out + i * kRowsPerBlock + 8, facc[i][1]);
    }
  }
};

// grid weights (formats/layout.h): one super-block of 256 of K decoded (formats/grid.h) into 64 int8 lines of signed
// codes and [256 / group][16] fp32 scales, then NT tokens over them as Lut4Tile multiplies looked-up codes:
// maddubs(|x|, sign(q, x)) (|q| <= 63, so two lines' int16 pair sums add before the widening madd). The outputs'
// fp32 accumulators stay in `out` from one super-block to the next (the same chain as one pass).
template <int NT>
struct GridTile {
  static void run(const uint8_t* lines, const float* sc, int group, int sp, const uint8_t* const* rows,
                  const ActLayout& a, float* out) {
    const int gps = kSuperBlock / group, lines_per_group = group / 4;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* x[NT];
    __m256 facc[NT][2];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) {
      x[i] = reinterpret_cast<const int8_t*>(rows[i]) + sp * kSuperBlock;
      facc[i][0] = _mm256_loadu_ps(out + i * kRowsPerBlock);
      facc[i][1] = _mm256_loadu_ps(out + i * kRowsPerBlock + 8);
    }
    for (int g = 0; g < gps; ++g) {
      __m256i acc[NT][2];
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
      for (int j = g * lines_per_group; j < (g + 1) * lines_per_group; j += 2) {
        const uint8_t* p = lines + (size_t)j * kLineBytes;
        __m256i xa[NT], xb[NT];
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) {
          int32_t l0, l1;
          std::memcpy(&l0, x[i] + 4 * j, 4);
          std::memcpy(&l1, x[i] + 4 * j + 4, 4);
          xa[i] = _mm256_set1_epi32(l0);
          xb[i] = _mm256_set1_epi32(l1);
        }
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          const __m256i q0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
          const __m256i q1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + kLineBytes + 32 * half));
#pragma GCC unroll 8
          for (int i = 0; i < NT; ++i) {
            const __m256i p0 = _mm256_maddubs_epi16(_mm256_abs_epi8(xa[i]), _mm256_sign_epi8(q0, xa[i]));
            const __m256i p1 = _mm256_maddubs_epi16(_mm256_abs_epi8(xb[i]), _mm256_sign_epi8(q1, xb[i]));
            acc[i][half] = _mm256_add_epi32(acc[i][half], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
          }
        }
      }
      const __m256 ws0 = _mm256_loadu_ps(sc + g * kRowsPerBlock), ws1 = _mm256_loadu_ps(sc + g * kRowsPerBlock + 8);
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) {
        const float xs = act_scales(rows[i], a)[sp * gps + g];
        facc[i][0] = epilogue8<false>(facc[i][0], acc[i][0], 0, 0, ws0, _mm256_setzero_ps(), xs);
        facc[i][1] = epilogue8<false>(facc[i][1], acc[i][1], 0, 0, ws1, _mm256_setzero_ps(), xs);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) {
      _mm256_storeu_ps(out + i * kRowsPerBlock, facc[i][0]);
      _mm256_storeu_ps(out + i * kRowsPerBlock + 8, facc[i][1]);
    }
  }
};

template <int N>
inline void grid_tail(int rest, const uint8_t* lines, const float* sc, int group, int sp, const uint8_t* const* rows,
                      const ActLayout& a, float* out) {
  if constexpr (N > 0) {
    if (rest == N) return GridTile<N>::run(lines, sc, group, sp, rows, a, out);
    grid_tail<N - 1>(rest, lines, sc, group, sp, rows, a, out);
  }
}

// grid, few tokens (decode): each row's block decoded straight into registers, 32 values of K at a time, never
// written out as lines. The 32 values of one row become one vector of int8 grid magnitudes (IQ2, IQ3: four 8-value
// or eight 4-value entries of the type's grid put together) and one of +-1 signs that psignb puts onto the
// activations instead (|x| <= 127), so maddubs(magnitudes, signed x) sums the pairs in int16 (|q| <= 62: no
// saturation) and madd with ones widens them to int32: lanes 0-3 the first 16 values, 4-7 the next. IQ1_S
// multiplies g + 1 (0..2, unsigned: 8 g + delta = 8 (g + 1) + delta - 8) and adds (delta - 8) times the group's
// activation sum to 8 times that sum; IQ1_M its signed codes 8 g + delta by the sign trick of the lines path. A tree
// of hadds turns eight rows' vectors into one vector of their eight sums (group 16: two, one per half of the 32).
// The sums are the exact int32 sums of the lines path and the epilogue is its fma(float(isum), scale * x_scale, acc)
// per group in order, the scale d * (2 s + 1) * unit the one exact product of grid::row_scales: any token count,
// either path, gives the same bits (and the scalar kernel's).
namespace gridrow {

// The decoders are called at many places per tile: always inlined (out of line, their Q32 goes through memory).
#define GRID_INLINE inline __attribute__((always_inline))

// One row's 32 values of K: q its grid magnitudes (IQ2, IQ3), g + 1 (IQ1_S) or signed codes (IQ1_M); s the +-1
// signs that go onto x (IQ2, IQ3).
struct Q32 {
  __m256i q, s;
};

// Entries i0 .. i3 of a table of 8-byte words as one vector (entry j in qword j): a load and three broadcast loads
// put together by blends, which leave the shuffle unit (the vector's busiest) to the rest.
GRID_INLINE __m256i words4(const uint64_t* t, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3) {
  const __m256i a = _mm256_castsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + i0)));
  const __m256i b = _mm256_set1_epi64x((long long)t[i1]), c = _mm256_set1_epi64x((long long)t[i2]);
  const __m256i d = _mm256_set1_epi64x((long long)t[i3]);
  return _mm256_blend_epi32(_mm256_blend_epi32(a, b, 0x0C), _mm256_blend_epi32(c, d, 0xC0), 0xF0);
}

// Entries i0 .. i7 of a table of 4-byte words as one vector (entry j in dword j), as words4.
GRID_INLINE __m256i dwords8(const uint32_t* t, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3, uint32_t i4,
                            uint32_t i5, uint32_t i6, uint32_t i7) {
  const uint32_t i[8] = {i0, i1, i2, i3, i4, i5, i6, i7};
  __m256i r = _mm256_castsi128_si256(_mm_cvtsi32_si128((int)t[i0]));
#pragma GCC unroll 8
  for (int j = 1; j < 8; ++j) r = _mm256_blend_epi32(r, _mm256_set1_epi32((int)t[i[j]]), 1 << j);
  return r;
}

// Byte k: -1 where bit k of `bits` is set, else +1 (IQ2_S, IQ3_S: a sign bit per value).
GRID_INLINE __m256i signs32(uint32_t bits) {
  const __m256i spread =
      _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                          _mm256_set_epi64x(0x0303030303030303ll, 0x0202020202020202ll, 0x0101010101010101ll, 0));
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
  return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(1));
}

// The signs of four 7-bit sign indices (IQ2_XXS, IQ3_XXS: aux's low 28 bits).
GRID_INLINE __m256i signs7x4(uint32_t aux) {
  using grid::kSignOnes7;
  return words4(kSignOnes7.data(), aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127);
}

// Values 32 c .. 32 c + 31 of one row's block b (formats/grid.h chunk(): chunks 4 c .. 4 c + 3).
template <Codebook T>
GRID_INLINE Q32 decode32(const uint8_t* b, int c) {
  using namespace grid;
  Q32 r;
  if constexpr (T == Codebook::iq2_xxs) {  // 4 index bytes, then the uint32 of 4 sign indices and the scale
    uint64_t v;
    std::memcpy(&v, b + 8 * c, 8);
    r.q = words4(kIq2xxs.data(), v & 255, (v >> 8) & 255, (v >> 16) & 255, (v >> 24) & 255);
    r.s = signs7x4((uint32_t)(v >> 32));
  } else if constexpr (T == Codebook::iq2_xs) {  // 4 uint16: a 9-bit index, a 7-bit sign index
    uint64_t v;
    std::memcpy(&v, b + 8 * c, 8);
    r.q = words4(kIq2xs.data(), v & 511, (v >> 16) & 511, (v >> 32) & 511, (v >> 48) & 511);
    r.s = words4(kSignOnes7.data(), (v >> 9) & 127, (v >> 25) & 127, (v >> 41) & 127, (uint32_t)(v >> 57));
  } else if constexpr (T == Codebook::iq2_s) {  // 4 low index bytes, 2 high bits each in byte 64 + c; sign bits
    const uint32_t lo = u32_at(b + 4 * c), hi = b[64 + c];
    r.q = words4(kIq2s.data(), (lo & 255) | (hi << 8 & 0x300), (lo >> 8 & 255) | (hi << 6 & 0x300),
                 (lo >> 16 & 255) | (hi << 4 & 0x300), (lo >> 24) | (hi << 2 & 0x300));
    r.s = signs32(u32_at(b + 32 + 4 * c));
  } else if constexpr (T == Codebook::iq3_xxs) {  // 8 index bytes of 4 values each; the uint32 as IQ2_XXS's
    const uint8_t* i = b + 8 * c;
    r.q = _mm256_set_epi32((int)kIq3xxs[i[7]], (int)kIq3xxs[i[6]], (int)kIq3xxs[i[5]], (int)kIq3xxs[i[4]],
                           (int)kIq3xxs[i[3]], (int)kIq3xxs[i[2]], (int)kIq3xxs[i[1]], (int)kIq3xxs[i[0]]);
    r.s = signs7x4(u32_at(b + 64 + 4 * c));
  } else if constexpr (T == Codebook::iq3_s) {  // 8 low index bytes, bit k of byte 64 + c the 9th of index k
    // the 8 indices as 16-bit words, low bytes interleaved with the 9th bits spread to bytes
    const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ull);
    const __m128i nine =
        _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(_mm_set1_epi8((char)b[64 + c]), bit), bit), _mm_set1_epi8(1));
    const __m128i idx = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * c)), nine);
    const uint64_t i0 = (uint64_t)_mm_cvtsi128_si64(idx), i1 = (uint64_t)_mm_extract_epi64(idx, 1);
    r.q = dwords8(kIq3s.data(), i0 & 0xFFFF, (i0 >> 16) & 0xFFFF, (i0 >> 32) & 0xFFFF, i0 >> 48, i1 & 0xFFFF,
                  (i1 >> 16) & 0xFFFF, (i1 >> 32) & 0xFFFF, i1 >> 48);
    r.s = signs32(u32_at(b + 72 + 4 * c));
  } else if constexpr (T == Codebook::iq1_s) {  // 4 low index bytes; uint16 c: 4 x 3 high index bits
    const uint32_t lo = u32_at(b + 4 * c), h = u16_at(b + 32 + 2 * c);
    const __m256i g = words4(kIq1s.data(), (lo & 255) | (h << 8 & 0x700), (lo >> 8 & 255) | (h << 5 & 0x700),
                             (lo >> 16 & 255) | (h << 2 & 0x700), (lo >> 24) | (h >> 1 & 0x700));
    r.q = _mm256_add_epi8(g, _mm256_set1_epi8(1));
  } else {  // IQ1_M: 4 low index bytes; uint16 c: 4 nibbles of (3 high index bits, delta sign)
    const uint32_t lo = u32_at(b + 4 * c), n = u16_at(b + 32 + 2 * c);
    const __m256i g = words4(kIq1s.data(), (lo & 255) | (n << 8 & 0x700), (lo >> 8 & 255) | (n << 4 & 0x700),
                             (lo >> 16 & 255) | (n & 0x700), (lo >> 24) | (n >> 4 & 0x700));
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi16((short)n),
                                               _mm256_set_epi64x(0x0101010101010101ll, 0x0101010101010101ll, 0, 0));
    const __m256i bit = _mm256_set_epi64x((long long)0x8080808080808080ull, 0x0808080808080808ll,
                                          (long long)0x8080808080808080ull, 0x0808080808080808ll);
    const __m256i delta = _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(1));
    r.q = _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(g, 3), _mm256_set1_epi8((char)0xF8)), delta);
  }
  return r;
}

// The 32 values' products with x as 8 int32 pair sums (ax = |x|, IQ1_M only).
template <Codebook T>
GRID_INLINE __m256i dot32(const Q32& d, __m256i x, __m256i ax) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (T == Codebook::iq1_s) return _mm256_madd_epi16(_mm256_maddubs_epi16(d.q, x), ones);
  if constexpr (T == Codebook::iq1_m)
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(d.q, x)), ones);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(d.q, _mm256_sign_epi8(x, d.s)), ones);
}

// Row r's sub-scales 2 s + 1 into sub[g][r] (grid::row_scales), and IQ1_S's delta - 8 into fix[g][r].
template <Codebook T>
GRID_INLINE void row_subs(const uint8_t* b, int r, uint8_t (*sub)[kRowsPerBlock], int8_t (*fix)[kRowsPerBlock]) {
  using grid::u16_at;
  using grid::u32_at;
  for (int g = 0; g < kSuperBlock / grid_info(T).group; ++g) {
    int s = 0;
    if constexpr (T == Codebook::iq2_xxs) s = (int)(u32_at(b + 8 * g + 4) >> 28);
    if constexpr (T == Codebook::iq3_xxs) s = (int)(u32_at(b + 64 + 4 * g) >> 28);
    if constexpr (T == Codebook::iq2_xs) s = (b[64 + g / 2] >> (4 * (g % 2))) & 15;
    if constexpr (T == Codebook::iq2_s) s = (b[72 + g / 2] >> (4 * (g % 2))) & 15;
    if constexpr (T == Codebook::iq3_s) s = (b[104 + g / 2] >> (4 * (g % 2))) & 15;
    if constexpr (T == Codebook::iq1_s) {
      const int h = u16_at(b + 32 + 2 * g);
      s = (h >> 12) & 7;
      fix[g][r] = (int8_t)((h & 0x8000 ? -1 : 1) - 8);
    }
    if constexpr (T == Codebook::iq1_m) s = (u16_at(b + 48 + 2 * (g / 4)) >> (3 * (g % 4))) & 7;
    sub[g][r] = (uint8_t)(2 * s + 1);
  }
}

// The power of two of a grid type's scales (grid::row_scales): d * (2 s + 1) * unit.
constexpr float unit_of(Codebook t) { return t == Codebook::iq3_xxs ? 0.25f : t == Codebook::iq3_s ? 1.f : 0.125f; }

// The scales of one super-block of a grid row block of type T: each row's sub-scale integers 2 s + 1 (and IQ1_S's
// delta - 8) and the rows' d, read once and then multiplied as GridTile's fp32 scales, 8 rows at a time.
template <Codebook T>
struct SuperScales {
  static constexpr int kBytes = grid_info(T).row_bytes, kGroups = kSuperBlock / grid_info(T).group;
  alignas(16) uint8_t sub[kGroups][kRowsPerBlock];
  alignas(16) int8_t fix[kGroups][kRowsPerBlock];
  __m256 d[2];

  // blk: the super-block's 16 rows; d16: their fp16 d (IQ1_M: none, its d is in its scale words)
  SuperScales(const uint8_t* blk, const uint8_t* d16) {
    alignas(32) uint16_t d1m[kRowsPerBlock];
    for (int r = 0; r < kRowsPerBlock; ++r) {
      row_subs<T>(blk + r * kBytes, r, sub, fix);
      if constexpr (T == Codebook::iq1_m) d1m[r] = grid::iq1m_d_bits(blk + r * kBytes);
    }
    if constexpr (T == Codebook::iq1_m) d16 = reinterpret_cast<const uint8_t*>(d1m);
    d[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d16)));
    d[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d16 + 16)));
  }
  // The fp32 scales of rows 8h .. 8h + 7 in group g: d * (2 s + 1) * unit, grid::row_scales's exact products.
  __m256 scales8(int g, int h) const {
    const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub[g] + 8 * h)));
    return _mm256_mul_ps(_mm256_mul_ps(d[h], _mm256_cvtepi32_ps(s)), _mm256_set1_ps(unit_of(T)));
  }
  // IQ1_S: delta - 8 of rows 8h .. 8h + 7 in group g
  __m256i fix8(int g, int h) const {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(fix[g] + 8 * h)));
  }
};

// NT tokens over one grid row block of type T, rows decoded in registers (above). out: [NT][16].
template <Codebook T>
struct Rows {
  template <int NT>
  struct Tile {
    static constexpr int kBytes = grid_info(T).row_bytes, kGroup = grid_info(T).group;
    static constexpr int kGroups = kSuperBlock / kGroup;

    // acc += float(isum) * (scale * x_scale) (GridTile's epilogue)
    static __m256 epilogue(__m256 acc, __m256i isum, __m256 ws, float xscale) {
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ws, _mm256_set1_ps(xscale)), acc);
    }

    static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
      const int8_t* x[NT];
      const float* xs[NT];
      const int32_t* xsum[NT];
      __m256 facc[NT][2];
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        x[t] = reinterpret_cast<const int8_t*>(rows[t]);
        xs[t] = act_scales(rows[t], a);
        xsum[t] = act_sums(rows[t], a);
        facc[t][0] = facc[t][1] = _mm256_setzero_ps();
      }
      constexpr int kSuperBytes = kRowsPerBlock * kBytes;
      for (int sp = 0; sp < w.kp / kSuperBlock; ++sp) {
        const uint8_t* blk = w.data + (size_t)sp * kSuperBytes;
        for (int l = 0; l < kSuperBytes; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk) + kSuperBytes + l, _MM_HINT_T0);
        const SuperScales<T> ss(blk, w.scales + sp * 32);
        for (int c = 0; c < kSuperBlock / 32; ++c) {
          __m256i xv[NT], ax[NT];
#pragma GCC unroll 8
          for (int t = 0; t < NT; ++t) {
            xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[t] + sp * kSuperBlock + 32 * c));
            ax[t] = T == Codebook::iq1_m ? _mm256_abs_epi8(xv[t]) : xv[t];
          }
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const uint8_t* b = blk + 8 * h * kBytes;
            __m256i pair[NT][4];  // rows (2i, 2i + 1) of the 8, hadd: [2i 01, 2i 23, 2i+1 01, 2i+1 23 | .. 45, 67]
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
              const Q32 q0 = decode32<T>(b + 2 * i * kBytes, c), q1 = decode32<T>(b + (2 * i + 1) * kBytes, c);
#pragma GCC unroll 8
              for (int t = 0; t < NT; ++t)
                pair[t][i] = _mm256_hadd_epi32(dot32<T>(q0, xv[t], ax[t]), dot32<T>(q1, xv[t], ax[t]));
            }
#pragma GCC unroll 8
            for (int t = 0; t < NT; ++t) {
              // b0: rows 0-3's sums of values 0-15 | of values 16-31; b1: rows 4-7's
              const __m256i b0 = _mm256_hadd_epi32(pair[t][0], pair[t][1]);
              const __m256i b1 = _mm256_hadd_epi32(pair[t][2], pair[t][3]);
              const __m256i lo = _mm256_permute2x128_si256(b0, b1, 0x20), hi = _mm256_permute2x128_si256(b0, b1, 0x31);
              const int g0 = sp * kGroups;
              if constexpr (kGroup == 32) {
                __m256i isum = _mm256_add_epi32(lo, hi);
                if constexpr (T == Codebook::iq1_s)
                  isum = _mm256_add_epi32(_mm256_slli_epi32(isum, 3),
                                          _mm256_mullo_epi32(ss.fix8(c, h), _mm256_set1_epi32(xsum[t][g0 + c])));
                facc[t][h] = epilogue(facc[t][h], isum, ss.scales8(c, h), xs[t][g0 + c]);
              } else {
                facc[t][h] = epilogue(facc[t][h], lo, ss.scales8(2 * c, h), xs[t][g0 + 2 * c]);
                facc[t][h] = epilogue(facc[t][h], hi, ss.scales8(2 * c + 1, h), xs[t][g0 + 2 * c + 1]);
              }
            }
          }
        }
      }
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        _mm256_storeu_ps(out + t * kRowsPerBlock, facc[t][0]);
        _mm256_storeu_ps(out + t * kRowsPerBlock + 8, facc[t][1]);
      }
    }
  };
};

// One row's 32 values as signed codes (the lines' bytes): q x sign, or for IQ1_S 8 (g + 1) + delta - 8.
template <Codebook T>
GRID_INLINE __m256i codes32(const uint8_t* b, int c) {
  const Q32 q = decode32<T>(b, c);
  if constexpr (T == Codebook::iq1_m) return q.q;
  if constexpr (T == Codebook::iq1_s) {
    const int delta = grid::u16_at(b + 32 + 2 * c) & 0x8000 ? -1 : 1;
    return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(q.q, 3), _mm256_set1_epi8((char)0xF8)),
                           _mm256_set1_epi8((char)(delta - 8)));
  }
  return _mm256_sign_epi8(q.q, q.s);
}

// Super-block sp of a grid row block of type T as grid::decode_super writes it, bit for bit: 64 lines of signed codes
// (line j: k 4j .. 4j + 3 of the 16 rows) and [groups][16] fp32 scales. Eight rows' 32 values at a time, an 8 x 8
// transpose of their 4-byte pieces giving the halves of 8 lines.
template <Codebook T>
inline void decode_lines(const RowBlock& w, int sp, uint8_t* lines, float* sc) {
  constexpr int kBytes = grid_info(T).row_bytes, kGroups = kSuperBlock / grid_info(T).group;
  const uint8_t* blk = w.data + (size_t)sp * kRowsPerBlock * kBytes;
  const SuperScales<T> ss(blk, w.scales + sp * 32);
  for (int g = 0; g < kGroups; ++g)
    for (int h = 0; h < 2; ++h) _mm256_store_ps(sc + g * kRowsPerBlock + 8 * h, ss.scales8(g, h));
  for (int c = 0; c < kSuperBlock / 32; ++c) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i y[8], t[8], u[8];
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) y[r] = codes32<T>(blk + (8 * h + r) * kBytes, c);
#pragma GCC unroll 4
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(y[i], y[i + 1]);  // [r0 0, r1 0, r0 1, r1 1 | r0 4, r1 4, r0 5, r1 5]
        t[i + 1] = _mm256_unpackhi_epi32(y[i], y[i + 1]);
      }
#pragma GCC unroll 2
      for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);  // [r0-3 piece 0 | piece 4]
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
      }
      uint8_t* dst = lines + (size_t)(8 * c) * kLineBytes + 32 * h;
#pragma GCC unroll 4
      for (int m = 0; m < 4; ++m) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + m * kLineBytes),
                           _mm256_permute2x128_si256(u[m], u[m + 4], 0x20));
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + (m + 4) * kLineBytes),
                           _mm256_permute2x128_si256(u[m], u[m + 4], 0x31));
      }
    }
  }
}

#undef GRID_INLINE
}  // namespace gridrow

// Bit-plane weights (formats/layout.h; avx512/kernels.cpp plane_quad): the four byte lines of one quad of K, each as
// two halves (rows 0..7, 8..15): out[f][h].
template <WeightFormat F>
inline void plane_quad(const uint8_t* unit, int qi, __m256i (*out)[2]) {
  constexpr Planes P = planes_of(F);
  const __m256i lo_mask = _mm256_set1_epi8((char)((1 << P.lo_bits) - 1));
  const __m256i hi_mask = _mm256_set1_epi8((char)(((1 << P.hi_bits) - 1) << P.lo_bits));
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    if constexpr (P.lo_bits == 4) {
      const __m256i l0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(unit + 2 * qi * kLineBytes + 32 * h));
      const __m256i l1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(unit + (2 * qi + 1) * kLineBytes + 32 * h));
      out[0][h] = _mm256_and_si256(l0, lo_mask);
      out[1][h] = _mm256_and_si256(_mm256_srli_epi16(l0, 4), lo_mask);
      out[2][h] = _mm256_and_si256(l1, lo_mask);
      out[3][h] = _mm256_and_si256(_mm256_srli_epi16(l1, 4), lo_mask);
    } else {
      const __m256i l = _mm256_load_si256(reinterpret_cast<const __m256i*>(unit + qi * kLineBytes + 32 * h));
      out[0][h] = _mm256_and_si256(l, lo_mask);
      out[1][h] = _mm256_and_si256(_mm256_srli_epi16(l, 2), lo_mask);
      out[2][h] = _mm256_and_si256(_mm256_srli_epi16(l, 4), lo_mask);
      out[3][h] = _mm256_and_si256(_mm256_srli_epi16(l, 6), lo_mask);
    }
    if constexpr (P.hi_bits == 1) {  // the quad's 4 bits as a nibble, bit f looked up to bit lo_bits (one vpshufb)
      __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(unit + P.hi_line() * kLineBytes + 32 * h));
      if (qi) v = _mm256_srli_epi16(v, 4);  // quad 1's bits 4..7 down to 0..3
      const __m256i nib = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
#pragma GCC unroll 4
      for (int f = 0; f < 4; ++f) {
        alignas(16) uint8_t t[16];
        for (int i = 0; i < 16; ++i) t[i] = (uint8_t)(((i >> f) & 1) << P.lo_bits);
        const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
        out[f][h] = _mm256_or_si256(out[f][h], _mm256_shuffle_epi8(table, nib));
      }
    } else if constexpr (P.hi_bits > 0) {
      __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(unit + P.hi_line() * kLineBytes + 32 * h));
      if (P.quads == 2 && qi) v = _mm256_srli_epi16(v, 4);  // quad 1's bits 4..7 down to 0..3
#pragma GCC unroll 4
      for (int f = 0; f < 4; ++f) {
        const int up = P.lo_bits - P.hi_shift(0, f);
        const __m256i s = up >= 0 ? _mm256_slli_epi16(v, up) : _mm256_srli_epi16(v, -up);
        out[f][h] = _mm256_or_si256(out[f][h], _mm256_and_si256(s, hi_mask));
      }
    }
  }
}

// int6 / int5 weights x int16 activations: each byte line's 16-byte chunks (4 rows x 4 k) widened to words and
// multiplied with madd as Int8Tile does (the same integer sums as int8 of the same codes).
template <WeightFormat F>
struct PlaneWide {
  template <int NT>
  struct Tile {
    static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
      w.mins ? body<true>(w, rows, a, out) : body<false>(w, rows, a, out);
    }
    template <bool kAffine>
    static void body(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
      constexpr Planes P = planes_of(F);
      constexpr int32_t kOffset = 1 << (code_bits(F) - 1);
      const int quads_per_group = w.group / 16, n_groups = w.kp / w.group;
      const int16_t* x[NT];
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const int16_t*>(rows[i]);
      __m256 facc[NT][2];
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
      for (int g = 0; g < n_groups; ++g) {
        __m256i acc[NT][4];
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i)
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) acc[i][c] = _mm256_setzero_si256();
        for (int qq = 0; qq < quads_per_group; ++qq) {
          const int q = g * quads_per_group + qq;
          const uint8_t* unit = w.data + P.unit_offset(q);
          _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes, _MM_HINT_T0);
          __m256i bl[4][2];
          plane_quad<F>(unit, q % P.quads, bl);
#pragma GCC unroll 4
          for (int f = 0; f < 4; ++f) {
            __m256i xb[NT];
#pragma GCC unroll 8
            for (int i = 0; i < NT; ++i) {
              int64_t q4;
              std::memcpy(&q4, x[i] + 16 * q + 4 * f, 8);
              xb[i] = _mm256_set1_epi64x(q4);
            }
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
              const __m256i y = bl[f][c / 2];
              const __m256i w16 =
                  _mm256_cvtepu8_epi16(c % 2 ? _mm256_extracti128_si256(y, 1) : _mm256_castsi256_si128(y));
#pragma GCC unroll 8
              for (int i = 0; i < NT; ++i) acc[i][c] = _mm256_add_epi32(acc[i][c], _mm256_madd_epi16(w16, xb[i]));
            }
          }
        }
        const __m256 ws0 = scales8(w, g, 0), ws1 = scales8(w, g, 1);
        const __m256 wm0 = mins8<kAffine>(w, g, 0), wm1 = mins8<kAffine>(w, g, 1);
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) {
          const float xs = act_scales(rows[i], a)[g];
          const int32_t xsum = act_sums(rows[i], a)[g];
          __m256i lo = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[i][0], acc[i][1]), 0xD8);
          __m256i hi = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[i][2], acc[i][3]), 0xD8);
          facc[i][0] = epilogue8<kAffine>(facc[i][0], lo, kOffset, xsum, ws0, wm0, xs);
          facc[i][1] = epilogue8<kAffine>(facc[i][1], hi, kOffset, xsum, ws1, wm1, xs);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) {
        _mm256_storeu_ps(out + i * kRowsPerBlock, facc[i][0]);
        _mm256_storeu_ps(out + i * kRowsPerBlock + 8, facc[i][1]);
      }
    }
  };
};

// int3 / int2 weights x int8 activations: maddubs per byte line as Int4Tile's nibble halves; a quad's four lines
// summed in int16 (|sum| <= 4 * 2 * 7 * 128), then widened to int32 per row.
template <WeightFormat F>
struct PlaneNarrow {
  template <int NT>
  struct Tile {
    static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
      w.mins ? body<true>(w, rows, a, out) : body<false>(w, rows, a, out);
    }
    template <bool kAffine>
    static void body(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
      constexpr Planes P = planes_of(F);
      constexpr int32_t kOffset = 1 << (code_bits(F) - 1);
      const int quads_per_group = w.group / 16, n_groups = w.kp / w.group;
      const __m256i ones = _mm256_set1_epi16(1);
      const int8_t* x[NT];
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const int8_t*>(rows[i]);
      __m256 facc[NT][2];
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
      for (int g = 0; g < n_groups; ++g) {
        __m256i acc[NT][2];
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        for (int qq = 0; qq < quads_per_group; ++qq) {
          const int q = g * quads_per_group + qq;
          const uint8_t* unit = w.data + P.unit_offset(q);
          _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes, _MM_HINT_T0);
          __m256i bl[4][2];
          plane_quad<F>(unit, q % P.quads, bl);
#pragma GCC unroll 8
          for (int i = 0; i < NT; ++i) {
            __m256i xd[4];
#pragma GCC unroll 4
            for (int f = 0; f < 4; ++f) {
              int32_t v;
              std::memcpy(&v, x[i] + 16 * q + 4 * f, 4);
              xd[f] = _mm256_set1_epi32(v);
            }
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
              const __m256i s01 =
                  _mm256_add_epi16(_mm256_maddubs_epi16(bl[0][h], xd[0]), _mm256_maddubs_epi16(bl[1][h], xd[1]));
              const __m256i s23 =
                  _mm256_add_epi16(_mm256_maddubs_epi16(bl[2][h], xd[2]), _mm256_maddubs_epi16(bl[3][h], xd[3]));
              acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(_mm256_add_epi16(s01, s23), ones));
            }
          }
        }
        const __m256 ws0 = scales8(w, g, 0), ws1 = scales8(w, g, 1);
        const __m256 wm0 = mins8<kAffine>(w, g, 0), wm1 = mins8<kAffine>(w, g, 1);
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) {
          const float xs = act_scales(rows[i], a)[g];
          const int32_t xsum = act_sums(rows[i], a)[g];
          facc[i][0] = epilogue8<kAffine>(facc[i][0], acc[i][0], kOffset, xsum, ws0, wm0, xs);
          facc[i][1] = epilogue8<kAffine>(facc[i][1], acc[i][1], kOffset, xsum, ws1, wm1, xs);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) {
        _mm256_storeu_ps(out + i * kRowsPerBlock, facc[i][0]);
        _mm256_storeu_ps(out + i * kRowsPerBlock + 8, facc[i][1]);
      }
    }
  };
};

// One token (decode) of bit-plane weights (avx512/kernels.cpp PlaneRow): PlaneWide / PlaneNarrow<F>::Tile<1>'s int32
// sums and epilogue (the same bits), the lines read in order and prefetched once each as Int4Tile<1> does, and
// two-level scales (T: k8, k4; f32 stands for any other type, widened by widen8) widened in the body with their super
// scales converted once per super-block.
template <ScaleType T, bool kMin>
inline __m256 sub_times8(const uint8_t* p, __m256 d) {  // 8 rows' sub-scales (k4 kMin: sub-mins) x super scales
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (T == ScaleType::k8) return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d);
  __m256i v = _mm256_cvtepu8_epi32(b);
  if constexpr (kMin) v = _mm256_srli_epi32(v, 4);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), d);
}
inline __m256 super8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <WeightFormat F, ScaleType T>
struct PlaneRow {
  static void run(const RowBlock& w, const uint8_t* row, const ActLayout& a, float* out) {
    w.mins ? body<true>(w, row, a, out) : body<false>(w, row, a, out);
  }
  // The group of quads [q, q + n)'s row sums: sum[0] rows 0..7, sum[1] rows 8..15.
  static void group_sum(const uint8_t* data, const uint8_t* row, int q, int n, __m256i* sum) {
    constexpr Planes P = planes_of(F);
    __m256i acc[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[c] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int e = q + n; q < e; ++q) {
      const uint8_t* unit = data + P.unit_offset(q);
      const int qi = q % P.quads;
      if (qi == 0) {
#pragma GCC unroll 5
        for (int l = 0; l < P.lines; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(unit) + l * kLineBytes + kInt4RowPrefetchBytes, _MM_HINT_T0);
      }
      __m256i bl[4][2];
      plane_quad<F>(unit, qi, bl);
      if constexpr (wide_codes(F)) {  // PlaneWide's madd on 16-byte chunks (4 rows x 4 k): acc[c] rows 4c..4c+3
        const int16_t* x = reinterpret_cast<const int16_t*>(row) + 16 * q;
#pragma GCC unroll 4
        for (int f = 0; f < 4; ++f) {
          int64_t q4;
          std::memcpy(&q4, x + 4 * f, 8);
          const __m256i xb = _mm256_set1_epi64x(q4);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            const __m256i y = bl[f][c / 2];
            const __m256i w16 =
                _mm256_cvtepu8_epi16(c % 2 ? _mm256_extracti128_si256(y, 1) : _mm256_castsi256_si128(y));
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(w16, xb));
          }
        }
      } else {  // PlaneNarrow's maddubs, a quad's four byte lines summed in int16: acc[h] rows 8h..8h+7
        const int8_t* x = reinterpret_cast<const int8_t*>(row) + 16 * q;
        __m256i xd[4];
#pragma GCC unroll 4
        for (int f = 0; f < 4; ++f) {
          int32_t v;
          std::memcpy(&v, x + 4 * f, 4);
          xd[f] = _mm256_set1_epi32(v);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i s01 =
              _mm256_add_epi16(_mm256_maddubs_epi16(bl[0][h], xd[0]), _mm256_maddubs_epi16(bl[1][h], xd[1]));
          const __m256i s23 =
              _mm256_add_epi16(_mm256_maddubs_epi16(bl[2][h], xd[2]), _mm256_maddubs_epi16(bl[3][h], xd[3]));
          acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(_mm256_add_epi16(s01, s23), ones));
        }
      }
    }
    if constexpr (wide_codes(F)) {
      sum[0] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[0], acc[1]), 0xD8);
      sum[1] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[2], acc[3]), 0xD8);
    } else {
      sum[0] = acc[0];
      sum[1] = acc[1];
    }
  }
  template <bool kAffine>
  static void body(const RowBlock& w, const uint8_t* row, const ActLayout& a, float* out) {
    constexpr int32_t kOffset = 1 << (code_bits(F) - 1);
    constexpr bool kTwo = two_level(T);
    const int quads_per_group = w.group / 16, n_groups = w.kp / w.group, per_super = kSuperBlock / w.group;
    const float* xscales = act_scales(row, a);
    const int32_t* xsums = act_sums(row, a);
    const uint8_t* sub = w.group_of(w.scales, 0);
    const uint8_t* sub_m = kAffine ? w.group_of(w.mins, 0) : nullptr;
    const uint8_t* sup = kTwo ? w.super_of(w.scales, 0) : nullptr;
    const uint8_t* sup_m = kTwo && kAffine ? w.super_of(w.mins, 0) : nullptr;
    __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
    for (int g0 = 0, s = 0; g0 < n_groups; g0 += per_super, ++s) {
      __m256 ds[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dm[2] = {ds[0], ds[1]};
      if constexpr (kTwo) {
        ds[0] = super8(sup + 32 * s), ds[1] = super8(sup + 32 * s + 16);
        if constexpr (kAffine) dm[0] = super8(sup_m + 32 * s), dm[1] = super8(sup_m + 32 * s + 16);
      }
      const int g1 = std::min(g0 + per_super, n_groups);
      for (int g = g0; g < g1; ++g) {
        __m256i sum[2];
        group_sum(w.data, row, g * quads_per_group, quads_per_group, sum);
        __m256 ws[2], wm[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          if constexpr (kTwo) {
            ws[h] = sub_times8<T, false>(sub + 16 * g + 8 * h, ds[h]);
            if constexpr (kAffine) wm[h] = sub_times8 < T, T == ScaleType::k4 > (sub_m + 16 * g + 8 * h, dm[h]);
          } else {
            ws[h] = scales8(w, g, h);
            wm[h] = mins8<kAffine>(w, g, h);
          }
        }
        f0 = epilogue8<kAffine>(f0, sum[0], kOffset, xsums[g], ws[0], wm[0], xscales[g]);
        f1 = epilogue8<kAffine>(f1, sum[1], kOffset, xsums[g], ws[1], wm[1], xscales[g]);
      }
    }
    _mm256_storeu_ps(out, f0);
    _mm256_storeu_ps(out + 8, f1);
  }
};

// A bit-plane row block: one token on PlaneRow (its scale type's body), more on the tiles of `Tile`.
template <WeightFormat F, template <int> class Tile, int kMax>
inline void plane_rowblock(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  if (n_tok != 1) return tiles::run_tiles<kMax, Tile>(w, rows, a, n_tok, out);
  switch (w.scale_type) {
    case ScaleType::k8: return PlaneRow<F, ScaleType::k8>::run(w, rows[0], a, out);
    case ScaleType::k4: return PlaneRow<F, ScaleType::k4>::run(w, rows[0], a, out);
    default: return PlaneRow<F, ScaleType::f32>::run(w, rows[0], a, out);
  }
}

// fp8 (formats/layout.h, avx512/kernels.cpp Fp8Tile): one 32-byte half of a line (rows 8h..8h+7) as fp32 q * 2^-8
// in four vectors of row pairs: lo[q] rows 8h + 4q .. + 3 as (k, k + 2) pairs of bytes 0 and 2, hi[q] of bytes 1, 3.
struct Fp8Half {
  __m256 lo[2], hi[2];
};
inline Fp8Half fp8_half(__m256i v) {
  const __m256i mask = _mm256_set1_epi16((short)0xbf80);
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(v, 1), mask);
  const __m256i l = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 1), mask);
  Fp8Half f;
  f.lo[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(l));
  f.lo[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(l, 1));
  f.hi[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  f.hi[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  return f;
}

// 8 rows' (c0 + c1) + (c2 + c3) of a group from the pair accumulators of their two quarters.
inline __m256 fp8_group_sum(const __m256* lo, const __m256* hi) {
  const __m256 s0 = _mm256_add_ps(lo[0], hi[0]), s1 = _mm256_add_ps(lo[1], hi[1]);  // c0 + c1, c2 + c3 per row
  const __m256 t0 = _mm256_add_ps(s0, _mm256_permute_ps(s0, 0xB1)), t1 = _mm256_add_ps(s1, _mm256_permute_ps(s1, 0xB1));
  const __m256 even = _mm256_shuffle_ps(t0, t1, 0x88);  // t0 0 2, t1 0 2 | t0 4 6, t1 4 6 (per 128-bit lane)
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8));
}

// Scales 8h .. 8h + 7 of group g times 256 (shared scales: the one, broadcast).
inline __m256 fp8_scales8(const RowBlock& w, int g, int half) {
  const __m256 s = w.shared_scales ? _mm256_set1_ps(w.scale(g, 0)) : scales8(w, g, half);
  return _mm256_mul_ps(s, _mm256_set1_ps(256.f));
}

// fp8 weights x fp32 activations, as the scalar kernel: one token at a time (its eight pair accumulators and the
// line's conversions fill the 16 ymm registers).
template <int NT>
struct Fp8Tile {
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout&, float* out) {
    static_assert(NT == 1, "one token per tile");
    const int lines_per_group = w.group / 4, n_groups = w.kp / w.group;
    const float* x = reinterpret_cast<const float*>(rows[0]);
    __m256 facc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const uint8_t* p = w.data;
    for (int g = 0; g < n_groups; ++g) {
      __m256 lo[2][2], hi[2][2];  // [half][quarter]
      for (int h = 0; h < 2; ++h) lo[h][0] = lo[h][1] = hi[h][0] = hi[h][1] = _mm256_setzero_ps();
      for (int jj = 0; jj < lines_per_group; ++jj, p += kLineBytes) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        const int j = g * lines_per_group + jj;
        double pl, ph;
        std::memcpy(&pl, x + 4 * j, 8);
        std::memcpy(&ph, x + 4 * j + 2, 8);
        const __m256 xl = _mm256_castpd_ps(_mm256_set1_pd(pl)), xh = _mm256_castpd_ps(_mm256_set1_pd(ph));
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const Fp8Half f = fp8_half(_mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32 * h)));
          lo[h][0] = _mm256_fmadd_ps(f.lo[0], xl, lo[h][0]);
          lo[h][1] = _mm256_fmadd_ps(f.lo[1], xl, lo[h][1]);
          hi[h][0] = _mm256_fmadd_ps(f.hi[0], xh, hi[h][0]);
          hi[h][1] = _mm256_fmadd_ps(f.hi[1], xh, hi[h][1]);
        }
      }
      for (int h = 0; h < 2; ++h) facc[h] = _mm256_fmadd_ps(fp8_group_sum(lo[h], hi[h]), fp8_scales8(w, g, h), facc[h]);
    }
    _mm256_storeu_ps(out, facc[0]);
    _mm256_storeu_ps(out + 8, facc[1]);
  }
};

// The SIMD wrapper of kernels/row_ops.h: 8 fp32 / int32 lanes.
struct V {
  static constexpr int kLanes = 8;
  using F = __m256;
  using I = __m256i;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float f) { return _mm256_set1_ps(f); }
  static F abs(F v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static bool finite(F v) {
    return _mm256_movemask_ps(_mm256_cmp_ps(abs(v), _mm256_set1_ps(FLT_MAX), _CMP_LE_OQ)) == 0xff;
  }
  static float hmax(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F nan_to_zero(F v) { return _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q)); }
  static F pow2(I n) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)); }
  static void stream(float* p, F v) { _mm256_stream_ps(p, v); }
  static I cvt(F v) { return _mm256_cvtps_epi32(v); }
  static I izero() { return _mm256_setzero_si256(); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static int32_t hsum(I v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
  }
  static __m128i to16(I v) { return _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)); }
  static void store_q8(int8_t* p, I v) {
    const __m128i w = to16(v);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  static void store_q16(int16_t* p, I v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to16(v)); }
  static void to_bf16(const float* x, uint16_t* d) {  // float_to_bf16 (formats/activation.h) on 8 lanes
    const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(x));
    const __m256i top = _mm256_srli_epi32(b, 16);
    __m256i r = _mm256_add_epi32(b, _mm256_set1_epi32(0x7fff));
    r = _mm256_srli_epi32(_mm256_add_epi32(r, _mm256_and_si256(top, _mm256_set1_epi32(1))), 16);
    const __m256i nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d), h);
  }
  static void from_bf16(const uint16_t* s, float* d) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    _mm256_storeu_ps(d, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
};

}  // namespace

RowOps row_ops() {
  return {row_ops::quantize<V>, row_ops::bf16_to_f32<V>,    row_ops::f32_to_bf16<V>, row_ops::axpy<V>,
          row_ops::swiglu<V>,   row_ops::clamped_swiglu<V>, row_ops::copy_stream<V>};
}

uint64_t read_bytes(const uint8_t* p, size_t bytes) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i + 128 <= bytes; i += 128) {
    a = _mm256_xor_si256(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_xor_si256(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_xor_si256(c, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_xor_si256(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  a = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
  return (uint64_t)_mm256_extract_epi64(a, 0) ^ (uint64_t)_mm256_extract_epi64(a, 3);
}

void rowblock_bf16(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  tiles::run_tiles<2, Bf16Tile>(w, rows, a, n_tok, out);
}
void rowblock_int8(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  tiles::run_tiles<2, Int8Tile>(w, rows, a, n_tok, out);
}
void rowblock_int4(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  tiles::run_tiles<2, Int4Tile>(w, rows, a, n_tok, out);
}
void rowblock_lut4(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  tiles::run_tiles<2, Lut4Tile>(w, rows, a, n_tok, out);
}
void rowblock_fp8(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  tiles::run_tiles<1, Fp8Tile>(w, rows, a, n_tok, out);
}
void rowblock_int6(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  plane_rowblock<WeightFormat::int6, PlaneWide<WeightFormat::int6>::Tile, 2>(w, rows, a, n_tok, out);
}
void rowblock_int5(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  plane_rowblock<WeightFormat::int5, PlaneWide<WeightFormat::int5>::Tile, 2>(w, rows, a, n_tok, out);
}
void rowblock_int3(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  plane_rowblock<WeightFormat::int3, PlaneNarrow<WeightFormat::int3>::Tile, 2>(w, rows, a, n_tok, out);
}
// grid: up to kGridRowTokens tokens (the decode's experts) on rows decoded in registers (gridrow), tiles of
// kGridRowTile; more on each super-block decoded into lines (gridrow::decode_lines) that GridTile reads for up to 6
// tokens at a time.
constexpr int kGridRowTokens = 3, kGridRowTile = 3;

template <Codebook T>
inline void grid_rows(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  if (n_tok <= kGridRowTokens)
    return tiles::run_tiles<kGridRowTile, gridrow::Rows<T>::template Tile>(w, rows, a, n_tok, out);
  constexpr int kMax = 6;
  alignas(64) uint8_t lines[kSuperBlock / 4 * kLineBytes];
  alignas(64) float sc[kSuperBlock / 16 * kRowsPerBlock];
  std::fill(out, out + (size_t)n_tok * kRowsPerBlock, 0.f);
  for (int sp = 0; sp < w.kp / kSuperBlock; ++sp) {
    _mm_prefetch(reinterpret_cast<const char*>(w.data) + (size_t)(sp + 1) * kRowsPerBlock * grid_info(T).row_bytes,
                 _MM_HINT_T0);
    gridrow::decode_lines<T>(w, sp, lines, sc);
    int t = 0;
    for (; t + kMax <= n_tok; t += kMax)
      GridTile<kMax>::run(lines, sc, w.group, sp, rows + t, a, out + t * kRowsPerBlock);
    grid_tail<kMax - 1>(n_tok - t, lines, sc, w.group, sp, rows + t, a, out + t * kRowsPerBlock);
  }
}

void rowblock_grid(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  switch (w.grid) {
    case Codebook::iq2_xxs: return grid_rows<Codebook::iq2_xxs>(w, rows, a, n_tok, out);
    case Codebook::iq2_xs: return grid_rows<Codebook::iq2_xs>(w, rows, a, n_tok, out);
    case Codebook::iq2_s: return grid_rows<Codebook::iq2_s>(w, rows, a, n_tok, out);
    case Codebook::iq3_xxs: return grid_rows<Codebook::iq3_xxs>(w, rows, a, n_tok, out);
    case Codebook::iq3_s: return grid_rows<Codebook::iq3_s>(w, rows, a, n_tok, out);
    case Codebook::iq1_s: return grid_rows<Codebook::iq1_s>(w, rows, a, n_tok, out);
    case Codebook::iq1_m: return grid_rows<Codebook::iq1_m>(w, rows, a, n_tok, out);
    default: std::fill(out, out + (size_t)n_tok * kRowsPerBlock, 0.f);  // not a grid type: refused at load
  }
}
void rowblock_int2(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  plane_rowblock<WeightFormat::int2, PlaneNarrow<WeightFormat::int2>::Tile, 2>(w, rows, a, n_tok, out);
}

}  // namespace avx2
}  // namespace hetmoe
