// Q6_K-shaped experts (int8 codes in [-32, 31], one scale per 16 = d * sc with an int8 sub-scale sc and a d per 256)
// on AMX at ~16 tokens per call, as a DeepSeek-V3 layer at T = 512 hands them out: the engine's grouped two-set loop
// (csrc/kernels/amx/gemm.h; activations per 16, one fp32 epilogue per group of 16) against a digit-plane loop that
// never leaves int32 inside a super-block. Not part of the package: it decides whether a Q6_K-native layout is worth
// building (docs/experiments/2026-12-02-amx-grouped-epilogue.md).
//
// Digit planes: |sc| <= 128 is written in base 4 (4 digits 0..3) and its sign folded into the codes, so plane p holds
// the int8 codes sign(sc) * q * digit_p(|sc|) (|.| <= 96). Each plane is one tdpbssd product over K steps of 64 with
// activations quantized per 256, and the 4 planes' int32 sums combine as p0 + 4 p1 + 16 p2 + 64 p3 = sum of
// sc * q * x over the super-block, then one fp32 fma with d * x_scale. The planes are written per call (software
// pipelined one super-block ahead), since storing them would quadruple the bytes.
//
// Variants (16 threads, each streaming its own calls: 2 row blocks x K 7168, like a gate/up row-block pair):
//   engine        Gemm<Native>::int8 on the packed int8 g16 lines (what hetmoe runs)
//   planes        the digit-plane loop
//   planes-gen    planes written, no tiles and no epilogue
//   planes-tiles  tiles and epilogue on one call's planes, none written (the compute side alone)
// It also prints the relative error of engine and planes against fp64 on one call.
//
// Build and run on the AMX machine from the repo root:
//   fl="-std=c++17 -O3 -DNDEBUG -fno-math-errno -ffp-contract=off -mamx-tile -mamx-int8 -mamx-bf16 -mavx2 -mfma -mf16c
//       -mbmi2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -pthread"
//   g++ $fl -Icsrc -o /tmp/q6k_planes bench/device/amx_q6k_planes.cpp csrc/runtime/cpu_features.cpp
//   /tmp/q6k_planes THREADS CALLS TOKENS REPEATS        (e.g. 16 512 16 3)
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "kernels/amx/kernels.cpp"  // the native tile policy and Gemm<Native>

using namespace hetmoe;
using namespace hetmoe::amx;

namespace {

constexpr int K = 7168, NG = K / 16, NS = K / 256;
constexpr size_t kBlockBytes = (size_t)K / 4 * kLineBytes;
constexpr size_t kPlane = 2 * 4096;       // one plane of one super-block: block 0, then block 1 (64 lines each)
constexpr size_t kPlaneSet = 4 * kPlane;  // the 4 planes of one super-block
using S = NativeT<true>;                  // signed B bytes

uint64_t rng(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

void* amalloc(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, n)) std::abort();
  return p;
}

struct Call {
  uint8_t* lines[2];  // int8 layout lines, q + 128
  float* scales[2];   // [NG][16] d * sc (the engine's int8 g16 scales)
  int8_t* sc[2];      // [NG][16]
  float* d[2];        // [NS][16]
};

// The 4 planes of super-block `sb` of one block (64 lines at `lines`, sub-scales `sc` [16 groups][16 rows]).
void make_planes(const uint8_t* lines, const int8_t* sc, uint8_t* out) {
  const __m512i flip = _mm512_set1_epi8((char)0x80), one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2),
                zero = _mm512_setzero_si512();
  for (int g = 0; g < 16; ++g) {
    const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * 16)));
    const __mmask64 neg = _mm512_movepi8_mask(_mm512_movm_epi32(_mm512_movepi32_mask(s)));
    const __m512i a = _mm512_abs_epi32(s);
    __mmask64 k1[4], k2[4];  // rows whose digit p has bit 0 / bit 1 set, as byte masks (4 bytes a row)
    for (int p = 0; p < 4; ++p) {
      const __m512i dg = _mm512_srli_epi32(a, 2 * p);
      k1[p] = _mm512_movepi8_mask(_mm512_movm_epi32(_mm512_test_epi32_mask(dg, one)));
      k2[p] = _mm512_movepi8_mask(_mm512_movm_epi32(_mm512_test_epi32_mask(dg, two)));
    }
    for (int l = 0; l < 4; ++l) {
      const size_t off = (size_t)(g * 4 + l) * kLineBytes;
      __m512i q = _mm512_xor_si512(_mm512_load_si512(lines + off), flip);  // q + 128 -> q
      q = _mm512_mask_sub_epi8(q, neg, zero, q);
      const __m512i q2 = _mm512_add_epi8(q, q);
      for (int p = 0; p < 4; ++p) {
        __m512i t = _mm512_maskz_mov_epi8(k1[p], q);
        t = _mm512_mask_add_epi8(t, k2[p], t, q2);
        _mm512_store_si512(out + p * kPlane + off, t);
      }
    }
  }
}

