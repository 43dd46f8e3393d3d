// A stand-alone probe of the AMX int8 tile loop on the GPU machine's Xeon: how fast the 2x2 tile step of
// kernels/amx/gemm.h runs by where its A and B tiles come from, so loop-nest changes are judged on numbers.
// Not part of the package. Build and run on the device:
//   g++ -O2 -std=c++17 -mamx-tile -mamx-int8 -mavx512f -pthread bench/device/amx_probe.cpp -o /tmp/amx_probe
//   /tmp/amx_probe
// Each line: a variant, threads, tokens per expert, and the int8 TOPS of the whole run.
//   2x2 (engine order)   the tile step of gemm.h: C 2x2, A tiles 4, 5, B tiles 6, 7, loads before each product
//   2x1 / 1x2 double-buffered   two alternating sets of A (or B) tiles, so a step's loads need not wait for the
//                        previous step's products (1.5 tile loads per product instead of 1)
//   1x3                  one 16-token A tile against three row blocks, A double-buffered (1.33 loads per product,
//                        A from L2 a third of them)
//   hot                  one expert's weights over and over (L2/L3); cold: 64 experts (1.9 GB) from DRAM
// Activations are packed 1 KB A tiles (formats/layout.h AmxPanel); K in chunks of 1024 (C kept between chunks).
// `/tmp/amx_probe 16 helpers`: 16 compute threads against 8, alone or each with a helper thread prefetching its
// next weight chunks (run_helpers).
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kK = 7168;            // gate/up K of the DeepSeek-V3 layer
constexpr int kN = 4096;            // gate + up rows
constexpr size_t kRowBytes = 7296;  // an AMX activation row of that K today (elements, scales, sums)

void tile_config() {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;
  for (int i = 0; i < 8; ++i) {
    const uint16_t colsb = 64;
    std::memcpy(cfg + 16 + 2 * i, &colsb, 2);
    cfg[48 + i] = 16;
  }
  _tile_loadconfig(cfg);
}

uint8_t* alloc(size_t n, uint8_t fill) {
  void* p = nullptr;
  if (posix_memalign(&p, 2 << 20, n)) std::abort();
  std::memset(p, fill, n);
  return static_cast<uint8_t*>(p);
}

struct Variant {
  bool packed;
  int chunk;            // K per chunk
  int bprefetch;        // bytes ahead prefetched on the first token block (0 = none)
  int mode = 0;         // 0 loads + dot products, 1 loads only, 2 dot products only, 3 + prefetch next A/B into L1
  int hint = 0;         // 0: first-block prefetch with prefetcht0, 2: with prefetcht2 (L2)
  bool spread = false;  // every token block prefetches (t2) its share of the next chunk's weights
};

// One expert: out rows [n_tok] x [pairs*32]; weights `w` in the packed-line layout (row block of 16 rows =
// K/4 lines of 64 B); A either rows of kRowBytes or packed tiles [tok block of 16][K/64][1 KB].
thread_local std::atomic<long>* g_progress = nullptr;  // chunks done by this thread (helper variants)

