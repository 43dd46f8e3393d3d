#include "moe/chunk_plan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "formats/activation.h"

namespace hetmoe {

namespace {

inline void load_row_fp32(const RowOps& ops, const void* base, bool bf16, int64_t row, int n, float* dst) {
  if (bf16) {
    ops.bf16_to_f32(static_cast<const uint16_t*>(base) + row * n, n, dst);
  } else {
    std::memcpy(dst, static_cast<const float*>(base) + row * n, sizeof(float) * n);
  }
}

constexpr int kAmxScratchSlot = 8;  // pool scratch slots: AMX rows of x per token (8), the panels of x (9) and h (10)

// Tokens per AMX task: its activation panel (tokens x K), re-read for every row block of the task, stays
// within 1.5 MiB of the 2 MiB L2 (the GEMM's own weight chunk is 32 KB).
int amx_panel_tokens(const ActLayout& a) { return std::max<int>(32, (int)((3u << 19) / a.row_bytes) / 32 * 32); }

// Per-row work (quantizing, combining) of a decode step is cheaper on the coordinator alone than waking every
// thread for it; it goes parallel above this many elements.
constexpr int64_t kSerialElements = 1 << 13;

// A parallel task takes consecutive rows worth about this many elements (at least ~4 tasks per thread): a row per
// task is slower, e.g. quantizing x into the AMX panels of a long prompt (BENCHMARKS.md#row-work-in-chunks).
constexpr int64_t kTaskElements = 1 << 14;

// fn(row, thread) for rows [0, n_rows): on the calling thread alone when the work is small or `serial` (another
// list of tasks is in flight on the pool), else as parallel tasks of consecutive rows.
template <class F>
void for_rows(ThreadPool& pool, int64_t n_rows, int64_t elems_per_row, const F& fn, bool serial = false) {
  if (serial || n_rows * elems_per_row <= kSerialElements) {
    for (int64_t i = 0; i < n_rows; ++i) fn(i, 0);
    return;
  }
  int64_t per_task = std::max<int64_t>(1, kTaskElements / std::max<int64_t>(1, elems_per_row));
  per_task = std::min(per_task, std::max<int64_t>(1, n_rows / (4 * pool.size())));
  const int64_t n_tasks = (n_rows + per_task - 1) / per_task;
  pool.parallel_for(n_tasks, [&](int64_t task, int th) {
    for (int64_t i = task * per_task, end = std::min(n_rows, i + per_task); i < end; ++i) fn(i, th);
  });
}

// in_part[j] = whether slot j of a token with weights w[0..k) belongs to `part` (JobPart): the d lowest weights by a
// stable ascending order with NaN last (torch's stable argsort) are the deferred part.
void select_part(const float* w, int k, int d, JobPart part, std::vector<uint8_t>& in_part) {
  int order[kMaxTopK];
  for (int j = 0; j < k; ++j) order[j] = j;
  std::stable_sort(order, order + k, [w](int a, int b) {
    if (std::isnan(w[a])) return false;
    return std::isnan(w[b]) || w[a] < w[b];
  });
  const uint8_t deferred = part == JobPart::deferred;
  for (int j = 0; j < k; ++j) in_part[j] = !deferred;
  for (int i = 0; i < d && i < k; ++i) in_part[order[i]] = deferred;
}

// out[t, c0:c1] (+)= sum_j weights[t, j] * y[slot(t, j), c0:c1] (+ addend[t, c0:c1]) for tokens [ta, tb) of the
// chunk, in j order so results depend neither on threads nor on how the columns are cut; acc: c1 - c0 floats.
void combine_rows(const RowOps& ops, const MoeCall& c, int H, int64_t t0, int64_t ta, int64_t tb,
                  const std::vector<int>& pos, const float* y, int c0, int c1, float* acc) {
  const int n = c1 - c0;
  for (int64_t t = ta; t < tb; ++t) {
    const size_t off = (size_t)(t0 + t) * H + c0;
    if (!c.accumulate)
      std::fill(acc, acc + n, 0.f);
    else if (c.out_bf16)
      ops.bf16_to_f32(static_cast<const uint16_t*>(c.out) + off, n, acc);
    else
      std::memcpy(acc, static_cast<const float*>(c.out) + off, sizeof(float) * n);
    for (int j = 0; j < c.k; ++j) {
      const int s = pos[(size_t)t * c.k + j];
      if (s >= 0) ops.axpy(c.weights[(t0 + t) * c.k + j], y + (size_t)s * H + c0, n, acc);
    }
    if (c.addend) ops.axpy(1.f, c.addend + off, n, acc);  // exactly acc + addend
    if (c.out_bf16)
      ops.f32_to_bf16(acc, n, static_cast<uint16_t*>(c.out) + off);
    else
      std::memcpy(static_cast<float*>(c.out) + off, acc, sizeof(float) * n);
  }
}

}  // namespace

ChunkPlan::ChunkPlan(const MoeExperts& ex, const MoeCall& call, ThreadPool& pool, int64_t t0, int64_t t1, int slot_base,
                     bool serial, StageClock& clock)
    : ex_(ex), call_(call), pool_(pool), t0_(t0), nt_((int)(t1 - t0)), E_(ex.config().n_expert), H_(ex.config().hidden),
      I_(ex.config().intermediate), k_(call.k), ops_(ex.row_ops()) {
  const int E = E_, H = H_, k = k_, nt = nt_;
  const WeightFormat fmt = ex.config().format;

  // ---- route: count (token, slot) pairs per expert
  count_.assign(E, 0);
  pos_.assign((size_t)nt * k, -1);
  std::vector<uint8_t> in_part(k, 1);
  for (int t = 0; t < nt; ++t) {
    if (call.part != JobPart::all) select_part(call.weights + (t0 + t) * k, k, call.defer_lowest, call.part, in_part);
    for (int j = 0; j < k; ++j) {
      if (!in_part[j]) continue;
      int64_t idx = (t0 + t) * k + j;
      int64_t id =
          call.ids_int32 ? static_cast<const int32_t*>(call.ids)[idx] : static_cast<const int64_t*>(call.ids)[idx];
      if (id == -1) continue;
      if (id < -1 || id >= E)
        throw std::invalid_argument("topk_ids[" + std::to_string(t0 + t) + ", " + std::to_string(j) +
                                    "] = " + std::to_string(id) + " is not an expert id in [0, " + std::to_string(E) +
                                    ") or -1");
      if (call.skip_mask && call.skip_mask[id]) continue;
      pos_[(size_t)t * k + j] = (int)id;  // expert for now; becomes the slot below
      ++count_[id];
    }
  }
  for (int e = 0; e < E; ++e)
    if (count_[e]) {
      if (!ex.is_loaded(e))
        throw std::runtime_error("expert " + std::to_string(e) + " is routed to but was never loaded");
      active_.push_back(e);
    }
  std::stable_sort(active_.begin(), active_.end(), [&](int a, int b) { return count_[a] > count_[b]; });
  first_.assign(E, 0);
  std::vector<int> fill(E, 0);
  for (int e : active_) first_[e] = n_slots_, n_slots_ += count_[e];
  slot_token_.resize(n_slots_);
  for (int t = 0; t < nt; ++t)
    for (int j = 0; j < k; ++j) {
      int& p = pos_[(size_t)t * k + j];
      if (p < 0) continue;
      int s = first_[p] + fill[p]++;
      slot_token_[s] = t;
      p = s;
    }
  clock.done(JobStage::route);
  if (n_slots_ == 0) return;

  const ActLayout& ga = ex.gate_up_act();
  const ActLayout& da = ex.down_act();
  const MatrixShape& gu = ex.gate_up_shape();
  const MatrixShape& dn = ex.down_shape();
  const int n_threads = pool.size();
  // AMX experts: those with at least amx_min_tokens tokens. `active` is sorted by count, so they come first
  // and own the slots [0, n_amx_slots).
  int n_amx = 0;
  while (n_amx < (int)active_.size() && ex.uses_amx(count_[active_[n_amx]])) ++n_amx;
  n_amx_slots_ = n_amx ? first_[active_[n_amx - 1]] + count_[active_[n_amx - 1]] : 0;
  const ActLayout& gxa = ex.gate_up_amx_act();
  const ActLayout& dxa = ex.down_amx_act();
  x_rows_.resize(n_slots_);
  h_rows_.resize(n_slots_);
  // AMX experts' rows in the activation panels (layout.h AmxPanel): each expert starts a block of 16 rows;
  // panel_row[s] is slot s's row, and the rows that pad an expert's last block are zero.
  amx_first_.assign(E, 0);
  panel_row_.resize(n_amx_slots_);
  int n_panel = 0;
  for (int i = 0; i < n_amx; ++i) {
    const int e = active_[i];
    amx_first_[e] = n_panel;
    for (int m = 0; m < count_[e]; ++m) panel_row_[first_[e] + m] = n_panel + m;
    n_panel += (count_[e] + 15) / 16 * 16;
  }
  auto make_panel = [&](int slot, const ActLayout& a) {
    uint8_t* p = pool.scratch(slot, AmxPanel::tile_bytes(a, n_panel) + AmxPanel::meta_bytes_of(a, n_panel));
    const AmxPanel panel = AmxPanel::make(a, p, p + AmxPanel::tile_bytes(a, n_panel));
    for (int i = 0; i < n_amx; ++i) {
      const int e = active_[i];
      for (int r = amx_first_[e] + count_[e]; r % 16; ++r) panel.store(r, nullptr, a.scales_off);
    }
    return panel;
  };

  // ---- quantize x, once per token: for the row-block kernels into rows; for AMX experts also in their
  // format, then copied to every panel row of the token (an expert's tokens are consecutive A-tile rows)
  // every token's x into scratch `slot` as activation rows of `layout` (`amx`: the AMX experts' format)
  auto quantize_x = [&](int slot, const ActLayout& layout, bool amx) {
    uint8_t* out = pool.scratch(slot_base + slot, (size_t)nt * layout.row_bytes);
    for_rows(
        pool, nt, H,
        [&](int64_t t, int th) {
          float* row = reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * H));
          load_row_fp32(ops_, call.x, call.x_bf16, t0 + t, H, row);
          ops_.quantize(fmt, amx, row, H, layout, out + t * layout.row_bytes);
        },
        serial);
    return out;
  };
  if (n_amx_slots_ < n_slots_) {
    uint8_t* xq = quantize_x(0, ga, false);
    for (int s = n_amx_slots_; s < n_slots_; ++s) x_rows_[s] = xq + (size_t)slot_token_[s] * ga.row_bytes;
  }
  if (n_amx_slots_ > 0) {
    uint8_t* xt = quantize_x(kAmxScratchSlot, gxa, true);
    xa_ = make_panel(slot_base + kAmxScratchSlot + 1, gxa);
    for_rows(
        pool, n_amx_slots_, gxa.scales_off / 4,
        [&](int64_t s, int) { xa_.store(panel_row_[s], xt + (size_t)slot_token_[s] * gxa.row_bytes, gxa.scales_off); },
        serial);
  }
  clock.done(JobStage::quantize_x);

  fuse_combine_ = nt <= kFusedCombineTokens;
  if (n_amx_slots_ > 0) ha_ = make_panel(slot_base + kAmxScratchSlot + 2, dxa);
  hq_ = pool.scratch(slot_base + 2, (size_t)(n_slots_ - n_amx_slots_) * da.row_bytes);
  for (int s = n_amx_slots_; s < n_slots_; ++s) h_rows_[s] = hq_ + (size_t)(s - n_amx_slots_) * da.row_bytes;
  h_ = reinterpret_cast<float*>(pool.scratch(slot_base + 1, sizeof(float) * (size_t)n_slots_ * I_));
  y_ = reinterpret_cast<float*>(pool.scratch(slot_base + 3, sizeof(float) * (size_t)n_slots_ * H));

  make_tasks(active_, count_, n_amx, TaskPlan{gu.n_blocks, 1, amx_panel_tokens(gxa), n_threads, false}, tasks_,
             &groups_);
  make_tasks(active_, count_, n_amx, TaskPlan{dn.n_blocks, 2, amx_panel_tokens(dxa), n_threads}, down_tasks_);
  rows_left_.reset(groups_.size());
  expert_left_.reset(E);
  for (size_t g = 0; g < groups_.size(); ++g) {
    rows_left_.set(g, groups_[g].n_tasks);
    expert_left_.add(groups_[g].e, groups_[g].n_tasks);
  }
  blocks_left_.reset(dn.n_blocks);
  std::vector<int> covers(dn.n_blocks + 1, 0);  // tasks covering each row block, by differences
  for (const Task& t : down_tasks_) ++covers[t.rb0], --covers[t.rb1];
  for (int b = 0, c = 0; b < dn.n_blocks; ++b) blocks_left_.set(b, c += covers[b]);
  tasks_left_.store(n_tasks(), std::memory_order_relaxed);
}

