#include "stream/host_funcs.h"

#include <dlfcn.h>

#include <stdexcept>

namespace hetmoe {

// ---------------------------------------------------------------- the driver, looked up at run time

namespace cuda_hooks {
namespace {

// The few driver types we need, declared here so that no CUDA header is needed to build.
using CUresult = int;
using CUstream = void*;  // CUstream_st*
constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorNotInitialized = 3;
constexpr CUresult kErrorInvalidContext = 201;
constexpr int kCaptureStatusNone = 0;  // CU_STREAM_CAPTURE_STATUS_NONE (ACTIVE = 1, INVALIDATED = 2)

struct Driver {
  CUresult (*launch_host_func)(CUstream, HostFn, void*) = nullptr;
  CUresult (*stream_is_capturing)(CUstream, int*) = nullptr;
  // Stream memory operations and mapped host memory (stream/signals.h); all or none, `no_signals` says why.
  CUresult (*write_value32)(CUstream, uint64_t, uint32_t, unsigned) = nullptr;
  CUresult (*wait_value32)(CUstream, uint64_t, uint32_t, unsigned) = nullptr;
  CUresult (*host_register)(void*, size_t, unsigned) = nullptr;
  CUresult (*host_unregister)(void*) = nullptr;
  CUresult (*host_device_pointer)(uint64_t*, void*, unsigned) = nullptr;
  CUresult (*stream_get_ctx)(CUstream, void**) = nullptr;
  CUresult (*ctx_push)(void*) = nullptr;
  CUresult (*ctx_pop)(void**) = nullptr;
  std::string no_signals;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;    // optional: messages only
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;  // optional: messages only
  std::string missing;                                             // why the driver cannot be used; "" when it can
};

template <typename F>
void lookup(void* lib, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
}

Driver load_driver() {
  Driver d;
  // RTLD_LOCAL: the driver's symbols stay out of the global namespace (torch may load its own copy).
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    d.missing = "libcuda.so.1 not found: CUDA host functions need the NVIDIA driver";
    if (why) d.missing += std::string(" (") + why + ")";
    return d;
  }
  // Never dlclose: host functions may still be queued, or captured in graphs, when this module unloads.
  lookup(lib, "cuLaunchHostFunc", d.launch_host_func);
  lookup(lib, "cuStreamIsCapturing", d.stream_is_capturing);
  lookup(lib, "cuGetErrorName", d.get_error_name);
  lookup(lib, "cuGetErrorString", d.get_error_string);
  // The _v2 stream memory operations are enabled by default since CUDA 11.7 (v1 needed a module parameter).
  lookup(lib, "cuStreamWriteValue32_v2", d.write_value32);
  lookup(lib, "cuStreamWaitValue32_v2", d.wait_value32);
  lookup(lib, "cuMemHostRegister_v2", d.host_register);
  lookup(lib, "cuMemHostUnregister", d.host_unregister);
  lookup(lib, "cuMemHostGetDevicePointer_v2", d.host_device_pointer);
  lookup(lib, "cuStreamGetCtx", d.stream_get_ctx);
  lookup(lib, "cuCtxPushCurrent_v2", d.ctx_push);
  lookup(lib, "cuCtxPopCurrent_v2", d.ctx_pop);
  if (!d.write_value32 || !d.wait_value32 || !d.host_register || !d.host_unregister || !d.host_device_pointer ||
      !d.stream_get_ctx || !d.ctx_push || !d.ctx_pop)
    d.no_signals = "libcuda.so.1 has no cuStreamWaitValue32_v2 (or a mapped-memory call): stream signals need the "
                   "driver of CUDA 11.7 or newer";
  if (!d.launch_host_func || !d.stream_is_capturing) {
    d.missing = "libcuda.so.1 has no cuLaunchHostFunc or cuStreamIsCapturing: CUDA host functions need the "
                "driver of CUDA 10 or newer";
    d.launch_host_func = nullptr;
    d.stream_is_capturing = nullptr;
  }
  return d;
}

const Driver& driver() {
  static const Driver d = load_driver();  // thread-safe, once
  return d;
}

const Driver& need_driver() {
  const Driver& d = driver();
  if (!d.missing.empty()) throw std::runtime_error(d.missing);
  return d;
}

void check(CUresult r, const char* what) {
  if (r == kSuccess) return;
  const Driver& d = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.get_error_name) d.get_error_name(r, &name);
  if (d.get_error_string) d.get_error_string(r, &text);
  std::string msg = std::string(what) + " failed: " + (name ? name : "CUDA error " + std::to_string(r));
  if (text) msg += std::string(" (") + text + ")";
  if (r == kErrorNotInitialized || r == kErrorInvalidContext)
    msg += "; CUDA must be initialized on this thread first (any torch.cuda call does it)";
  throw std::runtime_error(msg);
}

}  // namespace

