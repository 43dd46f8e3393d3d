#include "formats/lowbit.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "formats/layout.h"
#include "formats/pack.h"

// Every operation below is one the reference (hetmoe/cpu/lowbit.py) does as a separate torch op, in its order: fp32
// divisions (never a multiply by a reciprocal), round half to even, sums over a group as the same pairwise tree
// (_gsum: the first half plus the second, halving down to one), and no fused multiply-adds (the build passes
// -ffp-contract=off). Loops over a group have a fixed trip count so the compiler vectorizes them.

namespace hetmoe {

namespace {

// The search's functions are inlined into each ISA's entry (quantize_rows_isa): compiled for its instructions.
#define HOT inline __attribute__((always_inline))

// Round half to even for |v| < 2^22 with plain float adds (vectorizes); larger |v| stay beyond every code range, so
// the clamp after it gives what exact rounding gives. Only the sign of a zero can differ, which no code, scale or
// (nonzero) min depends on.
HOT float round_even(float v) { return (v + 12582912.f) - 12582912.f; }
HOT float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

constexpr int kLanes = 8;  // groups searched at once, one per lane: every step below is lane-wise

// The sums of t[0..G)[l] for each lane l as the reference's pairwise tree, into out[l]; t is overwritten.
template <int G>
HOT void tree_sums(float (*t)[kLanes], float* out) {
  for (int h = G / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i)
      for (int l = 0; l < kLanes; ++l) t[i][l] = t[i][l] + t[i + h][l];
  for (int l = 0; l < kLanes; ++l) out[l] = t[0][l];
}

// The search of kLanes groups, x[i][l] the i-th value of group l, w[i][l] its weight, sw[l] and swx[l] the sums of w
// and w * x: per group the (scale, offset) of least weighted squared error among the candidates, each refitted by
// least squares to the codes it rounds to, into best_s[l], best_b[l].
template <int G>
HOT void search_groups(const LowBitSearch& p, const float (*x)[kLanes], const float (*w)[kLanes], const float* sw,
                       const float* swx, float* best_s, float* best_b) {
  const float lo = p.affine ? 0.f : -(float)(1 << (p.bits - 1));
  const float hi = p.affine ? (float)((1 << p.bits) - 1) : (float)((1 << (p.bits - 1)) - 1);
  // affine: the range and the min; symmetric: the signed value of largest magnitude (the first, as argmax picks)
  float base[kLanes], b0[kLanes], best_e[kLanes] = {};
  if (p.affine) {
    float mn[kLanes], mx[kLanes];
    for (int l = 0; l < kLanes; ++l) mn[l] = mx[l] = x[0][l];
    for (int i = 1; i < G; ++i)
      for (int l = 0; l < kLanes; ++l) {
        mn[l] = x[i][l] < mn[l] ? x[i][l] : mn[l];
        mx[l] = x[i][l] > mx[l] ? x[i][l] : mx[l];
      }
    for (int l = 0; l < kLanes; ++l) {
      const float span = mx[l] - mn[l];
      base[l] = span < 1e-30f ? 1e-30f : span;
      b0[l] = mn[l];
    }
  } else {
    float am[kLanes], m[kLanes];
    for (int l = 0; l < kLanes; ++l) am[l] = std::fabs(x[0][l]), m[l] = x[0][l];
    for (int i = 1; i < G; ++i)
      for (int l = 0; l < kLanes; ++l) {
        const float a = std::fabs(x[i][l]);
        const bool gt = a > am[l];
        am[l] = gt ? a : am[l];
        m[l] = gt ? x[i][l] : m[l];
      }
    for (int l = 0; l < kLanes; ++l) base[l] = m[l] == 0.f ? 1e-30f : m[l], b0[l] = 0.f;
  }
  float q[G][kLanes], t[G][kLanes];
  for (int c = 0; c < p.n_cands; ++c) {
    const float den = p.denoms[c];
    float s0[kLanes], wq[kLanes], wqq[kLanes], wqx[kLanes], s[kLanes], b[kLanes], e[kLanes];
    for (int l = 0; l < kLanes; ++l) s0[l] = (c < p.n_negated ? -base[l] : base[l]) / den;
    for (int i = 0; i < G; ++i)
      for (int l = 0; l < kLanes; ++l) q[i][l] = clampf(round_even((x[i][l] - b0[l]) / s0[l]), lo, hi);
    for (int i = 0; i < G; ++i)
      for (int l = 0; l < kLanes; ++l) t[i][l] = w[i][l] * q[i][l];
    tree_sums<G>(t, wq);
    for (int i = 0; i < G; ++i)
      for (int l = 0; l < kLanes; ++l) t[i][l] = w[i][l] * q[i][l] * q[i][l];
    tree_sums<G>(t, wqq);
    for (int i = 0; i < G; ++i)
      for (int l = 0; l < kLanes; ++l) t[i][l] = w[i][l] * q[i][l] * x[i][l];
    tree_sums<G>(t, wqx);
    for (int l = 0; l < kLanes; ++l) {
      float sl, bl;
      if (!p.affine) {
        sl = wqx[l] / wqq[l], bl = 0.f;
      } else {
        const float swqq = sw[l] * wqq[l], det = swqq - wq[l] * wq[l];
        sl = (sw[l] * wqx[l] - wq[l] * swx[l]) / det;
        bl = (swx[l] - sl * wq[l]) / sw[l];
        sl = std::fabs(det) <= 1e-12f * std::fabs(swqq) ? NAN : sl;
      }
      const bool keep = std::fabs(sl) <= FLT_MAX && sl != 0.f;  // finite, not 0
      s[l] = keep ? sl : s0[l];
      b[l] = keep ? bl : b0[l];
    }
    for (int i = 0; i < G; ++i)
      for (int l = 0; l < kLanes; ++l) {
        const float d = (s[l] * clampf(round_even((x[i][l] - b[l]) / s[l]), lo, hi) + b[l]) - x[i][l];
        t[i][l] = w[i][l] * (d * d);
      }
    tree_sums<G>(t, e);
    for (int l = 0; l < kLanes; ++l) {
      const bool better = c == 0 || e[l] < best_e[l];
      best_s[l] = better ? s[l] : best_s[l];
      best_b[l] = better ? b[l] : best_b[l];
      // torch.minimum: a NaN error stays, and no later candidate is better than it
      best_e[l] = c == 0 ? e[l] : (e[l] != e[l] || best_e[l] != best_e[l]) ? NAN : std::min(e[l], best_e[l]);
    }
  }
}

float half_bits_to_float(uint16_t h) {
  uint8_t b[2];
  std::memcpy(b, &h, 2);
  return scale_to_float(ScaleType::f16, b);
}

// The reference's _k8 on one row's per-group values v[0..n): per super-block of `per` values an fp16 d at or above
// max |v| / 127 and int8 sub-scales round(v / d); v becomes sub * d.
void round_k8(float* v, int n, int per) {
  for (int s0 = 0; s0 < n; s0 += per) {
    const int s1 = std::min(n, s0 + per);
    float amax = 0.f;
    for (int i = s0; i < s1; ++i) amax = std::max(amax, std::fabs(v[i]));
    uint8_t hb[2];
    float d = store_scale_rounded(ScaleType::f16, amax / 127.f, hb);
    if (d * 127.f < amax) {  // one half step up (from 0: the smallest subnormal)
      uint16_t h;
      std::memcpy(&h, hb, 2);
      d = half_bits_to_float((uint16_t)(h + 1));
    }
    for (int i = s0; i < s1; ++i) v[i] = d > 0.f ? clampf(round_even(v[i] / d), -127.f, 127.f) * d : 0.f;
  }
}

template <int G>
HOT void quantize_rows(const LowBitSearch& p, const float* w, int64_t r0, int64_t r1, int64_t k, const float* imp,
                       int8_t* codes, float* scales, float* mins) {
  const int64_t ng = k / G, nb = (ng + kLanes - 1) / kLanes;  // groups, blocks of kLanes groups
  const float lo = p.affine ? 0.f : -(float)(1 << (p.bits - 1));
  const float hi = p.affine ? (float)((1 << p.bits) - 1) : (float)((1 << (p.bits - 1)) - 1);
  // the weights of each block, lane-wise (a block short of kLanes groups repeats its last one), and their sums
  std::vector<float> wt((size_t)nb * G * kLanes), sw((size_t)nb * kLanes);
  for (int64_t blk = 0; blk < nb; ++blk) {
    float(*wb)[kLanes] = reinterpret_cast<float(*)[kLanes]>(wt.data() + blk * G * kLanes);
    for (int l = 0; l < kLanes; ++l) {
      const int64_t g = std::min(ng - 1, blk * kLanes + l);
      for (int i = 0; i < G; ++i) wb[i][l] = imp ? imp[g * G + i] : 1.f;
    }
    float t[G][kLanes];
    std::memcpy(t, wb, sizeof(t));
    tree_sums<G>(t, sw.data() + blk * kLanes);
  }
  std::vector<float> s((size_t)nb * kLanes), b((size_t)nb * kLanes);
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = w + r * k;
    for (int64_t blk = 0; blk < nb; ++blk) {
      const float(*wb)[kLanes] = reinterpret_cast<const float(*)[kLanes]>(wt.data() + blk * G * kLanes);
      float x[G][kLanes], t[G][kLanes], swx[kLanes];
      for (int l = 0; l < kLanes; ++l) {
        const float* src = row + std::min(ng - 1, blk * kLanes + l) * G;
        for (int i = 0; i < G; ++i) x[i][l] = src[i];
      }
      for (int i = 0; i < G; ++i)
        for (int l = 0; l < kLanes; ++l) t[i][l] = wb[i][l] * x[i][l];
      tree_sums<G>(t, swx);
      search_groups<G>(p, x, wb, sw.data() + blk * kLanes, swx, s.data() + blk * kLanes, b.data() + blk * kLanes);
    }
    if (p.k8) {
      round_k8(s.data(), (int)ng, kSuperBlock / G);
      if (p.affine) {
        for (int64_t g = 0; g < ng; ++g) b[g] = -b[g];
        round_k8(b.data(), (int)ng, kSuperBlock / G);
        for (int64_t g = 0; g < ng; ++g) b[g] = -b[g];
      }
    }
    for (int64_t g = 0; g < ng; ++g) {
      const float* x = row + g * G;
      int8_t* q = codes + r * k + g * G;
      const float sg = s[g], bg = b[g];
      for (int i = 0; i < G; ++i) q[i] = (int8_t)(sg != 0.f ? clampf(round_even((x[i] - bg) / sg), lo, hi) : 0.f);
      scales[r * ng + g] = sg;
      if (p.affine) mins[r * ng + g] = -bg;
    }
  }
}

// The entries: the same code, built for baseline x86-64 and for AVX2 (8 lanes a step rather than 4; the same bits,
// each operation being an IEEE one either way).
template <int G>
void quantize_rows_isa(const LowBitSearch& p, const float* w, int64_t r0, int64_t r1, int64_t k, const float* imp,
                       int8_t* codes, float* scales, float* mins) {
  quantize_rows<G>(p, w, r0, r1, k, imp, codes, scales, mins);
}
template <int G>
__attribute__((target("avx2"))) void quantize_rows_avx2(const LowBitSearch& p, const float* w, int64_t r0, int64_t r1,
                                                        int64_t k, const float* imp, int8_t* codes, float* scales,
                                                        float* mins) {
  quantize_rows<G>(p, w, r0, r1, k, imp, codes, scales, mins);
}

#undef HOT

}  // namespace

