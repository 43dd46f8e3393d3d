// The loops of one decode attention span (dense/attention.h AttentionSpan), written once on GCC vector types of 8
// floats and compiled per ISA: included by dense/attention.cpp (portable: the baseline ISA, separate multiplies and
// adds) and kernels/avx2/attention.cpp (AVX2, contracted into FMA). Everything here has internal linkage, so each
// build keeps its own copy and no linker can swap one for the other.
//
// Two passes per kv head over the span's keys, read straight from the cache: every score first (blocks of 4 heads x 2
// keys, each block of 16 key dims loaded and converted once for the 4 heads, the dot product's 8 lanes summed in a
// fixed order), then per head the max, the probabilities and their sum, then the values weighted by them (blocks of
// 4 heads x 16 dims, keys in order, no rescaling). bf16 rows are converted without shuffles (load16 below), so the
// queries and outputs of a bf16 span are kept in that load order. Every sum has a fixed order, so a span's result
// does not depend on the thread running it.
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
    // a plain loop, which the compiler widens with unpacks (the queries' rows, converted in the portable build: a
    // hand-written interleave of 16-bit lanes compiled to a scalar move per element there)
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

// 16 elements of a row as two vectors. BF: 8 words of two bf16 each, split into the even elements (the low halves,
// shifted up) and the odd ones (the high halves, masked): two operations, no shuffle. fp32: the 16 in order. A bf16
// span keeps its queries and outputs in that load order (span_typed below).
template <bool BF>
__attribute__((always_inline)) inline void load16(const uint8_t* p, f32x8& a, f32x8& b) {
  if (BF) {
    u32x8 w;
    std::memcpy(&w, p, sizeof w);
    a = (f32x8)(w << 16);
    b = (f32x8)(w & 0xFFFF0000u);
  } else {
    a = load8(reinterpret_cast<const float*>(p));
    b = load8(reinterpret_cast<const float*>(p) + 8);
  }
}

// Rows of the cache the loops read: the first at p, the next `step` bytes on; full blocks of 16 elements (rows whose
// length is not a multiple of 16 are copied, zero-padded, into the span's staging buffer first).
struct Rows {
  const uint8_t* p;
  int64_t step;
};

// Copies nr rows of d elements (es bytes each) into dst, zero-padded to pad_lanes(d); the copy's Rows.
inline Rows stage(Rows r, int nr, int d, int es, uint8_t* dst) {
  const int64_t dp = pad_lanes(d) * es;
  for (int t = 0; t < nr; ++t) {
    std::memcpy(dst + t * dp, r.p + t * r.step, (size_t)d * es);
    std::memset(dst + t * dp + (int64_t)d * es, 0, dp - (int64_t)d * es);
  }
  return Rows{dst, dp};
}

// Scores of NH heads x NK keys (NH * NK == 8): s[h * ns + t] = scale * (q_h . k_t), q in load order [NH][dk], keys
// t0 .. t0 + NK (those past nk are not written). Each block of 16 dims is loaded once for the NH heads.
template <bool BF, int NH, int NK>
__attribute__((always_inline)) inline void score_block(const float* q, int dk, int d1p, Rows k1, int d2p, Rows k2,
                                                       int t0, int nk, float scale, float* s, int ns) {
  static_assert(NH * NK == 8, "one vector of 8 scores");
  constexpr int es = BF ? 2 : 4;
  const uint8_t* p1[NK];
  const uint8_t* p2[NK];
  for (int k = 0; k < NK; ++k) {  // keys past the span read the last one again, and are not written
    const int t = t0 + k < nk ? t0 + k : nk - 1;
    p1[k] = k1.p + t * k1.step;
    p2[k] = k2.p + t * k2.step;
  }
  f32x8 acc[8] = {};
  for (int i = 0; i < d1p; i += 16) {
    f32x8 ka[NK], kb[NK];
    for (int k = 0; k < NK; ++k) load16<BF>(p1[k] + i * es, ka[k], kb[k]);
    for (int h = 0; h < NH; ++h) {
      const f32x8 qa = load8(q + h * dk + i), qb = load8(q + h * dk + i + 8);
      for (int k = 0; k < NK; ++k) acc[h * NK + k] += qa * ka[k], acc[h * NK + k] += qb * kb[k];
    }
  }
  for (int i = 0; i < d2p; i += 16) {
    f32x8 ka[NK], kb[NK];
    for (int k = 0; k < NK; ++k) load16<BF>(p2[k] + i * es, ka[k], kb[k]);
    for (int h = 0; h < NH; ++h) {
      const f32x8 qa = load8(q + h * dk + d1p + i), qb = load8(q + h * dk + d1p + i + 8);
      for (int k = 0; k < NK; ++k) acc[h * NK + k] += qa * ka[k], acc[h * NK + k] += qb * kb[k];
    }
  }
  const f32x8 r = sum8x8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]) * scale;
  for (int h = 0; h < NH; ++h)
    for (int k = 0; k < NK && t0 + k < nk; ++k) s[h * ns + t0 + k] = r[h * NK + k];
}

