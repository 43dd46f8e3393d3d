// Portable reference micro-kernels: the semantics every ISA version reproduces bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "formats/activation.h"
#include "formats/grid.h"
#include "kernels/dispatch.h"

namespace hetmoe {
namespace scalar {

namespace {

void quantize(WeightFormat f, bool amx, const float* x, int k, const ActLayout& a, uint8_t* row) {
  if (amx)
    quantize_activation_amx(f, x, k, a, row);
  else
    quantize_activation(f, x, k, a, row);
}
void bf16_to_f32(const uint16_t* src, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}
void f32_to_bf16(const float* src, int n, uint16_t* dst) {
  for (int i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}
void axpy(float w, const float* y, int n, float* acc) {
  for (int i = 0; i < n; ++i) acc[i] += w * y[i];
}
void swiglu(const float* gate, const float* up, int n, float* h) {
  for (int i = 0; i < n; ++i) h[i] = hetmoe::swiglu(gate[i], up[i]);
}
void clamped_swiglu(const float* gate, const float* up, int n, float alpha, float limit, float offset, float* h) {
  for (int i = 0; i < n; ++i) h[i] = hetmoe::clamped_swiglu(gate[i], up[i], alpha, limit, offset);
}
void copy(const float* src, int n, float* dst) { std::memcpy(dst, src, sizeof(float) * n); }

}  // namespace

RowOps row_ops() { return {quantize, bf16_to_f32, f32_to_bf16, axpy, swiglu, clamped_swiglu, copy}; }

uint64_t read_bytes(const uint8_t* p, size_t bytes) {
  uint64_t a = 0, b = 0;
  for (size_t i = 0; i < bytes; i += 16) {
    uint64_t v[2];
    std::memcpy(v, p + i, 16);
    a ^= v[0];
    b ^= v[1];
  }
  return a ^ b;
}

void rowblock_bf16(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  const int lines = w.kp / 2;
  for (int t = 0; t < n_tok; ++t) {
    const float* x = reinterpret_cast<const float*>(rows[t]);
    for (int r = 0; r < kRowsPerBlock; ++r) {
      float even = 0.f, odd = 0.f;  // two independent fma chains: even and odd k
      for (int j = 0; j < lines; ++j) {
        uint16_t v[2];
        std::memcpy(v, w.data + (size_t)j * kLineBytes + 4 * r, 4);
        even = std::fma(bf16_to_float(v[0]), x[2 * j], even);
        odd = std::fma(bf16_to_float(v[1]), x[2 * j + 1], odd);
      }
      out[t * kRowsPerBlock + r] = even + odd;
    }
  }
}

// Integer formats: exact int32 dot product per group, then acc = fma(float(isum), w_scale * x_scale, acc)
// (affine: and acc = fma(float(-xsum), w_min * x_scale, acc)). lut4: the nibble indexes the codebook (kLut), and
// the sum of codebook value x activation has no offset to undo.
template <typename Q, int kOffset, bool kNibbles, bool kLut = false>
static void rowblock_int(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  const int kpl = kNibbles ? 8 : 4;
  const int n_groups = w.kp / w.group, lines_per_group = w.group / kpl;
  auto code = [&](int u) { return kLut ? (int32_t)w.codebook[u] : (int32_t)u; };
  for (int t = 0; t < n_tok; ++t) {
    const Q* x = reinterpret_cast<const Q*>(rows[t]);
    const float* xs = act_scales(rows[t], a);
    const int32_t* xsum = act_sums(rows[t], a);
    for (int r = 0; r < kRowsPerBlock; ++r) {
      float acc = 0.f;
      for (int g = 0; g < n_groups; ++g) {
        int32_t isum = 0;
        for (int j = g * lines_per_group; j < (g + 1) * lines_per_group; ++j) {
          const uint8_t* p = w.data + (size_t)j * kLineBytes + 4 * r;
          for (int b = 0; b < 4; ++b) {
            if (kNibbles) {
              isum += code(p[b] & 0x0f) * x[j * 8 + b];
              isum += code(p[b] >> 4) * x[j * 8 + 4 + b];
            } else {
              isum += (int32_t)p[b] * x[j * 4 + b];
            }
          }
        }
        const float scale = w.scale(g, r);
        if (w.mins) {  // affine (layout.h): the codes carry no offset, the min meets the element sum
          acc = std::fma((float)isum, scale * xs[g], acc);
          acc = std::fma((float)(-xsum[g]), w.min(g, r) * xs[g], acc);
        } else {
          isum -= kOffset * xsum[g];
          acc = std::fma((float)isum, scale * xs[g], acc);
        }
      }
      out[t * kRowsPerBlock + r] = acc;
    }
  }
}

void rowblock_int8(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  rowblock_int<int16_t, 128, false>(w, rows, a, n_tok, out);
}

void rowblock_int4(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  rowblock_int<int8_t, 8, true>(w, rows, a, n_tok, out);
}

void rowblock_lut4(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  rowblock_int<int8_t, 0, true, true>(w, rows, a, n_tok, out);
}

// Bit-plane formats (formats/layout.h): each stored code u read from its planes; the integer sums and the epilogue
// are those of int8 (int6, int5: int16 activations) or int4 (int3, int2: int8 activations), with the offset 2^(b-1)
// of symmetric codes.
template <WeightFormat F>
static void rowblock_planes(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  using Q = std::conditional_t<wide_codes(F), int16_t, int8_t>;
  constexpr Planes kPlanes = planes_of(F);
  constexpr int32_t kOffset = 1 << (code_bits(F) - 1);
  const int n_groups = w.kp / w.group;
  for (int t = 0; t < n_tok; ++t) {
    const Q* x = reinterpret_cast<const Q*>(rows[t]);
    const float* xs = act_scales(rows[t], a);
    const int32_t* xsum = act_sums(rows[t], a);
    for (int r = 0; r < kRowsPerBlock; ++r) {
      float acc = 0.f;
      for (int g = 0; g < n_groups; ++g) {
        int32_t isum = 0;
        for (int k = g * w.group; k < (g + 1) * w.group; ++k) isum += plane_code(kPlanes, w.data, r, k) * x[k];
        const float scale = w.scale(g, r);
        if (w.mins) {
          acc = std::fma((float)isum, scale * xs[g], acc);
          acc = std::fma((float)(-xsum[g]), w.min(g, r) * xs[g], acc);
        } else {
          isum -= kOffset * xsum[g];
          acc = std::fma((float)isum, scale * xs[g], acc);
        }
      }
      out[t * kRowsPerBlock + r] = acc;
    }
  }
}

void rowblock_int6(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  rowblock_planes<WeightFormat::int6>(w, rows, a, n_tok, out);
}
void rowblock_int5(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  rowblock_planes<WeightFormat::int5>(w, rows, a, n_tok, out);
}
void rowblock_int3(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  rowblock_planes<WeightFormat::int3>(w, rows, a, n_tok, out);
}
void rowblock_int2(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  rowblock_planes<WeightFormat::int2>(w, rows, a, n_tok, out);
}

// grid (formats/layout.h): each super-block of 256 decoded into int8 lines of the signed codes and their fp32 group
// scales (formats/grid.h), then the integer sums of int4's row-block (int8 activations, no offset: the codes are
// signed) and its epilogue acc = fma(float(isum), scale * x_scale, acc), the groups in order; out holds each
// output's accumulator from one super-block to the next.
void rowblock_grid(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  alignas(64) uint8_t lines[kSuperBlock / 4 * kLineBytes];
  float sc[kSuperBlock / 16 * kRowsPerBlock];
  const int gps = kSuperBlock / w.group, lines_per_group = w.group / 4;
  std::fill(out, out + (size_t)n_tok * kRowsPerBlock, 0.f);
  for (int sp = 0; sp < w.kp / kSuperBlock; ++sp) {
    grid::decode_super(w, sp, lines, sc);
    for (int t = 0; t < n_tok; ++t) {
      const int8_t* x = reinterpret_cast<const int8_t*>(rows[t]) + sp * kSuperBlock;
      const float* xs = act_scales(rows[t], a) + sp * gps;
      for (int r = 0; r < kRowsPerBlock; ++r) {
        float acc = out[t * kRowsPerBlock + r];
        for (int g = 0; g < gps; ++g) {
          int32_t isum = 0;
          for (int j = g * lines_per_group; j < (g + 1) * lines_per_group; ++j)
            for (int b = 0; b < 4; ++b) isum += (int32_t)(int8_t)lines[j * kLineBytes + 4 * r + b] * x[4 * j + b];
          acc = std::fma((float)isum, sc[g * kRowsPerBlock + r] * xs[g], acc);
        }
        out[t * kRowsPerBlock + r] = acc;
      }
    }
  }
}

// fp8 (formats/layout.h): each code as q * 2^-8, four fma chains per row (k mod 4: the bytes of a line; x stored
// x0 x2 x1 x3 per quad), summed (c0 + c1) + (c2 + c3) at the end of a group, which then meets its scale:
// acc = fma(sum, scale * 256, acc).
void rowblock_fp8(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  const int n_groups = w.kp / w.group, lines_per_group = w.group / 4;
  for (int t = 0; t < n_tok; ++t) {
    const float* x = reinterpret_cast<const float*>(rows[t]);
    for (int r = 0; r < kRowsPerBlock; ++r) {
      float acc = 0.f;
      for (int g = 0; g < n_groups; ++g) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        for (int j = g * lines_per_group; j < (g + 1) * lines_per_group; ++j) {
          const uint8_t* p = w.data + (size_t)j * kLineBytes + 4 * r;
          for (int b = 0; b < 4; ++b) c[b] = std::fma(e4m3_to_float(p[b]) * 0x1p-8f, x[fp8_act_index(4 * j + b)], c[b]);
        }
        acc = std::fma((c[0] + c[1]) + (c[2] + c[3]), w.scale(g, r) * 256.f, acc);
      }
      out[t * kRowsPerBlock + r] = acc;
    }
  }
}

void fp8_to_bf16_lines(const uint8_t* src, int n_lines, uint8_t* dst) {
  for (int l = 0; l < n_lines; ++l)
    for (int r = 0; r < kRowsPerBlock; ++r)
      for (int b = 0; b < 4; ++b) {
        const float q = e4m3_to_float(src[64 * l + 4 * r + b]) * 0x1p-8f;  // exact in bf16
        uint32_t bits;
        std::memcpy(&bits, &q, 4);
        const uint16_t h = (uint16_t)(bits >> 16);
        std::memcpy(dst + 128 * l + 64 * (b / 2) + 4 * r + 2 * (b % 2), &h, 2);
      }
}

}  // namespace scalar
}  // namespace hetmoe