void lowbit_quantize(const LowBitSearch& p, const float* w, int64_t rows, int64_t k, const float* imp, int threads,
                     int8_t* codes, float* scales, float* mins) {
  auto run = [&](int64_t r0, int64_t r1) {
    switch (p.group) {
      case 16:
        return (p.avx2 ? quantize_rows_avx2<16> : quantize_rows_isa<16>)(p, w, r0, r1, k, imp, codes, scales, mins);
      case 32:
        return (p.avx2 ? quantize_rows_avx2<32> : quantize_rows_isa<32>)(p, w, r0, r1, k, imp, codes, scales, mins);
      case 64:
        return (p.avx2 ? quantize_rows_avx2<64> : quantize_rows_isa<64>)(p, w, r0, r1, k, imp, codes, scales, mins);
      case 128:
        return (p.avx2 ? quantize_rows_avx2<128> : quantize_rows_isa<128>)(p, w, r0, r1, k, imp, codes, scales, mins);
    }
  };
  const int n = (int)std::max<int64_t>(1, std::min<int64_t>(threads, rows));
  if (n == 1) return run(0, rows);
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errs(n);
  for (int i = 0; i < n; ++i)
    pool.emplace_back([&, i] {
      try {
        run(rows * i / n, rows * (i + 1) / n);
      } catch (...) {
        errs[i] = std::current_exception();
      }
    });
  for (auto& t : pool) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

}  // namespace hetmoe