// Scores of G heads for nk keys (the rows k1, k2), into s[j * ns + t]: blocks of 4 heads x 2 keys, then 2 x 4, 1 x 8.
template <bool BF>
void score_keys(const float* q, int G, int dk, int d1p, Rows k1, int d2p, Rows k2, int nk, float scale, float* s,
                int ns) {
  int j = 0;
  for (; j + 4 <= G; j += 4)
    for (int t = 0; t < nk; t += 2)
      score_block<BF, 4, 2>(q + j * dk, dk, d1p, k1, d2p, k2, t, nk, scale, s + j * ns, ns);
  for (; j + 2 <= G; j += 2)
    for (int t = 0; t < nk; t += 4)
      score_block<BF, 2, 4>(q + j * dk, dk, d1p, k1, d2p, k2, t, nk, scale, s + j * ns, ns);
  for (; j < G; ++j)
    for (int t = 0; t < nk; t += 8)
      score_block<BF, 1, 8>(q + j * dk, dk, d1p, k1, d2p, k2, t, nk, scale, s + j * ns, ns);
}

// o_h += sum_{t < nv} p[h * ns + t] * v_t for NH heads and the 16 dims at d (o rows of dvp floats, load order).
template <bool BF, int NH>
__attribute__((always_inline)) inline void accumulate_block(const float* p, int ns, Rows v, int nv, int d, int dvp,
                                                            float* o) {
  constexpr int es = BF ? 2 : 4;
  f32x8 r[NH][2];
  for (int h = 0; h < NH; ++h) r[h][0] = load8(o + h * dvp + d), r[h][1] = load8(o + h * dvp + d + 8);
  const uint8_t* vp = v.p + d * es;
  for (int t = 0; t < nv; ++t, vp += v.step) {
    f32x8 va, vb;
    load16<BF>(vp, va, vb);
    for (int h = 0; h < NH; ++h) {
      const float w = p[h * ns + t];
      r[h][0] += w * va;
      r[h][1] += w * vb;
    }
  }
  for (int h = 0; h < NH; ++h) store8(o + h * dvp + d, r[h][0]), store8(o + h * dvp + d + 8, r[h][1]);
}

// o_j += sum_{t < nv} p[j * ns + t] * v_t for G heads: per block of 16 dims (its rows stay in L1), blocks of 4 heads.
template <bool BF>
void accumulate_keys(const float* p, int ns, int G, Rows v, int nv, int dvp, float* o) {
  for (int d = 0; d < dvp; d += 16) {
    int j = 0;
    for (; j + 4 <= G; j += 4) accumulate_block<BF, 4>(p + j * ns, ns, v, nv, d, dvp, o + j * dvp);
    for (; j + 2 <= G; j += 2) accumulate_block<BF, 2>(p + j * ns, ns, v, nv, d, dvp, o + j * dvp);
    for (; j < G; ++j) accumulate_block<BF, 1>(p + j * ns, ns, v, nv, d, dvp, o + j * dvp);
  }
}

