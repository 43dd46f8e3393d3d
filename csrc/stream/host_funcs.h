// Stream-ordered CPU work: CUDA host functions that submit a prepared job to a ThreadPool, or wait for the
// pool, when a CUDA stream reaches them — once when enqueued eagerly, at every replay when enqueued while the
// stream is captured into a CUDA graph. This is how one graph per decode step drives the CPU experts.
//
// No CUDA at build or link time: libcuda.so.1 is opened at first use (dlopen) and cuLaunchHostFunc and
// cuStreamIsCapturing are looked up there. Without the driver available() is false and every enqueue throws
// std::runtime_error; the rest of the extension is unaffected.
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
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/thread_pool.h"

namespace hetmoe {

using HostFn = void (*)(void*);  // CUhostFn

namespace cuda_hooks {

// Whether libcuda.so.1 and the entry points we need were found (looked up once, at the first call).
bool available();
// Why not, or "" when available.
const std::string& unavailable_reason();
// cuLaunchHostFunc on a raw stream handle (torch.cuda.Stream.cuda_stream). Throws std::runtime_error with the
// driver's message when it refuses, or the reason above when there is no driver.
void launch_host_func(uintptr_t stream, HostFn fn, void* data);
// cuStreamIsCapturing: whether work enqueued on `stream` now goes into a graph instead of running.
bool is_capturing(uintptr_t stream);

// Stream memory operations (csrc/stream/signals.h): whether the driver has them, or why not.
bool signals_available();
const std::string& signals_unavailable_reason();
// Registers [ptr, ptr + bytes) (page-aligned) as pinned host memory the device of `stream` can read and write;
// returns its device address. unmap_host_memory undoes it.
uint64_t map_host_memory(uintptr_t stream, void* ptr, size_t bytes);
void unmap_host_memory(void* ptr);
// cuStreamWriteValue32 (after all earlier work of the stream, with a memory fence) and cuStreamWaitValue32 with
// CU_STREAM_WAIT_VALUE_EQ (later work of the stream waits until *addr == value).
void write_value32(uintptr_t stream, uint64_t dev_addr, uint32_t value);
void wait_value32_eq(uintptr_t stream, uint64_t dev_addr, uint32_t value);

}  // namespace cuda_hooks

// A stand-in for a CUDA stream where there is none (tests run on CPU-only machines): host functions run in
// launch order on a thread of the FakeStream's own, as the driver runs them on its thread. Between
// begin_capture() and end_capture() launches are recorded instead, and replay() launches the recording again,
// as a graph replay would. pause() holds host functions back (not yet reached by the stream) until resume().
class FakeStream {
 public:
  FakeStream();
  ~FakeStream();  // resumes, runs what is queued, then stops
  FakeStream(const FakeStream&) = delete;
  FakeStream& operator=(const FakeStream&) = delete;

  void launch(HostFn fn, void* data);
  void begin_capture();
  void end_capture();
  bool capturing() const;
  void replay();
  void pause();
  void resume();
  void synchronize();  // until every host function launched so far has returned

 private:
  void thread_main();

  mutable std::mutex mu_;
  std::condition_variable cv_;       // the thread waits for work (or resume)
  std::condition_variable idle_cv_;  // synchronize waits for the queue to drain
  std::deque<std::pair<HostFn, void*>> queue_;
  std::vector<std::pair<HostFn, void*>> recording_;
  bool capturing_ = false;
  bool paused_ = false;
  bool running_ = false;  // a host function is executing
  bool stop_ = false;
  std::thread thread_;
};

// Where to enqueue: a CUDA stream handle, or a FakeStream when `fake` is set.
struct HostStream {
  uintptr_t cuda = 0;
  FakeStream* fake = nullptr;
};

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
