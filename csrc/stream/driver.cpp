#include "stream/driver.h"

#include <dlfcn.h>

#include <stdexcept>

namespace hetmoe {

namespace cuda_driver {
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

}  // namespace cuda_driver

}  // namespace hetmoe