// Two passes over the span's n <= kKeysPerSplit keys per kv head: every score, then the max, the probabilities and
// their sum, then the values weighted by them (no rescaling of the output).
template <bool BF>
void span_typed(const AttentionSpan& a) {
  constexpr int es = BF ? 2 : 4;
  const int d1p = (int)pad_lanes(a.d1), d2p = (int)pad_lanes(a.d2), dk = d1p + d2p, dvp = (int)pad_lanes(a.dv);
  const int G = a.G, NH = a.n_kv * a.G, n = (int)a.n, ns = (n + 7) / 8 * 8;
  float* q = a.work;                // [NH][dk] the queries in load order
  float* s = q + (int64_t)NH * dk;  // [G][ns] scores, then probabilities
  uint8_t* staged = reinterpret_cast<uint8_t*>(s + (int64_t)G * pad_lanes(kKeysPerSplit));
  for (int64_t i = 0; i < (int64_t)NH * dk; i += 16) {
    const f32x8 x0 = load8(a.q + i), x1 = load8(a.q + i + 8);
    store8(q + i, BF ? __builtin_shufflevector(x0, x1, 0, 2, 4, 6, 8, 10, 12, 14) : x0);
    store8(q + i + 8, BF ? __builtin_shufflevector(x0, x1, 1, 3, 5, 7, 9, 11, 13, 15) : x1);
  }
  std::memset(a.o, 0, sizeof(float) * NH * dvp);
  const bool stage_k = a.d1 % 16 || a.d2 % 16, stage_v = a.dv % 16;
  for (int kv = 0; kv < a.n_kv; ++kv) {
    const Rows k1{static_cast<const uint8_t*>(a.k1) + kv * a.k1_head * es, a.k1_step * es};
    const Rows k2{a.k2 ? static_cast<const uint8_t*>(a.k2) + kv * a.k2_head * es : nullptr, a.k2_step * es};
    for (int c0 = 0; c0 < n; c0 += kSpanKeys) {
      const int nc = std::min(kSpanKeys, n - c0);
      Rows r1{k1.p + c0 * k1.step, k1.step}, r2{k2.p + c0 * k2.step, k2.step};
      if (stage_k) {
        r1 = stage(r1, nc, a.d1, es, staged);
        if (a.d2) r2 = stage(r2, nc, a.d2, es, staged + (int64_t)kSpanKeys * d1p * es);
      }
      score_keys<BF>(q + (int64_t)kv * G * dk, G, dk, d1p, r1, a.d2 ? d2p : 0, r2, nc, a.scale, s + c0, ns);
    }
    float* m = a.m + kv * G;
    float* l = a.l + kv * G;
    const float inf = std::numeric_limits<float>::infinity();
    for (int j = 0; j < G; ++j) {
      float* sj = s + j * ns;
      for (int t = n; t < ns; ++t) sj[t] = -inf;  // probability 0
      f32x8 mv = load8(sj);
      for (int t = 8; t < ns; t += 8) {
        const f32x8 x = load8(sj + t);
        mv = x > mv ? x : mv;
      }
      const float mx = reduce8(mv, true);
      f32x8 lv = {};
      for (int t = 0; t < ns; t += 8) {
        const f32x8 p = exp_neg8(load8(sj + t) - mx);
        store8(sj + t, p);
        lv += p;
      }
      m[j] = mx;
      l[j] = reduce8(lv, false);
    }
    const Rows v = a.v ? Rows{static_cast<const uint8_t*>(a.v) + kv * a.v_head * es, a.v_step * es} : k1;
    for (int c0 = 0; c0 < n; c0 += kValueKeys) {
      const int nc = std::min(kValueKeys, n - c0);
      Rows rv{v.p + c0 * v.step, v.step};
      if (stage_v) rv = stage(rv, nc, a.dv, es, staged);
      accumulate_keys<BF>(s + c0, ns, G, rv, nc, dvp, a.o + (int64_t)kv * G * dvp);
    }
  }
  if (BF) {  // the outputs back in element order
    for (int64_t i = 0; i < (int64_t)NH * dvp; i += 16) {
      const f32x8 ev = load8(a.o + i), od = load8(a.o + i + 8);
      store8(a.o + i, __builtin_shufflevector(ev, od, 0, 8, 1, 9, 2, 10, 3, 11));
      store8(a.o + i + 8, __builtin_shufflevector(ev, od, 4, 12, 5, 13, 6, 14, 7, 15));
    }
  }
}

void span_impl(const AttentionSpan& a) {
  if (a.bf16)
    span_typed<true>(a);
  else
    span_typed<false>(a);
}

}  // namespace
}  // namespace hetmoe
