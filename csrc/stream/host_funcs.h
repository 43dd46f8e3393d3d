// Stream-ordered CPU work: CUDA host functions that submit a prepared job to a ThreadPool, or wait for the
// pool, when a CUDA stream reaches them — once when enqueued eagerly, at every replay when enqueued while the
// stream is captured into a CUDA graph. This is how one graph per decode step drives the CPU experts.
//
// The driver is looked up at run time (stream/driver.h): cuLaunchHostFunc and cuStreamIsCapturing. Without it
// every enqueue on a CUDA stream throws std::runtime_error; a FakeStream (stream/fake_stream.h) needs no driver.
//
// What a host function does, on the driver's callback thread: submit calls pool.submit_borrowed(job), sync
// calls pool.wait(allow_pending). Nothing else: no Python, no expert math, no CUDA call, no destructor.
//
// Errors: an exception thrown by a job stays in the pool, and the next ThreadPool::sync (a sync on a Python
// thread) rethrows it, exactly once; a sync host function never consumes it. A failure inside a host function
// itself (out of memory while queueing) is recorded the same way. The stream goes on in both cases: what the
// GPU then copies out of the job's output buffer is unspecified until that sync has raised.
//
// Ordering: a sync host function waits for the jobs submitted when it runs, like ThreadPool::sync. A submit
// enqueued on another stream must be ordered before it with events. The driver may run the host functions of
// independent streams on one thread, so a sync that waits also delays other streams' host functions.
//
// Lifetimes — the rule every caller keeps:
//   - The payload a host function receives (pool, job, allow_pending) is a small heap object owned by a
//     HostFuncs, never by the callback: the driver calls it until the stream has passed it, or, for a node
//     captured into a graph, at every replay of every graph instantiated from that capture.
//   - An eager payload is freed by release_finished() once its host function has returned and the job it
//     submitted has completed (the job and its buffers are in use until then).
//   - A captured payload lives until the HostFuncs is closed or destroyed: keep the HostFuncs at least as long
//     as the graph, and close it only when no replay is in flight and none will follow.
//   - close() (and the destructor) waits for the jobs its payloads submitted and frees every payload except
//     eager ones whose host function has not run yet: the stream may still reach those, so they are leaked
//     on purpose, with their job and pool, and their ids returned so the caller keeps the buffers too.
//   - The job's buffers (MoeCall pointers) must outlive its payload; hetmoe/cpu/experts.py keeps the Python
//     tensors beside the HostFuncs for exactly as long as the payload exists.
//   - The pool and the job are shared_ptrs in the payload, so neither can die while a host function may run.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/thread_pool.h"
#include "stream/fake_stream.h"

namespace hetmoe {

// Owner of host-function payloads (see the lifetime rules above). Methods may be called from any thread.
class HostFuncs {
 public:
  HostFuncs();
  ~HostFuncs();  // close()
  HostFuncs(const HostFuncs&) = delete;
  HostFuncs& operator=(const HostFuncs&) = delete;

  // Enqueue on `stream` a host function that submits `job` to `pool` / waits until at most allow_pending jobs
  // of `pool` are unfinished. Returns the payload's id (never 0).
  uint64_t enqueue_submit(const HostStream& stream, std::shared_ptr<ThreadPool> pool, std::shared_ptr<Job> job);
  uint64_t enqueue_sync(const HostStream& stream, std::shared_ptr<ThreadPool> pool, int64_t allow_pending);

  // Frees the eager payloads that are done (host function returned, submitted job completed); returns their ids.
  std::vector<uint64_t> release_finished();
  // Waits for the jobs submitted by the payloads, frees them all except eager ones whose host function has not
  // run yet (leaked; their ids are returned). Afterwards the HostFuncs is empty and can be used again.
  std::vector<uint64_t> close();

  size_t size() const;        // payloads held
  size_t n_captured() const;  // of which captured into graphs
  size_t n_not_run() const;   // eager payloads whose host function has not returned yet

  struct Payload;

 private:
  uint64_t enqueue(const HostStream& stream, std::unique_ptr<Payload> p, HostFn fn);

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Payload>> eager_;
  std::vector<std::unique_ptr<Payload>> captured_;
  uint64_t next_id_ = 1;
};

}  // namespace hetmoe
