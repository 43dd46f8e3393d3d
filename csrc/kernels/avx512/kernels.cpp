// AVX-512 micro-kernels (F/BW/VL/DQ + VNNI; compiled with those flags and called only when CPUID reports
// them). One 64-byte line is one zmm register: 16 rows x 4 bytes.
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cstring>

#include "formats/activation.h"
#include "kernels/dispatch.h"
#include "kernels/row_ops.h"
#include "kernels/tiles.h"

namespace hetmoe {
namespace avx512 {

namespace {

// bf16 weights x fp32 activations; even and odd k accumulate separately (see the AVX2 version).
template <int NT>
struct Bf16Tile {
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout&, float* out) {
    const int lines = w.kp / 2;
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    const float* x[NT];
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const float*>(rows[i]);
    __m512 even[NT], odd[NT];
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) even[i] = odd[i] = _mm512_setzero_ps();
    const uint8_t* p = w.data;
    for (int j = 0; j < lines; ++j, p += kLineBytes) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchL2Bytes, _MM_HINT_T1);
      __m512i v = _mm512_load_si512(p);
      __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      __m512 o = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) {
        even[i] = _mm512_fmadd_ps(e, _mm512_set1_ps(x[i][2 * j]), even[i]);
        odd[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(x[i][2 * j + 1]), odd[i]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) _mm512_storeu_ps(out + i * kRowsPerBlock, _mm512_add_ps(even[i], odd[i]));
  }
};

// 16 stored values of a one-level float type (f32, f16, bf16) at p as fp32: one load and one conversion.
inline __m512 plain16(ScaleType t, const uint8_t* p) {
  if (t == ScaleType::f16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  if (t == ScaleType::bf16) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
  return _mm512_loadu_ps(p);
}

// The 16 values of group g of a scale set of w (its scales, or its mins) as fp32 (formats/layout.h: one load and one
// conversion, k8 / k4 two and a multiply, e4m3 a multiply by the block's factor, zero-point mins the scales times the
// converted bytes; exact, the bits of RowBlock::value).
inline __m512 widen16(const RowBlock& w, const uint8_t* set, int g) {
  const uint8_t* p = w.group_of(set, g);
  switch (w.scale_type) {
    case ScaleType::f16:
    case ScaleType::bf16: return plain16(w.scale_type, p);
    case ScaleType::f32_zp:
    case ScaleType::f16_zp:
    case ScaleType::bf16_zp: {  // the base type's scales; the mins fl(scale * z) of the int8 zero points
      const __m512 sc = plain16(zp_base(w.scale_type), w.group_of(w.scales, g));
      if (set != w.mins) return sc;
      const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      return _mm512_mul_ps(sc, z);
    }
    case ScaleType::e8m0: {  // 2^(e - 128): exponent field e - 1, or for e < 2 the subnormal 2^-128 << e
      const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
      const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
      return _mm512_castsi512_ps(_mm512_mask_mov_epi32(normal, _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), sub));
    }
    case ScaleType::k8: {  // int8 sub-scale x fp16 super scale
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.super_of(set, g))));
      return _mm512_mul_ps(sc, d);
    }
    case ScaleType::k4: {  // 4-bit sub-scale (low nibble) or sub-min (high) x fp16 super scale / min
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      if (w.sub_shift(set)) b = _mm512_srli_epi32(b, 4);
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.super_of(set, g))));
      return _mm512_mul_ps(sc, d);
    }
    case ScaleType::e4m3:
    case ScaleType::e4m3_div: {  // E4M3 byte -> half of e4m3 * 2^-8 -> fp32, times (or over) the block's factor
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16((short)0x8000)),
                                        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
      const __m512 v = _mm512_cvtph_ps(h), f = _mm512_set1_ps(w.factor);
      return w.scale_type == ScaleType::e4m3 ? _mm512_mul_ps(v, f) : _mm512_div_ps(v, f);
    }
    case ScaleType::f32: break;
  }
  return _mm512_loadu_ps(p);
}
inline __m512 scales16(const RowBlock& w, int g) { return widen16(w, w.scales, g); }
// The group's 16 mins (affine kernels only).
inline __m512 mins16(const RowBlock& w, int g) { return widen16(w, w.mins, g); }

