// The STREAM-read probe: how fast this machine's DRAM feeds the pool's threads, measured in the same process
// (and run) as the kernels it is compared to.
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/dispatch.h"
#include "moe/moe.h"

namespace hetmoe {

double measure_read_bandwidth(ThreadPool& pool, size_t bytes, int repeats, Isa isa) {
  if (!cpu_features().supports(isa))
    throw std::invalid_argument(std::string("this CPU cannot run the ") + isa_name(isa) + " read loop");
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

}  // namespace hetmoe
