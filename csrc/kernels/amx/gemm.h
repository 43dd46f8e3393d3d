// The AMX GEMM of one expert: many tokens x one or two packed row blocks (formats/layout.h), written once
// against a tiny tile-op wrapper `Tiles` and compiled twice: kernels.cpp with the real tile instructions,
// emulated.cpp with a plain C++ emulation of exactly those instructions (so the loop and layout logic is tested
// on machines without AMX). Include it only from those two files: everything here is file-local.
//
// Tiles (static functions; tile numbers are fixed by the wrapper):
//   configure(a_colsb, b_rows)  C tiles 0..3 = 16 x 64 B, A tiles 4, 5 = 16 x a_colsb, B tiles 6, 7 = b_rows x 64 B
//   release()                   tilerelease
//   zero_c<I, J>()              C(I, J) = 0                       (C(I, J) is tile 2 I + J)
//   load_a<I>(p)                A(I) = 16 rows of a_colsb bytes at p + m * 64 (one panel tile, layout.h)
//   load_b<J>(p)                B(J) = b_rows rows of 64 B, contiguous at p
//   dp_bf16<I, J>()             C(I, J) += A(I) . B(J)    tdpbf16ps: fp32 += bf16 pair products
//   dp_int8<I, J>()             C(I, J) += A(I) . B(J)    int32 += signed A bytes x B bytes: unsigned (tdpbsud), or
//                                                          signed (tdpbssd) in a policy with kSignedB
//   kSignedB                    whether B bytes are signed: then unpack_int4 writes nibble - 8 (symmetric int4: no
//                               offset left to undo in the epilogue; int4_gemm below picks the policy per call)
//   store_c<I, J>(p, stride)    16 rows of 64 B to p + m * stride
//   load_c<I, J>(p, stride)     C(I, J) = 16 rows of 64 B from p + m * stride
//   unpack_int4(src, n, dst)    n int4 lines -> 2n int8 lines (low nibbles, then high nibbles, per line; minus 8
//                               with kSignedB)
//   unpack_lut4(src, n, cb, dst)  n lut4 lines -> 2n int8 lines as unpack_int4, each nibble i as its codebook value
//                               cb[i] (signed: kSignedB policies only)
//   unpack_fp8(src, n, dst)     n fp8 lines -> 2n bf16 lines (k 4j, 4j + 1, then 4j + 2, 4j + 3), each code as the
//                               bf16 of q * 2^-8 (exact)
//   prefetch_l2(p)              prefetcht2: the line at p into L2
//   epilogue_rows<kAffine, NB>(...)  the fp32 epilogue of one group (PlainEpilogue below, which the emulated policy
//                               derives from; the native one writes the same operations with intrinsics)
//
// Shapes: a tile step covers 32 tokens (A(0), A(1): 16 each) x 32 outputs (B(0), B(1): 16 rows each) x one K
// step (bf16: 32 k = 16 B rows of bf16 pairs; int8: min(group, 64) k = 16 or 8 B rows of 4 bytes). A B tile is
// a run of consecutive lines of one packed row block: the weights are read in place, never repacked (int4 and lut4
// are first expanded to int8 lines in a per-thread slab, since tiles multiply bytes, not nibbles). An A tile is a
// piece of the activation panel (formats/layout.h AmxPanel): 16 rows x 64 bytes, 1 KB contiguous.
//
// Loop nest: the caller hands one (expert, row-block pair, token range) task; here K is cut in chunks whose
// weights (32 KB) are read by every token block from L1/L2, while the tokens' activation tiles of the chunk stay
// in L2. Every tile step of a chunk also prefetches its share of the next chunk's weights (or of the first chunk
// of the caller's next call) into L2, so each thread streams DRAM evenly while all its token blocks compute
// (faster than prefetching in the first token block only: BENCHMARKS.md#amx-spread-prefetch). C accumulates in
// tiles across a chunk (bf16; `out` holds it
// between chunks) or across one scale group (int8/int4/lut4: then the int32 sums go through the same fp32 epilogue
// as the other kernels: acc = fma(float(isum - offset * xsum), w_scale * x_scale, acc), affine weights the
// two fmas of formats/layout.h; scales stored narrower than fp32 are widened first, exactly).
//
// `out` has round_up(n_tok, 32) rows of 32 floats (rows past n_tok are scratch).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "formats/activation.h"
#include "formats/grid.h"
#include "formats/layout.h"

