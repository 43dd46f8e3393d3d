// Where stream-ordered CPU work is enqueued: a CUDA stream, or a FakeStream that stands in for one in tests.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "stream/driver.h"

namespace hetmoe {

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

}  // namespace hetmoe