// acc += float(isum - offset * xsum) * (w_scale * x_scale), for 16 rows; affine (offset 0): then
// acc += float(-xsum) * (w_min * x_scale) (formats/layout.h). The tiles run a kernel body per scaling
// (kAffine), so the symmetric one carries no min or branch (they cost it registers: spills at NT >= 8).
// wscale / wmin: the group's 16 weight scales and mins (scales16, mins16; wmin unused when symmetric).
template <bool kAffine>
inline __m512 epilogue16(__m512 acc, __m512i isum, int32_t offset, int32_t xsum, __m512 wscale, __m512 wmin,
                         float xscale) {
  if constexpr (kAffine) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(wscale, _mm512_set1_ps(xscale)), acc);
    return _mm512_fmadd_ps(_mm512_set1_ps((float)(-xsum)), _mm512_mul_ps(wmin, _mm512_set1_ps(xscale)), acc);
  }
  isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset * xsum));
  __m512 s = _mm512_mul_ps(wscale, _mm512_set1_ps(xscale));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc);
}

// Sums the two int32 lanes of each 64-bit lane: 16 pair partials -> 8 row sums.
inline __m256i pair_sums(__m512i v) { return _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64(v, 32))); }

// int8 weights (unsigned, offset 128, or affine) x int16 activations with vpdpwssd; 32 bytes = 8 rows x 4 k.
template <int NT>
struct Int8Tile {
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    w.mins ? body<true>(w, rows, a, out) : body<false>(w, rows, a, out);
  }
  template <bool kAffine>
  static void body(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    const int lines_per_group = w.group / 4, n_groups = w.kp / w.group;
    const int16_t* x[NT];
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const int16_t*>(rows[i]);
    __m512 facc[NT];
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
    const uint8_t* p = w.data;
    for (int g = 0; g < n_groups; ++g) {
      __m512i acc[NT][2];
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
      for (int jj = 0; jj < lines_per_group; ++jj, p += kLineBytes) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchL2Bytes, _MM_HINT_T1);
        const int j = g * lines_per_group + jj;
        __m512i w0 = _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
        __m512i w1 = _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32)));
#pragma GCC unroll 16
        for (int i = 0; i < NT; ++i) {
          int64_t q4;
          std::memcpy(&q4, x[i] + 4 * j, 8);
          __m512i xb = _mm512_set1_epi64(q4);
          acc[i][0] = _mm512_dpwssd_epi32(acc[i][0], w0, xb);
          acc[i][1] = _mm512_dpwssd_epi32(acc[i][1], w1, xb);
        }
      }
      const __m512 ws = scales16(w, g), wm = kAffine ? mins16(w, g) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) {
        __m512i rows16 = _mm512_inserti64x4(_mm512_castsi256_si512(pair_sums(acc[i][0])), pair_sums(acc[i][1]), 1);
        facc[i] = epilogue16<kAffine>(facc[i], rows16, 128, act_sums(rows[i], a)[g], ws, wm, act_scales(rows[i], a)[g]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) _mm512_storeu_ps(out + i * kRowsPerBlock, facc[i]);
  }
};

// The unsigned bytes a nibble line multiplies: int4 the nibbles themselves (q + 8), lut4 (kLut) the codebook
// value + 128 of each, looked up with one vpshufb in `lut` (the codebook + 128, in every 128-bit lane).
template <bool kLut>
inline __m512i nibble_bytes(__m512i nibbles, __m512i lut) {
  if constexpr (kLut) return _mm512_shuffle_epi8(lut, nibbles);
  return nibbles;
}
inline __m512i lut_bytes(const RowBlock& w) {  // codebook + 128 as unsigned bytes (lut4), else unused zeros
  if (!w.codebook) return _mm512_setzero_si512();
  const __m128i cb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codebook));
  return _mm512_broadcast_i32x4(_mm_xor_si128(cb, _mm_set1_epi8((char)0x80)));
}