namespace hetmoe {
namespace amx {
namespace {

constexpr int kTokBlock = 32;     // tokens per tile step (two A tiles)
constexpr int kOutStride = 32;    // floats per output row: [n_tok][32]
constexpr int kChunkBf16 = 512;   // K per chunk: 2 row blocks x 16 rows x 512 x 2 B = 32 KB of weights
constexpr int kChunkInt8 = 1024;  // same bytes for int8 lines (a multiple of every group size)

// Grouped int8 weights: calls of up to this many tokens take the two-set 16-token loop (grouped_as), longer ones the
// 32-token loop with one C set (4 tiles per step: its A and B tiles serve twice as many products). The default of
// Gemm's kTwoSetMax; tests also build it with 0 and past every call to compare the loops' bits (amx::GemmVariant; the
// A/B timings of the cuts are in BENCHMARKS.md#amx-prefill). int4 weights take the two-set loop at every length: with
// the 32-token loop a 5120 x 2048 int4 g64 linear ran at 1.4 TFLOPS at T = 64..512 on the GPU machine's Xeon, with
// the two-set loop at 3.5-4.1 (int8: 5.8 and 4.0 at T = 512; BENCHMARKS.md#amx-prefill).
constexpr int kTwoSetMaxTokens = 32;

// A bit-plane block's codes (formats/layout.h) as kp / 4 int8 lines of the stored codes u, as plain C++ for the native
// and the emulated GEMM alike (the same bytes; each byte line one shift and mask per plane, which compilers vectorize).
inline void unpack_planes(const Planes& p, const uint8_t* src, int kp, uint8_t* dst) {
  const int lo_mask = (1 << p.lo_bits) - 1, hi_mask = (1 << p.hi_bits) - 1;
  for (int q = 0; q < kp / 16; ++q) {
    const uint8_t* unit = src + p.unit_offset(q);
    const uint8_t* hi = unit + p.hi_line() * kLineBytes;
    for (int f = 0; f < 4; ++f) {
      const uint8_t* lo = unit + p.lo_line(q, f) * kLineBytes;
      const int ls = p.lo_shift(f), hs = p.hi_shift(q, f);
      uint8_t* d = dst + (size_t)(4 * q + f) * kLineBytes;
      if (p.hi_bits)
        for (int b = 0; b < kLineBytes; ++b)
          d[b] = (uint8_t)(((lo[b] >> ls) & lo_mask) | (((hi[b] >> hs) & hi_mask) << p.lo_bits));
      else
        for (int b = 0; b < kLineBytes; ++b) d[b] = (uint8_t)((lo[b] >> ls) & lo_mask);
    }
  }
}

// Per-thread buffer of the int4 expansion (grows, 64-byte aligned, never shrinks).
inline uint8_t* slab(size_t bytes) {
  struct Buf {
    uint8_t* p = nullptr;
    size_t n = 0;
    ~Buf() { std::free(p); }
  };
  static thread_local Buf buf;
  if (bytes > buf.n) {
    std::free(buf.p);
    buf.p = nullptr;
    buf.n = 0;
    void* p = nullptr;
    if (posix_memalign(&p, 64, bytes) != 0) throw std::bad_alloc();
    buf.p = static_cast<uint8_t*>(p);
    buf.n = bytes;
  }
  return buf.p;
}

// The weights of the chunk after the one computing (the rest of this call's row blocks, or the first chunk of the
// next call's): `lines` lines of 64 B at p[0] (and p[1] when n == 2). Every tile step of the current chunk
// prefetches its share into L2, so the DRAM stream runs while all token blocks compute, not only the first.
struct NextChunk {
  const uint8_t* p[2] = {nullptr, nullptr};
  int n = 0;
  int lines = 0;
};

// The scales (and mins) of the one or two row blocks of a call: w[j] is block j, whose scale set (and, affine, min
// set) of its scale type the epilogues read widened to fp32.
struct BlockScales {
  const RowBlock* w[2] = {nullptr, nullptr};

  static BlockScales of(const RowBlock* blocks, int n_blk) {
    BlockScales b;
    for (int j = 0; j < n_blk && j < 2; ++j) b.w[j] = &blocks[j];
    return b;
  }
  bool affine() const { return w[0]->mins != nullptr; }
  // Block j's 16 scales / mins of group g as fp32: in place when stored as fp32, else widened into buf (exact).
  const float* widened(int j, int g, float* buf) const { return w[j]->widened(w[j]->scales, g, buf); }
  const float* widened_mins(int j, int g, float* buf) const { return w[j]->widened(w[j]->mins, g, buf); }
};

// The fp32 epilogue of one group for 16 outputs o (formats/layout.h): symmetric o = fma(float(isum - offset * xsum),
// w_scale * x_scale, o); affine (offset 0) the same, then o = fma(float(-xsum), w_min * x_scale, o). A function of its
// own with restrict pointers, instantiated per scaling, so each form is one 16-lane loop the compiler vectorizes
// without alias checks: with the affine branch inline in the group loop, GCC 12 emitted the symmetric form as 16
// scalar steps, which made the AMX prefill of every int8/int4 expert ~3x slower.
template <bool kAffine>
inline void epilogue16(float* __restrict o, const int32_t* __restrict isum, const float* __restrict ws,
                       const float* __restrict wm, float xs, int32_t xsum, int32_t offset) {
  if constexpr (kAffine) {
    for (int r = 0; r < 16; ++r) {
      o[r] = std::fma((float)isum[r], ws[r] * xs, o[r]);
      o[r] = std::fma((float)(-xsum), wm[r] * xs, o[r]);
    }
  } else {
    const int32_t xoff = offset * xsum;
    for (int r = 0; r < 16; ++r) o[r] = std::fma((float)(isum[r] - xoff), ws[r] * xs, o[r]);
  }
}

// fp8's epilogue of one group for 16 outputs o: o = fma(c, ws, o) (ws: the scales times 256; restrict pointers, so
// the compiler makes it one vector step, as epilogue16).
inline void fp8_epilogue16(float* __restrict o, const float* __restrict c, const float* __restrict ws) {
  for (int r = 0; r < 16; ++r) o[r] = std::fma(c[r], ws[r], o[r]);
}

// The epilogue of one group g for panel rows m0 .. m0 + rows and NB blocks of 16 outputs, as plain C++: a tile
// policy without its own (the emulated one) derives from this; the native one writes the same operations with
// AVX-512 intrinsics. out and c point at row m0's outputs and sums (rows kOutStride apart); ws[j] / wm[j]: block j's
// 16 scales / mins of the group; offset: the weights' unsigned offset (0 for signed B bytes and affine blocks).
struct PlainEpilogue {
  template <bool kAffine, int NB>
  static void epilogue_rows(float* out, const int32_t* c, const float* const* ws, const float* const* wm,
                            const AmxPanel& x, int m0, int rows, int g, int32_t offset) {
    for (int t = 0; t < rows; ++t) {
      const float xs = x.scales(m0 + t)[g];
      const int32_t xsum = x.sums(m0 + t)[g];
      for (int j = 0; j < NB; ++j)
        epilogue16<kAffine>(out + (size_t)t * kOutStride + 16 * j, c + t * kOutStride + 16 * j, ws[j],
                            kAffine ? wm[j] : nullptr, xs, xsum, offset);
    }
  }
};

template <class Tiles, int kTwoSetMax = kTwoSetMaxTokens>
struct Gemm {
  // Part `part` of n_parts of the next chunk into L2.
  static void prefetch_share(const NextChunk& nx, int part, int n_parts) {
    if (nx.n == 0) return;  // (no division per tile step when there is nothing to fetch)
    const int per = (nx.lines + n_parts - 1) / n_parts, l0 = part * per;
    const int l1 = l0 + per < nx.lines ? l0 + per : nx.lines;
    for (int j = 0; j < nx.n; ++j)
      for (int l = l0; l < l1; ++l) Tiles::prefetch_l2(nx.p[j] + (size_t)l * kLineBytes);
  }

