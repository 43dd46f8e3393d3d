// Quantization of one token's activations into an activation row (layout in layout.h). Done once per layer
// per token, before any expert reads it. Rounding is round-half-to-even on x * (qmax / amax), so a reference
// can reproduce it exactly in fp32. (Compiled with -ffp-contract=off: the rounding trick needs two roundings.)
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "formats/layout.h"

namespace hetmoe {

inline float* act_scales(uint8_t* row, const ActLayout& a) { return reinterpret_cast<float*>(row + a.scales_off); }
inline int32_t* act_sums(uint8_t* row, const ActLayout& a) { return reinterpret_cast<int32_t*>(row + a.sums_off); }
inline const float* act_scales(const uint8_t* row, const ActLayout& a) {
  return reinterpret_cast<const float*>(row + a.scales_off);
}
inline const int32_t* act_sums(const uint8_t* row, const ActLayout& a) {
  return reinterpret_cast<const int32_t*>(row + a.sums_off);
}

// One group x[g0, g1) (g1 - g0 <= group; the rest of the group up to `group` elements is zero padding) ->
// q[g0, g0 + group), its scale and the sum of its quantized values.
template <typename Q>
inline void quantize_group(const float* x, int g0, int g1, int group, float qmax, Q* q, float& scale, int32_t& sum) {
  float amax = 0.f;
  bool finite = true;
  for (int i = g0; i < g1; ++i) {
    amax = std::fmax(amax, std::fabs(x[i]));
    finite &= std::isfinite(x[i]);
  }
  sum = 0;
  if (amax > 0.f && finite) {
    float inv = qmax / amax;
    for (int i = g0; i < g1; ++i) {
      // Round half to even by the 1.5 * 2^23 trick: exact for |v| <= qmax, and vectorizable (nearbyint is
      // a library call on baseline x86-64).
      float v = (x[i] * inv + 12582912.f) - 12582912.f;
      v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
      q[i] = (Q)v;
      sum += (int32_t)v;
    }
    scale = amax / qmax;
  } else {
    for (int i = g0; i < g1; ++i) q[i] = 0;
    scale = finite ? 0.f : NAN;  // a NaN/Inf input makes the output NaN, never silently finite
  }
  for (int i = g1 > g0 ? g1 : g0; i < g0 + group; ++i) q[i] = 0;
}

template <typename Q>
inline void quantize_groups(const float* x, int k, const ActLayout& a, float qmax, uint8_t* row) {
  Q* q = reinterpret_cast<Q*>(row);
  float* scales = act_scales(row, a);
  int32_t* sums = act_sums(row, a);
  for (int g0 = 0, gi = 0; g0 < a.kp; g0 += a.group, ++gi)
    quantize_group(x, g0, g0 + a.group < k ? g0 + a.group : k, a.group, qmax, q, scales[gi], sums[gi]);
}

// x: fp32 [k] -> row (a.row_bytes bytes).
inline void quantize_activation(WeightFormat f, const float* x, int k, const ActLayout& a, uint8_t* row) {
  switch (f) {
    case WeightFormat::bf16: {
      float* dst = reinterpret_cast<float*>(row);
      std::memcpy(dst, x, sizeof(float) * k);
      for (int i = k; i < a.kp; ++i) dst[i] = 0.f;
      break;
    }
    case WeightFormat::fp8: {  // each quad x0 x2 x1 x3 (layout.h)
      float* dst = reinterpret_cast<float*>(row);
      for (int i = 0; i < a.kp; ++i) dst[fp8_act_index(i)] = i < k ? x[i] : 0.f;
      break;
    }
    default:  // integer codes: int16 rows for int8, int6, int5; int8 rows for int4, lut4, int3, int2
      if (wide_codes(f))
        quantize_groups<int16_t>(x, k, a, 32767.f, row);
      else
        quantize_groups<int8_t>(x, k, a, 127.f, row);
      break;
  }
}

inline uint16_t float_to_bf16(float f);

// The AMX experts' activation row (ActLayout::make(shape, true)): bf16 elements for bf16 and fp8 weights, int8
// groups with qmax 127 for int8, int4 and lut4 weights (for int4 and lut4 the same row as quantize_activation writes).
inline void quantize_activation_amx(WeightFormat f, const float* x, int k, const ActLayout& a, uint8_t* row) {
  if (float_activations(f)) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(row);
    for (int i = 0; i < k; ++i) dst[i] = float_to_bf16(x[i]);
    for (int i = k; i < a.kp; ++i) dst[i] = 0;
  } else {
    quantize_groups<int8_t>(x, k, a, 127.f, row);
  }
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

// exp(x) for the experts' SwiGLU: Cody-Waite range reduction and a degree-6 polynomial (relative error ~2e-7), in
// plain float arithmetic, so that the vector row op (kernels/row_ops.h swiglu) gives the same bits at every ISA.
inline float fast_exp(float x) {
  x = x == x ? x : 0.f;  // NaN: any finite value; the caller's numerator carries the NaN
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// The SwiGLU of one element: silu(gate) * up, silu(g) = g / (1 + exp(-g)).
inline float swiglu(float gate, float up) { return gate / (1.f + fast_exp(gate * -1.f)) * up; }

// The experts' gated activation, chosen per experts object (ExpertsConfig::glu): SwiGLU, or a clamped SwiGLU with
// a sigmoid gain `alpha`, a clamp `limit` and an `offset` added to the clamped up:
//     g = min(gate, limit), u = clamp(up, -limit, limit), h = (u + offset) * g * sigmoid(alpha * g)
// gpt-oss and MiniMax-M3: alpha 1.702, offset 1; DeepSeek-V4: alpha 1, offset 0 (silu(g) * u on clamped inputs).
// The clamps are written so that a NaN passes through (x86's min/max return their second operand on NaN; the
// vector row op, kernels/row_ops.h clamped_swiglu, takes the same operand order).
enum class GluKind : int { swiglu = 0, clamped_swiglu = 1 };
constexpr const char* kGluNames[] = {"swiglu", "clamped_swiglu"};

struct Glu {
  GluKind kind = GluKind::swiglu;
  float alpha = 1.f;   // clamped_swiglu: the sigmoid's gain
  float limit = 0.f;   // clamped_swiglu: the clamp (> 0)
  float offset = 1.f;  // clamped_swiglu: added to the clamped up
};

inline float clamped_swiglu(float gate, float up, float alpha, float limit, float offset) {
  const float g = limit < gate ? limit : gate;
  float u = limit < up ? limit : up;
  u = -limit > u ? -limit : u;
  return (u + offset) * (g / (1.f + fast_exp(g * -alpha)));
}

}  // namespace hetmoe