// The 4 planes' int32 sums of super-block sb for tokens m0..m0+15: cp[p] = [16][32].
void plane_tiles(const AmxPanel& x, int m0, int sb, const uint8_t* planes, int32_t (*cp)[16 * 32]) {
  for (int pp = 0; pp < 4; pp += 2) {
    S::zero_c<0, 0>(), S::zero_c<0, 1>(), S::zero_c<1, 0>(), S::zero_c<1, 1>();
    for (int s = 0; s < 4; ++s) {
      const uint8_t* a = x.at(m0, (size_t)sb * 256 + 64 * s);
      S::load_a<0>(a);
      S::load_a<1>(a);
      const uint8_t* p0 = planes + pp * kPlane + s * 1024;
      const uint8_t* p1 = p0 + kPlane;
      S::load_b<0>(p0), S::dp_int8<0, 0>();
      S::load_b<1>(p0 + 4096), S::dp_int8<0, 1>();
      S::load_b<0>(p1), S::dp_int8<1, 0>();
      S::load_b<1>(p1 + 4096), S::dp_int8<1, 1>();
    }
    S::store_c<0, 0>(cp[pp], 128), S::store_c<0, 1>(cp[pp] + 16, 128);
    S::store_c<1, 0>(cp[pp + 1], 128), S::store_c<1, 1>(cp[pp + 1] + 16, 128);
  }
}

void plane_epilogue(const Call& c, const AmxPanel& x, int m0, int rows, int sb, int32_t (*cp)[16 * 32], float* out) {
  for (int t = 0; t < rows; ++t) {
    const __m512 xs = _mm512_set1_ps(x.scales(m0 + t)[sb]);
    for (int j = 0; j < 2; ++j) {
      const int o = t * 32 + 16 * j;
      __m512i acc = _mm512_load_si512(cp[0] + o);
      for (int p = 1; p < 4; ++p)
        acc = _mm512_add_epi32(acc, _mm512_sllv_epi32(_mm512_load_si512(cp[p] + o), _mm512_set1_epi32(2 * p)));
      const __m512 w = _mm512_mul_ps(_mm512_load_ps(c.d[j] + sb * 16), xs);
      float* op = out + (size_t)(m0 + t) * 32 + 16 * j;
      _mm512_store_ps(op, _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xffff, acc), w, _mm512_load_ps(op)));
    }
  }
}

enum class Mode { full, gen_only, tiles_only };

// One call, software pipelined: the planes of sb + 1 are written while the tiles read those of sb, and the epilogue
// of sb - 1 reads sums stored one step earlier.
void plane_call(const Call& c, const AmxPanel& x, int n_tok, float* out, uint8_t* planes, const Call* next, Mode mode) {
  alignas(64) static thread_local int32_t cp[2][4][4][16 * 32];  // [parity][token block (<= 4)][plane]
  std::memset(out, 0, sizeof(float) * 32 * n_tok);
  const int n_blk = (n_tok + 15) / 16;
  auto gen = [&](int sb) {
    for (int j = 0; j < 2; ++j) {
      make_planes(c.lines[j] + (size_t)sb * 4096, c.sc[j] + sb * 256, planes + (sb & 1) * kPlaneSet + j * 4096);
      const uint8_t* nl = sb + 1 < NS ? c.lines[j] + (size_t)(sb + 1) * 4096 : (next ? next->lines[j] : nullptr);
      if (nl)
        for (int l = 0; l < 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(nl) + 64 * l, _MM_HINT_T2);
    }
  };
  gen(0);
  for (int sb = 0; sb < NS; ++sb) {
    if (sb + 1 < NS && mode != Mode::tiles_only) gen(sb + 1);
    if (mode == Mode::gen_only) continue;
    const uint8_t* pl = planes + (mode == Mode::tiles_only ? 0 : (sb & 1) * kPlaneSet);
    for (int b = 0; b < n_blk; ++b) plane_tiles(x, 16 * b, sb, pl, cp[sb & 1][b]);
    if (sb > 0)
      for (int b = 0; b < n_blk; ++b)
        plane_epilogue(c, x, 16 * b, std::min(16, n_tok - 16 * b), sb - 1, cp[(sb - 1) & 1][b], out);
  }
  if (mode != Mode::gen_only)
    for (int b = 0; b < n_blk; ++b)
      plane_epilogue(c, x, 16 * b, std::min(16, n_tok - 16 * b), NS - 1, cp[(NS - 1) & 1][b], out);
}