  // Part i of n of `s`'s lines.
  static NextChunk slice(const NextChunk& s, int i, int n) {
    NextChunk out;
    const int per = (s.lines + n - 1) / n, l0 = i * per, l1 = l0 + per < s.lines ? l0 + per : s.lines;
    if (s.n == 0 || l1 <= l0) return out;
    for (int j = 0; j < s.n; ++j) out.p[j] = s.p[j] + (size_t)l0 * kLineBytes;
    out.n = s.n;
    out.lines = l1 - l0;
    return out;
  }

  // The chunk after [k0, k1) of rows `lines` (kPerLine k per line; kp padded K; chunk: K per chunk), or the
  // first chunk of `next` (n_next blocks) after the last one.
  static NextChunk next_chunk(const uint8_t* const* lines, int n_blk, const RowBlock* next, int n_next, int k1, int kp,
                              int chunk, int k_per_line) {
    NextChunk nx;
    if (k1 < kp) {
      for (int j = 0; j < n_blk; ++j) nx.p[j] = lines[j] + (size_t)(k1 / k_per_line) * kLineBytes;
      nx.n = n_blk;
      nx.lines = ((k1 + chunk < kp ? k1 + chunk : kp) - k1) / k_per_line;
    } else if (next) {
      for (int j = 0; j < n_next; ++j) nx.p[j] = next[j].data;
      nx.n = n_next;
      nx.lines = (chunk < kp ? chunk : kp) / k_per_line;
    }
    return nx;
  }

  template <bool kBf16, int I, int J>
  static void dp() {
    if constexpr (kBf16)
      Tiles::template dp_bf16<I, J>();
    else
      Tiles::template dp_int8<I, J>();
  }

  // One K step of the NA x NB tile block: A tiles at a0, a1 (panel tiles), B tiles at b0, b1:
  // C(i, j) += A(i) . B(j).
  template <bool kBf16, int NA, int NB>
  static void tile_step(const uint8_t* a0, const uint8_t* a1, const uint8_t* b0, const uint8_t* b1) {
    Tiles::template load_a<0>(a0);
    Tiles::template load_b<0>(b0);
    dp<kBf16, 0, 0>();
    if constexpr (NB > 1) {
      Tiles::template load_b<1>(b1);
      dp<kBf16, 0, 1>();
    }
    if constexpr (NA > 1) {
      Tiles::template load_a<1>(a1);
      dp<kBf16, 1, 0>();
      if constexpr (NB > 1) dp<kBf16, 1, 1>();
    }
  }

  // ---- One K chunk [k0, k1) of a 32-token block, C kept in `c` ([32][kOutStride] fp32 or int32) between chunks:
  // bf16 weights x bf16 activations (fp32 sums, K step 32), or int8 lines x int8 activations summed over all of K
  // (int32, K step 64: per-row scales, one group per row).
  template <bool kBf16, int NA, int NB>
  static void k_chunk(const uint8_t* const* lines, const AmxPanel& x, int m0, int k0, int k1, bool resume, void* c,
                      const NextChunk& nx, int part0, int n_parts) {
    constexpr int kStep = kBf16 ? 32 : 64, kPerLine = kBf16 ? 2 : 4, kElem = kBf16 ? 2 : 1;
    const size_t cs = kOutStride * 4;
    uint8_t* cb = static_cast<uint8_t*>(c);
    if (resume) {
      Tiles::template load_c<0, 0>(cb, cs);
      if constexpr (NB > 1) Tiles::template load_c<0, 1>(cb + 64, cs);
      if constexpr (NA > 1) Tiles::template load_c<1, 0>(cb + 16 * cs, cs);
      if constexpr (NA > 1 && NB > 1) Tiles::template load_c<1, 1>(cb + 16 * cs + 64, cs);
    } else {
      Tiles::template zero_c<0, 0>();
      if constexpr (NB > 1) Tiles::template zero_c<0, 1>();
      if constexpr (NA > 1) Tiles::template zero_c<1, 0>();
      if constexpr (NA > 1 && NB > 1) Tiles::template zero_c<1, 1>();
    }
    for (int k = k0; k < k1; k += kStep) {
      const uint8_t* b0 = lines[0] + (size_t)(k / kPerLine) * kLineBytes;
      const uint8_t* b1 = NB > 1 ? lines[1] + (size_t)(k / kPerLine) * kLineBytes : nullptr;
      const uint8_t* a0 = x.at(m0, kElem * (size_t)k);
      prefetch_share(nx, part0 + (k - k0) / kStep, n_parts);
      tile_step<kBf16, NA, NB>(a0, a0 + x.block_bytes, b0, b1);
    }
    Tiles::template store_c<0, 0>(cb, cs);
    if constexpr (NB > 1) Tiles::template store_c<0, 1>(cb + 64, cs);
    if constexpr (NA > 1) Tiles::template store_c<1, 0>(cb + 16 * cs, cs);
    if constexpr (NA > 1 && NB > 1) Tiles::template store_c<1, 1>(cb + 16 * cs + 64, cs);
  }

