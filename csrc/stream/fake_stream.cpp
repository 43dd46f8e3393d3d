#include "stream/fake_stream.h"

#include <stdexcept>

namespace hetmoe {

FakeStream::FakeStream() : thread_([this] { thread_main(); }) {}

FakeStream::~FakeStream() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    paused_ = false;
  }
  cv_.notify_all();
  thread_.join();
}

void FakeStream::thread_main() {
  for (;;) {
    std::pair<HostFn, void*> item;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || (!paused_ && !queue_.empty()); });
      if (queue_.empty()) return;  // stopping, nothing left
      item = queue_.front();
      queue_.pop_front();
      running_ = true;
    }
    item.first(item.second);
    {
      std::lock_guard<std::mutex> lk(mu_);
      running_ = false;
    }
    idle_cv_.notify_all();
  }
}

void FakeStream::launch(HostFn fn, void* data) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (capturing_) {
      recording_.emplace_back(fn, data);
      return;
    }
    queue_.emplace_back(fn, data);
  }
  cv_.notify_all();
}

void FakeStream::begin_capture() {
  std::lock_guard<std::mutex> lk(mu_);
  if (capturing_) throw std::runtime_error("FakeStream: already capturing");
  capturing_ = true;
  recording_.clear();
}

void FakeStream::end_capture() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!capturing_) throw std::runtime_error("FakeStream: end_capture without begin_capture");
  capturing_ = false;
}

bool FakeStream::capturing() const {
  std::lock_guard<std::mutex> lk(mu_);
  return capturing_;
}

void FakeStream::replay() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (capturing_) throw std::runtime_error("FakeStream: replay while capturing");
    queue_.insert(queue_.end(), recording_.begin(), recording_.end());
  }
  cv_.notify_all();
}

void FakeStream::pause() {
  std::lock_guard<std::mutex> lk(mu_);
  paused_ = true;
}

void FakeStream::resume() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    paused_ = false;
  }
  cv_.notify_all();
}

void FakeStream::synchronize() {
  std::unique_lock<std::mutex> lk(mu_);
  if (paused_ && !queue_.empty())
    throw std::runtime_error("FakeStream: synchronize while paused with host functions queued would never return");
  idle_cv_.wait(lk, [&] { return queue_.empty() && !running_; });
}

}  // namespace hetmoe
