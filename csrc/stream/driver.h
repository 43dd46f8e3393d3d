// The CUDA driver calls behind stream-ordered CPU work (stream/host_funcs.h, stream/signals.h).
//
// No CUDA at build or link time: libcuda.so.1 is opened at first use (dlopen) and the entry points are looked up
// there. Without the driver available() is false and every call below throws std::runtime_error; the rest of the
// extension is unaffected.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace hetmoe {

using HostFn = void (*)(void*);  // CUhostFn

namespace cuda_driver {

// Whether libcuda.so.1 and the entry points we need were found (looked up once, at the first call).
bool available();
// Why not, or "" when available.
const std::string& unavailable_reason();
// cuLaunchHostFunc on a raw stream handle (torch.cuda.Stream.cuda_stream). Throws std::runtime_error with the
// driver's message when it refuses, or the reason above when there is no driver.
void launch_host_func(uintptr_t stream, HostFn fn, void* data);
// cuStreamIsCapturing: whether work enqueued on `stream` now goes into a graph instead of running.
bool is_capturing(uintptr_t stream);

// Stream memory operations (stream/signals.h): whether the driver has them, or why not.
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

}  // namespace cuda_driver

}  // namespace hetmoe
