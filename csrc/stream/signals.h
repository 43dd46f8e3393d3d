// Stream signals: stream-ordered submit and sync of CPU jobs through stream memory operations, the fast
// alternative to the host functions of stream/host_funcs.h (same calls, same contract for callers).
//
// Why: a host function runs on the driver's callback thread, which has to be woken for every call, a cost several
// times what a decode step can spend per MoE layer (BENCHMARKS.md#stream-signals).
// A stream memory operation is executed by the GPU itself: writing a word of pinned host memory, or waiting
// until a word there has a value. No driver thread, nothing to wake.
//
// One signal per submit, three 32-bit words in mapped pinned memory: kick, done, passed.
//   submit  GPU writes done = 0, then kick = 1 (after the stream's earlier work, behind a memory fence, so the
//           inputs it copied to the host are visible). The watcher thread, spinning over the kick words, sees
//           kick = 1, clears it and submits the job to the pool; the job's last act is done = 1.
//   sync    GPU waits until done == 1 for every signal submitted through this object and not yet waited for,
//           except the newest allow_pending, then writes passed = 1 (the GPU no longer reads this signal).
// Enqueued during a CUDA graph capture, the same operations become graph nodes and run at every replay; the
// done = 0 of each submit re-arms the signal, so no value has to change between replays.
//
// Ordering: jobs are submitted in the order the watcher sees their kicks; kicks written back to back are
// taken in the order their signals were created. Correctness never depends on it: a sync waits for the
// specific signals it covers, not for a count of the pool's jobs.
//
// Errors: a job's exception is kept by the pool and raised by the next ThreadPool::sync on a Python thread;
// done is still set, so the stream never hangs on a failed job (what it then copies out is unspecified until
// that sync has raised).
//
// Lifetimes (as for HostFuncs): captured signals live until close() (keep the object as long as its graphs,
// close it when no replay is in flight); eager ones are freed by release_finished() once the GPU has passed
// their wait and their job is complete. close() stops the watcher, waits for submitted jobs and frees
// everything, except eager signals the stream has not passed yet: those are handed, with the signal memory, to
// a watcher that serves them for the rest of the process (their jobs still run when the stream gets there;
// their ids are returned so the caller keeps the jobs' buffers), as leaked host-function payloads would.
//
// Idle cost: the watcher spins for 20 us after the last kick, then spins with sched_yield until 5 ms, then
// polls every 50 us, then every 1 ms after 1 s without kicks, and sleeps while no signal exists. It is one more
// runnable thread beside the pool's workers, pinned one per core: a worker it displaces holds up the whole parallel
// job for a scheduler time slice: a watcher that spun without yielding slowed decode steps by an order of
// magnitude (BENCHMARKS.md#watcher-yield).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/thread_pool.h"
#include "stream/driver.h"
#include "stream/fake_stream.h"

namespace hetmoe {

class StreamSignals {
 public:
  static constexpr int kCapacity = 4096;  // signals alive at once (graphs of 8 batch sizes x 61 layers x 2 use ~1k)

  StreamSignals();
  ~StreamSignals();  // close()
  StreamSignals(const StreamSignals&) = delete;
  StreamSignals& operator=(const StreamSignals&) = delete;

  // Same meaning as HostFuncs::enqueue_submit / enqueue_sync; allow_pending counts this object's signals.
  uint64_t enqueue_submit(const HostStream& stream, std::shared_ptr<ThreadPool> pool, std::shared_ptr<Job> job);
  uint64_t enqueue_sync(const HostStream& stream, std::shared_ptr<ThreadPool> pool, int64_t allow_pending);

  std::vector<uint64_t> release_finished();
  std::vector<uint64_t> close();

  size_t size() const;
  size_t n_captured() const;
  size_t n_not_run() const;  // eager signals the stream has not passed yet
  uint64_t kicks() const { return kicks_.load(std::memory_order_relaxed); }            // jobs the watcher submitted
  int slot_high_water() const { return high_water_.load(std::memory_order_relaxed); }  // slots ever used at once

  struct Signal;

 private:
  struct Arena;
  void start_watcher();  // mu_ held
  void watch();
  void ensure_mapped(const HostStream& stream);  // mu_ held
  void free_signal(Signal* s);                   // mu_ held

  mutable std::mutex mu_;
  std::condition_variable cv_;  // wakes the watcher when the first signal appears or on close
  std::unique_ptr<Arena> arena_;
  std::vector<std::unique_ptr<Signal>> signals_;  // live, in creation order
  std::vector<std::atomic<Signal*>> slot_owner_;  // slot -> signal, read by the watcher without the lock
  std::vector<int> free_slots_;
  std::atomic<int> high_water_{0};  // slots [0, high_water_) may be in use
  std::deque<Signal*> unsynced_;    // submitted, no wait enqueued yet (creation order)
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> kicks_{0};
  std::thread watcher_;
  uint64_t next_id_ = 1;
};

}  // namespace hetmoe