// int4 weights (unsigned nibbles, offset 8) and lut4 weights (kLut: codebook values + 128, offset 128) x int8
// activations with vpdpbusd. A vpdpbusd waits for the previous
// one on its accumulator: with one chain per token, the two per line would bound a one-token row block by their
// latency rather than by memory. So up to 4 tokens, low and high nibbles sum into separate accumulators (one token
// has a body of its own below, NibbleTile<1>, on 4 chains); more tokens are enough chains by themselves (and need the
// registers). The sums are int32: the same bits in any order. (Faster from the caches; DRAM-bound decode jobs gain
// nothing: BENCHMARKS.md#int4-accumulators.)
template <int NT, bool kLut>
struct NibbleTile {
  static constexpr int kSplit = NT <= 4 ? 2 : 1;  // chains per line: low/high nibbles apart
  static constexpr int kUnroll = 1;               // lines per step
  static constexpr int kChains = kSplit * kUnroll;
  static constexpr int32_t kOffset = kLut ? 128 : 8;
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    if constexpr (kLut)
      body<false>(w, rows, a, out);  // lut4 is symmetric
    else
      w.mins ? body<true>(w, rows, a, out) : body<false>(w, rows, a, out);
  }
  template <bool kAffine>
  static void body(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    const int lines_per_group = w.group / 8, n_groups = w.kp / w.group;  // a multiple of kUnroll
    const __m512i low4 = _mm512_set1_epi8(0x0f), lut = lut_bytes(w);
    const int8_t* x[NT];
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const int8_t*>(rows[i]);
    __m512 facc[NT];
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
    const uint8_t* p = w.data;
    for (int g = 0; g < n_groups; ++g) {
      __m512i acc[NT][kChains];
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i)
#pragma GCC unroll 4
        for (int c = 0; c < kChains; ++c) acc[i][c] = _mm512_setzero_si512();
      for (int jj = 0; jj < lines_per_group; jj += kUnroll) {
#pragma GCC unroll 2
        for (int u = 0; u < kUnroll; ++u, p += kLineBytes) {
          _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchL2Bytes, _MM_HINT_T1);
          const int j = g * lines_per_group + jj + u;
          __m512i v = _mm512_load_si512(p);
          __m512i lo = nibble_bytes<kLut>(_mm512_and_si512(v, low4), lut);
          __m512i hi = nibble_bytes<kLut>(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), lut);
#pragma GCC unroll 16
          for (int i = 0; i < NT; ++i) {
            int32_t l, h;
            std::memcpy(&l, x[i] + 8 * j, 4);
            std::memcpy(&h, x[i] + 8 * j + 4, 4);
            __m512i& c0 = acc[i][kSplit * u];
            __m512i& c1 = acc[i][kSplit * u + kSplit - 1];
            c0 = _mm512_dpbusd_epi32(c0, lo, _mm512_set1_epi32(l));
            c1 = _mm512_dpbusd_epi32(c1, hi, _mm512_set1_epi32(h));
          }
        }
      }
      const __m512 ws = scales16(w, g), wm = kAffine ? mins16(w, g) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) {
        __m512i sum = acc[i][0];
#pragma GCC unroll 4
        for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, acc[i][c]);
        facc[i] =
            epilogue16<kAffine>(facc[i], sum, kOffset, act_sums(rows[i], a)[g], ws, wm, act_scales(rows[i], a)[g]);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) _mm512_storeu_ps(out + i * kRowsPerBlock, facc[i]);
  }
};

// One token (decode), the same int32 sums as NibbleTile<NT> (any order gives the same bits) written for a weight
// stream at DRAM speed: two lines a step, each loaded once into a register, their nibble halves on four chains,
// prefetched into L1 2 KB ahead (1 KB or less left a core short of its stream on a Zen 4: BENCHMARKS.md#cpu-only).
constexpr int kInt4RowPrefetchBytes = 2048;
template <bool kLut>
struct NibbleTile<1, kLut> {
  static constexpr int32_t kOffset = kLut ? 128 : 8;
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
    if constexpr (kLut)
      body<false>(w, rows[0], a, out);
    else
      w.mins ? body<true>(w, rows[0], a, out) : body<false>(w, rows[0], a, out);
  }
  template <bool kAffine>
  static void body(const RowBlock& w, const uint8_t* row, const ActLayout& a, float* out) {
    const int lines_per_group = w.group / 8, n_groups = w.kp / w.group;  // even (group >= 16)
    const __m512i low4 = _mm512_set1_epi8(0x0f), lut = lut_bytes(w);
    const int8_t* x = reinterpret_cast<const int8_t*>(row);
    const float* xscales = act_scales(row, a);
    const int32_t* xsums = act_sums(row, a);
    __m512 f = _mm512_setzero_ps();
    const uint8_t* p = w.data;
    for (int g = 0; g < n_groups; ++g) {
      __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0;
      for (int j = 0; j < lines_per_group; j += 2, p += 2 * kLineBytes, x += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kInt4RowPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p) + kInt4RowPrefetchBytes + kLineBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchL2Bytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchL2Bytes + kLineBytes, _MM_HINT_T1);
        __m512i v0 = _mm512_load_si512(p), v1 = _mm512_load_si512(p + kLineBytes);
        asm("" : "+v"(v0), "+v"(v1));  // one load each, kept in registers for both nibbles
        int32_t x0, x1, x2, x3;
        std::memcpy(&x0, x, 4);
        std::memcpy(&x1, x + 4, 4);
        std::memcpy(&x2, x + 8, 4);
        std::memcpy(&x3, x + 12, 4);
        const __m512i l0 = nibble_bytes<kLut>(_mm512_and_si512(v0, low4), lut);
        const __m512i h0 = nibble_bytes<kLut>(_mm512_and_si512(_mm512_srli_epi16(v0, 4), low4), lut);
        const __m512i l1 = nibble_bytes<kLut>(_mm512_and_si512(v1, low4), lut);
        const __m512i h1 = nibble_bytes<kLut>(_mm512_and_si512(_mm512_srli_epi16(v1, 4), low4), lut);
        c0 = _mm512_dpbusd_epi32(c0, l0, _mm512_set1_epi32(x0));
        c1 = _mm512_dpbusd_epi32(c1, h0, _mm512_set1_epi32(x1));
        c2 = _mm512_dpbusd_epi32(c2, l1, _mm512_set1_epi32(x2));
        c3 = _mm512_dpbusd_epi32(c3, h1, _mm512_set1_epi32(x3));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3));
      f = epilogue16<kAffine>(f, sum, kOffset, xsums[g], scales16(w, g), kAffine ? mins16(w, g) : _mm512_setzero_ps(),
                              xscales[g]);
    }
    _mm512_storeu_ps(out, f);
  }
};
template <int NT>
using Int4Tile = NibbleTile<NT, false>;
template <int NT>
using Lut4Tile = NibbleTile<NT, true>;