void expert(const Variant& v, const uint8_t* w, int p0, int p1, const uint8_t* a, int n_tok, int32_t* c) {
  const size_t block = (size_t)kK / 4 * 64;  // bytes per row block
  const int chunk = v.chunk;
  for (int p = p0; p < p1; ++p) {
    const uint8_t* b0base = w + (size_t)(2 * p) * block;
    const uint8_t* b1base = b0base + block;
    for (int k0 = 0; k0 < kK; k0 += chunk) {
      for (int m0 = 0; m0 < n_tok; m0 += 32) {
        int32_t* cm = c + (size_t)m0 * 32;
        if (k0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, cm, 128);
          _tile_loadd(1, cm + 16, 128);
          _tile_loadd(2, cm + 16 * 32, 128);
          _tile_loadd(3, cm + 16 * 32 + 16, 128);
        }
        const bool first = m0 == 0 && v.bprefetch > 0;
        for (int k = k0; k < k0 + chunk; k += 64) {
          const uint8_t* b0 = b0base + (size_t)(k / 4) * 64;
          const uint8_t* b1 = b1base + (size_t)(k / 4) * 64;
          if (first && v.hint == 0)
            for (int l = 0; l < 16; ++l) {
              _mm_prefetch((const char*)b0 + v.bprefetch + 64 * l, _MM_HINT_T0);
              _mm_prefetch((const char*)b1 + v.bprefetch + 64 * l, _MM_HINT_T0);
            }
          if (first && v.hint == 2)
            for (int l = 0; l < 16; ++l) {
              _mm_prefetch((const char*)b0 + v.bprefetch + 64 * l, _MM_HINT_T2);
              _mm_prefetch((const char*)b1 + v.bprefetch + 64 * l, _MM_HINT_T2);
            }
          if (v.spread && k0 + chunk < kK) {
            // this block's share of the next chunk: chunk/4 lines per row block, over n_blocks * steps
            const int n_blocks = (n_tok + 31) / 32, steps = chunk / 64;
            const int per = (chunk / 4) / (n_blocks * steps) > 0 ? (chunk / 4) / (n_blocks * steps) : 1;
            const int idx = ((m0 / 32) * steps + (k - k0) / 64) * per;
            for (int l = 0; l < per && idx + l < chunk / 4; ++l) {
              _mm_prefetch((const char*)b0base + (size_t)(k0 + chunk) * 16 + 64 * (idx + l), _MM_HINT_T2);
              _mm_prefetch((const char*)b1base + (size_t)(k0 + chunk) * 16 + 64 * (idx + l), _MM_HINT_T2);
            }
          }
          const uint8_t *a0, *a1;
          size_t as;
          if (v.packed) {
            a0 = a + ((size_t)(m0 / 16) * (kK / 64) + k / 64) * 1024;
            a1 = a + ((size_t)(m0 / 16 + 1) * (kK / 64) + k / 64) * 1024;
            as = 64;
          } else {
            a0 = a + (size_t)m0 * kRowBytes + k;
            a1 = a0 + 16 * kRowBytes;
            as = kRowBytes;
          }
          if (v.mode == 3) {
            for (int l = 0; l < 16; ++l) {
              _mm_prefetch((const char*)a0 + 1024 + 64 * l, _MM_HINT_T0);
              _mm_prefetch((const char*)a1 + 1024 + 64 * l, _MM_HINT_T0);
            }
            if (!first)
              for (int l = 0; l < 16; ++l) {
                _mm_prefetch((const char*)b0 + 1024 + 64 * l, _MM_HINT_T0);
                _mm_prefetch((const char*)b1 + 1024 + 64 * l, _MM_HINT_T0);
              }
          }
          if (v.mode == 1) {
            _tile_loadd(4, a0, as);
            _tile_loadd(6, b0, 64);
            _tile_loadd(7, b1, 64);
            _tile_loadd(5, a1, as);
          } else if (v.mode == 2) {
            _tile_dpbusd(0, 4, 6);
            _tile_dpbusd(1, 4, 7);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
          } else {
            _tile_loadd(4, a0, as);
            _tile_loadd(6, b0, 64);
            _tile_dpbusd(0, 4, 6);
            _tile_loadd(7, b1, 64);
            _tile_dpbusd(1, 4, 7);
            _tile_loadd(5, a1, as);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
          }
        }
        _tile_stored(0, cm, 128);
        _tile_stored(1, cm + 16, 128);
        _tile_stored(2, cm + 16 * 32, 128);
        _tile_stored(3, cm + 16 * 32 + 16, 128);
      }
      if (g_progress) g_progress->store(g_progress->load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
  }
}

// Double-buffered tile orders (mode 4: 2x1, mode 5: 1x2): the tiles a step loads are not the ones the previous
// step's dot products read, so a step's loads can run while the previous step multiplies (tile registers are
// not renamed). 2x1: C 0,1 = tokens 0-15 / 16-31 x one row block; A sets {2,3} / {4,5}; B 6 / 7. 1x2: C 0,1 = 16
// tokens x row blocks 0 / 1; A 2 / 3; B sets {4,5} / {6,7}. Both load 1.5 tiles per dot product (2x2: 1).
void expert_db(const Variant& v, const uint8_t* w, int p0, int p1, const uint8_t* a, int n_tok, int32_t* c) {
  const size_t block = (size_t)kK / 4 * 64;
  const int chunk = v.chunk, steps = chunk / 64;
  auto at = [&](int m0, int k) { return a + ((size_t)(m0 / 16) * (kK / 64) + k / 64) * 1024; };
  for (int p = p0; p < p1; ++p) {
    const uint8_t* bb[2] = {w + (size_t)(2 * p) * block, w + (size_t)(2 * p + 1) * block};
    for (int k0 = 0; k0 < kK; k0 += chunk) {
      if (v.mode == 4) {
        for (int j = 0; j < 2; ++j)
          for (int m0 = 0; m0 < n_tok; m0 += 32) {
            int32_t* cm = c + (size_t)m0 * 32 + 16 * j;
            if (k0 == 0) {
              _tile_zero(0);
              _tile_zero(1);
            } else {
              _tile_loadd(0, cm, 128);
              _tile_loadd(1, cm + 16 * 32, 128);
            }
            const uint8_t* b = bb[j] + (size_t)(k0 / 4) * 64;
            _tile_loadd(2, at(m0, k0), 64);
            _tile_loadd(3, at(m0 + 16, k0), 64);
            _tile_loadd(6, b, 64);
            for (int s2 = 0; s2 < steps; s2 += 2) {
              const int k1 = k0 + 64 * (s2 + 1), k2 = k0 + 64 * (s2 + 2);
              _tile_loadd(4, at(m0, k1), 64);
              _tile_loadd(5, at(m0 + 16, k1), 64);
              _tile_loadd(7, bb[j] + (size_t)(k1 / 4) * 64, 64);
              _tile_dpbusd(0, 2, 6);
              _tile_dpbusd(1, 3, 6);
              if (s2 + 2 < steps) {
                _tile_loadd(2, at(m0, k2), 64);
                _tile_loadd(3, at(m0 + 16, k2), 64);
                _tile_loadd(6, bb[j] + (size_t)(k2 / 4) * 64, 64);
              }
              _tile_dpbusd(0, 4, 7);
              _tile_dpbusd(1, 5, 7);
            }
            _tile_stored(0, cm, 128);
            _tile_stored(1, cm + 16 * 32, 128);
          }
      } else {
        for (int m0 = 0; m0 < n_tok; m0 += 16) {
          int32_t* cm = c + (size_t)m0 * 32;
          if (k0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
          } else {
            _tile_loadd(0, cm, 128);
            _tile_loadd(1, cm + 16, 128);
          }
          _tile_loadd(2, at(m0, k0), 64);
          _tile_loadd(4, bb[0] + (size_t)(k0 / 4) * 64, 64);
          _tile_loadd(5, bb[1] + (size_t)(k0 / 4) * 64, 64);
          for (int s2 = 0; s2 < steps; s2 += 2) {
            const int k1 = k0 + 64 * (s2 + 1), k2 = k0 + 64 * (s2 + 2);
            _tile_loadd(3, at(m0, k1), 64);
            _tile_loadd(6, bb[0] + (size_t)(k1 / 4) * 64, 64);
            _tile_loadd(7, bb[1] + (size_t)(k1 / 4) * 64, 64);
            _tile_dpbusd(0, 2, 4);
            _tile_dpbusd(1, 2, 5);
            if (s2 + 2 < steps) {
              _tile_loadd(2, at(m0, k2), 64);
              _tile_loadd(4, bb[0] + (size_t)(k2 / 4) * 64, 64);
              _tile_loadd(5, bb[1] + (size_t)(k2 / 4) * 64, 64);
            }
            _tile_dpbusd(0, 3, 6);
            _tile_dpbusd(1, 3, 7);
          }
          _tile_stored(0, cm, 128);
          _tile_stored(1, cm + 16, 128);
        }
      }
    }
  }
}

// Mode 6, 1x3: one 16-token A tile against three row blocks (C 0-2), A double-buffered (tiles 3 / 4), B 5-7:
// each A tile (from L2) is used by 3 products instead of 2, and the next A loads while the products run. Row blocks
// in triples (255 of the 256; the run counts 255), K in chunks of `chunk`, the next chunk spread-prefetched.
void expert_1x3(const Variant& v, const uint8_t* w, int q0, int q1, const uint8_t* a, int n_tok, int32_t* c) {
  const size_t block = (size_t)kK / 4 * 64;
  const int chunk = v.chunk, steps = chunk / 64;
  auto at = [&](int m0, int k) { return a + ((size_t)(m0 / 16) * (kK / 64) + k / 64) * 1024; };
  for (int q = q0; q < q1; ++q) {
    const uint8_t* b[3] = {w + (size_t)(3 * q) * block, w + (size_t)(3 * q + 1) * block,
                           w + (size_t)(3 * q + 2) * block};
    for (int k0 = 0; k0 < kK; k0 += chunk) {
      const int n_blocks = n_tok / 16,
                per = (chunk / 4) / (n_blocks * steps) > 0 ? (chunk / 4) / (n_blocks * steps) : 1;
      for (int m0 = 0; m0 < n_tok; m0 += 16) {
        int32_t* cm = c + (size_t)m0 * 48;
        if (k0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
        } else {
          _tile_loadd(0, cm, 192);
          _tile_loadd(1, cm + 16, 192);
          _tile_loadd(2, cm + 32, 192);
        }
        _tile_loadd(3, at(m0, k0), 64);
        for (int s2 = 0; s2 < steps; s2 += 2) {
          const int ka = k0 + 64 * s2, kb = ka + 64;
          if (k0 + chunk < kK) {
            const int idx = ((m0 / 16) * steps + s2) * per;
            for (int l = 0; l < 2 * per && idx + l < chunk / 4; ++l)
              for (int j = 0; j < 3; ++j)
                _mm_prefetch((const char*)b[j] + (size_t)(k0 + chunk) * 16 + 64 * (idx + l), _MM_HINT_T2);
          }
          _tile_loadd(4, at(m0, kb), 64);
          _tile_loadd(5, b[0] + (size_t)(ka / 4) * 64, 64);
          _tile_loadd(6, b[1] + (size_t)(ka / 4) * 64, 64);
          _tile_loadd(7, b[2] + (size_t)(ka / 4) * 64, 64);
          _tile_dpbusd(0, 3, 5);
          _tile_dpbusd(1, 3, 6);
          _tile_dpbusd(2, 3, 7);
          if (s2 + 2 < steps) _tile_loadd(3, at(m0, kb + 64), 64);
          _tile_loadd(5, b[0] + (size_t)(kb / 4) * 64, 64);
          _tile_loadd(6, b[1] + (size_t)(kb / 4) * 64, 64);
          _tile_loadd(7, b[2] + (size_t)(kb / 4) * 64, 64);
          _tile_dpbusd(0, 4, 5);
          _tile_dpbusd(1, 4, 6);
          _tile_dpbusd(2, 4, 7);
        }
        _tile_stored(0, cm, 192);
        _tile_stored(1, cm + 16, 192);
        _tile_stored(2, cm + 32, 192);
      }
    }
  }
}

void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  pthread_setaffinity_np(pthread_self(), sizeof(s), &s);
}

