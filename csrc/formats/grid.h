// Decoding the grid format (formats/layout.h): the rows of one super-block of a grid row block -> 64 int8 lines of
// their signed codes q and their group scales as fp32. Portable C++ that every kernel level includes and compiles
// with its own flags (scalar, AVX2, AVX-512, the AMX expansion), so every path multiplies the same codes by the same
// scales. The codes are integers with |q| <= 63:
//   IQ2_XXS, IQ2_XS, IQ2_S   grid values {8, 25, 43} x sign         scale d * (2 s + 1) / 8   (s: 4 bits)
//   IQ3_XXS                  grid values {4, 12, .., 52, 62} x sign  scale d * (2 s + 1) / 4   (s: 4 bits)
//   IQ3_S                    grid values {1, 3, .., 15} x sign       scale d * (2 s + 1)       (s: 4 bits)
//   IQ1_S, IQ1_M             8 x grid value {-1, 0, 1} + delta (+-1)  scale d * (2 s + 1) / 8   (s: 3 bits)
// and each scale is one exact fp32 product (11 + 5 significant bits, a power of two), so scale * q is bitwise what
// gguf.quants.dequantize computes (d * (0.5 + s) * 0.25 * grid * sign, dl * (grid + delta), ...).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <emmintrin.h>  // SSE2, the x86-64 baseline: every build of the decoder has it

#include "formats/grid_tables.h"
#include "formats/layout.h"

