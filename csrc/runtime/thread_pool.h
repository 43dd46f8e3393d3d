// Persistent worker threads (one per physical core, pinned) and the FIFO job queue they serve.
//
// Thread 0 of the pool is the coordinator: it pops jobs in submission order and runs each one; inside a job,
// parallel_for() hands tasks to all pool threads (the coordinator included), pulled dynamically from an
// atomic counter so uneven tasks balance themselves. Threads spin for spin_us after their last work, then
// sleep on a condition variable: an idle pool costs ~0% CPU. Between the parallel phases of a running job the
// workers spin without yielding their cores (the next phase follows within microseconds, and a worker that yielded
// to another process waits for that process's time slice before it can join: every phase of a decode step then
// waits); with no job running they yield while they spin, leaving the core to a thread that shares it.
//
// submit() returns at once; sync(n) blocks until at most n submitted jobs are unfinished. An exception
// thrown by a job is kept and rethrown by the next sync(), never lost, exactly once.
//
// Thread safety: submit, submit_borrowed, sync, wait, pending and record_error may be called from any number
// of threads at once (the queue, the counters and the error slot change under queue_mu_). Besides Python's
// threads, CUDA host functions call submit_borrowed and wait from the driver's callback thread
// (csrc/stream/host_funcs.h).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace hetmoe {

class ThreadPool;

// A unit of work run by the coordinator. It may call pool.parallel_for(); it must not call submit/sync.
struct Job {
  virtual ~Job() = default;
  virtual void run(ThreadPool& pool) = 0;
  // The job this one runs, when it wraps another (a stream signal's job): what next_job_is compares.
  virtual const Job* inner() const { return this; }
};

// A job that runs a function (packing, bandwidth probes and other one-off work).
struct FunctionJob : Job {
  explicit FunctionJob(std::function<void(ThreadPool&)> f) : fn(std::move(f)) {}
  void run(ThreadPool& pool) override { fn(pool); }
  std::function<void(ThreadPool&)> fn;
};

// Jobs run one after another as one job: the calls of a CPU decode step queued with one submission
// (hetmoe/engine/cpu_decode.py), so the pool goes from one to the next without a round trip through the queue and
// the submitting thread. The list is fixed; the jobs' buffers may change between runs.
struct JobList : Job {
  explicit JobList(std::vector<std::shared_ptr<Job>> list) : jobs(std::move(list)) {
    for (const auto& job : jobs)
      if (!job) throw std::invalid_argument("JobList: a job of the list is null");
  }
  void run(ThreadPool& pool) override {
    for (const auto& job : jobs) job->run(pool);
  }
  std::vector<std::shared_ptr<Job>> jobs;
};

// Cache-line-aligned scratch memory owned by the pool and reused by the jobs it runs one after another.
class Scratch {
 public:
  uint8_t* get(size_t bytes);  // grows (never shrinks); contents are not preserved across growth
  ~Scratch();

 private:
  uint8_t* ptr_ = nullptr;
  size_t size_ = 0;
};

class ThreadPool {
 public:
  // n_threads <= 0: one per physical core. spin_us: how long idle threads spin before sleeping.
  ThreadPool(int n_threads, bool pin, int spin_us);
  // A pool on given CPUs (a NUMA subpool, runtime/topology.h): thread i pinned to cpus[i] when there are at least
  // n_threads of them, otherwise every thread allowed on the whole set. caller_may_spin: whether a thread
  // waiting in sync may spin briefly (only when some core has no pinned worker).
  ThreadPool(int n_threads, const std::vector<int>& cpus, int spin_us, bool caller_may_spin);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  const std::vector<int>& pinned_cpus() const { return cpus_; }

  // --- inside a job (coordinator thread only) ---
  using TaskFn = std::function<void(int64_t, int)>;
  // Runs fn(task, thread_index) for every task in [0, n_tasks); returns when all are done.
  void parallel_for(int64_t n_tasks, const TaskFn& fn);
  // The same in parts, so that tasks can outlive the job that started them (Expert Deferral's jobs, moe/moe.h):
  // parallel_start hands [0, n_tasks) to the workers and returns at once. parallel_append puts n_tasks more, run
  // by their own fn, behind those and returns the list index of its first (it starts a list when none is open).
  // With more = true the workers that reach the end of the list wait for the next append; parallel_help runs up
  // to max_tasks tasks below `limit` on the coordinator while any is left to take (returns how many it ran);
  // parallel_join takes part in what is left, waits for every task and rethrows the first error. One list at a
  // time: parallel_for and parallel_start join the previous one first. Each fn must stay valid until the join,
  // and at most kListParts parts of a list may have tasks not yet finished.
  static constexpr int kListParts = 8;
  void parallel_start(int64_t n_tasks, const TaskFn& fn, bool more = false);
  int64_t parallel_append(int64_t n_tasks, const TaskFn& fn, bool more = false);
  int64_t parallel_help(int64_t limit, int64_t max_tasks = INT64_MAX);
  void parallel_join();
  // Whether the job queued after the running one is `job` (compared through Job::inner), waiting up to wait_us
  // for some job to be queued after it.
  bool next_job_is(const Job* job, int wait_us = 0) const;
  // The job queued after the running one (through Job::inner), or null: what a job may prepare ahead.
  const Job* next_job() const;
  // Scratch buffers: slot s of the pool, or slot s of thread t (per-thread slots never alias).
  uint8_t* scratch(int slot, size_t bytes);
  uint8_t* thread_scratch(int thread, size_t bytes);

