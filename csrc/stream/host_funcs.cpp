#include "stream/host_funcs.h"

#include <atomic>
#include <stdexcept>

namespace hetmoe {

struct HostFuncs::Payload {
  uint64_t id = 0;
  std::shared_ptr<ThreadPool> pool;
  std::shared_ptr<Job> job;  // null for a sync
  int64_t allow_pending = 0;
  std::atomic<uint64_t> job_id{0};  // the pool's id of the latest submission (0: none, or it failed)
  std::atomic<uint64_t> runs{0};    // host-function calls that have returned: the callback's last write
};

namespace {

// The host functions. They must not throw into the driver: errors go to the pool for the next sync.
void host_submit(void* data) noexcept {
  auto* p = static_cast<HostFuncs::Payload*>(data);
  try {
    p->pool->submit_borrowed(p->job.get(), &p->job_id);
  } catch (...) {
    p->pool->record_error(std::current_exception());
  }
  p->runs.fetch_add(1, std::memory_order_release);  // last touch of *p: it may be freed from here on
}

void host_sync(void* data) noexcept {
  auto* p = static_cast<HostFuncs::Payload*>(data);
  try {
    p->pool->wait(p->allow_pending);
  } catch (...) {
    p->pool->record_error(std::current_exception());
  }
  p->runs.fetch_add(1, std::memory_order_release);
}

bool done(const HostFuncs::Payload& p) {
  if (p.runs.load(std::memory_order_acquire) == 0) return false;
  return !p.job || p.pool->completed() >= p.job_id.load(std::memory_order_acquire);
}

}  // namespace

HostFuncs::HostFuncs() = default;

HostFuncs::~HostFuncs() { close(); }

uint64_t HostFuncs::enqueue(const HostStream& stream, std::unique_ptr<Payload> p, HostFn fn) {
  std::lock_guard<std::mutex> lk(mu_);
  // Asked before launching: a node launched into a capture runs at every replay, so its payload must stay.
  bool captured = stream.fake ? stream.fake->capturing() : cuda_driver::is_capturing(stream.cuda);
  auto& list = captured ? captured_ : eager_;
  list.reserve(list.size() + 1);  // nothing may throw between a successful launch and taking ownership
  p->id = next_id_++;
  if (stream.fake)
    stream.fake->launch(fn, p.get());
  else
    cuda_driver::launch_host_func(stream.cuda, fn, p.get());  // throws: nothing was enqueued, p is freed
  uint64_t id = p->id;
  list.push_back(std::move(p));
  return id;
}

uint64_t HostFuncs::enqueue_submit(const HostStream& stream, std::shared_ptr<ThreadPool> pool,
                                   std::shared_ptr<Job> job) {
  if (!pool || !job) throw std::invalid_argument("enqueue_submit: null pool or job");
  auto p = std::make_unique<Payload>();
  p->pool = std::move(pool);
  p->job = std::move(job);
  return enqueue(stream, std::move(p), &host_submit);
}

uint64_t HostFuncs::enqueue_sync(const HostStream& stream, std::shared_ptr<ThreadPool> pool, int64_t allow_pending) {
  if (!pool) throw std::invalid_argument("enqueue_sync: null pool");
  if (allow_pending < 0) throw std::invalid_argument("sync: allow_pending must be >= 0");
  auto p = std::make_unique<Payload>();
  p->pool = std::move(pool);
  p->allow_pending = allow_pending;
  return enqueue(stream, std::move(p), &host_sync);
}

std::vector<uint64_t> HostFuncs::release_finished() {
  std::vector<uint64_t> freed;
  std::lock_guard<std::mutex> lk(mu_);
  size_t keep = 0;
  for (size_t i = 0; i < eager_.size(); ++i) {
    if (done(*eager_[i])) {
      freed.push_back(eager_[i]->id);
      eager_[i].reset();
    } else if (keep != i) {
      eager_[keep++] = std::move(eager_[i]);
    } else {
      ++keep;
    }
  }
  eager_.resize(keep);
  return freed;
}

std::vector<uint64_t> HostFuncs::close() {
  std::vector<std::unique_ptr<Payload>> eager, captured;
  {
    std::lock_guard<std::mutex> lk(mu_);
    eager.swap(eager_);
    captured.swap(captured_);
  }
  std::vector<uint64_t> leaked;
  for (auto& p : eager) {
    if (p->runs.load(std::memory_order_acquire) == 0) {
      leaked.push_back(p->id);
      (void)p.release();  // the stream may still reach it: see the lifetime rules in the header
      continue;
    }
    if (p->job) p->pool->wait_for(p->job_id.load(std::memory_order_acquire));
  }
  // By the lifetime rule no replay is in flight: the jobs of the last one may still be queued.
  for (auto& p : captured)
    if (p->job && p->runs.load(std::memory_order_acquire) > 0)
      p->pool->wait_for(p->job_id.load(std::memory_order_acquire));
  return leaked;
}

size_t HostFuncs::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return eager_.size() + captured_.size();
}

size_t HostFuncs::n_captured() const {
  std::lock_guard<std::mutex> lk(mu_);
  return captured_.size();
}

size_t HostFuncs::n_not_run() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (auto& p : eager_) n += p->runs.load(std::memory_order_acquire) == 0;
  return n;
}

}  // namespace hetmoe
