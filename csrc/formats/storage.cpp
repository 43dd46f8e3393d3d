#include "formats/storage.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "formats/pack.h"

namespace hetmoe {

namespace {

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

RandomFill RandomFill::make(WeightFormat f, float std, Codebook codebook) {
  // Standard deviation of the uniform quantized values: int8 q in [-127, 127], int4 q in [-8, 7], lut4 the
  // codebook's 16 values, fp8 the E4M3 values of exponents 2^-3 .. 2^1 (fill_random_block).
  float q_std = f == WeightFormat::int8 ? 73.6f : f == WeightFormat::fp8 ? 1.513f : 4.61f;
  if (plane_format(f)) {  // uniform over the 2^b codes
    const double n = (double)(1 << code_bits(f));
    q_std = (float)std::sqrt((n * n - 1.) / 12.);
  }
  if (f == WeightFormat::grid) q_std = 64.f;  // |code| x the sub-scale's factor, roughly: the d of fill_random_block
  if (f == WeightFormat::lut4) {
    double ss = 0.;
    for (int i = 0; i < 16; ++i) ss += (double)codebook_values(codebook)[i] * codebook_values(codebook)[i];
    q_std = (float)std::sqrt(ss / 16.);
    if (!(q_std > 0.f)) throw std::invalid_argument("fill_random: lut4 needs a codebook");
  }
  RandomFill r;
  r.scale = std / q_std;
  // bf16: magnitudes 2^e..2^(e+3) have a std of about 0.0316 * 2^(e+7)
  r.bf16_exp = 127 - 7 + (int)std::lround(std::log2(std::max(std, 1e-30f) / 0.0316f));
  if (r.bf16_exp < 1 || r.bf16_exp > 250) throw std::invalid_argument("fill_random: std out of range");
  return r;
}

void fill_random_block(const MatrixShape& s, int rb, uint64_t seed, const RandomFill& fill, uint8_t* data,
                       uint8_t* scales) {
  const int kpl = k_per_line(s.format);
  uint64_t state = seed;
  if (s.format == WeightFormat::grid) {  // random block bytes with one fp16 d (padded rows: zeros, d = 0)
    const GridInfo gi = grid_info(s.codebook);
    uint8_t d16[2];
    store_scale_rounded(ScaleType::f16, fill.scale, d16);
    std::memset(data, 0, s.block_bytes());
    if (s.has_scales()) std::memset(scales, 0, s.block_scale_bytes());
    for (int sp = 0; sp < s.n_supers(); ++sp)
      for (int r = 0; r < kRowsPerBlock && rb * kRowsPerBlock + r < s.n; ++r) {
        uint8_t* b = data + ((size_t)sp * kRowsPerBlock + r) * gi.row_bytes;
        for (int i = 0; i < gi.row_bytes; i += 8) {
          const uint64_t v = splitmix64(state);
          std::memcpy(b + i, &v, std::min(8, gi.row_bytes - i));
        }
        if (gi.has_d) {
          std::memcpy(scales + ((size_t)sp * kRowsPerBlock + r) * 2, d16, 2);
        } else {  // IQ1_M: the d's nibbles on top of its four scale words
          const uint16_t d = (uint16_t)(d16[0] | d16[1] << 8);
          for (int j = 0; j < 4; ++j)
            b[48 + 2 * j + 1] = (uint8_t)((b[48 + 2 * j + 1] & 0x0f) | ((d >> (4 * j)) & 15) << 4);
        }
      }
    return;
  }
  if (plane_format(s.format)) {  // uniform codes, padding the code of zero (the offset; affine 0: the min undoes it)
    const Planes p = planes_of(s.format);
    const int bits = code_bits(s.format), pad = s.affine() ? 0 : 1 << (bits - 1);
    const int kpu = s.lines_per_block() / p.lines * p.unit_k();
    std::memset(data, 0, s.block_bytes());
    for (int r = 0; r < kRowsPerBlock; ++r) {
      const bool row_ok = rb * kRowsPerBlock + r < s.n;
      for (int k = 0; k < kpu; k += 8) {
        const uint64_t bits64 = splitmix64(state);
        for (int i = 0; i < 8; ++i)
          set_plane_code(p, data, r, k + i,
                         row_ok && k + i < s.k ? (int)((bits64 >> (8 * i)) & ((1u << bits) - 1)) : pad);
      }
    }
  }
  for (int line = 0; line < (kpl ? s.lines_per_block() : 0); ++line) {
    for (int r = 0; r < kRowsPerBlock; ++r) {
      const bool row_ok = rb * kRowsPerBlock + r < s.n;
      const uint64_t bits = splitmix64(state);
      uint8_t* dst = data + (size_t)line * kLineBytes + 4 * r;
      const int k0 = line * kpl;
      if (s.format == WeightFormat::bf16) {
        for (int h = 0; h < 2; ++h) {
          const uint64_t b = bits >> (16 * h);
          // sign, one of three exponents from bf16_exp up (times [1, 2) from the mantissa), 7 mantissa bits
          uint16_t v = (uint16_t)(((b & 1) << 15) | ((fill.bf16_exp + (b >> 1) % 3) << 7) | ((b >> 8) & 0x7F));
          if (!row_ok || k0 + h >= s.k) v = 0;
          std::memcpy(dst + 2 * h, &v, 2);
        }
      } else if (s.format == WeightFormat::int8) {
        for (int b = 0; b < 4; ++b) {
          const int q = (int)((bits >> (16 * b)) % 255) - 127;
          dst[b] = (uint8_t)((row_ok && k0 + b < s.k ? q : 0) + 128);
        }
      } else if (s.format == WeightFormat::fp8) {
        for (int b = 0; b < 4; ++b) {  // sign, one of 5 exponent fields 4..8 (2^-3 .. 2^1), 3 mantissa bits
          const uint64_t v = bits >> (16 * b);
          const uint8_t code = (uint8_t)(((v >> 8) & 0x80) | ((4 + (v & 0xff) % 5) << 3) | ((v >> 8) & 7));
          dst[b] = row_ok && k0 + b < s.k ? code : 0;
        }
      } else {  // int4 (padding 8), lut4 (padding index 0)
        const uint8_t pad = s.format == WeightFormat::lut4 ? 0 : 8;
        for (int b = 0; b < 4; ++b) {
          const bool lo_ok = row_ok && k0 + b < s.k, hi_ok = row_ok && k0 + 4 + b < s.k;
          const uint8_t lo = lo_ok ? (bits >> (8 * b)) & 0xF : pad, hi = hi_ok ? (bits >> (8 * b + 4)) & 0xF : pad;
          dst[b] = (uint8_t)(lo | (hi << 4));
        }
      }
    }
  }
  // every scale the same (rounded to the scale type; k8 / k4: sub-scale 1, super scale fp16); affine: the same bytes
  // read as u with min = scale * 128 (int8) / 8 (int4) give the symmetric values again
  if (!s.has_scales()) return;
  uint8_t tmp[4];
  const ScaleType t = two_level(s.scale_type) ? ScaleType::f16 : s.scale_type;
  const float scale = store_scale_rounded(t, fill.scale, tmp);
  set_block_factor(s, scales, 1.f);  // e4m3: the factor store_scale_rounded rounded at
  std::vector<float> v(s.n_groups());
  for (int r = 0; r < kRowsPerBlock; ++r) {
    for (int pass = 0; pass < (s.affine() ? 2 : 1); ++pass) {
      const float value = pass == 0 ? scale : scale * (float)(1 << (code_bits(s.format) - 1));
      std::fill(v.begin(), v.end(), value);
      if (!store_row_set(s, v.data(), r, scales, pass == 1, true)) {
        std::fill(v.begin(), v.end(), value);
        store_row_set(s, v.data(), r, scales, pass == 1, false);
      }
    }
  }
}

uint64_t storage_checksum(ThreadPool& pool, const std::vector<std::pair<uint8_t*, size_t>>& ranges) {
  constexpr size_t kChunk = 1u << 20;
  std::vector<std::pair<const uint8_t*, size_t>> chunks;
  for (auto& [p, n] : ranges)
    for (size_t off = 0; off < n; off += kChunk) chunks.emplace_back(p + off, std::min(kChunk, n - off));
  std::vector<uint64_t> hashes(chunks.size());
  pool.run_and_wait([&](ThreadPool& pool) {
    pool.parallel_for((int64_t)chunks.size(), [&](int64_t c, int) {
      const uint8_t* p = chunks[c].first;
      const size_t n = chunks[c].second;
      uint64_t h[4] = {1, 2, 3, 4};  // four independent lanes keep the loop bandwidth-bound
      size_t i = 0;
      for (; i + 32 <= n; i += 32)
        for (int l = 0; l < 4; ++l) {
          uint64_t w;
          std::memcpy(&w, p + i + 8 * l, 8);
          h[l] = (h[l] ^ w) * 0x100000001B3ull + (h[l] >> 29);
        }
      uint64_t acc = n;
      for (; i < n; ++i) acc = (acc ^ p[i]) * 0x100000001B3ull;
      for (int l = 0; l < 4; ++l) acc = (acc ^ h[l]) * 0x9E3779B97F4A7C15ull + (acc >> 31);
      hashes[c] = acc;
    });
  });
  uint64_t total = 0xCBF29CE484222325ull;
  for (uint64_t h : hashes) total = (total ^ h) * 0x100000001B3ull + (total >> 33);
  return total;
}

}  // namespace hetmoe