// Bit-plane weights (formats/layout.h): the four byte lines of one quad of K (16 rows x 16 k, byte f: k 4f..4f+3 of
// the quad), unpacked from the quad's unit with a shift and a mask per plane. unit: the unit's first line; qi: the
// quad's place in its unit (0, or 1 where the high plane has 1 bit).
template <WeightFormat F>
inline void plane_quad(const uint8_t* unit, int qi, __m512i* out) {
  constexpr Planes P = planes_of(F);
  const __m512i lo_mask = _mm512_set1_epi8((char)((1 << P.lo_bits) - 1));
  if constexpr (P.lo_bits == 4) {
    const __m512i l0 = _mm512_load_si512(unit + 2 * qi * kLineBytes),
                  l1 = _mm512_load_si512(unit + (2 * qi + 1) * kLineBytes);
    out[0] = _mm512_and_si512(l0, lo_mask);
    out[1] = _mm512_and_si512(_mm512_srli_epi16(l0, 4), lo_mask);
    out[2] = _mm512_and_si512(l1, lo_mask);
    out[3] = _mm512_and_si512(_mm512_srli_epi16(l1, 4), lo_mask);
  } else {
    const __m512i l = _mm512_load_si512(unit + qi * kLineBytes);
    out[0] = _mm512_and_si512(l, lo_mask);
    out[1] = _mm512_and_si512(_mm512_srli_epi16(l, 2), lo_mask);
    out[2] = _mm512_and_si512(_mm512_srli_epi16(l, 4), lo_mask);
    out[3] = _mm512_and_si512(_mm512_srli_epi16(l, 6), lo_mask);
  }
  if constexpr (P.hi_bits > 0) {
    __m512i h = _mm512_load_si512(unit + P.hi_line() * kLineBytes);
    if (P.quads == 2 && qi) h = _mm512_srli_epi16(h, 4);  // quad 1's bits 4..7 down to 0..3 (bits 4..7 unused)
    const __m512i hi_mask = _mm512_set1_epi8((char)(((1 << P.hi_bits) - 1) << P.lo_bits));
    // field f at bit hi_shift(0, f), moved up to bit lo_bits
#pragma GCC unroll 4
    for (int f = 0; f < 4; ++f) {
      const int up = P.lo_bits - P.hi_shift(0, f);
      const __m512i v = up >= 0 ? _mm512_slli_epi16(h, up) : _mm512_srli_epi16(h, -up);
      out[f] = _mm512_or_si512(out[f], _mm512_and_si512(v, hi_mask));
    }
  }
}

// int6 / int5 weights x int16 activations: each byte line widened to words and multiplied with vpdpwssd as an int8
// line (Int8Tile), so the integer sums, and the outputs, are int8's for the same codes.
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
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const int16_t*>(rows[i]);
      __m512 facc[NT];
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
      for (int g = 0; g < n_groups; ++g) {
        __m512i acc[NT][2];
#pragma GCC unroll 16
        for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
        for (int qq = 0; qq < quads_per_group; ++qq) {
          const int q = g * quads_per_group + qq;
          const uint8_t* unit = w.data + P.unit_offset(q);
          _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchL2Bytes, _MM_HINT_T1);
          __m512i bl[4];
          plane_quad<F>(unit, q % P.quads, bl);
#pragma GCC unroll 4
          for (int f = 0; f < 4; ++f) {
            const __m512i w0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(bl[f]));
            const __m512i w1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(bl[f], 1));
