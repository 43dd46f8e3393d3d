// What one AMX tile product and one tile load cost on this machine, apart from any GEMM: a 2x2 tile step (C tiles
// 0-3, A tiles 4-5, B tiles 6-7, as kernels/amx/gemm.h) on fixed 1 KB buffers that stay in L1, with A tiles of
// 16 / 8 / 4 / 1 configured rows, and with no loads, the two A loads, or all four loads before the products.
// `amx_tile_costs N cfg` times ldtilecfg / tilezero / tilerelease instead. Not part of the package. On the device:
//   g++ -O2 -std=c++17 -mamx-tile -mamx-int8 -pthread bench/device/amx_tile_costs.cpp -o /tmp/amx_tile_costs
//   for n in 1 16; do /tmp/amx_tile_costs $n; done; /tmp/amx_tile_costs 1 cfg
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
static void cfg(int rows) {
  alignas(64) unsigned char c[64] = {};
  c[0] = 1;
  for (int t = 0; t < 8; ++t) {
    bool b = t >= 6;
    c[16 + 2 * t] = 64;
    c[48 + t] = b ? 16 : rows;
  }
  _tile_loadconfig(c);
}
alignas(64) static thread_local unsigned char buf[8192];
template <int MODE>
static double run(int rows, long iters) {
  cfg(rows);
  for (int i = 0; i < 8192; ++i) buf[i] = i * 7;
  _tile_loadd(4, buf, 64);
  _tile_loadd(5, buf + 1024, 64);
  _tile_loadd(6, buf + 2048, 64);
  _tile_loadd(7, buf + 3072, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) {
    if (MODE >= 1) _tile_loadd(4, buf, 64);
    if (MODE >= 2) _tile_loadd(6, buf + 2048, 64);
    _tile_dpbsud(0, 4, 6);
    if (MODE >= 2) _tile_loadd(7, buf + 3072, 64);
    _tile_dpbsud(1, 4, 7);
    if (MODE >= 1) _tile_loadd(5, buf + 1024, 64);
    _tile_dpbsud(2, 5, 6);
    _tile_dpbsud(3, 5, 7);
  }
  _tile_stored(0, buf + 4096, 64);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return s;
}
int main(int argc, char** argv) {
  int nth = argc > 1 ? atoi(argv[1]) : 1;
  if (argc > 2) {  // configure + zero + release cost
    syscall(SYS_arch_prctl, 0x1023, 18);
    for (int variant = 0; variant < 3; ++variant) {
      const long n = 20000;
      auto t0 = std::chrono::steady_clock::now();
      for (long i = 0; i < n; ++i) {
        cfg(16);
        _tile_zero(0);
        if (variant == 1) _tile_stored(0, buf, 64);
        if (variant != 2) _tile_release();
      }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      _tile_release();
      printf("%s: %.1f ns per round\n",
             variant == 0   ? "ldtilecfg+tilezero+tilerelease"
             : variant == 1 ? "ldtilecfg+zero+store+release"
                            : "ldtilecfg+zero (no release)",
             s / n * 1e9);
    }
    return 0;
  }
  long iters = 200000;
  const char* names[3] = {"no loads", "A loads (0.5/dp)", "A+B loads (1/dp)"};
  for (int mode = 0; mode < 3; ++mode)
    for (int rows : {16, 8, 4, 1}) {
      std::vector<double> secs(nth);
      std::atomic<int> ready{0};
      std::vector<std::thread> th;
      for (int t = 0; t < nth; ++t)
        th.emplace_back([&, t] {
          syscall(SYS_arch_prctl, 0x1023, 18);
          ready++;
          while (ready.load() < nth) {
          }
          secs[t] = mode == 0 ? run<0>(rows, iters) : mode == 1 ? run<1>(rows, iters) : run<2>(rows, iters);
        });
      for (auto& x : th) x.join();
      double mx = 0;
      for (double s : secs) mx = s > mx ? s : mx;
      double ns_per_dp = mx / (iters * 4.0) * 1e9;
      double tops = nth * iters * 4.0 * rows * 16 * 64 * 2 / mx / 1e12;
      printf("%-18s rows %2d threads %2d: %.2f ns per dp per thread, %.2f TOPS (useful rows)\n", names[mode], rows, nth,
             ns_per_dp, tops);
    }
}