  // K is walked in chunks (outer) and token blocks (inner): the chunk's weights (32 KB, L1), prefetched into L2
  // during the previous chunk, are reused by every token block, and the tokens' activations of one chunk stay in
  // L2 while the chunk's row blocks stream. C lives in `c_out` ([n_tok][kOutStride] 4-byte sums) between chunks.
  // Without `prefetch`, `spread` (the next call's packed int4 lines) is prefetched instead, cut evenly over the chunks.
  template <bool kBf16>
  static void chunked(const uint8_t* const* lines, int n_blk, const RowBlock* next, int n_next, int kp,
                      const AmxPanel& x, int n_tok, void* c_out, bool prefetch, const NextChunk& spread = {}) {
    constexpr int kChunk = kBf16 ? kChunkBf16 : kChunkInt8, kStep = kBf16 ? 32 : 64, kPerLine = kBf16 ? 2 : 4;
    Tiles::configure(64, 16);
    const int n_tok_blocks = (n_tok + kTokBlock - 1) / kTokBlock, n_chunks = (kp + kChunk - 1) / kChunk;
    for (int k0 = 0; k0 < kp; k0 += kChunk) {
      const int k1 = k0 + kChunk < kp ? k0 + kChunk : kp;
      const NextChunk nx = prefetch ? next_chunk(lines, n_blk, next, n_next, k1, kp, kChunk, kPerLine)
                                    : slice(spread, k0 / kChunk, n_chunks);
      const int steps = (k1 - k0) / kStep, n_parts = n_tok_blocks * steps;
      for (int m0 = 0; m0 < n_tok; m0 += kTokBlock) {
        const int part0 = m0 / kTokBlock * steps;
        void* c = static_cast<uint8_t*>(c_out) + (size_t)m0 * kOutStride * 4;
        const bool resume = k0 > 0;
        if (n_tok - m0 > 16)
          n_blk > 1 ? k_chunk<kBf16, 2, 2>(lines, x, m0, k0, k1, resume, c, nx, part0, n_parts)
                    : k_chunk<kBf16, 2, 1>(lines, x, m0, k0, k1, resume, c, nx, part0, n_parts);
        else
          n_blk > 1 ? k_chunk<kBf16, 1, 2>(lines, x, m0, k0, k1, resume, c, nx, part0, n_parts)
                    : k_chunk<kBf16, 1, 1>(lines, x, m0, k0, k1, resume, c, nx, part0, n_parts);
      }
    }
    Tiles::release();
  }

  // ---- bf16 weights x bf16 activations: fp32 accumulation in tiles across each K chunk, in `out` between them.
  static void bf16(const RowBlock* w, int n_blk, const RowBlock* next, int n_next, const AmxPanel& x, const ActLayout&,
                   int n_tok, float* out) {
    const uint8_t* lines[2] = {w[0].data, n_blk > 1 ? w[1].data : nullptr};
    chunked<true>(lines, n_blk, next, n_next, w[0].kp, x, n_tok, out, true);
  }

  // ---- int8 lines (unsigned, offset `offset`) x int8 activations: int32 per group in tiles, fp32 epilogue.
  // lines[j]: the int8-layout lines of block j (K per line 4); scales[j]: its [n_groups][16] scales.
  template <int NA, int NB>
  static void int8_group(const uint8_t* const* lines, const AmxPanel& x, int m0, int k0, int n_steps, int kstep,
                         int32_t* c, const NextChunk& nx, int part0, int n_parts) {
    if constexpr (NA > 0) Tiles::template zero_c<0, 0>();
    if constexpr (NB > 1) Tiles::template zero_c<0, 1>();
    if constexpr (NA > 1) Tiles::template zero_c<1, 0>();
    if constexpr (NA > 1 && NB > 1) Tiles::template zero_c<1, 1>();
    for (int s = 0; s < n_steps; ++s, k0 += kstep) {
      const uint8_t* b0 = lines[0] + (size_t)(k0 / 4) * kLineBytes;
      const uint8_t* b1 = NB > 1 ? lines[1] + (size_t)(k0 / 4) * kLineBytes : nullptr;
      const uint8_t* a0 = x.at(m0, k0);
      prefetch_share(nx, part0 + s, n_parts);
      tile_step<false, NA, NB>(a0, a0 + x.block_bytes, b0, b1);
    }
    const size_t cs = kOutStride * sizeof(int32_t);
    Tiles::template store_c<0, 0>(c, cs);
    if constexpr (NB > 1) Tiles::template store_c<0, 1>(c + 16, cs);
    if constexpr (NA > 1) Tiles::template store_c<1, 0>(c + 16 * kOutStride, cs);
    if constexpr (NA > 1 && NB > 1) Tiles::template store_c<1, 1>(c + 16 * kOutStride + 16, cs);
  }

  // ---- Grouped int8 lines (int8 and int4 weights with a scale per group of K): 16 tokens x the call's row blocks
  // per step, C in two sets of tiles that alternate by group (tiles 0, 1 for even groups with A in tile 4, tiles 2, 3
  // for odd ones with A in tile 5), so the fp32 epilogue of group g runs on the vector units while the tiles compute
  // group g + 1. Per output the groups are summed in the same order as in the row-block kernels (same bits).
  template <int P, int NB>
  static void group_tiles(const uint8_t* const* lines, const AmxPanel& x, int m0, int k0, int n_steps, int kstep,
                          int32_t* c) {
    Tiles::template zero_c<P, 0>();
    if constexpr (NB > 1) Tiles::template zero_c<P, 1>();
    for (int s = 0; s < n_steps; ++s, k0 += kstep) {
      Tiles::template load_a<P>(x.at(m0, k0));
      Tiles::template load_b<0>(lines[0] + (size_t)(k0 / 4) * kLineBytes);
      Tiles::template dp_int8<P, 0>();
      if constexpr (NB > 1) {
        Tiles::template load_b<1>(lines[1] + (size_t)(k0 / 4) * kLineBytes);
        Tiles::template dp_int8<P, 1>();
      }
    }
    const size_t cs = kOutStride * sizeof(int32_t);
    Tiles::template store_c<P, 0>(c, cs);
    if constexpr (NB > 1) Tiles::template store_c<P, 1>(c + 16, cs);
  }

