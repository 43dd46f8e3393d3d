// The scale search of hetmoe's own low-bit expert formats (hetmoe/cpu/lowbit.py quantize, its reference), the same
// arithmetic in the same order so that both give the same codes, scales and mins bit for bit.
#pragma once
#include <cstdint>

namespace hetmoe {

struct LowBitSearch {
  int bits = 3;                   // code bits: symmetric codes in [-2^(bits-1), 2^(bits-1) - 1], affine [0, 2^bits - 1]
  bool affine = false;            // value = scale * q + offset (offset = -min), else scale * q
  int group = 32;                 // values per group: a power of two, 2..128
  const float* denoms = nullptr;  // candidate scales: affine the group's range / denoms[c], symmetric m / denoms[c]
  int n_cands = 0;                // (m the signed value of largest magnitude, negated for the first n_negated)
  int n_negated = 0;
  bool avx2 = false;  // the AVX2 build of the search (the caller checked the CPU): the same results, faster
  bool k8 = true;  // scales (and mins) rounded to k8 (an int8 per group times an fp16 per 256 values) before the codes
};

// Quantizes rows [0, rows) of w (fp32 [rows][k], k a multiple of the group) with
// importance imp[k] (nullptr: all 1) into codes [rows][k], scales and (affine) mins [rows][k / group], splitting the
// rows over `threads` threads.
void lowbit_quantize(const LowBitSearch& p, const float* w, int64_t rows, int64_t k, const float* imp, int threads,
                     int8_t* codes, float* scales, float* mins);

}  // namespace hetmoe