#pragma GCC unroll 16
            for (int i = 0; i < NT; ++i) {
              int64_t q4;
              std::memcpy(&q4, x[i] + 16 * q + 4 * f, 8);
              const __m512i xb = _mm512_set1_epi64(q4);
              acc[i][0] = _mm512_dpwssd_epi32(acc[i][0], w0, xb);
              acc[i][1] = _mm512_dpwssd_epi32(acc[i][1], w1, xb);
            }
          }
        }
        const __m512 ws = scales16(w, g), wm = kAffine ? mins16(w, g) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int i = 0; i < NT; ++i) {
          __m512i rows16 = _mm512_inserti64x4(_mm512_castsi256_si512(pair_sums(acc[i][0])), pair_sums(acc[i][1]), 1);
          facc[i] =
              epilogue16<kAffine>(facc[i], rows16, kOffset, act_sums(rows[i], a)[g], ws, wm, act_scales(rows[i], a)[g]);
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) _mm512_storeu_ps(out + i * kRowsPerBlock, facc[i]);
    }
  };
};

// int3 / int2 weights x int8 activations: each byte line multiplied with vpdpbusd as a nibble half of an int4 line
// (NibbleTile), up to 4 tokens on two chains per token (even and odd byte lines).
template <WeightFormat F>
struct PlaneNarrow {
  template <int NT>
  struct Tile {
    static constexpr int kChains = NT <= 4 ? 2 : 1;
    static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
      w.mins ? body<true>(w, rows, a, out) : body<false>(w, rows, a, out);
    }
    template <bool kAffine>
    static void body(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
      constexpr Planes P = planes_of(F);
      constexpr int32_t kOffset = 1 << (code_bits(F) - 1);
      const int quads_per_group = w.group / 16, n_groups = w.kp / w.group;
      const int8_t* x[NT];
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const int8_t*>(rows[i]);
      __m512 facc[NT];
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
      for (int g = 0; g < n_groups; ++g) {
        __m512i acc[NT][kChains];
#pragma GCC unroll 16
        for (int i = 0; i < NT; ++i)
#pragma GCC unroll 2
          for (int c = 0; c < kChains; ++c) acc[i][c] = _mm512_setzero_si512();
        for (int qq = 0; qq < quads_per_group; ++qq) {
          const int q = g * quads_per_group + qq;
          const uint8_t* unit = w.data + P.unit_offset(q);
          _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchBytes, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(unit) + kPrefetchL2Bytes, _MM_HINT_T1);
          __m512i bl[4];
          plane_quad<F>(unit, q % P.quads, bl);
#pragma GCC unroll 4
          for (int f = 0; f < 4; ++f) {
#pragma GCC unroll 16
            for (int i = 0; i < NT; ++i) {
              int32_t xd;
              std::memcpy(&xd, x[i] + 16 * q + 4 * f, 4);
              __m512i& c = acc[i][f % kChains];
              c = _mm512_dpbusd_epi32(c, bl[f], _mm512_set1_epi32(xd));
            }
          }
        }
        const __m512 ws = scales16(w, g), wm = kAffine ? mins16(w, g) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int i = 0; i < NT; ++i) {
          __m512i sum = acc[i][0];
          if constexpr (kChains > 1) sum = _mm512_add_epi32(sum, acc[i][1]);
          facc[i] =
              epilogue16<kAffine>(facc[i], sum, kOffset, act_sums(rows[i], a)[g], ws, wm, act_scales(rows[i], a)[g]);
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) _mm512_storeu_ps(out + i * kRowsPerBlock, facc[i]);
    }
  };
};