  // The epilogue of group g for rows m0 .. m0 + rows of `out` from the int32 sums in c ([rows][kOutStride]), through
  // the policy's epilogue_rows (the native one is hand-vectorized: ~6 instructions per 16 outputs, against ~13 for
  // the compiler's loop, which let the tiles of the next group run under it; BENCHMARKS.md#amx-prefill).
  template <bool kAffine, int NB>
  static void group_epilogue(float* out, const int32_t* c, const BlockScales& sc, int wgroup, int group, int32_t offset,
                             const AmxPanel& x, int m0, int rows, int g) {
    const int wg = g * group / wgroup;
    alignas(64) float wide[2][kRowsPerBlock], wide_m[2][kRowsPerBlock];
    const float* ws[2] = {sc.widened(0, wg, wide[0]), NB > 1 ? sc.widened(1, wg, wide[1]) : nullptr};
    const float* wm[2] = {kAffine ? sc.widened_mins(0, wg, wide_m[0]) : nullptr,
                          kAffine && NB > 1 ? sc.widened_mins(1, wg, wide_m[1]) : nullptr};
    Tiles::template epilogue_rows<kAffine, NB>(out + (size_t)m0 * kOutStride, c, ws, wm, x, m0, rows, g,
                                               kAffine || Tiles::kSignedB ? 0 : offset);
  }

  // K in chunks (the chunk's weights stay in L1 for every token block), then 16-token blocks, then the chunk's
  // groups in the two-set pipeline. Prefetch as in `chunked`: the lines' next chunk, or a slice of `spread`.
  template <bool kAffine, int NB>
  static void grouped_as(const uint8_t* const* lines, const BlockScales& sc, const RowBlock* next, int n_next, int kp,
                         int wgroup, int32_t offset, const AmxPanel& x, int n_tok, float* out, bool prefetch, int group,
                         const NextChunk& spread) {
    const int kstep = group < 64 ? group : 64, n_steps = group / kstep;
    const int chunk = kChunkInt8 / group * group, per_chunk = chunk / group;
    const int n_blocks = (n_tok + 15) / 16, n_chunks = (kp + chunk - 1) / chunk;
    alignas(64) int32_t c[2][16 * kOutStride];
    std::memset(out, 0, sizeof(float) * kOutStride * (size_t)n_tok);
    Tiles::configure(kstep, kstep / 4);
    for (int kc = 0; kc < kp; kc += chunk) {
      const int kc_end = kc + chunk < kp ? kc + chunk : kp, g0 = kc / group, g1 = kc_end / group;
      const NextChunk nx =
          prefetch ? next_chunk(lines, NB, next, n_next, kc_end, kp, chunk, 4) : slice(spread, kc / chunk, n_chunks);
      for (int m0 = 0; m0 < n_tok; m0 += 16) {
        const int rows = n_tok - m0 < 16 ? n_tok - m0 : 16, part0 = (m0 / 16) * per_chunk;
        auto fetch = [&](int g) { prefetch_share(nx, part0 + g - g0, n_blocks * per_chunk); };
        auto epi = [&](const int32_t* cg, int g) {
          group_epilogue<kAffine, NB>(out, cg, sc, wgroup, group, offset, x, m0, rows, g);
        };
        for (int g = g0; g < g1; g += 2) {  // c[0] holds group g, c[1] group g + 1
          fetch(g);
          group_tiles<0, NB>(lines, x, m0, g * group, n_steps, kstep, c[0]);
          if (g > g0) epi(c[1], g - 1);
          if (g + 1 < g1) {
            fetch(g + 1);
            group_tiles<1, NB>(lines, x, m0, (g + 1) * group, n_steps, kstep, c[1]);
          }
          epi(c[0], g);
        }
        if ((g1 - g0) % 2 == 0) epi(c[1], g1 - 1);
      }
    }
    Tiles::release();
  }

  // The 32-token loop (grouped int8 calls of more than kTwoSetMax tokens): one C set of up to 2 x 2 tiles per group,
  // its epilogue after the tiles; A and B tiles serve twice the products of the two-set loop's 16-token steps.
  template <bool kAffine>
  static void grouped32(const uint8_t* const* lines, const BlockScales& sc, int n_blk, const RowBlock* next, int n_next,
                        int kp, int wgroup, int32_t offset, const AmxPanel& x, int n_tok, float* out, bool prefetch,
                        int group) {
    const int kstep = group < 64 ? group : 64, n_steps = group / kstep;
    const int chunk = kChunkInt8 / group * group;
    alignas(64) int32_t c[kTokBlock * kOutStride];
    std::memset(out, 0, sizeof(float) * kOutStride * (size_t)n_tok);
    Tiles::configure(kstep, kstep / 4);
    const int n_tok_blocks = (n_tok + kTokBlock - 1) / kTokBlock;
    for (int kc = 0; kc < kp; kc += chunk) {
      const int kc_end = kc + chunk < kp ? kc + chunk : kp;
      const NextChunk nx = prefetch ? next_chunk(lines, n_blk, next, n_next, kc_end, kp, chunk, 4) : NextChunk{};
      const int steps = (kc_end - kc) / kstep, n_parts = n_tok_blocks * steps;
      for (int m0 = 0; m0 < n_tok; m0 += kTokBlock) {
        const int rows = n_tok - m0 < kTokBlock ? n_tok - m0 : kTokBlock;
        for (int k0 = kc; k0 < kc_end; k0 += group) {
          const int g = k0 / group, part0 = (m0 / kTokBlock) * steps + (k0 - kc) / kstep;
          if (rows > 16)
            n_blk > 1 ? int8_group<2, 2>(lines, x, m0, k0, n_steps, kstep, c, nx, part0, n_parts)
                      : int8_group<2, 1>(lines, x, m0, k0, n_steps, kstep, c, nx, part0, n_parts);
          else
            n_blk > 1 ? int8_group<1, 2>(lines, x, m0, k0, n_steps, kstep, c, nx, part0, n_parts)
                      : int8_group<1, 1>(lines, x, m0, k0, n_steps, kstep, c, nx, part0, n_parts);
          n_blk > 1 ? group_epilogue<kAffine, 2>(out, c, sc, wgroup, group, offset, x, m0, rows, g)
                    : group_epilogue<kAffine, 1>(out, c, sc, wgroup, group, offset, x, m0, rows, g);
        }
      }
    }
    Tiles::release();
  }

