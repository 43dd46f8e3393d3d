// The one dispatch table for expert micro-kernels, keyed by (weight format, ISA) and resolved once at load.
//
// A micro-kernel computes one packed row block (16 output rows, see formats/layout.h) for a list of tokens:
//     out[t][r] = sum_k W[r][k] * x_t[k]      for t < n_tok, r < 16
// where x_t is the token's activation row, already quantized for the format (formats/activation.h).
// Every kernel of one format produces bitwise the same result: integer dot products are exact per group and
// the float epilogue (acc = fma(float(isum), w_scale * x_scale, acc)) and the bf16 fma order are fixed.
#pragma once
#include <cstdint>

#include "engine/cpu_features.h"
#include "formats/layout.h"

namespace hetmoe {

// Software prefetch distance along a weight stream: measured ~5-10% more decode bandwidth than relying on
// the hardware prefetcher alone (dev machine, 2 threads).
constexpr int kPrefetchBytes = 512;

using RowBlockKernel = void (*)(const RowBlock& w, const uint8_t* const* act_rows, const ActLayout& act, int n_tok,
                                float* out /* [n_tok][16] */);

struct KernelEntry {
  RowBlockKernel rowblock = nullptr;
  const char* name = nullptr;  // e.g. "int4/avx512-vnni"
};

// The table entry for (format, isa). An ISA whose kernels are not written yet for a format falls back to the
// next lower level (the AMX slot runs the AVX-512 kernels until the AMX issue fills it); `name` tells which ran.
KernelEntry select_kernel(WeightFormat format, Isa isa);

// Streams `bytes` (a multiple of 64) through vector loads and returns a value depending on all of them:
// the STREAM-style read loop our bandwidth probe uses, at the same ISA level as the kernels.
using ReadKernel = uint64_t (*)(const uint8_t* p, size_t bytes);
ReadKernel select_read_kernel(Isa isa);

namespace scalar {
uint64_t read_bytes(const uint8_t*, size_t);
void rowblock_bf16(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int8(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int4(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
}  // namespace scalar
namespace avx2 {
uint64_t read_bytes(const uint8_t*, size_t);
void rowblock_bf16(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int8(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int4(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
}  // namespace avx2
namespace avx512 {
uint64_t read_bytes(const uint8_t*, size_t);
void rowblock_bf16(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int8(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
void rowblock_int4(const RowBlock&, const uint8_t* const*, const ActLayout&, int, float*);
}  // namespace avx512

}  // namespace hetmoe
