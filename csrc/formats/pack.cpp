#include "formats/pack.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "formats/activation.h"

namespace hetmoe {

namespace {

// Byte offset, inside a row block, of element (row r, column k), and for int4 which nibble holds it.
inline size_t elem_offset(WeightFormat f, int r, int k, int* nibble) {
  int kpl = k_per_line(f);
  int line = k / kpl, j = k % kpl;
  size_t base = (size_t)line * kLineBytes + (size_t)r * 4;
  switch (f) {
    case WeightFormat::bf16: *nibble = 0; return base + (size_t)j * 2;
    case WeightFormat::int8: *nibble = 0; return base + j;
    case WeightFormat::int4: *nibble = j / 4; return base + (j % 4);
  }
  return 0;
}

inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Chooses the int4 scale of one group (values w[0..n)); q must hold n codes in [-8, 7].
float choose_int4_scale(const float* w, int n, int8_t* q) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(w[i]));
  if (!(amax > 0.f) || !std::isfinite(amax)) {
    std::memset(q, 0, n);
    return amax > 0.f ? NAN : 0.f;
  }
  float best_err = INFINITY, best_s = amax / 7.f;
  for (int c = 0; c < 9; ++c) {
    float s = amax / (7.f + 0.5f * c), inv = 1.f / s, err = 0.f;
    for (int i = 0; i < n; ++i) {
      float d = w[i] - clampf(std::nearbyint(w[i] * inv), -8.f, 7.f) * s;
      err += d * d;
    }
    if (err < best_err) best_err = err, best_s = s;
  }
  // Least-squares refit of the scale for the chosen codes, kept only if it lowers the error.
  float inv = 1.f / best_s;
  double wq = 0, qq = 0;
  for (int i = 0; i < n; ++i) {
    q[i] = (int8_t)clampf(std::nearbyint(w[i] * inv), -8.f, 7.f);
    wq += (double)w[i] * q[i];
    qq += (double)q[i] * q[i];
  }
  if (qq > 0 && wq > 0) {
    float s2 = (float)(wq / qq), err2 = 0.f;
    for (int i = 0; i < n; ++i) {
      float d = w[i] - q[i] * s2;
      err2 += d * d;
    }
    if (err2 < best_err) best_s = s2;
  }
  return best_s;
}

}  // namespace

void pack_row_block(const MatrixShape& s, const float* w, int rb, uint8_t* data, float* scales) {
  const WeightFormat f = s.format;
  const uint8_t zero = f == WeightFormat::int8 ? 128 : (f == WeightFormat::int4 ? 0x88 : 0);
  std::memset(data, zero, s.block_bytes());
  if (s.has_scales()) std::memset(scales, 0, s.block_scales() * sizeof(float));
  int8_t codes[256];
  for (int r = 0; r < kRowsPerBlock; ++r) {
    int row = rb * kRowsPerBlock + r;
    if (row >= s.n) break;
    const float* src = w + (size_t)row * s.k;
    int nib;
    if (f == WeightFormat::bf16) {
      for (int k = 0; k < s.k; ++k) {
        uint16_t v = float_to_bf16(src[k]);
        std::memcpy(data + elem_offset(f, r, k, &nib), &v, 2);
      }
      continue;
    }
    float row_amax = 0.f;
    if (s.per_row)
      for (int k = 0; k < s.k; ++k) row_amax = std::fmax(row_amax, std::fabs(src[k]));
    for (int g = 0; g < s.n_groups(); ++g) {
      int k0 = g * s.group, n = std::min(s.group, s.k - k0);
      if (n <= 0) break;
      float scale;
      if (f == WeightFormat::int8) {
        float amax = row_amax;
        if (!s.per_row)
          for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(src[k0 + i]));
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < n; ++i) codes[i] = (int8_t)clampf(std::nearbyint(src[k0 + i] * inv), -127.f, 127.f);
        scale = amax / 127.f;
      } else {
        scale = choose_int4_scale(src + k0, n, codes);
      }
      scales[(size_t)g * kRowsPerBlock + r] = scale;
      for (int i = 0; i < n; ++i) {
        uint8_t* p = data + elem_offset(f, r, k0 + i, &nib);
        if (f == WeightFormat::int8) {
          *p = (uint8_t)(codes[i] + 128);
        } else {
          uint8_t u = (uint8_t)(codes[i] + 8);
          *p = nib ? (uint8_t)((*p & 0x0f) | (u << 4)) : (uint8_t)((*p & 0xf0) | u);
        }
      }
    }
  }
}

void unpack_row_block(const MatrixShape& s, const uint8_t* data, const float* scales, int rb, float* w) {
  const WeightFormat f = s.format;
  for (int r = 0; r < kRowsPerBlock; ++r) {
    int row = rb * kRowsPerBlock + r;
    if (row >= s.n) break;
    float* dst = w + (size_t)row * s.k;
    for (int k = 0; k < s.k; ++k) {
      int nib;
      const uint8_t* p = data + elem_offset(f, r, k, &nib);
      if (f == WeightFormat::bf16) {
        uint16_t v;
        std::memcpy(&v, p, 2);
        dst[k] = bf16_to_float(v);
      } else {
        float sc = scales[(size_t)(k / s.group) * kRowsPerBlock + r];
        int q = f == WeightFormat::int8 ? (int)*p - 128 : (int)((*p >> (4 * nib)) & 0x0f) - 8;
        dst[k] = (float)q * sc;
      }
    }
  }
}

}  // namespace hetmoe