// One token (decode) of bit-plane weights: the int32 sums and the epilogue of PlaneWide / PlaneNarrow<F>::Tile<1>
// (the same bits: int32 sums in any order), written for a weight stream at DRAM speed, where the tiles' per-group
// costs would bound it (a group of 16 is one line of int2): the lines read in order, each prefetched once (as
// NibbleTile<1>), and the scales widened in the body. T is the matrix's scale type when it has two levels (k8, k4):
// its super scales are converted once per super-block, its sub-scales with one load, a convert and a multiply per
// group, the bits of widen16; any other type (T = f32 here) widens each group with widen16.
template <ScaleType T, bool kMin>
inline __m512 sub_times(const uint8_t* p, __m512 d) {  // group's 16 sub-scales (k4 kMin: sub-mins) x super scales
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (T == ScaleType::k8) return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d);
  __m512i v = _mm512_cvtepu8_epi32(b);
  if constexpr (kMin) v = _mm512_srli_epi32(v, 4);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), d);
}
inline __m512 super16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <WeightFormat F, ScaleType T>
struct PlaneRow {
  static void run(const RowBlock& w, const uint8_t* row, const ActLayout& a, float* out) {
    w.mins ? body<true>(w, row, a, out) : body<false>(w, row, a, out);
  }
  // The group of quads [q, q + n)'s 16 row sums.
  static __m512i group_sum(const uint8_t* data, const uint8_t* row, int q, int n) {
    constexpr Planes P = planes_of(F);
    __m512i c0 = _mm512_setzero_si512(), c1 = c0;
    for (int e = q + n; q < e; ++q) {
      const uint8_t* unit = data + P.unit_offset(q);
      const int qi = q % P.quads;
      if (qi == 0) {
#pragma GCC unroll 5
        for (int l = 0; l < P.lines; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(unit) + l * kLineBytes + kInt4RowPrefetchBytes, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(unit) + l * kLineBytes + kPrefetchL2Bytes, _MM_HINT_T1);
        }
      }
      __m512i bl[4];
      plane_quad<F>(unit, qi, bl);
      if constexpr (wide_codes(F)) {  // int16 activations: PlaneWide's vpdpwssd on words, c0 rows 0..7, c1 8..15
        const int16_t* x = reinterpret_cast<const int16_t*>(row) + 16 * q;
#pragma GCC unroll 4
        for (int f = 0; f < 4; ++f) {
          int64_t q4;
          std::memcpy(&q4, x + 4 * f, 8);
          const __m512i xb = _mm512_set1_epi64(q4);
          c0 = _mm512_dpwssd_epi32(c0, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(bl[f])), xb);
          c1 = _mm512_dpwssd_epi32(c1, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(bl[f], 1)), xb);
        }
      } else {  // int8 activations: PlaneNarrow's vpdpbusd, byte lines on two chains
        const int8_t* x = reinterpret_cast<const int8_t*>(row) + 16 * q;
        int32_t x0, x1, x2, x3;
        std::memcpy(&x0, x, 4);
        std::memcpy(&x1, x + 4, 4);
        std::memcpy(&x2, x + 8, 4);
        std::memcpy(&x3, x + 12, 4);
        c0 = _mm512_dpbusd_epi32(c0, bl[0], _mm512_set1_epi32(x0));
        c1 = _mm512_dpbusd_epi32(c1, bl[1], _mm512_set1_epi32(x1));
        c0 = _mm512_dpbusd_epi32(c0, bl[2], _mm512_set1_epi32(x2));
        c1 = _mm512_dpbusd_epi32(c1, bl[3], _mm512_set1_epi32(x3));
      }
    }
    if constexpr (wide_codes(F)) return _mm512_inserti64x4(_mm512_castsi256_si512(pair_sums(c0)), pair_sums(c1), 1);
    return _mm512_add_epi32(c0, c1);
  }
  template <bool kAffine>
  static void body(const RowBlock& w, const uint8_t* row, const ActLayout& a, float* out) {
    constexpr int32_t kOffset = 1 << (code_bits(F) - 1);
    constexpr bool kTwo = two_level(T);
    const int quads_per_group = w.group / 16, n_groups = w.kp / w.group, per_super = kSuperBlock / w.group;
    const float* xscales = act_scales(row, a);
    const int32_t* xsums = act_sums(row, a);
    // two levels: group g's sub bytes at sub + 16 g (k4: the mins' in the same bytes), its super-block's at + 32 s
    const uint8_t* sub = w.group_of(w.scales, 0);
    const uint8_t* sub_m = kAffine ? w.group_of(w.mins, 0) : nullptr;
    const uint8_t* sup = kTwo ? w.super_of(w.scales, 0) : nullptr;
    const uint8_t* sup_m = kTwo && kAffine ? w.super_of(w.mins, 0) : nullptr;
    __m512 f = _mm512_setzero_ps();
    for (int g0 = 0, s = 0; g0 < n_groups; g0 += per_super, ++s) {
      const __m512 ds = kTwo ? super16(sup + 32 * s) : _mm512_setzero_ps();
      const __m512 dm = kTwo && kAffine ? super16(sup_m + 32 * s) : _mm512_setzero_ps();
      const int g1 = std::min(g0 + per_super, n_groups);
      for (int g = g0; g < g1; ++g) {
        const __m512i sum = group_sum(w.data, row, g * quads_per_group, quads_per_group);
        __m512 ws, wm = _mm512_setzero_ps();
        if constexpr (kTwo) {
          ws = sub_times<T, false>(sub + 16 * g, ds);
          if constexpr (kAffine) wm = sub_times < T, T == ScaleType::k4 > (sub_m + 16 * g, dm);
        } else {
          ws = scales16(w, g);
          if constexpr (kAffine) wm = mins16(w, g);
        }
        f = epilogue16<kAffine>(f, sum, kOffset, xsums[g], ws, wm, xscales[g]);
      }
    }
    _mm512_storeu_ps(out, f);
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

// fp8 (formats/layout.h): a line's 64 codes as fp32 q * 2^-8 in four vectors of row pairs: lo[h] holds rows
// 8h..8h+7 as (k, k + 2) pairs of bytes 0 and 2 (lanes 2r, 2r + 1), hi[h] the pairs of bytes 1 and 3. Each 16-bit
// word's high byte is a code: shifted right arithmetically by 1 and masked (sign at bit 15, the other 7 bits at
// 7..13) it is the IEEE half of q * 2^-8, which vcvtph2ps widens exactly; the low bytes are moved up first.
struct Fp8Line {
  __m512 lo[2], hi[2];
};
inline Fp8Line fp8_line(__m512i v) {
  const __m512i mask = _mm512_set1_epi16((short)0xbf80);
  const __m512i h = _mm512_and_si512(_mm512_srai_epi16(v, 1), mask);
  const __m512i l = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 1), mask);
  Fp8Line f;
  f.lo[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(l));
  f.lo[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(l, 1));
  f.hi[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  f.hi[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  return f;
}

// The 16 rows' (c0 + c1) + (c2 + c3) of a group from the pair accumulators (lo[h]: c0, c2 of rows 8h..; hi: c1, c3).
inline __m512 fp8_group_sum(const __m512* lo, const __m512* hi) {
  const __m512 s0 = _mm512_add_ps(lo[0], hi[0]), s1 = _mm512_add_ps(lo[1], hi[1]);  // c0 + c1, c2 + c3 per row
  const __m512 t0 = _mm512_add_ps(s0, _mm512_permute_ps(s0, 0xB1)), t1 = _mm512_add_ps(s1, _mm512_permute_ps(s1, 0xB1));
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  return _mm512_permutex2var_ps(t0, even, t1);
}

// The group's 16 scales times 256 (the 2^8 of the codes' halves; shared scales: the one, broadcast).
inline __m512 fp8_scales16(const RowBlock& w, int g) {
  const __m512 s = w.shared_scales ? _mm512_set1_ps(w.scale(g, 0)) : scales16(w, g);
  return _mm512_mul_ps(s, _mm512_set1_ps(256.f));
}

// fp8 weights x fp32 activations (stored x0 x2 x1 x3 per quad: the pairs each half-vector multiplies are one 64-bit
// broadcast), four fma chains per row and token, as the scalar kernel.
template <int NT>
struct Fp8Tile {
  static void run(const RowBlock& w, const uint8_t* const* rows, const ActLayout&, float* out) {
    const int lines_per_group = w.group / 4, n_groups = w.kp / w.group;
    const float* x[NT];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) x[i] = reinterpret_cast<const float*>(rows[i]);
    __m512 facc[NT];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
    const uint8_t* p = w.data;
    for (int g = 0; g < n_groups; ++g) {
      __m512 lo[NT][2], hi[NT][2];
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) lo[i][0] = lo[i][1] = hi[i][0] = hi[i][1] = _mm512_setzero_ps();
      for (int jj = 0; jj < lines_per_group; ++jj, p += kLineBytes) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchL2Bytes, _MM_HINT_T1);
        const int j = g * lines_per_group + jj;
        const Fp8Line f = fp8_line(_mm512_load_si512(p));
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) {
          int64_t pl, ph;
          std::memcpy(&pl, x[i] + 4 * j, 8);
          std::memcpy(&ph, x[i] + 4 * j + 2, 8);
          const __m512 xl = _mm512_castsi512_ps(_mm512_set1_epi64(pl)), xh = _mm512_castsi512_ps(_mm512_set1_epi64(ph));
          lo[i][0] = _mm512_fmadd_ps(f.lo[0], xl, lo[i][0]);
          lo[i][1] = _mm512_fmadd_ps(f.lo[1], xl, lo[i][1]);
          hi[i][0] = _mm512_fmadd_ps(f.hi[0], xh, hi[i][0]);
          hi[i][1] = _mm512_fmadd_ps(f.hi[1], xh, hi[i][1]);
        }
      }
      const __m512 ws = fp8_scales16(w, g);
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) facc[i] = _mm512_fmadd_ps(fp8_group_sum(lo[i], hi[i]), ws, facc[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) _mm512_storeu_ps(out + i * kRowsPerBlock, facc[i]);
  }
};

