// The STREAM-read probe: how fast this machine's DRAM feeds the pool's threads, measured in the same process
// (and run) as the kernels it is compared to; and the AMX tile unit's own peak, the ceiling of the AMX GEMM.
#pragma once
#include <cstddef>
#include <cstdint>

#include "runtime/cpu_features.h"
#include "runtime/thread_pool.h"
#include "runtime/topology.h"

namespace hetmoe {

// DRAM read bandwidth (GB/s, best of `repeats`) with all pool threads, each streaming its own slice of a buffer of
// `bytes`.
double measure_read_bandwidth(ThreadPool& pool, size_t bytes, int repeats, Isa isa);
// The same with every subpool reading its own buffer at once (first touched by its threads).
double measure_read_bandwidth(NumaPools& pools, size_t bytes, int repeats, Isa isa);
// TFLOPS (2 x multiply-adds) of every pool thread running amx::peak_loop(bf16, rounds) at once (best of 3).
double measure_amx_peak(ThreadPool& pool, bool bf16, int64_t rounds);

}  // namespace hetmoe