bool amx_perm() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

double run(const Variant& v, int threads, int n_tok, int n_exp, int reps, uint8_t* w, uint8_t* a_rows,
           uint8_t* a_packed) {
  const int pairs = kN / 32;
  const size_t wbytes = (size_t)kN * kK;
  const size_t a_bytes = v.packed ? (size_t)n_tok / 16 * (kK / 64) * 1024 : (size_t)n_tok * kRowBytes;
  std::atomic<int> ready{0};
  std::vector<std::thread> ts;
  std::atomic<long> t_start{0};
  double secs = 0;
  std::vector<double> per(threads);
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      pin(t);
      if (!amx_perm()) std::abort();
      tile_config();
      std::vector<int32_t> c((size_t)n_tok * 32);
      const int p0 = pairs * t / threads, p1 = pairs * (t + 1) / threads;
      const int q0 = 85 * t / threads, q1 = 85 * (t + 1) / threads;  // row-block triples (1x3)
      if (v.mode == 6) c.resize((size_t)n_tok * 48);
      auto one = [&](int e) {
        const uint8_t* a = (v.packed ? a_packed : a_rows) + (e % 8) * a_bytes;
        if (v.mode == 6)
          expert_1x3(v, w + e * wbytes, q0, q1, a, n_tok, c.data());
        else if (v.mode >= 4)
          expert_db(v, w + e * wbytes, p0, p1, a, n_tok, c.data());
        else
          expert(v, w + e * wbytes, p0, p1, a, n_tok, c.data());
      };
      for (int e = 0; e < n_exp; ++e) one(e);  // warm-up pass
      ready.fetch_add(1);
      while (ready.load() < threads) {
      }
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r)
        for (int e = 0; e < n_exp; ++e) one(e);
      per[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      _tile_release();
    });
  for (auto& t : ts) t.join();
  for (double s : per) secs = s > secs ? s : secs;
  const double ops = 2.0 * n_tok * kN * kK * n_exp * reps * (v.mode == 6 ? 255.0 / 256 : 1.0);
  return ops / secs / 1e12;
}

