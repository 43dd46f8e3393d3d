#include "kernels/dispatch.h"

namespace hetmoe {

namespace {

// [isa][format]; an empty entry falls back to the level below.
const KernelEntry kTable[4][3] = {
    /* scalar */ {{scalar::rowblock_bf16, "bf16/scalar"},
                  {scalar::rowblock_int8, "int8/scalar"},
                  {scalar::rowblock_int4, "int4/scalar"}},
    /* avx2   */ {{avx2::rowblock_bf16, "bf16/avx2-fma"},
                  {avx2::rowblock_int8, "int8/avx2-madd"},
                  {avx2::rowblock_int4, "int4/avx2-maddubs"}},
    /* avx512 */ {{avx512::rowblock_bf16, "bf16/avx512-fma"},
                  {avx512::rowblock_int8, "int8/avx512-vnni"},
                  {avx512::rowblock_int4, "int4/avx512-vnni"}},
    /* amx    */ {{}, {}, {}},  // AMX tile kernels: filled by the AMX prefill issue
};

}  // namespace

KernelEntry select_kernel(WeightFormat format, Isa isa) {
  for (int level = (int)isa; level >= 0; --level) {
    const KernelEntry& e = kTable[level][(int)format];
    if (e.rowblock) return e;
  }
  return kTable[0][(int)format];
}

ReadKernel select_read_kernel(Isa isa) {
  if (isa >= Isa::avx512) return avx512::read_bytes;
  if (isa == Isa::avx2) return avx2::read_bytes;
  return scalar::read_bytes;
}

}  // namespace hetmoe