  // --- from any other thread ---
  // Returns the job's id: ids count submissions from 1 and jobs complete in id order.
  uint64_t submit(std::shared_ptr<Job> job);
  // Like submit, but the pool takes no reference: the caller keeps the job alive until completed() >= the
  // returned id. Nothing is left for a later caller to release and no destructor can run here, which is what
  // a CUDA host function on the driver's thread needs (a released job could hold the last reference to this
  // pool or to gigabytes of packed experts).
  // id_out (optional) receives the id before the job can start, so a submitter that records it can never see the
  // job finish ahead of its own record.
  uint64_t submit_borrowed(Job* job, std::atomic<uint64_t>* id_out = nullptr);
  void sync(int64_t allow_pending = 0);  // rethrows the first error of a finished job
  // Like sync, but leaves errors (and finished jobs) for the next sync: a CUDA host function has no way to
  // report an error, so the next sync on a Python thread raises it.
  void wait(int64_t allow_pending = 0);
  void wait_for(uint64_t id) { wait_completed(id); }  // until job `id` (and all before it) completed
  // Keeps err (unless an earlier error is waiting) for the next sync to rethrow.
  void record_error(std::exception_ptr err);
  int64_t pending() const;
  uint64_t completed() const { return completed_.load(std::memory_order_acquire); }
  // Runs fn as a job after those already queued and waits for it alone; its error is rethrown here and
  // never mixed with the errors of other jobs (which stay for the next sync).
  void run_and_wait(std::function<void(ThreadPool&)> fn);

 private:
  void start();
  void pin_thread(int index) const;
  void worker_main(int index);
  void coordinator_main();
  void run_tasks(int thread_index);
  void run_task(int64_t t, int thread_index);  // the fn of t's part, its error kept for the join
  void wait_for_generation(uint64_t seen, int thread_index);
  void wait_completed(uint64_t target);
  uint64_t enqueue(Job* job, std::shared_ptr<Job> owner, std::vector<std::shared_ptr<Job>>* release,
                   std::atomic<uint64_t>* id_out = nullptr);

  int n_threads_;
  int spin_us_;
  bool caller_may_spin_;  // a core is left for the threads that submit and sync
  std::vector<int> cpus_;
  std::vector<int> cpu_set_;  // when not pinned one by one: every thread may run on these CPUs (empty: any)
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> in_job_{false};  // the coordinator is running a job: workers wait for its next phase unyielding

  // parallel_for state
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_task_{0};
  std::atomic<int> busy_workers_{0};
  std::atomic<int64_t> n_tasks_{0};
  std::atomic<bool> more_tasks_{false};  // parallel_append will raise n_tasks_
  struct Part {
    int64_t start = 0;
    const TaskFn* fn = nullptr;
  };
  Part parts_[kListParts];  // part i of the list in parts_[i % kListParts]
  std::atomic<int> n_parts_{0};
  bool list_open_ = false;  // coordinator only
  std::mutex task_error_mu_;
  std::exception_ptr task_error_;
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;

  // job queue
  mutable std::mutex queue_mu_;
  std::condition_variable queue_cv_;  // coordinator waits for jobs
  std::condition_variable done_cv_;   // sync waits for completions
  struct Queued {
    Job* job;
    std::shared_ptr<Job> owner;  // null for submit_borrowed
  };
  std::deque<Queued> queue_;
  // Finished jobs are released by the next submit/sync caller, never by the coordinator: a job may hold the
  // last reference to this pool, whose destructor must not run on its own thread.
  std::vector<std::shared_ptr<Job>> finished_;
  std::atomic<uint64_t> submitted_{0};
  std::atomic<uint64_t> completed_{0};
  std::exception_ptr job_error_;

  std::vector<std::unique_ptr<Scratch>> scratch_;
  std::vector<std::unique_ptr<Scratch>> thread_scratch_;
};

}  // namespace hetmoe