  template <bool kAffine>
  static void grouped(const uint8_t* const* lines, const BlockScales& sc, int n_blk, const RowBlock* next, int n_next,
                      int kp, int wgroup, int32_t offset, const AmxPanel& x, int n_tok, float* out, bool prefetch,
                      int group, const NextChunk& spread) {
    n_blk > 1
        ? grouped_as<kAffine, 2>(lines, sc, next, n_next, kp, wgroup, offset, x, n_tok, out, prefetch, group, spread)
        : grouped_as<kAffine, 1>(lines, sc, next, n_next, kp, wgroup, offset, x, n_tok, out, prefetch, group, spread);
  }

  // Same chunk / token-block order as bf16; the fp32 accumulators are `out` itself (group order per output is
  // the same as in the row-block kernels, so int4 gives their exact bits). The loop's group is the activations'
  // (a.group); the weight scales are read per weight group `wgroup` (the same, except for per-row int8 weights,
  // whose scales repeat in every group of 128 while their h groups are longer).
  // Every block of one call has the same scaling (gate and up of one matrix shape, or row blocks of down), so
  // sc.affine() picks the instantiation.
  // `two_set`: grouped calls take the two-set loop at any length (int4: kTwoSetMaxTokens above).
  static void int8_lines(const uint8_t* const* lines, const BlockScales& sc, int n_blk, const RowBlock* next,
                         int n_next, int kp, int wgroup, int32_t offset, const AmxPanel& x, const ActLayout& a,
                         int n_tok, float* out, bool prefetch, const NextChunk& spread = {}, bool two_set = false) {
    if (sc.affine())
      int8_lines_as<true>(lines, sc, n_blk, next, n_next, kp, wgroup, offset, x, a, n_tok, out, prefetch, spread,
                          two_set);
    else
      int8_lines_as<false>(lines, sc, n_blk, next, n_next, kp, wgroup, offset, x, a, n_tok, out, prefetch, spread,
                           two_set);
  }

  template <bool kAffine>
  static void int8_lines_as(const uint8_t* const* lines, const BlockScales& sc, int n_blk, const RowBlock* next,
                            int n_next, int kp, int wgroup, int32_t offset, const AmxPanel& x, const ActLayout& a,
                            int n_tok, float* out, bool prefetch, const NextChunk& spread, bool two_set) {
    const int group = a.group;
    // One activation group per row (per-row int8 weights, or all of K in one group): all of K is summed first, in
    // K steps of 64 (a K of 32 in one group of 32 takes the grouped loop below, whose K step is the group).
    if (!kAffine && a.group >= kp && kp % 64 == 0) {
      int32_t* sums = reinterpret_cast<int32_t*>(out);  // the same [n_tok][32] 4-byte cells, converted in place
      chunked<false>(lines, n_blk, next, n_next, kp, x, n_tok, sums, prefetch, spread);
      for (int t = 0; t < n_tok; ++t) {
        const float xs = x.scales(t)[0];
        const int32_t xoff = offset * x.sums(t)[0];
        for (int j = 0; j < n_blk; ++j) {
          alignas(64) float wide[kRowsPerBlock];
          const float* ws = sc.widened(j, 0, wide);  // group 0 (per-row scales repeat in every group)
          int32_t ci[16];
          std::memcpy(ci, sums + (size_t)t * kOutStride + 16 * j, sizeof(ci));  // read before the cells are overwritten
          float* o = out + (size_t)t * kOutStride + 16 * j;
          for (int r = 0; r < 16; ++r) o[r] = std::fma((float)(ci[r] - xoff), ws[r] * xs, 0.f);
        }
      }
      return;
    }
    if (n_tok > kTwoSetMax && !two_set)
      grouped32<kAffine>(lines, sc, n_blk, next, n_next, kp, wgroup, offset, x, n_tok, out, prefetch, group);
    else
      grouped<kAffine>(lines, sc, n_blk, next, n_next, kp, wgroup, offset, x, n_tok, out, prefetch, group, spread);
  }

  static void int8(const RowBlock* w, int n_blk, const RowBlock* next, int n_next, const AmxPanel& x,
                   const ActLayout& a, int n_tok, float* out) {
    const uint8_t* lines[2] = {w[0].data, n_blk > 1 ? w[1].data : nullptr};
    int8_lines(lines, BlockScales::of(w, n_blk), n_blk, next, n_next, w[0].kp, w[0].group, 128, x, a, n_tok, out, true);
  }

