// The work of one MoE job over one chunk of tokens (ChunkPlan), and the per-stage clock of a job (StageClock).
// MoeJob (moe.h) runs plans one after another; Expert Deferral's paired and chained jobs (moe/deferral.h) run two
// plans in one list of tasks.
#pragma once
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#include "moe/expert_tasks.h"
#include "moe/moe.h"

namespace hetmoe {

constexpr int64_t kTokensPerChunk = 1024;  // bounds the scratch memory of very long prompts

// Reads the clock at stage boundaries only while the experts are profiling; hands the sums over at the end
// (count_job: as one job; a plan made ahead for a queued job is not one).
class StageClock {
 public:
  explicit StageClock(const MoeExperts& ex, bool count_job = true) : ex_(ex), on_(ex.profiling()), job_(count_job) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  void done(JobStage stage) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    ns_[(int)stage] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count();
    last_ = now;
  }
  ~StageClock() {
    if (on_) ex_.add_profile(ns_, job_);
  }

 private:
  const MoeExperts& ex_;
  bool on_, job_;
  std::chrono::steady_clock::time_point last_;
  int64_t ns_[kJobStages] = {};
};

// Countdowns over the tasks of a phase: the task that brings one to zero finishes what depends on all of them.
class Countdown {
 public:
  void reset(size_t n) { left_ = std::vector<std::atomic<int>>(n); }
  void set(size_t i, int v) { left_[i].store(v, std::memory_order_relaxed); }
  void add(size_t i, int v) { left_[i].fetch_add(v, std::memory_order_relaxed); }
  bool zero(size_t i) const { return left_[i].load(std::memory_order_acquire) == 0; }
  // True for the caller that takes index i to zero; acquire-release, so it sees every other task's writes.
  bool arrive(size_t i) { return left_[i].fetch_sub(1, std::memory_order_acq_rel) == 1; }

 private:
  std::vector<std::atomic<int>> left_;
};

// One chunk of tokens of one call, from its routing to its combine. The constructor runs on the coordinator: it
// routes, quantizes x and cuts the work into tasks. run_task(i) (any pool thread, any order of pulling) runs one
// task, and finish() what is left after all of them (the combine of many tokens, or of a chunk without slots).
//
// The tasks: gate + up with SwiGLU -> h [n_slots, I], then down -> y [n_slots, H], in one list. An expert's down
// tasks wait (spinning) until its gate+up tasks are done and its h quantized; they come after every gate+up task
// and in the same expert order, so such a wait is at most the last gate+up task, and the threads stream weights
// from the first task to the last without a barrier between the phases. h is quantized once per (token, expert),
// in the format of the expert's path (AMX slots into their panel), by the gate+up task that completes the
// expert's rows for those tokens. With a few tokens (decode), y is combined a run of row blocks at a time by the
// down task that completes those blocks for every expert; with many, a combine that late would fall on the few
// threads running the last tasks, so finish() runs it on every thread.
class ChunkPlan {
 public:
  // Pool scratch slots from slot_base on (two plans in flight at once use different bases). serial: the
  // constructor runs its row work on the calling thread alone (another plan's tasks may be in flight).
  ChunkPlan(const MoeExperts& ex, const MoeCall& call, ThreadPool& pool, int64_t t0, int64_t t1, int slot_base,
            bool serial, StageClock& clock);
  int64_t n_tasks() const { return (int64_t)(tasks_.size() + down_tasks_.size()); }
  int64_t n_tokens() const { return nt_; }
  void run_task(int64_t ti, int th);
  const ThreadPool::TaskFn& task_fn() const { return fn_; }  // run_task, for the pool's list
  bool done() const { return tasks_left_.load(std::memory_order_acquire) == 0; }
  // A plan whose tasks start before the previous job's are done: its combine waits for combine_after_previous().
  void hold_combine() { combine_held_.store(true, std::memory_order_relaxed); }
  void combine_after_previous() { combine_held_.store(false, std::memory_order_release); }
  // Until every task has run (or one has failed).
  void wait() const {
    while (!done() && !failed()) _mm_pause();
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  void finish(ThreadPool& pool, bool serial);

 private:
  void quantize_h(int s, int th);

  const MoeExperts& ex_;
  const MoeCall& call_;
  ThreadPool& pool_;
  int64_t t0_;
  int nt_, E_, H_, I_, k_;
  const RowOps& ops_;
  std::vector<int> count_, pos_, active_, first_, slot_token_, amx_first_, panel_row_;
  std::vector<const uint8_t*> x_rows_, h_rows_;
  int n_slots_ = 0, n_amx_slots_ = 0;
  AmxPanel xa_, ha_;
  uint8_t* hq_ = nullptr;
  float *h_ = nullptr, *y_ = nullptr;
  bool fuse_combine_ = false;
  std::vector<Task> tasks_, down_tasks_;
  std::vector<TaskGroup> groups_;
  Countdown rows_left_, expert_left_, blocks_left_;
  std::atomic<int64_t> tasks_left_{0};
  std::atomic<bool> failed_{false};  // a gate+up task threw: the waits give up (the pool reports the error)
  std::atomic<bool> combine_held_{false};
  ThreadPool::TaskFn fn_ = [this](int64_t i, int th) { run_task(i, th); };
};

}  // namespace hetmoe