// Activation panel of n_tok rows quantized per `grp` (int8, qmax 127).
AmxPanel panel_of(const std::vector<float>& xf, int n_tok, int grp) {
  const MatrixShape s = MatrixShape::make(WeightFormat::int8, 32, K, 16);
  const ActLayout a = ActLayout::make(s, true, grp);
  const int rows = (n_tok + 15) / 16 * 16;
  auto* tiles = static_cast<uint8_t*>(amalloc(AmxPanel::tile_bytes(a, rows)));
  auto* meta = static_cast<uint8_t*>(amalloc(AmxPanel::meta_bytes_of(a, rows)));
  std::memset(tiles, 0, AmxPanel::tile_bytes(a, rows));
  std::memset(meta, 0, AmxPanel::meta_bytes_of(a, rows));
  AmxPanel p = AmxPanel::make(a, tiles, meta);
  for (int t = 0; t < n_tok; ++t)
    for (int g = 0; g < K / grp; ++g) {
      float amax = 0;
      for (int k = 0; k < grp; ++k) amax = std::max(amax, std::fabs(xf[(size_t)t * K + g * grp + k]));
      const float sc = amax / 127.f, inv = sc > 0 ? 1.f / sc : 0.f;
      int32_t sum = 0;
      for (int k = 0; k < grp; ++k) {
        const int q = (int)std::nearbyint(xf[(size_t)t * K + g * grp + k] * inv);
        *reinterpret_cast<int8_t*>(p.at(t, (size_t)g * grp + k)) = (int8_t)q;
        sum += q;
      }
      const_cast<float*>(p.scales(t))[g] = sc;
      const_cast<int32_t*>(p.sums(t))[g] = sum;
    }
  return p;
}

Call random_call(uint64_t& s) {
  Call c;
  for (int j = 0; j < 2; ++j) {
    c.lines[j] = static_cast<uint8_t*>(amalloc(kBlockBytes));
    c.scales[j] = static_cast<float*>(amalloc(NG * 64));
    c.sc[j] = static_cast<int8_t*>(amalloc(NG * 16));
    c.d[j] = static_cast<float*>(amalloc(NS * 64));
    auto* w = reinterpret_cast<uint64_t*>(c.lines[j]);
    for (size_t b = 0; b < kBlockBytes / 8; ++b) {  // codes q in [-32, 31], stored q + 128
      const uint64_t r = rng(s);
      uint64_t v = 0;
      for (int e = 0; e < 8; ++e) v |= (((r >> (6 * e)) & 63) + 96) << (8 * e);
      w[b] = v;
    }
    for (int i = 0; i < NS * 16; ++i) c.d[j][i] = 1e-3f * (1 + (rng(s) % 1000) / 1000.f);
    for (int g = 0; g < NG; ++g)
      for (int r = 0; r < 16; ++r) {
        const auto v = (int8_t)(rng(s) & 0xff);
        c.sc[j][g * 16 + r] = v;
        c.scales[j][g * 16 + r] = c.d[j][(g / 16) * 16 + r] * (float)v;
      }
  }
  return c;
}