bool available() { return driver().missing.empty(); }

const std::string& unavailable_reason() { return driver().missing; }

void launch_host_func(uintptr_t stream, HostFn fn, void* data) {
  const Driver& d = need_driver();
  check(d.launch_host_func(reinterpret_cast<CUstream>(stream), fn, data), "cuLaunchHostFunc");
}

bool signals_available() { return driver().missing.empty() && driver().no_signals.empty(); }

const std::string& signals_unavailable_reason() {
  return driver().missing.empty() ? driver().no_signals : driver().missing;
}

namespace {
const Driver& need_signals() {
  const Driver& d = need_driver();
  if (!d.no_signals.empty()) throw std::runtime_error(d.no_signals);
  return d;
}

// Makes the context of `stream` current on this thread for the scope (registering memory needs one).
class StreamContext {
 public:
  explicit StreamContext(uintptr_t stream) : d_(need_signals()) {
    void* ctx = nullptr;
    check(d_.stream_get_ctx(reinterpret_cast<CUstream>(stream), &ctx), "cuStreamGetCtx");
    check(d_.ctx_push(ctx), "cuCtxPushCurrent");
  }
  ~StreamContext() {
    void* ctx = nullptr;
    d_.ctx_pop(&ctx);
  }

 private:
  const Driver& d_;
};
}  // namespace

uint64_t map_host_memory(uintptr_t stream, void* ptr, size_t bytes) {
  const Driver& d = need_signals();
  StreamContext scope(stream);
  // PORTABLE (1): valid in every context; DEVICEMAP (2): the device may read and write it.
  check(d.host_register(ptr, bytes, 1u | 2u), "cuMemHostRegister");
  uint64_t dev = 0;
  CUresult r = d.host_device_pointer(&dev, ptr, 0);
  if (r != kSuccess) {
    d.host_unregister(ptr);
    check(r, "cuMemHostGetDevicePointer");
  }
  return dev;
}

void unmap_host_memory(void* ptr) {
  const Driver& d = driver();
  if (d.host_unregister) d.host_unregister(ptr);  // at teardown: nothing useful to do with an error
}

void write_value32(uintptr_t stream, uint64_t dev_addr, uint32_t value) {
  // Flags 0: the write is ordered after all earlier work of the stream, with a memory fence before it.
  check(need_signals().write_value32(reinterpret_cast<CUstream>(stream), dev_addr, value, 0), "cuStreamWriteValue32");
}

void wait_value32_eq(uintptr_t stream, uint64_t dev_addr, uint32_t value) {
  constexpr unsigned kWaitEq = 1;  // CU_STREAM_WAIT_VALUE_EQ
  check(need_signals().wait_value32(reinterpret_cast<CUstream>(stream), dev_addr, value, kWaitEq),
        "cuStreamWaitValue32");
}

bool is_capturing(uintptr_t stream) {
  const Driver& d = need_driver();
  int status = kCaptureStatusNone;
  check(d.stream_is_capturing(reinterpret_cast<CUstream>(stream), &status), "cuStreamIsCapturing");
  // An invalidated capture counts as captured: keeping a payload too long is harmless, freeing one early not.
  return status != kCaptureStatusNone;
}

}  // namespace cuda_hooks

// ---------------------------------------------------------------- FakeStream

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

// ---------------------------------------------------------------- HostFuncs

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
  bool captured = stream.fake ? stream.fake->capturing() : cuda_hooks::is_capturing(stream.cuda);
  auto& list = captured ? captured_ : eager_;
  list.reserve(list.size() + 1);  // nothing may throw between a successful launch and taking ownership
  p->id = next_id_++;
  if (stream.fake)
    stream.fake->launch(fn, p.get());
  else
    cuda_hooks::launch_host_func(stream.cuda, fn, p.get());  // throws: nothing was enqueued, p is freed
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
