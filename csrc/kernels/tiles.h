// Token tiling shared by the SIMD micro-kernels: a kernel's Tile<NT>::run computes one row block for NT
// tokens (weights loaded once per line, used NT times); run_tiles covers n_tok tokens with full tiles of
// kMax and one smaller tile for the rest.
//
// Each ISA file instantiates these with Tile types from its own anonymous namespace, so every instantiation
// is local to the file compiled with that ISA's flags (no cross-ISA ODR merging).
#pragma once
#include <cstdint>

#include "formats/layout.h"

namespace hetmoe {
namespace tiles {

template <int N, template <int> class Tile>
inline void run_tail(int rest, const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, float* out) {
  if constexpr (N > 0) {
    if (rest == N) return Tile<N>::run(w, rows, a, out);
    run_tail<N - 1, Tile>(rest, w, rows, a, out);
  }
}

template <int kMax, template <int> class Tile>
inline void run_tiles(const RowBlock& w, const uint8_t* const* rows, const ActLayout& a, int n_tok, float* out) {
  int t = 0;
  for (; t + kMax <= n_tok; t += kMax) Tile<kMax>::run(w, rows + t, a, out + t * kRowsPerBlock);
  run_tail<kMax - 1, Tile>(n_tok - t, w, rows + t, a, out + t * kRowsPerBlock);
}

}  // namespace tiles
}  // namespace hetmoe
