// What every owner of packed matrices (moe/experts.cpp, dense/linear.cpp) does with its storage besides packing:
// random packed weights for benchmarks, and a checksum of the packed bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "formats/layout.h"
#include "runtime/thread_pool.h"

namespace hetmoe {

// Random weights with a standard deviation of about `std`, written straight into the packed layout (no fp32 source,
// no packing): uniform quantized values with one scale for every group (bf16: random magnitudes over three octaves).
struct RandomFill {
  float scale;   // int8/int4: every scale
  int bf16_exp;  // bf16: the lowest of the three biased exponents
  // Throws std::invalid_argument when std is out of the range bf16 can express.
  static RandomFill make(WeightFormat f, float std, Codebook codebook = Codebook::none);
};

// Row block rb of a matrix of shape s, deterministic in `seed`; elements outside [n, k] get the padding value (zero).
void fill_random_block(const MatrixShape& s, int rb, uint64_t seed, const RandomFill& fill, uint8_t* data,
                       uint8_t* scales);

// 64-bit hash of the bytes of `ranges`, in their order; computed on the pool, independent of its thread count.
uint64_t storage_checksum(ThreadPool& pool, const std::vector<std::pair<uint8_t*, size_t>>& ranges);

}  // namespace hetmoe
