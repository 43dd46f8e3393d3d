// GGUF's K-quant blocks (llama.cpp's Q4_K, Q5_K, Q6_K) decoded into the codes, scales and mins that
// formats/pack.h pack_row_block_codes packs exactly (hetmoe/load/gguf/kquants.py documents the byte layouts; the Python
// side checks the sizes). A row is cut in super-blocks of 256 values:
//   Q4_K (144 B)  fp16 d, fp16 dmin, 12 B of 6-bit (scale, min) pairs, 128 B of nibbles   -> codes 0..15, per 32
//   Q5_K (176 B)  as Q4_K with 32 B of fifth bits before the nibbles                      -> codes 0..31, per 32
//   Q6_K (210 B)  128 B of low nibbles, 64 B of 2-bit highs, 16 int8 scales, fp16 d      -> codes -32..31, per 16
//   Q3_K (110 B)  32 B of high-bit masks, 64 B of 2-bit lows, 12 B of 6-bit scales, d    -> codes -4..3, per 16
//   Q2_K (84 B)   16 B of 4-bit (scale, min) pairs, 64 B of 2-bit codes, fp16 d, dmin    -> codes 0..3, per 16
// Scales (and mins) are fp32(d) * float(integer scale), one fp32 rounding (exact: 11 + 8 significant bits at most):
// what gguf's numpy dequantization computes, so scale * code (- min) is bitwise its value; a k8 matrix stores them
// as an int8 sub-scale and an fp16 super scale again (formats/layout.h).
#pragma once
#include <cstdint>

namespace hetmoe {

enum class KQuant : int { q4_k = 0, q5_k = 1, q6_k = 2, q3_k = 3, q2_k = 4 };

constexpr int kQkK = 256;  // values per super-block
int kquant_block_bytes(KQuant kind);
int kquant_group(KQuant kind);  // values per scale: 32 (Q4_K, Q5_K), 16 (Q6_K, Q3_K, Q2_K)

// rows x cols values (cols a multiple of 256) from `raw` (rows * cols / 256 blocks, row-major): codes int8
// [rows][cols], scales fp32 [rows][cols / group], mins (Q4_K / Q5_K / Q2_K only, else ignored) fp32
// [rows][cols / group].
void decode_kquant(KQuant kind, const uint8_t* raw, int64_t rows, int64_t cols, int8_t* codes, float* scales,
                   float* mins);

}  // namespace hetmoe