// The SIMD wrapper of kernels/row_ops.h: 16 fp32 / int32 lanes.
struct V {
  static constexpr int kLanes = 16;
  using F = __m512;
  using I = __m512i;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float f) { return _mm512_set1_ps(f); }
  static F abs(F v) { return _mm512_abs_ps(v); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static bool finite(F v) {
    return _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ) == 0xffff;
  }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F nan_to_zero(F v) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v); }
  static F pow2(I n) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23)); }
  static void stream(float* p, F v) { _mm512_stream_ps(p, v); }
  static I cvt(F v) { return _mm512_cvtps_epi32(v); }
  static I izero() { return _mm512_setzero_si512(); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static int32_t hsum(I v) { return _mm512_reduce_add_epi32(v); }
  static void store_q8(int8_t* p, I v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v)); }
  static void store_q16(int16_t* p, I v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v));
  }
  static void to_bf16(const float* x, uint16_t* d) {  // float_to_bf16 (formats/activation.h) on 16 lanes
    const __m512i b = _mm512_castps_si512(_mm512_loadu_ps(x));
    const __m512i top = _mm512_srli_epi32(b, 16);
    __m512i r = _mm512_add_epi32(b, _mm512_set1_epi32(0x7fff));
    r = _mm512_srli_epi32(_mm512_add_epi32(r, _mm512_and_si512(top, _mm512_set1_epi32(1))), 16);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm512_cvtepi32_epi16(r));
  }
  static void from_bf16(const uint16_t* s, float* d) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    _mm512_storeu_ps(d, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
};

}  // namespace