namespace hetmoe {
namespace grid {

// A packed grid (grid_tables.h) as words of int8 values, value j in byte j.
template <size_t N, int M>
constexpr std::array<uint64_t, N> expand8(const uint16_t (&packed)[N], const int (&map)[M]) {
  std::array<uint64_t, N> out{};
  for (size_t i = 0; i < N; ++i) {
    uint64_t w = 0;
    for (int j = 0; j < 8; ++j) w |= (uint64_t)(uint8_t)(int8_t)map[(packed[i] >> (2 * j)) & 3] << (8 * j);
    out[i] = w;
  }
  return out;
}
template <size_t N, int M>
constexpr std::array<uint32_t, N> expand4(const uint16_t (&packed)[N], const int (&map)[M]) {
  std::array<uint32_t, N> out{};
  for (size_t i = 0; i < N; ++i) {
    uint32_t w = 0;
    for (int j = 0; j < 4; ++j) w |= (uint32_t)(uint8_t)map[(packed[i] >> (3 * j)) & 7] << (8 * j);
    out[i] = w;
  }
  return out;
}

constexpr int kIq2Map[3] = {8, 25, 43};
constexpr int kIq3xxsMap[8] = {4, 12, 20, 28, 36, 44, 52, 62};
constexpr int kIq3sMap[8] = {1, 3, 5, 7, 9, 11, 13, 15};
constexpr int kIq1Map[3] = {-1, 0, 1};
inline constexpr auto kIq2xxs = expand8(grid_tables::kIq2xxsPacked, kIq2Map);
inline constexpr auto kIq2xs = expand8(grid_tables::kIq2xsPacked, kIq2Map);
inline constexpr auto kIq2s = expand8(grid_tables::kIq2sPacked, kIq2Map);
inline constexpr auto kIq3xxs = expand4(grid_tables::kIq3xxsPacked, kIq3xxsMap);
inline constexpr auto kIq3s = expand4(grid_tables::kIq3sPacked, kIq3sMap);
inline constexpr auto kIq1s = expand8(grid_tables::kIq1sPacked, kIq1Map);

// Byte j of kSignMask[s]: 0xFF where bit j of s is set. kSigns7[i]: the 8 signs of a 7-bit sign index (IQ2_XXS,
// IQ2_XS, IQ3_XXS): its 7 bits and their parity as bit 7 (an even number of minus signs, llama.cpp's ksigns_iq2xs).
constexpr std::array<uint64_t, 256> sign_masks() {
  std::array<uint64_t, 256> out{};
  for (int s = 0; s < 256; ++s)
    for (int j = 0; j < 8; ++j)
      if (s >> j & 1) out[s] |= (uint64_t)0xFF << (8 * j);
  return out;
}
constexpr std::array<uint8_t, 128> signs7() {
  std::array<uint8_t, 128> out{};
  for (int i = 0; i < 128; ++i) {
    int parity = 0;
    for (int j = 0; j < 7; ++j) parity ^= i >> j & 1;
    out[i] = (uint8_t)(i | parity << 7);
  }
  return out;
}
inline constexpr auto kSignMask = sign_masks();
inline constexpr auto kSigns7 = signs7();
// kSignMask[kSigns7[i]]: one load per 8 values where the file holds sign indices
constexpr std::array<uint64_t, 128> sign_masks7() {
  std::array<uint64_t, 128> out{};
  for (int i = 0; i < 128; ++i) out[i] = sign_masks()[signs7()[i]];
  return out;
}
inline constexpr auto kSignMask7 = sign_masks7();
// The same signs as +-1 bytes (0x01 / 0xFF): what a SIMD sign instruction (x86 psignb) applies to the activations.
constexpr std::array<uint64_t, 128> sign_ones7() {
  std::array<uint64_t, 128> out{};
  for (int i = 0; i < 128; ++i) out[i] = sign_masks7()[i] | 0x0101010101010101ull;
  return out;
}
inline constexpr auto kSignOnes7 = sign_ones7();

// The functions below are compiled into every kernel file with that file's ISA flags: internal linkage keeps each
// file's own copy (one merged copy could be an AVX-512 build called on an AVX2 CPU).
namespace {

// Eight values g_j (each 1..127, as the IQ2 / IQ3 grids hold) negated where byte j of the mask m is 0xFF: ~g + 1 per
// byte, which never carries into the next byte since g >= 1.
inline uint64_t with_mask(uint64_t g, uint64_t m) { return (g ^ m) + (m & 0x0101010101010101ull); }
inline uint64_t with_signs(uint64_t g, uint8_t s) { return with_mask(g, kSignMask[s]); }
inline uint64_t with_signs7(uint64_t g, int s7) { return with_mask(g, kSignMask7[s7]); }

// IQ1: 8 * g + delta per byte (g in {-1, 0, 1}, delta +-1), in one SSE2 register (no carries between bytes to care
// about there).
inline uint64_t iq1_codes(uint64_t g, int delta) {
  __m128i v = _mm_cvtsi64_si128((long long)g);
  v = _mm_and_si128(_mm_slli_epi16(v, 3), _mm_set1_epi8((char)0xF8));
  return (uint64_t)_mm_cvtsi128_si64(_mm_add_epi8(v, _mm_set1_epi8((char)delta)));
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint16_t u16_at(const uint8_t* p) { return (uint16_t)(p[0] | p[1] << 8); }

// IQ1_M's fp16 d, from the top nibbles of its 4 uint16 scale words (b: its block, the 56 bytes).
inline uint16_t iq1m_d_bits(const uint8_t* b) {
  uint16_t s16[4];
  for (int j = 0; j < 4; ++j) s16[j] = u16_at(b + 48 + 2 * j);
  return (uint16_t)((s16[0] >> 12) | ((s16[1] >> 8) & 0xF0) | ((s16[2] >> 4) & 0xF00) | (s16[3] & 0xF000));
}

// Values 8c .. 8c + 7 (chunk c, c < 32) of one row's block b of grid type T as 8 signed codes, value j in byte j.
template <Codebook T>
inline uint64_t chunk(const uint8_t* b, int c) {
  if constexpr (T == Codebook::iq2_xxs) {  // 8 x (4 index bytes, uint32: four 7-bit sign indices, a 4-bit scale)
    const uint32_t aux = u32_at(b + 8 * (c / 4) + 4);
    return with_signs7(kIq2xxs[b[8 * (c / 4) + c % 4]], (aux >> (7 * (c % 4))) & 127);
  } else if constexpr (T == Codebook::iq2_xs) {  // 32 uint16: a 9-bit index, a 7-bit sign index; 8 B of scales
    const uint16_t v = u16_at(b + 2 * c);
    return with_signs7(kIq2xs[v & 511], v >> 9);
  } else if constexpr (T == Codebook::iq2_s) {  // 32 low index bytes, 32 sign bytes, 8 B of 2-bit high indices
    return with_signs(kIq2s[b[c] | ((b[64 + c / 4] >> (2 * (c % 4))) & 3) << 8], b[32 + c]);
  } else if constexpr (T == Codebook::iq3_xxs) {  // 64 index bytes (4 values each); 8 uint32 as IQ2_XXS's
    const uint32_t aux = u32_at(b + 64 + 4 * (c / 4));
    const uint64_t g = kIq3xxs[b[2 * c]] | (uint64_t)kIq3xxs[b[2 * c + 1]] << 32;
    return with_signs7(g, (aux >> (7 * (c % 4))) & 127);
  } else if constexpr (T == Codebook::iq3_s) {  // 64 low index bytes, 8 B of high index bits, 32 sign bytes
    const int hi = b[64 + c / 4] >> ((2 * c) % 8);
    const int i0 = b[2 * c] | (hi & 1) << 8, i1 = b[2 * c + 1] | (hi >> 1 & 1) << 8;
    return with_signs(kIq3s[i0] | (uint64_t)kIq3s[i1] << 32, b[72 + c]);
  } else if constexpr (T == Codebook::iq1_s) {  // 32 low index bytes; 8 uint16: 4 x 3-bit high index, scale, sign
    const uint16_t h = u16_at(b + 32 + 2 * (c / 4));
    return iq1_codes(kIq1s[b[c] | ((h >> (3 * (c % 4))) & 7) << 8], h & 0x8000 ? -1 : 1);
  } else {  // IQ1_M: 32 low index bytes; 16 B of (3-bit high index, delta sign) nibbles
    const int nib = (b[32 + c / 2] >> (4 * (c % 2))) & 15;
    return iq1_codes(kIq1s[b[c] | (nib & 7) << 8], nib & 8 ? -1 : 1);
  }
}

// The group scales of one row's block b (d: its fp16 d as fp32; IQ1_M's is in b) into sc[g * 16]. False when d is
// not finite.
inline bool row_scales(Codebook type, const uint8_t* b, float d, float* sc) {
  switch (type) {
    case Codebook::iq2_xxs:
    case Codebook::iq3_xxs: {  // the top 4 bits of each group's uint32
      const uint8_t* aux = b + (type == Codebook::iq2_xxs ? 4 : 64);
      const float unit = type == Codebook::iq2_xxs ? 0.125f : 0.25f;
      const int stride = type == Codebook::iq2_xxs ? 8 : 4;
      for (int ib = 0; ib < 8; ++ib) sc[ib * 16] = d * (float)(2 * (u32_at(aux + stride * ib) >> 28) + 1) * unit;
      break;
    }
    case Codebook::iq2_xs:
    case Codebook::iq2_s: {  // 8 bytes of two 4-bit scales, one per 16
      const uint8_t* scales = b + (type == Codebook::iq2_xs ? 64 : 72);
      for (int g = 0; g < 16; ++g) sc[g * 16] = d * (float)(2 * ((scales[g / 2] >> (4 * (g % 2))) & 15) + 1) * 0.125f;
      break;
    }
    case Codebook::iq3_s:  // 4 bytes of two 4-bit scales, one per 32
      for (int ib = 0; ib < 8; ++ib) sc[ib * 16] = d * (float)(1 + 2 * ((b[104 + ib / 2] >> (4 * (ib % 2))) & 15));
      break;
    case Codebook::iq1_s:  // bits 12..14 of each group's uint16
      for (int ib = 0; ib < 8; ++ib) sc[ib * 16] = d * (float)(2 * ((u16_at(b + 32 + 2 * ib) >> 12) & 7) + 1) * 0.125f;
      break;
    case Codebook::iq1_m: {  // 4 uint16 of four 3-bit scales (one per 16), their top nibbles the fp16 d
      const uint16_t dbits = iq1m_d_bits(b);
      const uint8_t h2[2] = {(uint8_t)dbits, (uint8_t)(dbits >> 8)};
      d = scale_to_float(ScaleType::f16, h2);
      for (int g = 0; g < 16; ++g)
        sc[g * 16] = d * (float)(2 * ((u16_at(b + 48 + 2 * (g / 4)) >> (3 * (g % 4))) & 7) + 1) * 0.125f;
      break;
    }
    default: return false;
  }
  return d - d == 0.f;  // finite
}

// The codes of 16 rows of grid type T (rows: row 0's block, the next rows' row_bytes apart) into 64 lines, four rows
// at a time: each chunk's 8 codes of rows 4i .. 4i + 3 become one 16-byte store into line 2c (their low halves) and
// one into line 2c + 1 (their high halves).
template <Codebook T>
inline void super_codes(const uint8_t* rows, size_t row_bytes, uint8_t* lines) {
  for (int r0 = 0; r0 < kRowsPerBlock; r0 += 4) {
    const uint8_t* b = rows + r0 * row_bytes;
    uint8_t* dst = lines + 4 * r0;
    for (int c = 0; c < kSuperBlock / 8; ++c) {
      const __m128 q01 =
          _mm_castsi128_ps(_mm_set_epi64x((long long)chunk<T>(b + row_bytes, c), (long long)chunk<T>(b, c)));
      const __m128 q23 = _mm_castsi128_ps(
          _mm_set_epi64x((long long)chunk<T>(b + 3 * row_bytes, c), (long long)chunk<T>(b + 2 * row_bytes, c)));
      _mm_storeu_ps(reinterpret_cast<float*>(dst + (size_t)(2 * c) * kLineBytes), _mm_shuffle_ps(q01, q23, 0x88));
      _mm_storeu_ps(reinterpret_cast<float*>(dst + (size_t)(2 * c + 1) * kLineBytes), _mm_shuffle_ps(q01, q23, 0xDD));
    }
  }
}

// Super-block s of grid row block w: its 16 rows' codes into `lines` (64 lines of 64 bytes, line j = k 4j .. 4j + 3
// of the super-block, as an int8 line of signed codes) and its scales into `scales` ([256 / group][16] fp32).
// False when a row's d is not finite.
inline bool decode_super(const RowBlock& w, int s, uint8_t* lines, float* scales) {
  const GridInfo gi = grid_info(w.grid);
  const uint8_t* rows = w.data + (size_t)s * kRowsPerBlock * gi.row_bytes;
  const uint8_t* d16 = gi.has_d ? w.scales + (size_t)s * kRowsPerBlock * 2 : nullptr;
  bool ok = true;
  for (int r = 0; r < kRowsPerBlock; ++r)
    ok &= row_scales(w.grid, rows + (size_t)r * gi.row_bytes, d16 ? scale_to_float(ScaleType::f16, d16 + 2 * r) : 0.f,
                     scales + r);
  switch (w.grid) {
    case Codebook::iq2_xxs: super_codes<Codebook::iq2_xxs>(rows, gi.row_bytes, lines); break;
    case Codebook::iq2_xs: super_codes<Codebook::iq2_xs>(rows, gi.row_bytes, lines); break;
    case Codebook::iq2_s: super_codes<Codebook::iq2_s>(rows, gi.row_bytes, lines); break;
    case Codebook::iq3_xxs: super_codes<Codebook::iq3_xxs>(rows, gi.row_bytes, lines); break;
    case Codebook::iq3_s: super_codes<Codebook::iq3_s>(rows, gi.row_bytes, lines); break;
    case Codebook::iq1_s: super_codes<Codebook::iq1_s>(rows, gi.row_bytes, lines); break;
    case Codebook::iq1_m: super_codes<Codebook::iq1_m>(rows, gi.row_bytes, lines); break;
    default: return false;
  }
  return ok;
}

}  // namespace

}  // namespace grid
}  // namespace hetmoe