// Helper variants: `compute` threads run the engine's loop (spread prefetch) on CPUs cc[i]; with helpers, thread
// i's helper on CPU hc[i] follows its chunk counter and prefetches (prefetcht2) or loads the weights of the chunks
// `lead` ahead of it, so the compute thread finds them in a cache it shares (when the two CPUs are siblings).
double run_helpers(int compute, const std::vector<int>& cc, const std::vector<int>& hc, int lead, bool touch, int n_tok,
                   int n_exp, uint8_t* w, uint8_t* a_packed) {
  const Variant v{true, 1024, 0, 0, 0, true};
  const int pairs = kN / 32, nch = kK / 1024;
  const size_t wbytes = (size_t)kN * kK, block = (size_t)kK / 4 * 64;
  const size_t a_bytes = (size_t)n_tok / 16 * (kK / 64) * 1024;
  std::vector<std::atomic<long>> prog(compute);
  std::atomic<int> ready{0};
  const bool helpers = !hc.empty();
  const int n_threads = compute * (helpers ? 2 : 1);
  std::vector<double> per(compute);
  std::vector<std::thread> ts;
  std::atomic<long> sink{0};
  for (int t = 0; t < compute; ++t) prog[t].store(-1);
  for (int t = 0; t < n_threads; ++t)
    ts.emplace_back([&, t] {
      const bool helper = t >= compute;
      const int i = helper ? t - compute : t;
      pin(helper ? hc[i] : cc[i]);
      const int p0 = pairs * i / compute, p1 = pairs * (i + 1) / compute;
      if (helper) {
        ready.fetch_add(1);
        while (ready.load() < n_threads) {
        }
        const long total = (long)n_exp * (p1 - p0) * nch;
        long acc = 0;
        while (prog[i].load(std::memory_order_acquire) < 0) _mm_pause();  // warm-up done, timed pass starts at 0
        for (long cidx = 0; cidx < total; ++cidx) {
          while (cidx > prog[i].load(std::memory_order_acquire) + lead) _mm_pause();
          const int e = (int)(cidx / ((long)(p1 - p0) * nch)), p = p0 + (int)(cidx / nch % (p1 - p0)),
                    k0 = (int)(cidx % nch) * 1024;
          const uint8_t* b0 = w + e * wbytes + (size_t)(2 * p) * block + (size_t)k0 * 16;
          for (int j = 0; j < 2; ++j)
            for (int l = 0; l < 256; ++l) {
              const uint8_t* q = b0 + j * block + 64 * l;
              if (touch)
                acc += *(const volatile uint8_t*)q;
              else
                _mm_prefetch((const char*)q, _MM_HINT_T2);
            }
        }
        sink.fetch_add(acc);
        return;
      }
      if (!amx_perm()) std::abort();
      tile_config();
      std::vector<int32_t> c((size_t)n_tok * 32);
      for (int e = 0; e < n_exp; ++e) expert(v, w + e * wbytes, p0, p1, a_packed + (e % 8) * a_bytes, n_tok, c.data());
      ready.fetch_add(1);
      while (ready.load() < n_threads) {
      }
      g_progress = &prog[i];
      auto t0 = std::chrono::steady_clock::now();
      prog[i].store(0, std::memory_order_release);
      for (int e = 0; e < n_exp; ++e) expert(v, w + e * wbytes, p0, p1, a_packed + (e % 8) * a_bytes, n_tok, c.data());
      per[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      prog[i].store(1L << 40);
      g_progress = nullptr;
      _tile_release();
    });
  for (auto& t : ts) t.join();
  double secs = 0;
  for (double x : per) secs = x > secs ? x : secs;
  return 2.0 * n_tok * kN * kK * n_exp / secs / 1e12;
}
}  // namespace

