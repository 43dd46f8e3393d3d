// The per-token row work of a MoE job, vectorized: quantizing activation rows (formats/activation.h, bit for bit
// the same rows), fp32 <-> bf16 rows, the experts' SwiGLU and clamped SwiGLU (the same bits as formats/activation.h),
// copies that bypass the caches, and the combine's weighted sum. Written once over a small SIMD wrapper V and
// instantiated by each ISA file with its own V (avx2/kernels.cpp: 8 lanes, avx512/kernels.cpp: 16 lanes), in that
// file's anonymous namespace like kernels/tiles.h.
//
// V (static members; F a float vector, I an int32 vector, both of V::kLanes lanes):
//   load(p) store(p, F)                fp32, unaligned
//   zero() set1(f) abs(F) max(F, F)    min(F, F) add sub mul (F, F) -> F
//   finite(F) -> bool                  every lane finite (not NaN/Inf)
//   hmax(F) -> float                   largest lane
//   cvt(F) -> I                        exact for integral values
//   iadd(I, I) izero() hsum(I) -> int32
//   store_q8(int8_t*, I) store_q16(int16_t*, I)       narrowing stores of in-range values
//   to_bf16(const float*, uint16_t*)  from_bf16(const uint16_t*, float*)   kLanes elements, round to nearest even
//                                                      (NaN stays NaN, as float_to_bf16)
//   div(F, F)  nan_to_zero(F)          a / b; NaN lanes -> 0
//   pow2(I n) -> F                     2^n for n in [-126, 127]
//   stream(float*, F)                  a store that bypasses the caches (p aligned to the vector)
// Every arithmetic step is the scalar code's (mul, then add, then sub; the build has -ffp-contract=off), so rows
// equal the scalar reference exactly.
#pragma once
#include <cstdint>
#include <cstring>

#include "formats/activation.h"

