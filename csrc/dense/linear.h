// A dense linear on the CPU engine: the engine's matrix product with one expert and all tokens. One packed matrix
// W [N, K] (Hugging Face out x in: attention projections, shared experts, dense MLPs, lm_head) in the layout of
// formats/layout.h, computed by the kernels of the one dispatch table (kernels/dispatch.h) on the engine's pool.
//
// One call:  x [T, K] -> out[t, :] (+)= W norm(x_t) (+ bias)      for t < T
//   norm     optional RMSNorm of the input (Hugging Face: w * (x / sqrt(mean(x^2) + eps)), in fp32), optionally
//            written out too (norm_out), rounded as the eager module rounds it
//   quantize every token's row once, for the path that computes it (in parallel over tokens when there are many)
//   tasks    (row-block range x token range), pulled by every pool thread:
//            few tokens: each task does all tokens over its row blocks, so the weights stream once, each thread on
//              its own ranges (decode);
//            many tokens: the AMX GEMM where the engine has one and T >= amx_min_tokens, else the row-block kernels
//              over token ranges
//   store    out = (W x + bias), or out = out + (W x + bias) with accumulate; fp32 or bf16, rows `out_stride` apart
// Every output element is computed by one kernel call whose result depends on its token and row only: the result
// is bitwise the same for any thread count and any task split.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "formats/layout.h"
#include "kernels/dispatch.h"
#include "runtime/cpu_features.h"
#include "runtime/huge_buffer.h"
#include "runtime/thread_pool.h"

namespace hetmoe {

struct LinearConfig {
  int n = 0;  // N: output features (rows of W)
  int k = 0;  // K: input features
  WeightFormat format = WeightFormat::bf16;
  int group = 64;  // int8/int4 scale group (32, 64, 128; int8 also 16); <= 0 means per-row scales
  Isa isa = Isa::scalar;
  AmxMode amx = AmxMode::off;  // isa == amx implies native; emulated: tests only
  int amx_min_tokens = 4;      // calls with at least this many tokens use the AMX GEMM (where there is one)
};

// Arguments of one call. Pointers are raw and must stay valid while the job can run; strides are in elements.
struct LinearCall {
  const void* x = nullptr;  // [capacity, x_stride] fp32, or bf16 with x_bf16; the first K of each row are read
  bool x_bf16 = false;
  int64_t x_stride = 0;  // 0: K
  void* out = nullptr;   // [capacity, out_stride] fp32, or bf16 with out_bf16; the first N of each row are written
  bool out_bf16 = false;
  int64_t out_stride = 0;       // 0: N
  const float* bias = nullptr;  // [N] or null
  bool accumulate = false;      // out += result (a residual add)
  const float* norm = nullptr;  // [K] RMSNorm weight, or null: no norm
  float norm_eps = 1e-6f;
  // With norm: the normed rows are also written here, in x's dtype, rounded as an eager RMSNorm module in that
  // dtype rounds them (bf16: the normalised x, then its product with the weight), and the product reads these
  // rounded values: the call is then exactly `h = norm(x); out = W h` (a MoE block's input and its router).
  void* norm_out = nullptr;
  int64_t norm_out_stride = 0;            // 0: K
  const int64_t* n_tokens_ptr = nullptr;  // if set, T is read from here when the job runs
  int64_t n_tokens = 0;                   // otherwise T
  int64_t capacity = 0;                   // rows of x and out
};

class DenseLinear {
 public:
  DenseLinear(const LinearConfig& cfg, std::shared_ptr<ThreadPool> pool);

  // Packs rows [r0, r0 + n_rows) from fp32 w [n_rows, K] (row-major), on the pool; r0 is a multiple of 16 and
  // n_rows too unless the call ends at N. Throws std::invalid_argument for other ranges or NaN/Inf weights.
  void load_rows(int r0, int n_rows, const float* w);
  // fp32 [N, K]: the values the kernels multiply by.
  void unpack(float* w) const;
  // Random weights for benchmarks (formats/storage.h RandomFill), deterministic in `seed`; marks every row loaded.
  void fill_random(uint64_t seed, float std);
  // The packed storage as (pointer, bytes) ranges: data, then scales (bf16: none). mark_loaded follows a restore.
  std::vector<std::pair<uint8_t*, size_t>> storage() const;
  void mark_loaded();
  uint64_t checksum() const;
  size_t nbytes() const { return shape_.data_bytes() + shape_.scale_bytes(); }  // weights + scales, streamed per call
  bool loaded() const { return n_loaded_blocks_.load(std::memory_order_acquire) == shape_.n_blocks; }

  // Computes one call now (a job on the pool, after those queued) and returns when it is done; rethrows its error.
  void run(const LinearCall& call) const;
  // The job's work on the coordinator thread of `pool` (LinearJob::run and run()).
  void compute(const LinearCall& call, ThreadPool& pool) const;

  const LinearConfig& config() const { return cfg_; }
  const MatrixShape& shape() const { return shape_; }
  const ActLayout& act() const { return act_; }
  const ActLayout& amx_act() const { return amx_act_; }
  const KernelEntry& kernel() const { return kernel_; }
  AmxMode amx_mode() const { return kernel_.gemm ? cfg_.amx : AmxMode::off; }
  int amx_min_tokens() const { return amx_min_tokens_.load(std::memory_order_relaxed); }
  void set_amx_min_tokens(int n);
  bool uses_amx(int64_t n_tokens) const { return kernel_.gemm != nullptr && n_tokens >= amx_min_tokens(); }
  ThreadPool& pool() const { return *pool_; }
  RowBlock block(int rb) const;

 private:
  LinearConfig cfg_;
  std::shared_ptr<ThreadPool> pool_;
  MatrixShape shape_;
  ActLayout act_, amx_act_;
  KernelEntry kernel_;
  RowOps row_ops_;
  std::atomic<int> amx_min_tokens_{4};
  HugeBuffer data_, scales_;
  std::vector<uint8_t> block_loaded_;
  std::atomic<int> n_loaded_blocks_{0};
};

// Throws std::invalid_argument for a call no job can run (null buffers, strides shorter than a row, ...).
void check_linear_call(const DenseLinear& lin, const LinearCall& call);

// A prepared call: submit it to the linear's pool as often as needed (the buffers' contents, and T through
// n_tokens_ptr, may change between runs).
class LinearJob : public Job {
 public:
  LinearJob(std::shared_ptr<const DenseLinear> linear, const LinearCall& call);
  void run(ThreadPool& pool) override { linear_->compute(call_, pool); }

 private:
  std::shared_ptr<const DenseLinear> linear_;
  LinearCall call_;
};

}  // namespace hetmoe