void engine_call(const Call& c, const Call* next, const AmxPanel& x, const ActLayout& a, int n_tok, float* out) {
  RowBlock w[2], nx[2];
  for (int j = 0; j < 2; ++j) {
    w[j] = {c.lines[j], c.scales[j], K, 16, nullptr};
    if (next) nx[j] = {next->lines[j], next->scales[j], K, 16, nullptr};
  }
  Gemm<Native>::int8(w, 2, next ? nx : nullptr, 2, x, a, n_tok, out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s THREADS CALLS TOKENS REPEATS\n", argv[0]);
    return 2;
  }
  const int n_thr = std::atoi(argv[1]), n_calls = std::atoi(argv[2]), n_tok = std::atoi(argv[3]),
            reps = std::atoi(argv[4]);
  if (n_thr < 1 || n_calls < 1 || n_tok < 1 || n_tok > 64 || reps < 1) {
    std::fprintf(stderr, "THREADS, CALLS, REPEATS >= 1 and 1 <= TOKENS <= 64\n");
    return 2;
  }
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
    std::perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
    return 1;
  }
  std::vector<std::vector<Call>> calls(n_thr);
  {
    std::vector<std::thread> th;
    for (int i = 0; i < n_thr; ++i)
      th.emplace_back([&, i] {
        uint64_t s = 0x9E3779B97F4A7C15ull * (i + 1);
        for (int c = 0; c < n_calls; ++c) calls[i].push_back(random_call(s));
      });
    for (auto& t : th) t.join();
  }
  std::vector<float> xf((size_t)n_tok * K);
  uint64_t s = 42;
  for (auto& v : xf) v = (rng(s) % 20001) / 10000.f - 1.f;
  const MatrixShape shape = MatrixShape::make(WeightFormat::int8, 32, K, 16);
  const ActLayout a16 = ActLayout::make(shape, true, 16);
  const AmxPanel x16 = panel_of(xf, n_tok, 16), x256 = panel_of(xf, n_tok, 256);

  {  // error of one call against fp64 on the dequantized weights
    const Call& c = calls[0][0];
    auto* o1 = static_cast<float*>(amalloc(64 * 32 * 4));
    auto* o2 = static_cast<float*>(amalloc(64 * 32 * 4));
    auto* planes = static_cast<uint8_t*>(amalloc(2 * kPlaneSet));
    engine_call(c, nullptr, x16, a16, n_tok, o1);
    S::configure(64, 16);
    plane_call(c, x256, n_tok, o2, planes, nullptr, Mode::full);
    S::release();
    double e1 = 0, e2 = 0, nr = 0;
    for (int t = 0; t < n_tok; ++t)
      for (int j = 0; j < 2; ++j)
        for (int r = 0; r < 16; ++r) {
          double ref = 0;
          for (int k = 0; k < K; ++k) {
            const int q = (int)c.lines[j][(size_t)(k / 4) * 64 + r * 4 + k % 4] - 128;
            ref += (double)c.scales[j][(k / 16) * 16 + r] * q * xf[(size_t)t * K + k];
          }
          const double v1 = o1[t * 32 + 16 * j + r], v2 = o2[t * 32 + 16 * j + r];
          e1 += (v1 - ref) * (v1 - ref), e2 += (v2 - ref) * (v2 - ref), nr += ref * ref;
        }
    std::printf("relative rms error against fp64: engine (x per 16) %.3e, planes (x per 256) %.3e\n",
                std::sqrt(e1 / nr), std::sqrt(e2 / nr));
  }

  const char* names[] = {"engine", "planes", "planes-gen", "planes-tiles"};
  for (int variant = 0; variant < 4; ++variant)
    for (int rep = 0; rep < reps; ++rep) {
      std::atomic<int> ready{0};
      std::atomic<bool> go{false};
      std::vector<std::thread> th;
      for (int i = 0; i < n_thr; ++i)
        th.emplace_back([&, i] {
          cpu_set_t cs;
          CPU_ZERO(&cs);
          CPU_SET(i, &cs);
          pthread_setaffinity_np(pthread_self(), sizeof(cs), &cs);
          auto* out = static_cast<float*>(amalloc(64 * 32 * 4));
          auto* planes = static_cast<uint8_t*>(amalloc(2 * kPlaneSet));
          const auto& cl = calls[i];
          ++ready;
          while (!go) {
          }
          if (variant == 0) {
            for (int c = 0; c < n_calls; ++c)
              engine_call(cl[c], c + 1 < n_calls ? &cl[c + 1] : nullptr, x16, a16, n_tok, out);
          } else {
            const Mode m = variant == 1 ? Mode::full : variant == 2 ? Mode::gen_only : Mode::tiles_only;
            S::configure(64, 16);
            for (int c = 0; c < n_calls; ++c)
              plane_call(cl[c], x256, n_tok, out, planes, c + 1 < n_calls ? &cl[c + 1] : nullptr, m);
            S::release();
          }
        });
      while (ready < n_thr) {
      }
      const auto t0 = std::chrono::steady_clock::now();
      go = true;
      for (auto& t : th) t.join();
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double flops = 2.0 * n_tok * 32 * K * n_calls * n_thr;
      std::printf("%-12s tokens %2d repeat %d: %7.1f ms, %.2f TFLOPS\n", names[variant], n_tok, rep, wall * 1e3,
                  flops / wall / 1e12);
    }
  return 0;
}
