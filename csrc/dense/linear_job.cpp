// The call of a DenseLinear (dense/linear.h): checks, the fused RMSNorm and quantization of the tokens' rows, the
// cut into (row-block range x token range) tasks, and the tasks themselves.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "dense/linear.h"
#include "dense/sum_order.h"
#include "formats/activation.h"

namespace hetmoe {

namespace {

// Up to this many tokens a task takes all of them: the weights stream from DRAM once, each thread over its own row
// ranges (decode). A row block is reused from L1 for every token, which costs less than a second pass over DRAM.
constexpr int64_t kStreamTokens = 16;
// A streaming call takes 2 long tasks per thread, the last n_threads of them cut in 4: every task starts a new DRAM
// stream (its first lines at DRAM latency), and the short last ones let the threads finish together (the MoE
// decode phase's split, moe/expert_tasks.cpp).
constexpr int kStreamingTasksPerThread = 2;
constexpr int kTailCuts = 4;
// With many tokens: ~16 tasks per thread (the last task to finish bounds the tail to a few percent) of at most
// kRowTaskTokens tokens on the row-block kernels (their activation rows stay in L2 while the row blocks pass).
constexpr int kTasksPerThread = 16;
constexpr int64_t kRowTaskTokens = 32;
constexpr int64_t kAmxTokenUnit = 32;  // tokens per AMX tile step; AMX tasks start at multiples of it
// The quantization of a call with at most this many elements (T x K) runs on the coordinator alone: waking every
// thread costs more (moe/chunk_plan.cpp kSerialElements).
constexpr int64_t kSerialElements = 1 << 13;
constexpr int64_t kTaskElements = 1 << 14;  // a parallel quantization task takes about this many elements
// Pool scratch slots of a call (the MoE jobs use 0..10; jobs run one after another, slots apart keep them readable).
constexpr int kRowsSlot = 12;      // activation rows, or the AMX panel
constexpr int kPointersSlot = 13;  // [T] pointers to the activation rows

// Tokens per AMX task: its activation panel (tokens x K), re-read for every row-block pair of the task, stays within
// 1.5 MiB of a 2 MiB L2 (moe/chunk_plan.cpp amx_panel_tokens).
int64_t amx_panel_tokens(const ActLayout& a) {
  return std::max<int64_t>(kAmxTokenUnit, (int64_t)((3u << 19) / a.row_bytes) / kAmxTokenUnit * kAmxTokenUnit);
}

struct Range {
  int rb0, rb1;    // row blocks
  int64_t t0, t1;  // tokens
};

// x[i] = w[i] * (x[i] / sqrt(mean(x^2) + eps)) for i < k, in fp32 (Hugging Face RMSNorm without its bf16 rounding);
// the sum of squares in PyTorch's order (dense/sum_order.h): bitwise an fp32 model's RMSNorm on an AVX2 PyTorch.
void rms_norm(float* x, int k, const float* w, float eps) {
  const float ss = sum_squares_torch_order(x, k);
  const float inv = 1.f / std::sqrt(ss / (float)k + eps);
  for (int i = 0; i < k; ++i) x[i] = w[i] * (x[i] * inv);
}

// rms_norm with the rounding points of the eager module (hetmoe/layers/norm.py) for a bf16 x: the normalised x
// rounded to bf16, then its product with the weight rounded again; fp32 x: rms_norm itself.
void rms_norm_rounded(float* x, int k, const float* w, float eps, bool bf16) {
  if (!bf16) return rms_norm(x, k, w, eps);
  const float ss = sum_squares_torch_order(x, k);
  const float inv = 1.f / std::sqrt(ss / (float)k + eps);
  for (int i = 0; i < k; ++i) x[i] = bf16_to_float(float_to_bf16(w[i] * bf16_to_float(float_to_bf16(x[i] * inv))));
}

// The tasks of a call of T tokens: row ranges outside, token parts inside (the parts of one row range run at about
// the same time and share its weights through L3).
void make_ranges(int nb, int64_t T, bool amx, const ActLayout& amx_act, int n_threads, std::vector<Range>& out) {
  out.clear();
  if (!amx && T <= kStreamTokens) {
    // n_threads * (kStreamingTasksPerThread - 1) long ranges, then n_threads long ones cut in kTailCuts each
    const int64_t units = (int64_t)n_threads * kStreamingTasksPerThread * kTailCuts;
    const int64_t long_units = (int64_t)n_threads * (kStreamingTasksPerThread - 1) * kTailCuts;
    int prev = 0;
    for (int64_t u = 0; u < units;) {
      u += u < long_units ? kTailCuts : 1;
      const int b = (int)(nb * u / units);
      if (b > prev) out.push_back({prev, b, 0, T});
      prev = std::max(prev, b);
    }
    return;
  }
  const int64_t per_part = amx ? std::min(round_up(T, kAmxTokenUnit), amx_panel_tokens(amx_act)) : kRowTaskTokens;
  const int64_t n_parts = (T + per_part - 1) / per_part;
  const int gran = amx ? 2 : 1;  // row blocks per AMX GEMM call
  const int units = (nb + gran - 1) / gran;
  const int64_t target = (int64_t)kTasksPerThread * n_threads;
  const int n_ranges = (int)std::max<int64_t>(1, std::min<int64_t>(units, (target + n_parts - 1) / n_parts));
  for (int r = 0; r < n_ranges; ++r) {
    const int rb0 = std::min(nb, (int)((int64_t)units * r / n_ranges) * gran);
    const int rb1 = std::min(nb, (int)((int64_t)units * (r + 1) / n_ranges) * gran);
    if (rb1 <= rb0) continue;
    for (int64_t t0 = 0; t0 < T; t0 += per_part) out.push_back({rb0, rb1, t0, std::min(T, t0 + per_part)});
  }
}

// out[t, c0 + j] (+)= y[j] (+ bias[c0 + j]) for j < nc: the result, plus the bias, then added to out.
void store_out(const LinearCall& c, int64_t out_stride, const float* y, int64_t t, int c0, int nc) {
  float v[2 * kRowsPerBlock];
  for (int j = 0; j < nc; ++j) v[j] = c.bias ? y[j] + c.bias[c0 + j] : y[j];
  if (c.out_bf16) {
    uint16_t* o = static_cast<uint16_t*>(c.out) + t * out_stride + c0;
    for (int j = 0; j < nc; ++j) o[j] = float_to_bf16(c.accumulate ? bf16_to_float(o[j]) + v[j] : v[j]);
  } else {
    float* o = static_cast<float*>(c.out) + t * out_stride + c0;
    for (int j = 0; j < nc; ++j) o[j] = c.accumulate ? o[j] + v[j] : v[j];
  }
}

}  // namespace

void check_linear_call(const DenseLinear& lin, const LinearCall& c) {
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  const int N = lin.config().n, K = lin.config().k;
  if (c.capacity < 0)
    bad("linear call: the capacity (rows of x and out) must be >= 0, got " + std::to_string(c.capacity));
  if (c.n_tokens_ptr == nullptr && (c.n_tokens < 0 || c.n_tokens > c.capacity))
    bad("linear call: T = " + std::to_string(c.n_tokens) + " is outside [0, " + std::to_string(c.capacity) + "]");
  if ((c.capacity > 0 || c.n_tokens_ptr) && (!c.x || !c.out)) bad("linear call: x and out must be set");
  if (c.x_stride != 0 && c.x_stride < K)
    bad("linear call: x's row stride " + std::to_string(c.x_stride) + " is shorter than in_features " +
        std::to_string(K));
  if (c.out_stride != 0 && c.out_stride < N)
    bad("linear call: out's row stride " + std::to_string(c.out_stride) + " is shorter than out_features " +
        std::to_string(N));
  if (c.norm_out && !c.norm) bad("linear call: norm_out needs a norm");
  if (c.norm_out_stride != 0 && c.norm_out_stride < K)
    bad("linear call: norm_out's row stride " + std::to_string(c.norm_out_stride) + " is shorter than in_features " +
        std::to_string(K));
  if (c.norm && !(c.norm_eps >= 0.f && std::isfinite(c.norm_eps)))
    bad("linear call: norm_eps must be finite and >= 0, got " + std::to_string(c.norm_eps));
}

LinearJob::LinearJob(std::shared_ptr<const DenseLinear> linear, const LinearCall& call)
    : linear_(std::move(linear)), call_(call) {
  if (!linear_) throw std::invalid_argument("LinearJob needs a linear");
  check_linear_call(*linear_, call_);
}

void DenseLinear::run(const LinearCall& call) const {
  check_linear_call(*this, call);
  pool_->run_and_wait([&](ThreadPool& pool) { compute(call, pool); });
}

void DenseLinear::compute(const LinearCall& c, ThreadPool& pool) const {
  const int64_t T = c.n_tokens_ptr ? *c.n_tokens_ptr : c.n_tokens;
  if (T < 0 || T > c.capacity)
    throw std::invalid_argument("number of tokens " + std::to_string(T) + " is outside [0, " +
                                std::to_string(c.capacity) + "], the capacity of this call's buffers");
  if (T == 0) return;
  if (!loaded()) throw std::runtime_error("the linear's weights are not all loaded (load_rows or fill_random)");
  const int K = shape_.k, N = shape_.n;
  const int64_t xs = c.x_stride ? c.x_stride : K, os = c.out_stride ? c.out_stride : N;
  const bool amx = uses_amx(T);
  const WeightFormat fmt = cfg_.format;
  const ActLayout& a = amx ? amx_act_ : act_;

  // ---- every token's row once: load, norm, quantize (AMX: into the panel, padded with zero rows to 16)
  const int64_t panel_rows = round_up(T, 16);
  uint8_t* rows_buf =
      pool.scratch(kRowsSlot, amx ? AmxPanel::tile_bytes(a, panel_rows) + AmxPanel::meta_bytes_of(a, panel_rows)
                                  : (size_t)T * a.row_bytes);
  const AmxPanel panel = amx ? AmxPanel::make(a, rows_buf, rows_buf + AmxPanel::tile_bytes(a, panel_rows)) : AmxPanel{};
  auto quantize = [&](int64_t t, int th) {
    float* row = reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * shape_.kp + a.row_bytes));
    if (c.x_bf16)
      row_ops_.bf16_to_f32(static_cast<const uint16_t*>(c.x) + t * xs, K, row);
    else
      std::memcpy(row, static_cast<const float*>(c.x) + t * xs, sizeof(float) * K);
    if (c.norm && c.norm_out) {
      rms_norm_rounded(row, K, c.norm, c.norm_eps, c.x_bf16);
      const int64_t ns = c.norm_out_stride ? c.norm_out_stride : K;
      if (c.x_bf16)
        row_ops_.f32_to_bf16(row, K, static_cast<uint16_t*>(c.norm_out) + t * ns);
      else
        std::memcpy(static_cast<float*>(c.norm_out) + t * ns, row, sizeof(float) * K);
    } else if (c.norm) {
      rms_norm(row, K, c.norm, c.norm_eps);
    }
    if (amx) {
      uint8_t* tmp = reinterpret_cast<uint8_t*>(row + shape_.kp);
      row_ops_.quantize(fmt, true, row, K, a, tmp);
      panel.store(t, tmp, a.scales_off);
    } else {
      row_ops_.quantize(fmt, false, row, K, a, rows_buf + t * a.row_bytes);
    }
  };
  if (T * K <= kSerialElements) {
    for (int64_t t = 0; t < T; ++t) quantize(t, 0);
  } else {
    const int64_t per_task = std::max<int64_t>(1, std::min<int64_t>(kTaskElements / K, T / (4 * (int64_t)pool.size())));
    pool.parallel_for((T + per_task - 1) / per_task, [&](int64_t i, int th) {
      for (int64_t t = i * per_task, end = std::min(T, t + per_task); t < end; ++t) quantize(t, th);
    });
  }
  if (amx)
    for (int64_t r = T; r < panel_rows; ++r) panel.store(r, nullptr, a.scales_off);
  const uint8_t** rows = nullptr;
  if (!amx) {
    rows = reinterpret_cast<const uint8_t**>(pool.scratch(kPointersSlot, sizeof(uint8_t*) * T));
    for (int64_t t = 0; t < T; ++t) rows[t] = rows_buf + t * a.row_bytes;
  }

  // ---- the tasks
  std::vector<Range> ranges;
  make_ranges(shape_.n_blocks, T, amx, amx_act_, pool.size(), ranges);
  pool.parallel_for((int64_t)ranges.size(), [&](int64_t i, int th) {
    const Range& r = ranges[i];
    const int n = (int)(r.t1 - r.t0);
    if (amx) {
      if (amx_mode() == AmxMode::native && !amx_thread_ready())
        throw std::runtime_error("AMX permission refused on a pool thread (arch_prctl ARCH_REQ_XCOMP_PERM)");
      float* o = reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * 32 * round_up(n, 32)));
      const AmxPanel x = panel.from(r.t0);
      for (int rb = r.rb0; rb < r.rb1; rb += 2) {
        const int n_blk = std::min(2, r.rb1 - rb), n_next = std::min(2, r.rb1 - rb - 2);
        const RowBlock w[2] = {block(rb), block(n_blk > 1 ? rb + 1 : rb)};
        const RowBlock next[2] = {n_next > 0 ? block(rb + 2) : w[0], n_next > 1 ? block(rb + 3) : w[0]};
        kernel_.gemm(w, n_blk, n_next > 0 ? next : nullptr, n_next, x, a, n, o);
        const int c0 = rb * kRowsPerBlock, nc = std::min(kRowsPerBlock * n_blk, N - c0);
        for (int j = 0; j < n; ++j) store_out(c, os, o + j * 2 * kRowsPerBlock, r.t0 + j, c0, nc);
      }
      return;
    }
    float* o = reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * kRowsPerBlock * n));
    for (int rb = r.rb0; rb < r.rb1; ++rb) {
      kernel_.rowblock(block(rb), rows + r.t0, a, n, o);
      const int c0 = rb * kRowsPerBlock, nc = std::min(kRowsPerBlock, N - c0);
      for (int j = 0; j < n; ++j) store_out(c, os, o + j * kRowsPerBlock, r.t0 + j, c0, nc);
    }
  });
}

}  // namespace hetmoe