  static void int4(const RowBlock* w, int n_blk, const RowBlock* next, int n_next, const AmxPanel& x,
                   const ActLayout& a, int n_tok, float* out) {
    // One int4 line (8 k) becomes two int8 lines (k 8j..8j+3 from the low nibbles, 8j+4..8j+7 from the high
    // ones): consecutive K, so the expanded block is in the int8 layout with offset 8 instead of 128, or with signed
    // B bytes (kSignedB: nibble - 8, offset 0, so the epilogue has no offset * xsum to subtract). The next
    // call's packed lines are prefetched into L2 across this call's steps (per-row and two-set loops: int4 never
    // takes the 32-token loop), so its expansion reads L2, not DRAM.
    const int kp = w[0].kp, int4_lines = kp / 8;
    const size_t block_bytes = (size_t)kp / 4 * kLineBytes;
    uint8_t* buf = slab(block_bytes * n_blk);
    const uint8_t* lines[2] = {buf, buf + block_bytes};
    for (int j = 0; j < n_blk; ++j) Tiles::unpack_int4(w[j].data, int4_lines, buf + j * block_bytes);
    int8_lines(lines, BlockScales::of(w, n_blk), n_blk, nullptr, 0, kp, w[0].group, Tiles::kSignedB ? 0 : 8, x, a,
               n_tok, out, false, spread_of(next, n_next), true);
  }

  // ---- lut4 weights: as int4, each nibble expanded through the codebook (Tiles::unpack_lut4) into its signed
  // int8 value, summed with tdpbssd (a policy with kSignedB): the tile sums are the true sums of codebook value x
  // activation, and the epilogue has no offset.
  static void lut4(const RowBlock* w, int n_blk, const RowBlock* next, int n_next, const AmxPanel& x,
                   const ActLayout& a, int n_tok, float* out) {
    static_assert(Tiles::kSignedB, "lut4 expands to signed bytes");
    const int kp = w[0].kp, nib_lines = kp / 8;
    const size_t block_bytes = (size_t)kp / 4 * kLineBytes;
    uint8_t* buf = slab(block_bytes * n_blk);
    const uint8_t* lines[2] = {buf, buf + block_bytes};
    for (int j = 0; j < n_blk; ++j) Tiles::unpack_lut4(w[j].data, nib_lines, w[j].codebook, buf + j * block_bytes);
    int8_lines(lines, BlockScales::of(w, n_blk), n_blk, nullptr, 0, kp, w[0].group, 0, x, a, n_tok, out, false,
               spread_of(next, n_next), true);
  }

  // ---- fp8 weights: each line widened to two bf16 lines of q * 2^-8 (Tiles::unpack_fp8, exact), multiplied by
  // the bf16 activations in tiles one scale group at a time (K step 32, C zeroed per group), and each group's fp32
  // sums added by o = fma(c, scale * 256, o) (formats/layout.h), the groups in order per output. Chunks and token
  // blocks as `chunked`; the next call's fp8 lines are prefetched into L2 across the steps.
  static void fp8(const RowBlock* w, int n_blk, const RowBlock* next, int n_next, const AmxPanel& x, const ActLayout&,
                  int n_tok, float* out) {
    const int kp = w[0].kp, group = w[0].group;
    const size_t block_bytes = (size_t)kp / 2 * kLineBytes;
    uint8_t* buf = slab(block_bytes * n_blk);
    const uint8_t* lines[2] = {buf, buf + block_bytes};
    for (int j = 0; j < n_blk; ++j) Tiles::unpack_fp8(w[j].data, kp / 4, buf + j * block_bytes);
    NextChunk spread;
    if (next) {
      for (int j = 0; j < n_next && j < 2; ++j) spread.p[j] = next[j].data;
      spread.n = n_next < 2 ? n_next : 2;
      spread.lines = next[0].kp / 4;
    }
    const int chunk = kChunkBf16 / group * group, n_chunks = (kp + chunk - 1) / chunk;
    const int n_tok_blocks = (n_tok + kTokBlock - 1) / kTokBlock;
    alignas(64) float c[kTokBlock * kOutStride];
    std::memset(out, 0, sizeof(float) * kOutStride * (size_t)n_tok);
    Tiles::configure(64, 16);
    for (int kc = 0; kc < kp; kc += chunk) {
      const int kc_end = kc + chunk < kp ? kc + chunk : kp;
      const NextChunk nx = slice(spread, kc / chunk, n_chunks);
      const int steps = (kc_end - kc) / 32, n_parts = n_tok_blocks * steps;
      for (int m0 = 0; m0 < n_tok; m0 += kTokBlock) {
        const int rows = n_tok - m0 < kTokBlock ? n_tok - m0 : kTokBlock;
        for (int k0 = kc; k0 < kc_end; k0 += group) {
          const int part0 = (m0 / kTokBlock) * steps + (k0 - kc) / 32, k1 = k0 + group;
          if (rows > 16)
            n_blk > 1 ? k_chunk<true, 2, 2>(lines, x, m0, k0, k1, false, c, nx, part0, n_parts)
                      : k_chunk<true, 2, 1>(lines, x, m0, k0, k1, false, c, nx, part0, n_parts);
          else
            n_blk > 1 ? k_chunk<true, 1, 2>(lines, x, m0, k0, k1, false, c, nx, part0, n_parts)
                      : k_chunk<true, 1, 1>(lines, x, m0, k0, k1, false, c, nx, part0, n_parts);
          for (int j = 0; j < n_blk; ++j) {
            alignas(64) float ws[kRowsPerBlock];
            for (int r = 0; r < kRowsPerBlock; ++r) ws[r] = w[j].scale(k0 / group, r) * 256.f;
            for (int t = 0; t < rows; ++t)
              fp8_epilogue16(out + (size_t)(m0 + t) * kOutStride + 16 * j, c + t * kOutStride + 16 * j, ws);
          }
        }
      }
    }
    Tiles::release();
  }