int main(int argc, char** argv) {
  const int max_threads = argc > 1 ? atoi(argv[1]) : 16;
  const int n_cold = 64;
  const size_t wbytes = (size_t)kN * kK;
  uint8_t* w = alloc(wbytes * n_cold, 1);
  for (size_t i = 0; i < wbytes * n_cold; i += 4096) w[i] = (uint8_t)(i >> 12);
  const int max_tok = 256;
  uint8_t* a_rows = alloc((size_t)8 * max_tok * kRowBytes + 64 * kRowBytes, 2);
  uint8_t* a_packed = alloc((size_t)8 * max_tok * kK + 65536, 2);
  printf("variant                          threads tok  data   TOPS\n");
  struct Named {
    const char* name;
    Variant v;
  };
  if (argc > 2 && std::string(argv[2]) == "helpers") {
    std::vector<int> all, lo, hi, even, odd;
    for (int c = 0; c < 16; ++c) (c < 8 ? lo : hi).push_back(c), (c % 2 ? odd : even).push_back(c), all.push_back(c);
    for (int n_tok : {64, 256})
      for (int round = 0; round < 3; ++round) {
        auto show = [&](const char* name, double tops) {
          printf("%-40s %4d cold %6.2f  (%.1f GB/s of weights)\n", name, n_tok, tops,
                 tops * 1e12 / (2.0 * n_tok) / 1e9);
          fflush(stdout);
        };
        show("16 compute (engine)", run_helpers(16, all, {}, 0, false, n_tok, n_cold, w, a_packed));
        show("8 compute 0-7", run_helpers(8, lo, {}, 0, false, n_tok, n_cold, w, a_packed));
        show("8 compute 0-7 + helpers 8-15 t2 lead 4", run_helpers(8, lo, hi, 4, false, n_tok, n_cold, w, a_packed));
        show("8 compute even + helpers odd t2 lead 4", run_helpers(8, even, odd, 4, false, n_tok, n_cold, w, a_packed));
        show("8 compute even + helpers odd load lead 4",
             run_helpers(8, even, odd, 4, true, n_tok, n_cold, w, a_packed));
        show("8 compute 0-7 + helpers 8-15 t2 lead 16", run_helpers(8, lo, hi, 16, false, n_tok, n_cold, w, a_packed));
      }
    return 0;
  }
  const Named variants[] = {
      {"2x2 (engine order)", {true, 1024, 0, 0, 0, false}},
      {"2x1 double-buffered", {true, 1024, 0, 4, 0, false}},
      {"1x2 double-buffered", {true, 1024, 0, 5, 0, false}},
      {"1x3, A double-buffered, chunk 512", {true, 512, 0, 6, 0, false}},
      {"1x3, A double-buffered, chunk 1024", {true, 1024, 0, 6, 0, false}},
  };
  // hot: one expert over and over (1 thread and all); cold: 64 experts from DRAM (all threads)
  for (int n_tok : {64, 256})
    for (int round = 0; round < 2; ++round)
      for (const Named& nv : variants) {
        for (int th : {1, max_threads}) {
          const double tops = run(nv.v, th, n_tok, 1, th == 1 ? 20 : 60, w, a_rows, a_packed);
          printf("%-32s %7d %4d %-5s %6.2f\n", nv.name, th, n_tok, "hot", tops);
        }
        const double tops = run(nv.v, max_threads, n_tok, n_cold, 1, w, a_rows, a_packed);
        printf("%-32s %7d %4d %-5s %6.2f  (%.1f GB/s of weights)\n", nv.name, max_threads, n_tok, "cold", tops,
               tops * 1e12 / (2.0 * n_tok) / 1e9);
        fflush(stdout);
      }
  return 0;
}
