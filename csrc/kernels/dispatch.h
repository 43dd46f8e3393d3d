// The one dispatch table for expert micro-kernels, keyed by (weight format, ISA) and resolved once at load.
//
// A micro-kernel computes one packed row block (16 output rows, see formats/layout.h) for a list of tokens:
//     out[t][r] = sum_k W[r][k] * x_t[k]      for t < n_tok, r < 16
// where x_t is the token's activation row, already quantized for the format (formats/activation.h).
// Every kernel of one format produces bitwise the same result: integer dot products are exact per group and
// the float epilogue (acc = fma(float(isum), w_scale * x_scale, acc)) and the bf16 and fp8 fma orders are fixed.
#pragma once
#include <cstdint>

#include "formats/layout.h"
#include "runtime/cpu_features.h"

namespace hetmoe {

// Software prefetch distances along a weight stream: into L1 kPrefetchBytes ahead, and on AVX-512 also into L2
// kPrefetchL2Bytes ahead, far enough to cover DRAM latency at a thread's share of the bandwidth. Decode jobs
// stream faster with both than with the hardware prefetcher alone (BENCHMARKS.md#l2-prefetch).
constexpr int kPrefetchBytes = 512;
constexpr int kPrefetchL2Bytes = 4096;

using RowBlockKernel = void (*)(const RowBlock& w, const uint8_t* const* act_rows, const ActLayout& act, int n_tok,
                                float* out /* [n_tok][16] */);

// A GEMM over many tokens of one expert (kernels/amx/gemm.h): one or two packed row blocks, tokens read as A
// tiles from an activation panel (formats/layout.h AmxPanel) of AMX activation rows (ActLayout::make(shape, true)):
//     out[t * 32 + 16 * j + r] = sum_k W_j[r][k] * a_t[k]      for t < n_tok, j < n_blk (1 or 2), r < 16
// with a_t = panel row t. Rows up to round_up(n_tok, 16) are read (the caller provides them; rows past n_tok only
// feed outputs that are not used). out has round_up(n_tok, 32) rows (those past n_tok: scratch).
// `next` (n_next blocks, or null): the row blocks of the caller's next call, whose first weights this call
// prefetches into L2 while it ends.
using GemmKernel = void (*)(const RowBlock* w, int n_blk, const RowBlock* next, int n_next, const AmxPanel& x,
                            const ActLayout& a, int n_tok, float* out /* [round_up(n_tok, 32)][32] */);

struct KernelEntry {
  RowBlockKernel rowblock = nullptr;
  const char* name = nullptr;  // e.g. "int4/avx512-vnni"
  GemmKernel gemm = nullptr;   // AMX tile GEMM for experts with many tokens (null: none)
  const char* gemm_name = nullptr;
};

// How the AMX GEMM runs: not at all, on the AMX units, or through the plain C++ emulation of the same tile
// instructions (tests of the tile loop logic on machines without AMX; slow).
enum class AmxMode : int { off = 0, native = 1, emulated = 2 };

// The table entry for (format, isa). An ISA whose kernels are not written for a format falls back to the
// next lower level; `name` tells which ran. The AMX level runs the AVX-512 row-block kernels (few tokens per
// expert) plus the AMX GEMM (many tokens); `emulated` replaces that GEMM by its emulation.
KernelEntry select_kernel(WeightFormat format, Isa isa, AmxMode amx = AmxMode::off);

// Throws std::invalid_argument naming what is wrong when (matrix format, isa, amx, amx_min_tokens) is not a kernel
// choice this build and CPU can run: a group other than 16/32/64/128 (fp8: 32/64/128) or <= 0 (per row: int8,
// int4 and fp8), lut4 without a codebook or a codebook on another format, affine lut4 or fp8, scales narrower than
// fp32 on per-row matrices, e8m0 on affine ones, k8 or k4 on fp8, k4 or a zero-point type (fp32_zp, fp16_zp, bf16_zp)
// on symmetric ones, e4m3 / e4m3_div on a format other than lut4, bf16 with scale options, an ISA
// the CPU (or HETMOE_MAX_ISA) refuses, native AMX without isa amx, amx_min_tokens < 1, shared scales on a format other
// than fp8 or on per-row fp8. The experts and the dense linear check their configs with it.
void check_kernel_choice(const MatrixFormat& m, Isa isa, AmxMode amx, int amx_min_tokens);

// Whether the AMX tile kernels were compiled into this build (the compiler knew -mamx-*).
bool amx_kernels_compiled();

// The per-token row work of a MoE job (kernels/row_ops.h), per ISA level: the same bits at every level.
struct RowOps {
  // formats/activation.h quantize_activation (amx = false) or quantize_activation_amx (amx = true)
  void (*quantize)(WeightFormat f, bool amx, const float* x, int k, const ActLayout& a, uint8_t* row);
  void (*bf16_to_f32)(const uint16_t* src, int n, float* dst);
  void (*f32_to_bf16)(const float* src, int n, uint16_t* dst);
  void (*axpy)(float w, const float* y, int n, float* acc);             // acc[i] += w * y[i]
  void (*swiglu)(const float* gate, const float* up, int n, float* h);  // h[i] = silu(gate[i]) * up[i]
  // h[i] = clamped_swiglu(gate[i], up[i], alpha, limit, offset) (formats/activation.h)
  void (*clamped_swiglu)(const float* gate, const float* up, int n, float alpha, float limit, float offset, float* h);
  // dst[i] = src[i], with stores that bypass the caches where the ISA has them (the caller fences before
  // another thread reads dst: stream_fence)
  void (*copy_stream)(const float* src, int n, float* dst);
};
// Orders this thread's cache-bypassing stores (RowOps::copy_stream) before its later stores.
void stream_fence();
RowOps select_row_ops(Isa isa);

// Streams `bytes` (a multiple of 64) through vector loads and returns a value depending on all of them:
// the STREAM-style read loop our bandwidth probe uses, at the same ISA level as the kernels.
using ReadKernel = uint64_t (*)(const uint8_t* p, size_t bytes);
ReadKernel select_read_kernel(Isa isa);

// fp8 lines -> bf16 lines for the AMX GEMM (kernels/amx/gemm.h unpack_fp8): n_lines fp8 lines of src become 2 n_lines
// bf16 lines of dst (line 2j: k 4j, 4j + 1; line 2j + 1: k 4j + 2, 4j + 3), each code the bf16 of q * 2^-8. The
// emulated GEMM takes the scalar one, the native the AVX-512 one (the same bytes).
namespace scalar {
void fp8_to_bf16_lines(const uint8_t* src, int n_lines, uint8_t* dst);
}
namespace avx512 {
void fp8_to_bf16_lines(const uint8_t* src, int n_lines, uint8_t* dst);
}

namespace scalar {
uint64_t read_bytes(const uint8_t*, size_t);
RowOps row_ops();
void rowblock_bf16(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int8(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int4(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_lut4(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_fp8(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int6(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int5(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int3(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int2(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_grid(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
}  // namespace scalar
namespace avx2 {
uint64_t read_bytes(const uint8_t*, size_t);
RowOps row_ops();
void rowblock_bf16(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int8(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int4(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_lut4(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_fp8(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int6(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int5(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int3(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int2(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_grid(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
}  // namespace avx2
namespace avx512 {
uint64_t read_bytes(const uint8_t*, size_t);
RowOps row_ops();
void rowblock_bf16(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int8(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int4(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_lut4(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_fp8(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int6(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int5(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int3(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int2(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
}  // namespace avx512
namespace amx {                   // kernels/amx/kernels.cpp (real tile instructions) and emulated.cpp (plain C++)
GemmKernel gemm(WeightFormat f);  // Gemm<Native> (native AMX builds only)
// The loops of the AMX GEMM the engine does not pick, for same-bits tests of the emulated one (tests/cpu/
// test_amx_loops.py; their A/B timings: BENCHMARKS.md#amx-prefill). `loop`: grouped int8 calls take the two-set
// 16-token loop up to 32 tokens and the 32-token loop above (engine), or one of the two at every length (int4 takes
// the two-set loop at every length in any case). `int4_signed` false: symmetric int4 expanded to unsigned bytes
// (tdpbsud, offset 8 undone in the epilogue) instead of signed ones (tdpbssd).
enum class GroupedLoop : int { engine = 0, two_set = 1, one_set = 2 };
struct GemmVariant {
  GroupedLoop loop = GroupedLoop::engine;
  bool int4_signed = true;
};
GemmKernel emulated_gemm(WeightFormat f, const GemmVariant& v = {});  // Gemm<Emulated> (v: tests only)
// The tile unit's own rate: `rounds` x 4 independent tdpbf16ps / tdpbsud on register tiles, nothing loaded or
// stored in the loop (native AMX builds only); returns the multiply-adds done.
uint64_t peak_loop(bool bf16, int64_t rounds);
}  // namespace amx

}  // namespace hetmoe
