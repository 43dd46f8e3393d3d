// The AMX GEMM's loop nest and fp32 epilogue (csrc/kernels/amx/gemm.h) without the tile instructions: Gemm over a
// tile wrapper whose products and loads do nothing and whose store_c copies fixed int32 sums, so the time is the
// epilogue's, on any x86 machine. It shows the scalar symmetric epilogue of 7a2f8b6 (GCC 12 unrolled it into 16
// scalar fmas per token and row block: ~3x slower AMX prefill). It times gemm.h's plain C++ epilogue (the emulated
// policy's; the native policy's hand-vectorized one is in csrc/kernels/amx/kernels.cpp). Not part of the package.
// Build and run (on AVX-512 machines add -mavx512f -mavx512bw -mavx512vl, as csrc/kernels/amx/kernels.cpp is built):
//   fl="-O3 -std=gnu++17 -fno-math-errno -ffp-contract=off -mavx2 -mfma"
//   g++ $fl -Icsrc -o /tmp/amx_epi bench/device/amx_epilogue.cpp
//   for f in "int4 64" "int8 128" "int4 64 affine" "int8 128 affine"; do /tmp/amx_epi $f; done
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/amx/gemm.h"

using namespace hetmoe;

namespace {

alignas(64) int32_t g_sums[256];

struct NullTiles : amx::PlainEpilogue {  // the plain C++ epilogue
  static constexpr bool kSignedB = false;
  static void configure(int, int) {}
  static void release() {}
  template <int I, int J>
  static void zero_c() {}
  template <int I>
  static void load_a(const void*) {}
  template <int J>
  static void load_b(const void*) {}
  template <int I, int J>
  static void load_c(const void*, size_t) {}
  template <int I, int J>
  static void dp_bf16() {}
  template <int I, int J>
  static void dp_int8() {}
  template <int I, int J>
  static void store_c(void* p, size_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, g_sums + 16 * r, 64);
  }
  static void unpack_int4(const uint8_t*, int, uint8_t*) {}
  static void prefetch_l2(const void*) {}
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s int4|int8 GROUP [affine]\n", argv[0]);
    return 2;
  }
  const bool int8 = std::string(argv[1]) == "int8", affine = argc > 3 && std::string(argv[3]) == "affine";
  const int group = std::atoi(argv[2]), K = 2048, n_tok = 128;  // qwen3-30b-a3b gate/up, 128 tokens per expert
  for (int i = 0; i < 256; ++i) g_sums[i] = (i * 37) % 101 - 50;
  const MatrixShape s = MatrixShape::make(int8 ? WeightFormat::int8 : WeightFormat::int4, 32, K, group,
                                          affine ? Scaling::affine : Scaling::symmetric);
  const ActLayout a = ActLayout::make(s, true);
  std::vector<uint8_t> data(2 * s.block_bytes());
  std::vector<float> scales(2 * s.block_scales(), 0.01f);
  std::vector<uint8_t> tiles(AmxPanel::tile_bytes(a, n_tok)), meta(AmxPanel::meta_bytes_of(a, n_tok));
  const AmxPanel x = AmxPanel::make(a, tiles.data(), meta.data());
  for (int t = 0; t < n_tok; ++t)
    for (int g = 0; g < s.n_groups(); ++g) {
      const_cast<float*>(x.scales(t))[g] = 0.02f;
      const_cast<int32_t*>(x.sums(t))[g] = t + g;
    }
  RowBlock w[2];
  for (int j = 0; j < 2; ++j) w[j] = RowBlock::at(s, data.data() + j * s.block_bytes(), &scales[j * s.block_scales()]);
  std::vector<float> out((size_t)n_tok * amx::kOutStride);
  auto call = [&] {
    (int8 ? amx::Gemm<NullTiles>::int8 : amx::Gemm<NullTiles>::int4)(w, 2, nullptr, 0, x, a, n_tok, out.data());
  };
  for (int i = 0; i < 50; ++i) call();
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 200; ++i) call();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 200;
    best = us < best ? us : best;
  }
  double sum = 0;
  for (float v : out) sum += v;
  std::printf("%s g%d%s: %.1f us per call (2 row blocks x %d tokens x K %d, best of 7), checksum %.6g\n", argv[1],
              group, affine ? " affine" : "", best, n_tok, K, sum);
}