RowOps row_ops() {
  return {row_ops::quantize<V>, row_ops::bf16_to_f32<V>,    row_ops::f32_to_bf16<V>, row_ops::axpy<V>,
          row_ops::swiglu<V>,   row_ops::clamped_swiglu<V>, row_ops::copy_stream<V>};
}

uint64_t read_bytes(const uint8_t* p, size_t bytes) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (size_t i = 0; i + 256 <= bytes; i += 256) {
    a = _mm512_xor_si512(a, _mm512_load_si512(p + i));
    b = _mm512_xor_si512(b, _mm512_load_si512(p + i + 64));
    c = _mm512_xor_si512(c, _mm512_load_si512(p + i + 128));
    d = _mm512_xor_si512(d, _mm512_load_si512(p + i + 192));
  }
  a = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
  return (uint64_t)_mm512_reduce_add_epi64(a);
}

void rowblock_bf16(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  tiles::run_tiles<12, Bf16Tile>(w, rows, a, n_tok, out);
}
void rowblock_int8(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  tiles::run_tiles<8, Int8Tile>(w, rows, a, n_tok, out);
}
void rowblock_int4(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  tiles::run_tiles<12, Int4Tile>(w, rows, a, n_tok, out);
}
void rowblock_lut4(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  tiles::run_tiles<12, Lut4Tile>(w, rows, a, n_tok, out);
}
void rowblock_fp8(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  tiles::run_tiles<4, Fp8Tile>(w, rows, a, n_tok, out);
}
void rowblock_int6(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  plane_rowblock<WeightFormat::int6, PlaneWide<WeightFormat::int6>::Tile, 8>(w, rows, a, n_tok, out);
}
void rowblock_int5(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  plane_rowblock<WeightFormat::int5, PlaneWide<WeightFormat::int5>::Tile, 8>(w, rows, a, n_tok, out);
}
void rowblock_int3(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  plane_rowblock<WeightFormat::int3, PlaneNarrow<WeightFormat::int3>::Tile, 12>(w, rows, a, n_tok, out);
}
void rowblock_int2(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  plane_rowblock<WeightFormat::int2, PlaneNarrow<WeightFormat::int2>::Tile, 12>(w, rows, a, n_tok, out);
}

void fp8_to_bf16_lines(const uint8_t* src, int n_lines, uint8_t* dst) {
  // Fp8Line's pairs: lanes 2r, 2r + 1 of lo are k 4j, 4j + 2 of row r, of hi k 4j + 1, 4j + 3. A bf16 line's dword is
  // (k + 1) << 16 | k, so (hi's top half | lo >> 16) holds line 2j's dword in even lanes and 2j + 1's in odd ones.
  const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int l = 0; l < n_lines; ++l) {
    _mm_prefetch(reinterpret_cast<const char*>(src) + 64 * l + 1024, _MM_HINT_T0);
    const Fp8Line f = fp8_line(_mm512_load_si512(src + 64 * l));
    __m512i d[2];
    for (int h = 0; h < 2; ++h)
      d[h] = _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(f.hi[h]), top),
                             _mm512_srli_epi32(_mm512_castps_si512(f.lo[h]), 16));
    _mm512_store_si512(dst + 128 * l, _mm512_permutex2var_epi32(d[0], even, d[1]));
    _mm512_store_si512(dst + 128 * l + 64, _mm512_permutex2var_epi32(d[0], odd, d[1]));
  }
}

}  // namespace avx512
}  // namespace hetmoe
