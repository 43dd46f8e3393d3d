// The sum of squares of an fp32 row in the order PyTorch's CPU sum (AVX2 build) adds it, so that an RMSNorm on the
// engine (dense/linear_job.cpp, dense/decode_block.cpp) is bitwise an fp32 model's F.rms_norm on such a machine:
// vectors of 8 lanes read 4 at a time into 4 accumulators, which cascade up to 3 more levels every 16 (or more)
// steps; then the accumulators, the vectors left over and the 4 accumulators added in order; then the scalar tail
// and the 8 lanes, in order.
#pragma once
#include <cstdint>

namespace hetmoe {

inline float sum_squares_torch_order(const float* x, int64_t n) {
  constexpr int kLevels = 4;
  const int64_t n_vec = n / 8, n_step = n_vec / 4;
  int ceil_log2 = 0;
  while (((int64_t)1 << ceil_log2) < n_step) ++ceil_log2;
  const int level_power = ceil_log2 / kLevels > 4 ? ceil_log2 / kLevels : 4;
  const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
  float acc[kLevels][4][8] = {};
  auto add_vec = [&](float* a, int64_t v) {
    for (int l = 0; l < 8; ++l) a[l] += x[v * 8 + l] * x[v * 8 + l];
  };
  int64_t i = 0;
  while (i + level_step <= n_step) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) add_vec(acc[0][k], i * 4 + k);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 8; ++l) acc[j][k][l] += acc[j - 1][k][l], acc[j - 1][k][l] = 0.0f;
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < n_step; ++i)
    for (int k = 0; k < 4; ++k) add_vec(acc[0][k], i * 4 + k);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 8; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = n_step * 4; v < n_vec; ++v) add_vec(acc[0][0], v);
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < 8; ++l) acc[0][0][l] += acc[0][k][l];
  float sum = 0.0f;
  for (int64_t e = n_vec * 8; e < n; ++e) sum += x[e] * x[e];
  for (int l = 0; l < 8; ++l) sum += acc[0][0][l];
  return sum;
}

}  // namespace hetmoe
