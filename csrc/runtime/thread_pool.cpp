#include "runtime/thread_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

#include "runtime/cpu_features.h"

namespace hetmoe {

using Clock = std::chrono::steady_clock;

uint8_t* Scratch::get(size_t bytes) {
  if (bytes <= size_) return ptr_;
  std::free(ptr_);
  size_t want = bytes + bytes / 4 + 4096;
  void* p = nullptr;
  if (posix_memalign(&p, 64, want) != 0) {
    ptr_ = nullptr;
    size_ = 0;
    throw std::bad_alloc();
  }
  ptr_ = static_cast<uint8_t*>(p);
  size_ = want;
  return ptr_;
}

Scratch::~Scratch() { std::free(ptr_); }

static void pin_to_cpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: a refused pin is not an error
}

ThreadPool::ThreadPool(int n_threads, bool pin, int spin_us) : spin_us_(spin_us < 0 ? 0 : spin_us) {
  std::vector<int> cores = physical_core_cpus();
  n_threads_ = n_threads > 0 ? n_threads : (int)cores.size();
  caller_may_spin_ = n_threads_ < (int)cores.size();
  if (n_threads_ > 1024) throw std::invalid_argument("threads must be at most 1024");
  // Pin one thread per physical core; with more threads than cores, pinning would stack threads, so skip it.
  if (pin && n_threads_ <= (int)cores.size()) cpus_.assign(cores.begin(), cores.begin() + n_threads_);
  start();
}

ThreadPool::ThreadPool(int n_threads, const std::vector<int>& cpus, int spin_us, bool caller_may_spin)
    : n_threads_(n_threads), spin_us_(spin_us < 0 ? 0 : spin_us), caller_may_spin_(caller_may_spin) {
  if (n_threads_ < 1 || n_threads_ > 1024) throw std::invalid_argument("threads must be in [1, 1024]");
  if (n_threads_ <= (int)cpus.size())
    cpus_.assign(cpus.begin(), cpus.begin() + n_threads_);
  else
    cpu_set_ = cpus;
  start();
}

void ThreadPool::start() {
  for (int i = 0; i < n_threads_; ++i) thread_scratch_.emplace_back(new Scratch());
  threads_.emplace_back([this] { coordinator_main(); });
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker_main(i); });
}

void ThreadPool::pin_thread(int index) const {
  if (!cpus_.empty()) {
    pin_to_cpu(cpus_[index]);
  } else if (!cpu_set_.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : cpu_set_) CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort, like pin_to_cpu
  }
}

ThreadPool::~ThreadPool() {
  finished_.clear();
  // The coordinator drains the queue first (its jobs still need the workers), then the workers stop.
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    stop_.store(true);
  }
  queue_cv_.notify_all();
  threads_[0].join();
  {
    std::lock_guard<std::mutex> lk(wake_mu_);
    generation_.fetch_add(1);
  }
  wake_cv_.notify_all();
  for (size_t i = 1; i < threads_.size(); ++i) threads_[i].join();
}

uint8_t* ThreadPool::scratch(int slot, size_t bytes) {
  while ((int)scratch_.size() <= slot) scratch_.emplace_back(new Scratch());
  return scratch_[slot]->get(bytes);
}

uint8_t* ThreadPool::thread_scratch(int thread, size_t bytes) { return thread_scratch_[thread]->get(bytes); }

// ---------------------------------------------------------------- parallel_for

void ThreadPool::run_task(int64_t t, int thread_index) {
  const int n = n_parts_.load(std::memory_order_acquire), oldest = n > kListParts ? n - kListParts : 0;
  int i = n - 1;
  while (i > oldest && parts_[i % kListParts].start > t) --i;
  const Part& part = parts_[i % kListParts];
  try {
    if (part.start > t) throw std::logic_error("thread pool: a task of a list part already reused");
    (*part.fn)(t - part.start, thread_index);
  } catch (...) {
    std::lock_guard<std::mutex> lk(task_error_mu_);
    if (!task_error_) task_error_ = std::current_exception();
  }
}

void ThreadPool::run_tasks(int thread_index) {
  for (;;) {
    int64_t t = next_task_.fetch_add(1, std::memory_order_relaxed);
    while (t >= n_tasks_.load(std::memory_order_acquire) && more_tasks_.load(std::memory_order_acquire)) _mm_pause();
    if (t >= n_tasks_.load(std::memory_order_acquire)) break;
    run_task(t, thread_index);
  }
}

void ThreadPool::parallel_for(int64_t n_tasks, const TaskFn& fn) {
  parallel_join();
  if (n_tasks <= 0) return;
  if (n_threads_ == 1 || n_tasks == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
    return;
  }
  parallel_start(n_tasks, fn);
  parallel_join();
}

