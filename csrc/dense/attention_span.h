// The loops of one decode attention span (dense/attention.h AttentionSpan), written once on GCC vector types of 8
// floats and compiled per ISA: included by dense/attention.cpp (portable: the baseline ISA, separate multiplies and
// adds) and kernels/avx2/attention.cpp (AVX2, contracted into FMA). Everything here has internal linkage, so each
// build keeps its own copy and no linker can swap one for the other.
//
// Per chunk of kSpanKeys keys: the keys (and values) are converted to fp32 rows padded with zeros to kLanes, scored
// against every query head (blocks of 2 heads x 4 keys, the dot product's 8 lanes summed in a fixed order), the
// running max and sum updated per head, and the values accumulated into the output (blocks of 4 heads x 16
// dims, keys in order). Every sum has a fixed order, so a span's result does not depend on the thread running it.
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>

#include "dense/attention.h"

// 32-byte vectors passed between these internal functions on a baseline build, where GCC notes the ABI of such
// arguments (reported at the end of the including file): none of them crosses a library boundary.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace hetmoe {
namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

__attribute__((always_inline)) inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
__attribute__((always_inline)) inline void store8(float* p, const f32x8& v) { std::memcpy(p, &v, sizeof v); }
__attribute__((always_inline)) inline f32x8 splat8(float x) { return f32x8{x, x, x, x, x, x, x, x}; }
// Lane i: the sum of the 8 lanes of a_i, in a fixed order (pairs, then quads, then halves): 8 dot products finished
// with 21 vector operations instead of 8 horizontal sums.
__attribute__((always_inline)) inline f32x8 sum8x8(const f32x8& a0, const f32x8& a1, const f32x8& a2, const f32x8& a3,
                                                   const f32x8& a4, const f32x8& a5, const f32x8& a6, const f32x8& a7) {
  const f32x8 p01 = __builtin_shufflevector(a0, a1, 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(a0, a1, 1, 9, 3, 11, 5, 13, 7, 15);
  const f32x8 p23 = __builtin_shufflevector(a2, a3, 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(a2, a3, 1, 9, 3, 11, 5, 13, 7, 15);
  const f32x8 p45 = __builtin_shufflevector(a4, a5, 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(a4, a5, 1, 9, 3, 11, 5, 13, 7, 15);
  const f32x8 p67 = __builtin_shufflevector(a6, a7, 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(a6, a7, 1, 9, 3, 11, 5, 13, 7, 15);
  // [a0..a3 over lanes 0-3, a0..a3 over lanes 4-7], the same for a4..a7
  const f32x8 q03 = __builtin_shufflevector(p01, p23, 0, 1, 8, 9, 4, 5, 12, 13) +
                    __builtin_shufflevector(p01, p23, 2, 3, 10, 11, 6, 7, 14, 15);
  const f32x8 q47 = __builtin_shufflevector(p45, p67, 0, 1, 8, 9, 4, 5, 12, 13) +
                    __builtin_shufflevector(p45, p67, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(q03, q47, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(q03, q47, 4, 5, 6, 7, 12, 13, 14, 15);
}

// The max (max = true) or the sum of the 8 lanes, in a fixed order.
__attribute__((always_inline)) inline float reduce8(const f32x8& a, bool max) {
  const f32x8 b = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
  const f32x8 c = max ? (a > b ? a : b) : a + b;
  const f32x8 d = __builtin_shufflevector(c, c, 2, 3, 0, 1, 6, 7, 4, 5);
  const f32x8 e = max ? (c > d ? c : d) : c + d;
  return max ? (e[0] > e[1] ? e[0] : e[1]) : e[0] + e[1];
}

// e^x for x <= 0 (exactly 0 below -87.3, where e^x leaves the normal floats; NaN stays NaN): x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 3e-7), 2^n from the exponent bits. Plain
// float operations, so it vectorizes at every ISA, unlike std::exp.
__attribute__((always_inline)) inline f32x8 exp_neg8(const f32x8& x) {
  const f32x8 lo = splat8(-87.3f);
  const f32x8 xc = x < lo ? lo : x;
  const f32x8 magic = splat8(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer (in the low mantissa bits)
  const f32x8 t = xc * 1.44269504f + magic;
  const f32x8 n = t - magic;
  const f32x8 r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts: n * 0.693359375 is exact
  f32x8 p = splat8(1.0f / 720);
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const i32x8 e = ((i32x8)t - 0x4B400000 + 127) << 23;  // t's low bits hold n
  const f32x8 y = p * (f32x8)e;
  return x < lo ? splat8(0.0f) : y;
}
// The same for one float, operation for operation (no vector crosses a call here).
inline float exp_neg(float x) {
  const float xc = x < -87.3f ? -87.3f : x;
  const float t = xc * 1.44269504f + 12582912.0f;
  const float n = t - 12582912.0f;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t e;
  std::memcpy(&e, &t, sizeof e);
  e = (e - 0x4B400000 + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &e, sizeof two_n);
  return x < -87.3f ? 0.0f : p * two_n;
}

// A row of d elements (bf16 or fp32) as fp32, zero-padded to pad_lanes(d).
inline void row_to_f32(const void* src, bool bf16, int d, float* dst) {
  int i = 0;
  if (bf16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    // 16 at a time: each value the high half of a (little-endian) word whose low half is 0, interleaved by two
    // shuffles (the zero-extend and shift below compiled to twice the instructions: ~10% of a span)
    for (; i + 16 <= d; i += 16) {
      u16x16 h;
      std::memcpy(&h, s + i, sizeof h);
      const u16x16 z = {};
      const u16x16 lo = __builtin_shufflevector(z, h, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const u16x16 hi = __builtin_shufflevector(z, h, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
      std::memcpy(dst + i, &lo, sizeof lo);
      std::memcpy(dst + i + 8, &hi, sizeof hi);
    }
    for (; i + 8 <= d; i += 8) {
      u16x8 h;
      std::memcpy(&h, s + i, sizeof h);
      const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
      std::memcpy(dst + i, &w, sizeof w);
    }
    for (; i < d; ++i) {
      const uint32_t w = (uint32_t)s[i] << 16;
      std::memcpy(dst + i, &w, sizeof w);
    }
  } else {
    std::memcpy(dst, src, sizeof(float) * d);
    i = d;
  }
  for (; i < pad_lanes(d); ++i) dst[i] = 0.0f;
}

inline const void* advance(const void* p, int64_t elems, bool bf16) {
  return static_cast<const uint8_t*>(p) + elems * (bf16 ? 2 : 4);
}

// s[j][t] = scale * (q_j . kc_t) for G heads and kSpanKeys keys: q [G][dk], kc [kSpanKeys][dk], dk % 8 == 0. Blocks
// of 2 heads x 4 keys (1 head x 8 keys for the last head of an odd G), 8 accumulators of 8 lanes each.
void score_chunk(const float* q, int G, int dk, const float* kc, float scale, float* s) {
  int j = 0;
  for (; j + 2 <= G; j += 2) {
    const float* q0 = q + (int64_t)j * dk;
    const float* q1 = q0 + dk;
    for (int t = 0; t < kSpanKeys; t += 4) {
      const float* k = kc + (int64_t)t * dk;
      f32x8 a00 = {}, a01 = {}, a02 = {}, a03 = {}, a10 = {}, a11 = {}, a12 = {}, a13 = {};
      for (int i = 0; i < dk; i += 8) {
        const f32x8 x0 = load8(q0 + i), x1 = load8(q1 + i);
        const f32x8 k0 = load8(k + i), k1 = load8(k + dk + i), k2 = load8(k + 2 * dk + i), k3 = load8(k + 3 * dk + i);
        a00 += x0 * k0;
        a01 += x0 * k1;
        a02 += x0 * k2;
        a03 += x0 * k3;
        a10 += x1 * k0;
        a11 += x1 * k1;
        a12 += x1 * k2;
        a13 += x1 * k3;
      }
      const f32x8 r = sum8x8(a00, a01, a02, a03, a10, a11, a12, a13) * scale;  // [head j: 4 keys, head j + 1: 4]
      std::memcpy(s + j * kSpanKeys + t, &r, 4 * sizeof(float));
      std::memcpy(s + (j + 1) * kSpanKeys + t, reinterpret_cast<const float*>(&r) + 4, 4 * sizeof(float));
    }
  }
  for (; j < G; ++j) {
    const float* q0 = q + (int64_t)j * dk;
    for (int t = 0; t < kSpanKeys; t += 8) {
      const float* k = kc + (int64_t)t * dk;
      f32x8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
      for (int i = 0; i < dk; i += 8) {
        const f32x8 x0 = load8(q0 + i);
        a0 += x0 * load8(k + i);
        a1 += x0 * load8(k + dk + i);
        a2 += x0 * load8(k + 2 * dk + i);
        a3 += x0 * load8(k + 3 * dk + i);
        a4 += x0 * load8(k + 4 * dk + i);
        a5 += x0 * load8(k + 5 * dk + i);
        a6 += x0 * load8(k + 6 * dk + i);
        a7 += x0 * load8(k + 7 * dk + i);
      }
      store8(s + j * kSpanKeys + t, sum8x8(a0, a1, a2, a3, a4, a5, a6, a7) * scale);
    }
  }
}

// o_j = alpha_j * o_j + sum_{t < nc} p[j][t] * vc_t for G heads: vc rows of `stride` floats, o rows of dvp floats
// (dvp % 16 == 0).
void accumulate_chunk(const float* p, const float* alpha, int G, const float* vc, int64_t stride, int dvp, int nc,
                      float* o) {
  int j = 0;
  for (; j + 4 <= G; j += 4) {
    float* o0 = o + (int64_t)j * dvp;
    const float* p0 = p + j * kSpanKeys;
    for (int d = 0; d < dvp; d += 16) {
      f32x8 r[4][2];
      for (int h = 0; h < 4; ++h) {
        r[h][0] = load8(o0 + h * dvp + d) * alpha[j + h];
        r[h][1] = load8(o0 + h * dvp + d + 8) * alpha[j + h];
      }
      for (int t = 0; t < nc; ++t) {
        const f32x8 v0 = load8(vc + t * stride + d), v1 = load8(vc + t * stride + d + 8);
        for (int h = 0; h < 4; ++h) {
          const float w = p0[h * kSpanKeys + t];
          r[h][0] += w * v0;
          r[h][1] += w * v1;
        }
      }
      for (int h = 0; h < 4; ++h) {
        store8(o0 + h * dvp + d, r[h][0]);
        store8(o0 + h * dvp + d + 8, r[h][1]);
      }
    }
  }
  for (; j < G; ++j) {
    float* o0 = o + (int64_t)j * dvp;
    const float* p0 = p + j * kSpanKeys;
    for (int d = 0; d < dvp; d += 16) {
      f32x8 r0 = load8(o0 + d) * alpha[j], r1 = load8(o0 + d + 8) * alpha[j];
      for (int t = 0; t < nc; ++t) {
        r0 += p0[t] * load8(vc + t * stride + d);
        r1 += p0[t] * load8(vc + t * stride + d + 8);
      }
      store8(o0 + d, r0);
      store8(o0 + d + 8, r1);
    }
  }
}

void span_impl(const AttentionSpan& a) {
  const int d1p = (int)pad_lanes(a.d1), d2p = (int)pad_lanes(a.d2), dk = d1p + d2p, dvp = (int)pad_lanes(a.dv);
  const int G = a.G, NH = a.n_kv * a.G;
  float* kc = a.work;                // [kSpanKeys][dk]
  float* vc = kc + kSpanKeys * dk;   // [kSpanKeys][dvp] (unused when v is k1)
  float* s = vc + kSpanKeys * dvp;   // [G][kSpanKeys]: scores, then probabilities
  float* alpha = s + G * kSpanKeys;  // [G]
  const float inf = std::numeric_limits<float>::infinity();
  for (int j = 0; j < NH; ++j) a.m[j] = -inf, a.l[j] = 0.0f;
  std::memset(a.o, 0, sizeof(float) * NH * dvp);
  // Chunk by chunk, the kv heads of the task one after the other: the task reads its block of the cache in order.
  for (int64_t c0 = 0; c0 < a.n; c0 += kSpanKeys) {
    const int nc = (int)std::min<int64_t>(kSpanKeys, a.n - c0);
    for (int kv = 0; kv < a.n_kv; ++kv) {
      for (int t = 0; t < kSpanKeys; ++t) {
        float* krow = kc + t * dk;
        float* vrow = vc + t * dvp;
        if (t >= nc) {  // past the span: zero keys and values (scored, then masked below)
          std::memset(krow, 0, sizeof(float) * dk);
          if (a.v) std::memset(vrow, 0, sizeof(float) * dvp);
          continue;
        }
        row_to_f32(advance(a.k1, (c0 + t) * a.k1_step + kv * a.k1_head, a.bf16), a.bf16, a.d1, krow);
        if (a.d2) row_to_f32(advance(a.k2, (c0 + t) * a.k2_step + kv * a.k2_head, a.bf16), a.bf16, a.d2, krow + d1p);
        if (a.v) row_to_f32(advance(a.v, (c0 + t) * a.v_step + kv * a.v_head, a.bf16), a.bf16, a.dv, vrow);
      }
      float* m = a.m + kv * G;
      float* l = a.l + kv * G;
      score_chunk(a.q + (int64_t)kv * G * dk, G, dk, kc, a.scale, s);
      static_assert(kSpanKeys == 16, "the softmax below takes a chunk as two vectors");
      for (int j = 0; j < G; ++j) {
        float* sj = s + j * kSpanKeys;
        for (int t = nc; t < kSpanKeys; ++t) sj[t] = -inf;  // keys past the span: probability 0
        const f32x8 s0 = load8(sj), s1 = load8(sj + 8);
        const float mx = std::max(m[j], reduce8(s0 > s1 ? s0 : s1, true));
        const f32x8 p0 = exp_neg8(s0 - mx), p1 = exp_neg8(s1 - mx);
        store8(sj, p0);
        store8(sj + 8, p1);
        alpha[j] = exp_neg(m[j] - mx);
        l[j] = l[j] * alpha[j] + reduce8(p0 + p1, false);
        m[j] = mx;
      }
      accumulate_chunk(s, alpha, G, a.v ? vc : kc, a.v ? dvp : dk, dvp, nc, a.o + (int64_t)kv * G * dvp);
    }
  }
}

}  // namespace
}  // namespace hetmoe
