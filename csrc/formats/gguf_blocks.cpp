#include "formats/gguf_blocks.h"

#include <cstring>

#include "formats/layout.h"

namespace hetmoe {

namespace {

// IEEE half -> float, exact (formats/layout.h: the widening of fp16 scales).
inline float half_to_float(const uint8_t* p) { return scale_to_float(ScaleType::f16, p); }

// The eight 6-bit scales and mins of a Q4_K / Q5_K super-block from its 12 bytes s.
inline void scale_min(const uint8_t* s, int* sc, int* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
    m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// One Q4_K / Q5_K super-block (qh: the fifth bits, or null) -> 256 codes, 8 scales, 8 mins.
inline void affine_block(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, int8_t* q, float* scales,
                         float* mins) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  int sc[8], m[8];
  scale_min(b + 4, sc, m);
  for (int j = 0; j < 8; ++j) {
    scales[j] = d * (float)sc[j];
    mins[j] = dmin * (float)m[j];
  }
  for (int c = 0; c < 4; ++c)  // low nibbles of bytes 32c.. are sub-block 2c, the high ones 2c + 1
    for (int i = 0; i < 32; ++i) {
      const uint8_t v = qs[32 * c + i];
      int lo = v & 0x0f, hi = v >> 4;
      if (qh) {
        lo |= ((qh[i] >> (2 * c)) & 1) << 4;
        hi |= ((qh[i] >> (2 * c + 1)) & 1) << 4;
      }
      q[64 * c + i] = (int8_t)lo;
      q[64 * c + 32 + i] = (int8_t)hi;
    }
}

// One Q6_K super-block -> 256 codes in [-32, 31] and 16 scales. Values 128 h + 32 t + i (t < 4, i < 32): low 4 bits
// from byte 64 h + 32 (t % 2) + i of ql (its high nibble for t >= 2), high 2 bits from byte 32 h + i of qh (bits 2 t).
inline void q6_block(const uint8_t* b, int8_t* q, float* scales) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  for (int g = 0; g < 16; ++g) scales[g] = d * (float)sc[g];
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t) {
      const uint8_t *lo = ql + 64 * h + 32 * (t % 2), *hi = qh + 32 * h;
      const int lo_shift = 4 * (t / 2), hi_shift = 2 * t;
      int8_t* out = q + 128 * h + 32 * t;
      for (int i = 0; i < 32; ++i)
        out[i] = (int8_t)((((lo[i] >> lo_shift) & 0x0f) | (((hi[i] >> hi_shift) & 0x03) << 4)) - 32);
    }
}

// Values 128 h + 32 t + i (h < 2, t < 4, i < 32) of a Q2_K / Q3_K super-block: bits 2t..2t+1 of byte 32 h + i of qs
// (Q3_K: minus 4 where bit 4 h + t of hmask byte i is clear).
inline void two_bit_codes(const uint8_t* qs, const uint8_t* hmask, int8_t* q) {
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 32; ++i) {
        int v = (qs[32 * h + i] >> (2 * t)) & 3;
        if (hmask) v -= ((hmask[i] >> (4 * h + t)) & 1) ? 0 : 4;
        q[128 * h + 32 * t + i] = (int8_t)v;
      }
}

// One Q3_K super-block -> 256 codes in [-4, 3] and 16 scales d * (sc - 32). Scale j's 6 bits: the low nibble of
// byte j (j < 8) or the high nibble of byte j - 8, and bits 2 (j / 4) of byte 8 + j % 4 above them.
inline void q3_block(const uint8_t* b, int8_t* q, float* scales) {
  const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
  const float d = half_to_float(b + 108);
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? sc[j] & 0x0f : sc[j - 8] >> 4, high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    scales[j] = d * (float)((low | high << 4) - 32);
  }
  two_bit_codes(qs, hmask, q);
}

// One Q2_K super-block -> 256 codes in 0..3, 16 scales d * (sc & 15) and mins dmin * (sc >> 4).
inline void q2_block(const uint8_t* b, int8_t* q, float* scales, float* mins) {
  const uint8_t *sc = b, *qs = b + 16;
  const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
  for (int j = 0; j < 16; ++j) {
    scales[j] = d * (float)(sc[j] & 0x0f);
    mins[j] = dmin * (float)(sc[j] >> 4);
  }
  two_bit_codes(qs, nullptr, q);
}

}  // namespace

int kquant_block_bytes(KQuant kind) {
  switch (kind) {
    case KQuant::q4_k: return 144;
    case KQuant::q5_k: return 176;
    case KQuant::q6_k: return 210;
    case KQuant::q3_k: return 110;
    case KQuant::q2_k: return 84;
  }
  return 0;
}
int kquant_group(KQuant kind) { return kind == KQuant::q4_k || kind == KQuant::q5_k ? 32 : 16; }

void decode_kquant(KQuant kind, const uint8_t* raw, int64_t rows, int64_t cols, int8_t* codes, float* scales,
                   float* mins) {
  const int64_t n_blocks = rows * (cols / kQkK), bytes = kquant_block_bytes(kind);
  const int per_block = kQkK / kquant_group(kind);  // scales per super-block
  for (int64_t i = 0; i < n_blocks; ++i) {
    const uint8_t* b = raw + i * bytes;
    int8_t* q = codes + i * kQkK;
    float* s = scales + i * per_block;
    if (kind == KQuant::q6_k)
      q6_block(b, q, s);
    else if (kind == KQuant::q3_k)
      q3_block(b, q, s);
    else if (kind == KQuant::q2_k)
      q2_block(b, q, s, mins + i * per_block);
    else if (kind == KQuant::q4_k)
      affine_block(b, nullptr, b + 16, q, s, mins + i * per_block);
    else
      affine_block(b, b + 16, b + 48, q, s, mins + i * per_block);
  }
}

}  // namespace hetmoe
