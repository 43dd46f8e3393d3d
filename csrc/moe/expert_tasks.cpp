#include "moe/expert_tasks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "formats/activation.h"

namespace hetmoe {

namespace {

// Relative cost of one row block: streaming it once (1) plus each token's compute, which the AMX GEMM does
// about 8x faster than the row-block kernels.
constexpr double kRowBlockTokenCost = 1.0 / 4;
constexpr double kAmxTokenCost = 1.0 / 32;
constexpr int kAmxTokenUnit = 32;    // tokens per AMX tile step
constexpr int kTasksPerThread = 16;  // the last task to finish bounds the phase's tail to a few percent of it
// Decode-like phases (row-block experts only, each with fewer than 1 / kRowBlockTokenCost tokens: streaming the
// weights is the cost) take fewer, longer tasks: every task starts a new DRAM stream whose first lines come at DRAM
// latency, which costs more than the longer tail. With deferral pairs chained (one list of tasks from layer to
// layer, moe/deferral.h), 2 per thread stream fastest; 1, 3 and 4 are slower (BENCHMARKS.md#decode-tasks-per-thread).
constexpr int kStreamingTasksPerThread = 2;
// ... and such a phase's last n_threads tasks are cut in this many when it ends the job, so that the threads done
// first share the last stretch of work (BENCHMARKS.md#one-task-list).
constexpr int kTailCuts = 4;

void check_amx_thread(const MoeExperts& ex) {
  if (ex.amx_mode() == AmxMode::native && !amx_thread_ready())
    throw std::runtime_error("AMX permission refused on a pool thread (arch_prctl ARCH_REQ_XCOMP_PERM)");
}

// The start of an AMX task: the thread's AMX permission checked, `out` set to its GEMM output scratch
// (round_up(n, 32) rows of 32 floats); returns the panel from the task's first token on (m0 is a multiple of 32).
AmxPanel amx_task_start(const MoeExperts& ex, const PhaseInput& in, const Task& task, ThreadPool& pool, int thread,
                        float*& out) {
  check_amx_thread(ex);
  const int n = task.m1 - task.m0;
  out = reinterpret_cast<float*>(pool.thread_scratch(thread, sizeof(float) * 32 * ((n + 31) / 32 * 32)));
  return in.amx.from(in.amx_first[task.e] + task.m0);
}

}  // namespace

void make_tasks(const std::vector<int>& active, const std::vector<int>& count, int amx_experts, const TaskPlan& plan,
                std::vector<Task>& tasks, std::vector<TaskGroup>* groups) {
  tasks.clear();
  if (groups) groups->clear();
  const int nb = plan.n_blocks;
  auto block_cost = [&](size_t i) {
    return 1.0 + count[active[i]] * ((int)i < amx_experts ? kAmxTokenCost : kRowBlockTokenCost);
  };
  double total = 0;
  bool streaming = amx_experts == 0;
  for (size_t i = 0; i < active.size(); ++i) {
    total += nb * block_cost(i);
    streaming = streaming && count[active[i]] * kRowBlockTokenCost < 1.0;
  }
  const double target = total / ((streaming ? kStreamingTasksPerThread : kTasksPerThread) * plan.n_threads);
  int n_groups = 0;
  for (size_t i = 0; i < active.size(); ++i) {
    const int e = active[i], n = count[e];
    const bool amx = (int)i < amx_experts;
    const int gran = amx ? plan.row_gran : 1;
    const double cost = block_cost(i);
    int step = std::max(1, (int)(target / cost) / gran) * gran;
    step = std::min(step, nb);
    // Rows alone too coarse (one step costs more than twice the target): split the tokens as well. AMX tasks
    // also cap their tokens so the activation panel stays in L2.
    int parts = cost * step > 2 * target ? (int)std::ceil(cost * step / target) : 1;
    const int unit = amx ? kAmxTokenUnit : 8;
    int per_part = (int)((n + parts - 1) / parts + unit - 1) / unit * unit;
    if (amx) per_part = std::min(per_part, std::max(unit, plan.amx_max_tokens));
    per_part = std::max(per_part, 1);
    const int n_parts = (n + per_part - 1) / per_part, n_ranges = (nb + step - 1) / step;
    if (groups)
      for (int m0 = 0; m0 < n; m0 += per_part) groups->push_back({e, m0, std::min(n, m0 + per_part), n_ranges});
    // Row ranges of about equal size (in whole units of `gran` blocks), no short remainder; row ranges outside,
    // token parts inside: the parts of one row range run at about the same time and share its weights through L3.
    const int units = (nb + gran - 1) / gran;
    for (int r = 0; r < n_ranges; ++r) {
      auto bound = [&](int i) { return std::min(nb, (units * i + n_ranges - 1) / n_ranges * gran); };
      const int rb0 = bound(r), rb1 = bound(r + 1);
      for (int m0 = 0, g = n_groups; m0 < n; m0 += per_part, ++g)
        tasks.push_back({e, rb0, rb1, m0, std::min(n, m0 + per_part), amx, g});
    }
    n_groups += n_parts;
  }
  // A streaming phase ends in smaller tasks: its last n_threads tasks are cut in kTailCuts by rows, so the
  // threads finish within a fraction of a task of each other while the rest keep their long streams.
  if (streaming && plan.cut_tail) {
    const size_t n_tail = std::min(tasks.size(), (size_t)plan.n_threads);
    std::vector<Task> tail(tasks.end() - n_tail, tasks.end());
    tasks.resize(tasks.size() - n_tail);
    for (const Task& t : tail) {
      const int rows = t.rb1 - t.rb0, c = std::min(kTailCuts, rows);
      for (int i = 0; i < c; ++i) {
        Task piece = t;
        piece.rb0 = t.rb0 + rows * i / c;
        piece.rb1 = t.rb0 + rows * (i + 1) / c;
        tasks.push_back(piece);
      }
      if (groups) (*groups)[t.group].n_tasks += c - 1;
    }
  }
}

// h[i][rb*16 + r] = glu(gate[i][r] + bg[r], up[i][r] + bu[r]) for the n tokens of one row block (rows past I left
// alone; the biases bg, bu of expert e when it has them, added in place); gate/up rows of token i start at
// i * stride.
static void store_glu(const MoeExperts& ex, int e, float* gate, float* up, int stride, int n, int rb, int I, float* h) {
  const int r0 = rb * kRowsPerBlock, r_end = std::min(kRowsPerBlock, I - r0);
  if (const float* bias = ex.gate_up_bias(e)) {
    const float* bg = bias + r0;
    const float* bu = bias + I + r0;
    for (int i = 0; i < n; ++i)
      for (int r = 0; r < r_end; ++r) {
        gate[i * stride + r] += bg[r];
        up[i * stride + r] += bu[r];
      }
  }
  const RowOps& ops = ex.row_ops();
  const Glu& glu = ex.config().glu;
  for (int i = 0; i < n; ++i) {
    float* out = h + (size_t)i * I + r0;
    if (glu.kind == GluKind::clamped_swiglu)
      ops.clamped_swiglu(gate + i * stride, up + i * stride, r_end, glu.alpha, glu.limit, glu.offset, out);
    else
      ops.swiglu(gate + i * stride, up + i * stride, r_end, out);
  }
}

// Adds expert e's down bias (when it has one) to the n output rows o[i * stride + r] of down rows [r0, r0 + count).
static void add_down_bias(const MoeExperts& ex, int e, float* o, int stride, int n, int r0, int count) {
  const float* bias = ex.down_bias(e);
  if (!bias) return;
  for (int i = 0; i < n; ++i)
    for (int r = 0; r < count; ++r) o[i * stride + r] += bias[r0 + r];
}

void run_gate_up_task(const MoeExperts& ex, const Task& task, const PhaseInput& in, float* h, ThreadPool& pool,
                      int thread) {
  const int I = ex.config().intermediate;
  const int n = task.m1 - task.m0, s0 = in.first[task.e] + task.m0;
  const KernelEntry& kernel = ex.kernel();
  if (task.amx) {
    float* o;
    const AmxPanel x = amx_task_start(ex, in, task, pool, thread, o);
    for (int rb = task.rb0; rb < task.rb1; ++rb) {
      const RowBlock w[2] = {ex.gate_up_block(task.e, rb, 0), ex.gate_up_block(task.e, rb, 1)};
      const bool more = rb + 1 < task.rb1;
      const RowBlock next[2] = {more ? ex.gate_up_block(task.e, rb + 1, 0) : w[0],
                                more ? ex.gate_up_block(task.e, rb + 1, 1) : w[1]};
      kernel.gemm(w, 2, more ? next : nullptr, 2, x, ex.gate_up_amx_act(), n, o);  // o[i] = gate 0..15, up 0..15
      store_glu(ex, task.e, o, o + kRowsPerBlock, 2 * kRowsPerBlock, n, rb, I, h + (size_t)s0 * I);
    }
    return;
  }
  float* g = reinterpret_cast<float*>(pool.thread_scratch(thread, sizeof(float) * 2 * kRowsPerBlock * n));
  float* u = g + kRowsPerBlock * n;
  for (int rb = task.rb0; rb < task.rb1; ++rb) {
    kernel.rowblock(ex.gate_up_block(task.e, rb, 0), in.rows + s0, ex.gate_up_act(), n, g);
    kernel.rowblock(ex.gate_up_block(task.e, rb, 1), in.rows + s0, ex.gate_up_act(), n, u);
    store_glu(ex, task.e, g, u, kRowsPerBlock, n, rb, I, h + (size_t)s0 * I);
  }
}

void run_down_task(const MoeExperts& ex, const Task& task, const PhaseInput& in, float* y, ThreadPool& pool,
                   int thread) {
  const int H = ex.config().hidden;
  const int n = task.m1 - task.m0, s0 = in.first[task.e] + task.m0;
  const KernelEntry& kernel = ex.down_kernel();
  // y rows go around the caches when they are read only by the combine after the job's tasks
  const RowOps& ops = ex.row_ops();
  auto put_y = [&](const float* src, int count, float* dst) {
    if (in.stream_out)
      ops.copy_stream(src, count, dst);
    else
      std::memcpy(dst, src, sizeof(float) * count);
  };
  if (task.amx) {
    float* o;
    const AmxPanel x = amx_task_start(ex, in, task, pool, thread, o);
    for (int rb = task.rb0; rb < task.rb1; rb += 2) {
      const int n_blk = std::min(2, task.rb1 - rb);
      const RowBlock w[2] = {ex.down_block(task.e, rb), ex.down_block(task.e, n_blk > 1 ? rb + 1 : rb)};
      const int n_next = std::min(2, task.rb1 - rb - 2);
      const RowBlock next[2] = {n_next > 0 ? ex.down_block(task.e, rb + 2) : w[0],
                                n_next > 1 ? ex.down_block(task.e, rb + 3) : w[0]};
      kernel.gemm(w, n_blk, n_next > 0 ? next : nullptr, n_next, x, ex.down_amx_act(), n, o);
      const int r_end = std::min(kRowsPerBlock * n_blk, H - rb * kRowsPerBlock);
      add_down_bias(ex, task.e, o, 32, n, rb * kRowsPerBlock, r_end);
      for (int i = 0; i < n; ++i) put_y(o + i * 32, r_end, y + (size_t)(s0 + i) * H + rb * kRowsPerBlock);
    }
  } else {
    float* o = reinterpret_cast<float*>(pool.thread_scratch(thread, sizeof(float) * kRowsPerBlock * n));
    for (int rb = task.rb0; rb < task.rb1; ++rb) {
      kernel.rowblock(ex.down_block(task.e, rb), in.rows + s0, ex.down_act(), n, o);
      const int r_end = std::min(kRowsPerBlock, H - rb * kRowsPerBlock);
      add_down_bias(ex, task.e, o, kRowsPerBlock, n, rb * kRowsPerBlock, r_end);
      for (int i = 0; i < n; ++i) put_y(o + i * kRowsPerBlock, r_end, y + (size_t)(s0 + i) * H + rb * kRowsPerBlock);
    }
  }
  if (in.stream_out) stream_fence();  // the streamed rows are visible before the task counts as done
}

}  // namespace hetmoe