void ThreadPool::parallel_start(int64_t n_tasks, const TaskFn& fn, bool more) {
  parallel_join();
  list_open_ = true;
  parts_[0] = Part{0, &fn};
  n_parts_.store(1, std::memory_order_relaxed);
  n_tasks_.store(n_tasks, std::memory_order_relaxed);
  more_tasks_.store(more, std::memory_order_relaxed);
  next_task_.store(0, std::memory_order_relaxed);
  if (n_threads_ == 1) return;  // no workers: the coordinator runs everything when it helps or joins
  busy_workers_.store(n_threads_ - 1, std::memory_order_relaxed);
  {
    // Publishing under the mutex means a worker that is about to sleep cannot miss this generation.
    std::lock_guard<std::mutex> lk(wake_mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_cv_.notify_all();
}

int64_t ThreadPool::parallel_append(int64_t n_tasks, const TaskFn& fn, bool more) {
  // Workers that saw the end of a closed list have left it: a new list then.
  if (!list_open_ || !more_tasks_.load(std::memory_order_relaxed)) {
    parallel_start(n_tasks, fn, more);
    return 0;
  }
  const int64_t start = n_tasks_.load(std::memory_order_relaxed);
  if (n_tasks > 0) {
    const int i = n_parts_.load(std::memory_order_relaxed);
    parts_[i % kListParts] = Part{start, &fn};
    n_parts_.store(i + 1, std::memory_order_release);  // before the count that lets workers reach the part
  }
  n_tasks_.store(start + n_tasks, std::memory_order_release);
  more_tasks_.store(more, std::memory_order_release);  // after the count: a worker that sees false sees the count
  return start;
}

int64_t ThreadPool::parallel_help(int64_t limit, int64_t max_tasks) {
  int64_t ran = 0;
  if (!list_open_) return ran;
  int64_t t = next_task_.load(std::memory_order_relaxed);
  while (ran < max_tasks && t < limit && t < n_tasks_.load(std::memory_order_acquire)) {
    if (next_task_.compare_exchange_weak(t, t + 1, std::memory_order_relaxed)) {
      run_task(t, 0);
      ++ran;
      t = next_task_.load(std::memory_order_relaxed);
    }
  }
  return ran;
}

void ThreadPool::parallel_join() {
  if (!list_open_) return;
  if (more_tasks_.load(std::memory_order_relaxed)) more_tasks_.store(false, std::memory_order_release);
  run_tasks(0);
  while (busy_workers_.load(std::memory_order_acquire) != 0) _mm_pause();
  list_open_ = false;
  if (task_error_) {
    std::exception_ptr e;
    std::swap(e, task_error_);
    std::rethrow_exception(e);
  }
}

bool ThreadPool::next_job_is(const Job* job, int wait_us) const {
  const auto deadline = Clock::now() + std::chrono::microseconds(wait_us);
  const Job* next = next_job();
  while (!next && Clock::now() < deadline) {
    _mm_pause();
    next = next_job();
  }
  return next == job;
}

const Job* ThreadPool::next_job() const {
  // the running job is not completed yet: one more submission than that means a job is queued behind it
  if (submitted_.load(std::memory_order_acquire) <= completed_.load(std::memory_order_acquire) + 1) return nullptr;
  std::lock_guard<std::mutex> lk(queue_mu_);
  return queue_.size() >= 2 ? queue_[1].job->inner() : nullptr;
}

void ThreadPool::wait_for_generation(uint64_t seen, int thread_index) {
  auto deadline = Clock::now() + std::chrono::microseconds(spin_us_);
  int spins = 0;
  while (generation_.load(std::memory_order_acquire) == seen) {
    _mm_pause();
    if (++spins % 256 == 0) {
      if (Clock::now() <= deadline) {
        // Between jobs, let a thread that shares this core (the one submitting jobs, a framework's thread) run
        // while we wait; inside a job, keep the core for its next phase (thread_pool.h).
        if (!in_job_.load(std::memory_order_relaxed)) sched_yield();
        continue;
      }
      std::unique_lock<std::mutex> lk(wake_mu_);
      wake_cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      return;
    }
  }
}

void ThreadPool::worker_main(int index) {
  pin_thread(index);
  uint64_t seen = 0;
  for (;;) {
    wait_for_generation(seen, index);
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    run_tasks(index);
    busy_workers_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

// ---------------------------------------------------------------- job queue

void ThreadPool::coordinator_main() {
  pin_thread(0);
  for (;;) {
    Job* job;
    // Spin on the submission counter first (cheap, keeps submit->start latency low), then sleep.
    auto deadline = Clock::now() + std::chrono::microseconds(spin_us_);
    int spins = 0;
    while (submitted_.load(std::memory_order_acquire) == completed_.load(std::memory_order_relaxed) &&
           !stop_.load(std::memory_order_relaxed)) {
      _mm_pause();
      if (++spins % 256 == 0) {
        if (Clock::now() > deadline) break;
        sched_yield();
      }
    }
    {
      std::unique_lock<std::mutex> lk(queue_mu_);
      queue_cv_.wait(lk, [&] { return !queue_.empty() || stop_.load(); });
      if (queue_.empty()) return;  // stopping with nothing left to run
      job = queue_.front().job;    // kept alive by the queue entry or, when borrowed, by its submitter
    }
    std::exception_ptr err;
    in_job_.store(true, std::memory_order_relaxed);
    try {
      job->run(*this);
    } catch (...) {
      err = std::current_exception();
    }
    in_job_.store(false, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      if (queue_.front().owner) finished_.push_back(std::move(queue_.front().owner));
      queue_.pop_front();
      if (err && !job_error_) job_error_ = err;
      completed_.fetch_add(1, std::memory_order_release);
    }
    done_cv_.notify_all();
  }
}

uint64_t ThreadPool::enqueue(Job* job, std::shared_ptr<Job> owner, std::vector<std::shared_ptr<Job>>* release,
                             std::atomic<uint64_t>* id_out) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    if (release) release->swap(finished_);
    if (stop_.load()) throw std::runtime_error("submit: thread pool is shutting down");
    id = submitted_.load(std::memory_order_relaxed) + 1;
    if (id_out) id_out->store(id, std::memory_order_release);  // before the coordinator can pop the job
    queue_.push_back(Queued{job, std::move(owner)});
    submitted_.store(id, std::memory_order_release);
  }
  queue_cv_.notify_one();
  return id;
}

uint64_t ThreadPool::submit(std::shared_ptr<Job> job) {
  if (!job) throw std::invalid_argument("submit: null job");
  std::vector<std::shared_ptr<Job>> done;  // released after the lock, on this thread
  Job* raw = job.get();
  return enqueue(raw, std::move(job), &done);
}

uint64_t ThreadPool::submit_borrowed(Job* job, std::atomic<uint64_t>* id_out) {
  if (!job) throw std::invalid_argument("submit: null job");
  return enqueue(job, nullptr, nullptr, id_out);
}

void ThreadPool::record_error(std::exception_ptr err) {
  std::lock_guard<std::mutex> lk(queue_mu_);
  if (err && !job_error_) job_error_ = err;
}

int64_t ThreadPool::pending() const {
  return (int64_t)(submitted_.load(std::memory_order_acquire) - completed_.load(std::memory_order_acquire));
}

// Waits until completed_ >= target. When the pool leaves a core free, a short spin serves the hybrid decode
// loop (jobs finish within microseconds of the wait); when every core has a pinned worker, a spinning caller
// would steal a worker's core and stall the phase it is in, so the caller sleeps at once.
void ThreadPool::wait_completed(uint64_t target) {
  const int spin = caller_may_spin_ ? (spin_us_ < 50 ? spin_us_ : 50) : 0;
  auto deadline = Clock::now() + std::chrono::microseconds(spin);
  int spins = 0;
  while (completed_.load(std::memory_order_acquire) < target) {
    _mm_pause();
    if (++spins % 64 == 0 && Clock::now() > deadline) {
      std::unique_lock<std::mutex> lk(queue_mu_);
      done_cv_.wait(lk, [&] { return completed_.load(std::memory_order_acquire) >= target; });
      break;
    }
  }
}

void ThreadPool::wait(int64_t allow_pending) {
  if (allow_pending < 0) throw std::invalid_argument("sync: allow_pending must be >= 0");
  uint64_t sub = submitted_.load(std::memory_order_acquire);
  wait_completed(sub > (uint64_t)allow_pending ? sub - allow_pending : 0);
}

void ThreadPool::sync(int64_t allow_pending) {
  wait(allow_pending);
  std::exception_ptr err;
  std::vector<std::shared_ptr<Job>> done;
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    std::swap(err, job_error_);
    done.swap(finished_);
  }
  if (err) std::rethrow_exception(err);
}

void ThreadPool::run_and_wait(std::function<void(ThreadPool&)> fn) {
  std::exception_ptr err;
  uint64_t id = submit(std::make_shared<FunctionJob>([&](ThreadPool& pool) {
    try {
      fn(pool);
    } catch (...) {
      err = std::current_exception();
    }
  }));
  wait_completed(id);
  if (err) std::rethrow_exception(err);
}

}  // namespace hetmoe