namespace hetmoe {
namespace row_ops {

// A full group of n = group elements (a multiple of kLanes), quantized to Q with qmax; false when the group holds
// a NaN/Inf or is all zero (the caller then takes the scalar path, which handles those cases).
template <class V, typename Q>
inline bool quantize_full_group(const float* x, int n, float qmax, Q* q, float& scale, int32_t& sum) {
  using F = typename V::F;
  F m = V::zero();
  bool finite = true;
  for (int i = 0; i < n; i += V::kLanes) {
    const F v = V::load(x + i);
    finite &= V::finite(v);
    m = V::max(m, V::abs(v));
  }
  const float amax = V::hmax(m);
  if (!finite || !(amax > 0.f)) return false;
  const F inv = V::set1(qmax / amax), magic = V::set1(12582912.f), hi = V::set1(qmax), lo = V::set1(-qmax);
  auto acc = V::izero();
  for (int i = 0; i < n; i += V::kLanes) {
    F v = V::sub(V::add(V::mul(V::load(x + i), inv), magic), magic);
    v = V::max(V::min(v, hi), lo);
    const auto iv = V::cvt(v);
    acc = V::iadd(acc, iv);
    if constexpr (sizeof(Q) == 1)
      V::store_q8(q + i, iv);
    else
      V::store_q16(q + i, iv);
  }
  scale = amax / qmax;
  sum = V::hsum(acc);
  return true;
}

template <class V, typename Q>
inline void quantize_groups(const float* x, int k, const ActLayout& a, float qmax, uint8_t* row) {
  Q* q = reinterpret_cast<Q*>(row);
  float* scales = act_scales(row, a);
  int32_t* sums = act_sums(row, a);
  for (int g0 = 0, gi = 0; g0 < a.kp; g0 += a.group, ++gi) {
    const int g1 = g0 + a.group < k ? g0 + a.group : k;
    const bool full = g1 - g0 == a.group && a.group % V::kLanes == 0;
    if (!full || !quantize_full_group<V>(x + g0, a.group, qmax, q + g0, scales[gi], sums[gi]))
      quantize_group(x, g0, g1, a.group, qmax, q, scales[gi], sums[gi]);
  }
}

// formats/activation.h quantize_activation (amx = false) / quantize_activation_amx (amx = true).
template <class V>
inline void quantize(WeightFormat f, bool amx, const float* x, int k, const ActLayout& a, uint8_t* row) {
  if (float_activations(f)) {
    if (!amx) return quantize_activation(f, x, k, a, row);  // an fp32 copy
    uint16_t* dst = reinterpret_cast<uint16_t*>(row);
    int i = 0;
    for (; i + V::kLanes <= k; i += V::kLanes) V::to_bf16(x + i, dst + i);
    for (; i < k; ++i) dst[i] = float_to_bf16(x[i]);
    for (; i < a.kp; ++i) dst[i] = 0;
  } else if (wide_codes(f) && !amx) {  // int8, int6, int5
    quantize_groups<V, int16_t>(x, k, a, 32767.f, row);
  } else {
    quantize_groups<V, int8_t>(x, k, a, 127.f, row);
  }
}

// dst[i] = float(src[i]) for i < n (bf16 -> fp32, exact).
template <class V>
inline void bf16_to_f32(const uint16_t* src, int n, float* dst) {
  int i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) V::from_bf16(src + i, dst + i);
  for (; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

// dst[i] = bf16(src[i]) for i < n.
template <class V>
inline void f32_to_bf16(const float* src, int n, uint16_t* dst) {
  int i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) V::to_bf16(src + i, dst + i);
  for (; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// formats/activation.h fast_exp, lane by lane, step by step (a NaN lane gives a finite value, as there).
template <class V>
inline typename V::F fast_exp(typename V::F x) {
  using F = typename V::F;
  x = V::nan_to_zero(x);
  x = V::max(V::min(x, V::set1(88.f)), V::set1(-87.f));
  const F magic = V::set1(12582912.f);
  const F k = V::sub(V::add(V::mul(x, V::set1(1.44269504f)), magic), magic);
  const F r = V::sub(V::sub(x, V::mul(k, V::set1(0.693145752f))), V::mul(k, V::set1(1.42860677e-6f)));
  F p = V::set1(1.38888889e-3f);
  p = V::add(V::mul(p, r), V::set1(8.33333333e-3f));
  p = V::add(V::mul(p, r), V::set1(4.16666667e-2f));
  p = V::add(V::mul(p, r), V::set1(1.66666667e-1f));
  p = V::add(V::mul(p, r), V::set1(0.5f));
  p = V::add(V::mul(p, r), V::set1(1.f));
  p = V::add(V::mul(p, r), V::set1(1.f));
  return V::mul(p, V::pow2(V::cvt(k)));
}

// h[i] = swiglu(gate[i], up[i]) for i < n: formats/activation.h swiglu, step by step.
template <class V>
inline void swiglu(const float* gate, const float* up, int n, float* h) {
  int i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    const auto g = V::load(gate + i);
    const auto e = fast_exp<V>(V::mul(g, V::set1(-1.f)));
    V::store(h + i, V::mul(V::div(g, V::add(V::set1(1.f), e)), V::load(up + i)));
  }
  for (; i < n; ++i) h[i] = hetmoe::swiglu(gate[i], up[i]);
}

// h[i] = clamped_swiglu(gate[i], up[i], alpha, limit, offset) for i < n: formats/activation.h, step by step (V::min and
// V::max take the clamp first, the value second, as the scalar conditionals do: a NaN value passes through).
template <class V>
inline void clamped_swiglu(const float* gate, const float* up, int n, float alpha, float limit, float offset,
                           float* h) {
  const auto hi = V::set1(limit), lo = V::set1(-limit), one = V::set1(1.f), neg_alpha = V::set1(-alpha);
  const auto off = V::set1(offset);
  int i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    const auto g = V::min(hi, V::load(gate + i));
    const auto u = V::max(lo, V::min(hi, V::load(up + i)));
    const auto e = fast_exp<V>(V::mul(g, neg_alpha));
    V::store(h + i, V::mul(V::add(u, off), V::div(g, V::add(one, e))));
  }
  for (; i < n; ++i) h[i] = hetmoe::clamped_swiglu(gate[i], up[i], alpha, limit, offset);
}

// dst[i] = src[i] for i < n, written around the caches where dst is aligned to the vector (a buffer written once
// and read much later, by other threads: no read of the old lines, no eviction of the weights being streamed).
template <class V>
inline void copy_stream(const float* src, int n, float* dst) {
  if (reinterpret_cast<uintptr_t>(dst) % (sizeof(float) * V::kLanes) != 0) {
    std::memcpy(dst, src, sizeof(float) * n);
    return;
  }
  int i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) V::stream(dst + i, V::load(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

// acc[i] += w * y[i] for i < n (a multiply, then an add: the scalar combine's rounding).
template <class V>
inline void axpy(float w, const float* y, int n, float* acc) {
  const auto wv = V::set1(w);
  int i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) V::store(acc + i, V::add(V::load(acc + i), V::mul(wv, V::load(y + i))));
  for (; i < n; ++i) acc[i] += w * y[i];
}

}  // namespace row_ops
}  // namespace hetmoe