void ChunkPlan::quantize_h(int s, int th) {
  const WeightFormat fmt = ex_.down_format();  // h is down's activation
  if (s < n_amx_slots_) {
    const ActLayout& dxa = ex_.down_amx_act();
    uint8_t* row = pool_.thread_scratch(th, dxa.row_bytes);
    ops_.quantize(fmt, true, h_ + (size_t)s * I_, I_, dxa, row);
    ha_.store(panel_row_[s], row, dxa.scales_off);
  } else {
    const ActLayout& da = ex_.down_act();
    ops_.quantize(fmt, false, h_ + (size_t)s * I_, I_, da, hq_ + (size_t)(s - n_amx_slots_) * da.row_bytes);
  }
}

void ChunkPlan::run_task(int64_t ti, int th) {
  struct Done {  // counts the task as run however it ends
    std::atomic<int64_t>& left;
    ~Done() { left.fetch_sub(1, std::memory_order_acq_rel); }
  } done{tasks_left_};
  const int64_t n_gu = (int64_t)tasks_.size();
  if (ti < n_gu) {
    const Task& task = tasks_[ti];
    try {
      run_gate_up_task(ex_, task, PhaseInput{x_rows_.data(), xa_, amx_first_.data(), first_.data()}, h_, pool_, th);
      if (rows_left_.arrive(task.group)) {
        const TaskGroup& g = groups_[task.group];
        for (int s = first_[g.e] + g.m0; s < first_[g.e] + g.m1; ++s) quantize_h(s, th);
      }
    } catch (...) {
      failed_.store(true, std::memory_order_relaxed);
      throw;
    }
    expert_left_.arrive(task.e);
    return;
  }
  const Task& task = down_tasks_[ti - n_gu];
  while (!expert_left_.zero(task.e)) {
    if (failed()) return;
    _mm_pause();
  }
  run_down_task(ex_, task, PhaseInput{h_rows_.data(), ha_, amx_first_.data(), first_.data(), !fuse_combine_}, y_, pool_,
                th);
  if (!fuse_combine_) return;
  while (combine_held_.load(std::memory_order_acquire)) _mm_pause();
  // combine each run of the task's blocks that it was the last to compute
  for (int b = task.rb0, run0 = -1; b <= task.rb1; ++b) {
    const bool mine = b < task.rb1 && blocks_left_.arrive(b);
    if (mine && run0 < 0) run0 = b;
    if (!mine && run0 >= 0) {
      const int c0 = run0 * kRowsPerBlock, c1 = std::min(H_, b * kRowsPerBlock);
      combine_rows(ops_, call_, H_, t0_, 0, nt_, pos_, y_, c0, c1,
                   reinterpret_cast<float*>(pool_.thread_scratch(th, sizeof(float) * (c1 - c0))));
      run0 = -1;
    }
  }
}

void ChunkPlan::finish(ThreadPool& pool, bool serial) {
  if (n_slots_ > 0 && fuse_combine_) return;
  for_rows(
      pool, nt_, (int64_t)H_ * (k_ + 1),
      [&](int64_t t, int th) {
        combine_rows(ops_, call_, H_, t0_, t, t + 1, pos_, y_, 0, H_,
                     reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * H_)));
      },
      serial);
}

}  // namespace hetmoe
