#include "formats/lowbit.h"

#include <algorithm>
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

// Round half to even for |v| < 2^22 with plain float adds (vectorizes); larger |v| stay beyond every code range, so
// the clamp after it gives what exact rounding gives. Only the sign of a zero can differ, which no code, scale or
// (nonzero) min depends on.
inline float round_even(float v) { return (v + 12582912.f) - 12582912.f; }
inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The sum of v[0..G) as the reference's pairwise tree; v is overwritten.
template <int G>
inline float tree_sum(float* v) {
  for (int h = G / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) v[i] = v[i] + v[i + h];
  return v[0];
}

struct Fit {
  float s, b;
};

// The search of one group x[0..G) with weights w[0..G): the (scale, offset) of least weighted squared error among
// the candidates, each refitted by least squares to the codes it rounds to.
template <int G>
Fit search_group(const LowBitSearch& p, const float* x, const float* w, float sw, float swx) {
  const float lo = p.affine ? 0.f : -(float)(1 << (p.bits - 1));
  const float hi = p.affine ? (float)((1 << p.bits) - 1) : (float)((1 << (p.bits - 1)) - 1);
  float base = 0.f, b0 = 0.f;  // affine: the range and the min; symmetric: the signed value of largest magnitude
  if (p.affine) {
    float mn = x[0], mx = x[0];
    for (int i = 1; i < G; ++i) mn = std::min(mn, x[i]), mx = std::max(mx, x[i]);
    base = std::max(mx - mn, 1e-30f);
    b0 = mn;
  } else {
    int idx = 0;  // the first of the largest |x|, as argmax picks
    for (int i = 1; i < G; ++i)
      if (std::fabs(x[i]) > std::fabs(x[idx])) idx = i;
    base = x[idx] == 0.f ? 1e-30f : x[idx];
  }
  float best_s = 0.f, best_b = 0.f, best_e = 0.f;
  float q[G], t[G];
  for (int c = 0; c < p.n_cands; ++c) {
    const float s0 = (c < p.n_negated ? -base : base) / p.denoms[c];
    for (int i = 0; i < G; ++i) q[i] = clampf(round_even((x[i] - b0) / s0), lo, hi);
    for (int i = 0; i < G; ++i) t[i] = w[i] * q[i];
    const float wq = tree_sum<G>(t);
    for (int i = 0; i < G; ++i) t[i] = w[i] * q[i] * q[i];
    const float wqq = tree_sum<G>(t);
    for (int i = 0; i < G; ++i) t[i] = w[i] * q[i] * x[i];
    const float wqx = tree_sum<G>(t);
    float s, b;
    if (!p.affine) {
      s = wqx / wqq, b = 0.f;
    } else {
      const float swqq = sw * wqq, det = swqq - wq * wq;
      s = (sw * wqx - wq * swx) / det;
      b = (swx - s * wq) / sw;
      if (std::fabs(det) <= 1e-12f * std::fabs(swqq)) s = NAN;
    }
    if (!(std::isfinite(s) && s != 0.f)) s = s0, b = b0;
    for (int i = 0; i < G; ++i) {
      const float d = (s * clampf(round_even((x[i] - b) / s), lo, hi) + b) - x[i];
      t[i] = w[i] * (d * d);
    }
    const float e = tree_sum<G>(t);
    if (c == 0 || e < best_e) best_s = s, best_b = b;
    // torch.minimum: a NaN error stays, and no later candidate is better than it
    best_e = c == 0 ? e : (std::isnan(e) || std::isnan(best_e)) ? NAN : std::min(e, best_e);
  }
  return {best_s, best_b};
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
void quantize_rows(const LowBitSearch& p, const float* w, int64_t r0, int64_t r1, int64_t k, const float* imp,
                   int8_t* codes, float* scales, float* mins) {
  const int64_t ng = k / G;
  const float lo = p.affine ? 0.f : -(float)(1 << (p.bits - 1));
  const float hi = p.affine ? (float)((1 << p.bits) - 1) : (float)((1 << (p.bits - 1)) - 1);
  std::vector<float> ones(imp ? 0 : G, 1.f), sw(ng);
  for (int64_t g = 0; g < ng; ++g) {
    float t[G];
    for (int i = 0; i < G; ++i) t[i] = imp ? imp[g * G + i] : 1.f;
    sw[g] = tree_sum<G>(t);
  }
  std::vector<float> s(ng), b(ng);
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = w + r * k;
    for (int64_t g = 0; g < ng; ++g) {
      const float* x = row + g * G;
      const float* wg = imp ? imp + g * G : ones.data();
      float t[G];
      for (int i = 0; i < G; ++i) t[i] = wg[i] * x[i];
      const Fit f = search_group<G>(p, x, wg, sw[g], tree_sum<G>(t));
      s[g] = f.s, b[g] = f.b;
    }
    if (p.k8) {
      round_k8(s.data(), (int)ng, kSuperBlock / G);
      if (p.affine) {
        for (auto& v : b) v = -v;
        round_k8(b.data(), (int)ng, kSuperBlock / G);
        for (auto& v : b) v = -v;
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

}  // namespace

void lowbit_quantize(const LowBitSearch& p, const float* w, int64_t rows, int64_t k, const float* imp, int threads,
                     int8_t* codes, float* scales, float* mins) {
  auto run = [&](int64_t r0, int64_t r1) {
    switch (p.group) {
      case 16: return quantize_rows<16>(p, w, r0, r1, k, imp, codes, scales, mins);
      case 32: return quantize_rows<32>(p, w, r0, r1, k, imp, codes, scales, mins);
      case 64: return quantize_rows<64>(p, w, r0, r1, k, imp, codes, scales, mins);
      case 128: return quantize_rows<128>(p, w, r0, r1, k, imp, codes, scales, mins);
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
