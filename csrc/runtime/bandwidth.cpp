#include "runtime/bandwidth.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/dispatch.h"
#include "runtime/huge_buffer.h"

namespace hetmoe {

double measure_read_bandwidth(ThreadPool& pool, size_t bytes, int repeats, Isa isa) {
  if (!cpu_features().supports(isa))
    throw std::invalid_argument(std::string("this CPU cannot run the ") + isa_name(isa) +
                                " read loop: " + isa_refusal(isa));
  const int n = pool.size();
  const size_t slice = bytes / n / 4096 * 4096;
  if (slice == 0) throw std::invalid_argument("bandwidth probe: buffer too small for the thread count");
  HugeBuffer buf(slice * n);
  ReadKernel read = select_read_kernel(isa);
  std::vector<uint64_t> sink(n * 8, 0);
  double best = 0;
  pool.run_and_wait([&](ThreadPool& p) {
    // First touch by the reading thread (pages land on its node), then timed passes.
    p.parallel_for(n, [&](int64_t i, int) {
      for (size_t o = 0; o < slice; o += 4096) buf.data()[i * slice + o] = (uint8_t)o;
    });
    for (int r = 0; r < repeats; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      p.parallel_for(n, [&](int64_t i, int) { sink[i * 8] += read(buf.data() + i * slice, slice); });
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, (double)(slice * n) / s / 1e9);
    }
  });
  return best;
}

double measure_read_bandwidth(NumaPools& pools, size_t bytes, int repeats, Isa isa) {
  if (!cpu_features().supports(isa))
    throw std::invalid_argument(std::string("this CPU cannot run the ") + isa_name(isa) +
                                " read loop: " + isa_refusal(isa));
  const int n = pools.size();
  std::vector<size_t> per_thread(n);
  std::vector<HugeBuffer> bufs;
  size_t total = 0;
  for (int s = 0; s < n; ++s) {
    const int threads = pools.pool(s).size();
    per_thread[s] = bytes / n / threads / 4096 * 4096;
    if (per_thread[s] == 0) throw std::invalid_argument("bandwidth probe: buffer too small for the thread count");
    bufs.emplace_back(per_thread[s] * threads);
    pools.bind(s, bufs.back().data(), bufs.back().size());
    total += bufs.back().size();
  }
  ReadKernel read = select_read_kernel(isa);
  std::vector<std::vector<uint64_t>> sink(n);
  pools.run_on_all(n, [&](int s, ThreadPool& p) {  // first touch by the thread that reads it
    sink[s].assign((size_t)p.size() * 8, 0);
    p.parallel_for(p.size(), [&](int64_t i, int) {
      for (size_t o = 0; o < per_thread[s]; o += 4096) bufs[s].data()[i * per_thread[s] + o] = (uint8_t)o;
    });
  });
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    pools.run_on_all(n, [&](int s, ThreadPool& p) {
      p.parallel_for(
          p.size(), [&](int64_t i, int) { sink[s][i * 8] += read(bufs[s].data() + i * per_thread[s], per_thread[s]); });
    });
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, (double)total / sec / 1e9);
  }
  return best;
}

double measure_amx_peak(ThreadPool& pool, bool bf16, int64_t rounds) {
#ifdef HETMOE_HAVE_AMX
  if (!amx_unavailable_reason().empty())
    throw std::invalid_argument("this CPU cannot run AMX: " + amx_unavailable_reason());
  const int n = pool.size();
  double best = 0;
  std::atomic<int> refused{0};
  pool.run_and_wait([&](ThreadPool& p) {
    for (int r = 0; r < 3; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      p.parallel_for(n, [&](int64_t, int) {
        if (!amx_thread_ready()) return (void)refused.fetch_add(1);
        amx::peak_loop(bf16, rounds);
      });
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * (double)rounds * 4 * 16 * 16 * (bf16 ? 32 : 64) * n / s / 1e12);
    }
  });
  if (refused.load()) throw std::runtime_error("AMX permission refused on a pool thread");
  return best;
#else
  (void)pool, (void)bf16, (void)rounds;
  throw std::invalid_argument("this build has no AMX kernels (the compiler did not know -mamx-*)");
#endif
}

}  // namespace hetmoe
