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

}  // namespace

int kquant_block_bytes(KQuant kind) { return kind == KQuant::q4_k ? 144 : kind == KQuant::q5_k ? 176 : 210; }
int kquant_group(KQuant kind) { return kind == KQuant::q6_k ? 16 : 32; }

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
    else if (kind == KQuant::q4_k)
      affine_block(b, nullptr, b + 16, q, s, mins + i * per_block);
    else
      affine_block(b, b + 16, b + 48, q, s, mins + i * per_block);
  }
}

}  // namespace hetmoe