  // ---- bit-plane weights (int6, int5, int3, int2; formats/layout.h): each block's planes expanded into int8 lines of
  // the stored codes u (unpack_planes: byte line f of quad q is int8 line 4q + f), summed with tdpbsud (a policy with
  // unsigned B bytes), the offset 2^(b-1) of symmetric codes undone in the epilogue as int8's 128 is. The next call's
  // packed lines are prefetched into L2 across this call's steps, as int4's.
  template <WeightFormat F>
  static void planes(const RowBlock* w, int n_blk, const RowBlock* next, int n_next, const AmxPanel& x,
                     const ActLayout& a, int n_tok, float* out) {
    static_assert(!Tiles::kSignedB, "bit-plane codes expand to unsigned bytes");
    constexpr Planes P = planes_of(F);
    const int kp = w[0].kp;
    const size_t block_bytes = (size_t)kp / 4 * kLineBytes;
    uint8_t* buf = slab(block_bytes * n_blk);
    const uint8_t* lines[2] = {buf, buf + block_bytes};
    for (int j = 0; j < n_blk; ++j) unpack_planes(P, w[j].data, kp, buf + j * block_bytes);
    NextChunk spread;
    if (next) {
      for (int j = 0; j < n_next && j < 2; ++j) spread.p[j] = next[j].data;
      spread.n = n_next < 2 ? n_next : 2;
      spread.lines = (next[0].kp + P.unit_k() - 1) / P.unit_k() * P.lines;
    }
    const int32_t offset = w[0].mins ? 0 : 1 << (code_bits(F) - 1);
    int8_lines(lines, BlockScales::of(w, n_blk), n_blk, nullptr, 0, kp, w[0].group, offset, x, a, n_tok, out, false,
               spread, true);
  }

  // ---- grid weights (formats/layout.h): each block decoded (formats/grid.h, the row-block kernels' decoding) into
  // int8 lines of its signed codes and fp32 scales [n_groups][16] in the slab, summed with tdpbssd (a policy with
  // kSignedB) as lut4's: the tile sums are the true sums, the epilogue has no offset. The next call's packed bytes
  // are prefetched into L2 across this call's steps.
  static void grid(const RowBlock* w, int n_blk, const RowBlock* next, int n_next, const AmxPanel& x,
                   const ActLayout& a, int n_tok, float* out) {
    static_assert(Tiles::kSignedB, "grid codes expand to signed bytes");
    const int kp = w[0].kp, group = w[0].group, gps = kSuperBlock / group;
    const size_t line_bytes = (size_t)kp / 4 * kLineBytes, scale_bytes = (size_t)(kp / group) * kRowsPerBlock * 4;
    uint8_t* buf = slab((line_bytes + scale_bytes) * n_blk);
    RowBlock wide[2];
    const uint8_t* lines[2] = {nullptr, nullptr};
    for (int j = 0; j < n_blk; ++j) {
      uint8_t* l = buf + j * (line_bytes + scale_bytes);
      float* sc = reinterpret_cast<float*>(l + line_bytes);
      for (int sp = 0; sp < kp / kSuperBlock; ++sp)
        grid::decode_super(w[j], sp, l + (size_t)sp * (kSuperBlock / 4) * kLineBytes, sc + sp * gps * kRowsPerBlock);
      wide[j] = w[j];
      wide[j].scales = reinterpret_cast<const uint8_t*>(sc);
      wide[j].scale_type = ScaleType::f32;
      wide[j].grid = Codebook::none;
      lines[j] = l;
    }
    NextChunk spread;
    if (next) {
      for (int j = 0; j < n_next && j < 2; ++j) spread.p[j] = next[j].data;
      spread.n = n_next < 2 ? n_next : 2;
      spread.lines = next[0].kp / kSuperBlock * kRowsPerBlock * grid_info(next[0].grid).row_bytes / kLineBytes;
    }
    int8_lines(lines, BlockScales::of(wide, n_blk), n_blk, nullptr, 0, kp, group, 0, x, a, n_tok, out, false, spread,
               true);
  }

  // The next call's packed nibble lines, prefetched into L2 across an int4 / lut4 call's steps.
  static NextChunk spread_of(const RowBlock* next, int n_next) {
    NextChunk spread;
    if (next) {
      for (int j = 0; j < n_next && j < 2; ++j) spread.p[j] = next[j].data;
      spread.n = n_next < 2 ? n_next : 2;
      spread.lines = next[0].kp / 8;
    }
    return spread;
  }
};

// int4 weights: symmetric blocks through the policy with signed B bytes (the tile sums are the true sums, and the
// epilogue skips the offset: the same integers, the same bits), affine ones (K-quant codes 0..15 with a min)
// through the unsigned one. Gemm<Unsigned>::int4 sends symmetric blocks through the unsigned one too (the A/B of
// BENCHMARKS.md#amx-prefill; tests compare the bits: amx::GemmVariant::int4_signed).
template <class Unsigned, class Signed, int kTwoSetMax = kTwoSetMaxTokens>
void int4_gemm(const RowBlock* w, int n_blk, const RowBlock* next, int n_next, const AmxPanel& x, const ActLayout& a,
               int n_tok, float* out) {
  static_assert(!Unsigned::kSignedB && Signed::kSignedB, "int4_gemm: (unsigned, signed) tile policies");
  if (w[0].mins)
    Gemm<Unsigned, kTwoSetMax>::int4(w, n_blk, next, n_next, x, a, n_tok, out);
  else
    Gemm<Signed, kTwoSetMax>::int4(w, n_blk, next, n_next, x, a, n_tok, out);
}

}  // namespace
}  // namespace amx
}  // namespace hetmoe
