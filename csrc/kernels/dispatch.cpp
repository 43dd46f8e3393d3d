#include "kernels/dispatch.h"

#include <immintrin.h>

#include <stdexcept>
#include <string>

namespace hetmoe {

namespace {

// [isa][format]; an empty entry falls back to the level below.
// clang-format off
const KernelEntry kTable[4][kWeightFormats] = {
    /* scalar */ {{scalar::rowblock_bf16, "bf16/scalar"},
                  {scalar::rowblock_int8, "int8/scalar"},
                  {scalar::rowblock_int4, "int4/scalar"},
                  {scalar::rowblock_lut4, "lut4/scalar"},
                  {scalar::rowblock_fp8, "fp8/scalar"},
                  {scalar::rowblock_int6, "int6/scalar"},
                  {scalar::rowblock_int5, "int5/scalar"},
                  {scalar::rowblock_int3, "int3/scalar"},
                  {scalar::rowblock_int2, "int2/scalar"},
                  {scalar::rowblock_grid, "grid/scalar"}},
    /* avx2   */ {{avx2::rowblock_bf16, "bf16/avx2-fma"},
                  {avx2::rowblock_int8, "int8/avx2-madd"},
                  {avx2::rowblock_int4, "int4/avx2-maddubs"},
                  {avx2::rowblock_lut4, "lut4/avx2-pshufb-maddubs"},
                  {avx2::rowblock_fp8, "fp8/avx2-fma"},
                  {avx2::rowblock_int6, "int6/avx2-planes-madd"},
                  {avx2::rowblock_int5, "int5/avx2-planes-madd"},
                  {avx2::rowblock_int3, "int3/avx2-planes-maddubs"},
                  {avx2::rowblock_int2, "int2/avx2-planes-maddubs"},
                  {avx2::rowblock_grid, "grid/avx2-decode-maddubs"}},
    /* avx512 */ {{avx512::rowblock_bf16, "bf16/avx512-fma"},
                  {avx512::rowblock_int8, "int8/avx512-vnni"},
                  {avx512::rowblock_int4, "int4/avx512-vnni"},
                  {avx512::rowblock_lut4, "lut4/avx512-vpshufb-vnni"},
                  {avx512::rowblock_fp8, "fp8/avx512-fma"},
                  {avx512::rowblock_int6, "int6/avx512-planes-vnni"},
                  {avx512::rowblock_int5, "int5/avx512-planes-vnni"},
                  {avx512::rowblock_int3, "int3/avx512-planes-vnni"},
                  {avx512::rowblock_int2, "int2/avx512-planes-vnni"},
                  {}},  // grid: the AVX2 kernel (an AVX-512 one is not verified on an AVX-512 CPU yet)
    /* amx    */ {{}, {}, {}, {}, {}, {}, {}, {}, {}, {}},  // row blocks of few tokens: the AVX-512 kernels; the GEMM from amx::gemm
};
// clang-format on

// [native, emulated][format]
const char* const kGemmNames[2][kWeightFormats] = {
    {"bf16/amx-tdpbf16ps", "int8/amx-tdpbsud", "int4/amx-tdpbsud", "lut4/amx-tdpbssd", "fp8/amx-tdpbf16ps",
     "int6/amx-planes-tdpbsud", "int5/amx-planes-tdpbsud", "int3/amx-planes-tdpbsud", "int2/amx-planes-tdpbsud",
     "grid/amx-decode-tdpbssd"},
    {"bf16/amx-emulated", "int8/amx-emulated", "int4/amx-emulated", "lut4/amx-emulated", "fp8/amx-emulated",
     "int6/amx-emulated", "int5/amx-emulated", "int3/amx-emulated", "int2/amx-emulated", "grid/amx-emulated"}};

const char* format_label(WeightFormat f) {
  static const char* const names[kWeightFormats] = {"bf16", "int8", "int4", "lut4", "fp8",
                                                    "int6", "int5", "int3", "int2", "grid"};
  return names[(int)f];
}

const char* scale_type_name(ScaleType t) {
  static const char* const names[kScaleTypes] = {"fp32", "fp16",     "bf16",    "e8m0",    "k8",     "k4",
                                                 "e4m3", "e4m3_div", "fp32_zp", "fp16_zp", "bf16_zp"};
  return names[(int)t];
}

}  // namespace

bool amx_kernels_compiled() {
#ifdef HETMOE_HAVE_AMX
  return true;
#else
  return false;
#endif
}

KernelEntry select_kernel(WeightFormat format, Isa isa, AmxMode amx) {
  KernelEntry out = kTable[0][(int)format];
  for (int level = (int)isa; level >= 0; --level) {
    const KernelEntry& e = kTable[level][(int)format];
    if (e.rowblock) {
      out = e;
      break;
    }
  }
  if (isa == Isa::amx && amx == AmxMode::off) amx = AmxMode::native;
  if (amx != AmxMode::off) {
    const bool native = amx == AmxMode::native;
#ifdef HETMOE_HAVE_AMX
    out.gemm = native ? amx::gemm(format) : amx::emulated_gemm(format);
#else
    out.gemm = native ? nullptr : amx::emulated_gemm(format);
#endif
    out.gemm_name = out.gemm ? kGemmNames[native ? 0 : 1][(int)format] : nullptr;
  }
  return out;
}

void stream_fence() { _mm_sfence(); }

RowOps select_row_ops(Isa isa) {
  if (isa >= Isa::avx512) return avx512::row_ops();
  if (isa == Isa::avx2) return avx2::row_ops();
  return scalar::row_ops();
}

ReadKernel select_read_kernel(Isa isa) {
  if (isa >= Isa::avx512) return avx512::read_bytes;
  if (isa == Isa::avx2) return avx2::read_bytes;
  return scalar::read_bytes;
}

void check_kernel_choice(const MatrixFormat& m, Isa isa, AmxMode amx, int amx_min_tokens) {
  auto bad = [](const std::string& msg) { throw std::invalid_argument(msg); };
  const int group = m.group;
  const bool lut4 = m.format == WeightFormat::lut4, per_row = group <= 0;
  if (m.format == WeightFormat::grid) {
    if (!grid_codebook(m.codebook))
      bad("grid weights need a grid type (iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s or iq1_m)");
    if (group != grid_info(m.codebook).group)
      bad("grid weights of this type have groups of " + std::to_string(grid_info(m.codebook).group) + ", got " +
          std::to_string(group));
    if (m.scaling != Scaling::symmetric || m.scale_type != ScaleType::f16 || m.shared_scales)
      bad("grid weights are symmetric with fp16 scales (the blocks' d)");
  } else if (m.format == WeightFormat::bf16) {
    if (m.scale_type != ScaleType::f32 || m.codebook != Codebook::none || m.scaling != Scaling::symmetric)
      bad("bf16 weights have no scales, scaling or codebook");
  } else {
    if (lut4 && group != 16 && group != 32 && group != 64 && group != 128)
      bad("lut4 group_size must be 16, 32, 64 or 128, got " + std::to_string(group));
    if (!lut4 && !per_row && group != 16 && group != 32 && group != 64 && group != 128)
      bad("group_size must be 16, 32, 64 or 128 (or 0 for per-row), got " + std::to_string(group));
    if (plane_format(m.format) && per_row)
      bad(std::string(format_label(m.format)) + " weights need a group size of 16, 32, 64 or 128 (no per-row scales)");
    if (lut4 && (m.codebook == Codebook::none || grid_codebook(m.codebook)))
      bad("lut4 weights need a codebook (e2m1 or iq4nl)");
    if (!lut4 && m.codebook != Codebook::none) bad("a codebook goes with lut4 weights only");
    if (lut4 && m.scaling == Scaling::affine) bad("lut4 weights are symmetric: affine scaling needs int8 or int4");
    if (m.scale_type != ScaleType::f32 && per_row)
      bad(std::string(scale_type_name(m.scale_type)) + " scales need grouped weights (per-row scales are fp32)");
    if (m.scale_type == ScaleType::e8m0 && m.scaling == Scaling::affine)
      bad("e8m0 scales need symmetric weights (affine mins are stored as the scales, and e8m0 has no negative or "
          "zero value)");
    if (m.format == WeightFormat::fp8 && m.scaling == Scaling::affine)
      bad("fp8 weights are symmetric: affine scaling needs int8 or int4");
    if (m.format == WeightFormat::fp8 && two_level(m.scale_type))
      bad(std::string("fp8 weights take fp32, fp16, bf16 or e8m0 scales, not ") + scale_type_name(m.scale_type) +
          " (two-level scales go with the integer formats)");
    if (factor_scales(m.scale_type) && !lut4)
      bad(std::string(scale_type_name(m.scale_type)) + " scales (NVFP4's E4M3 bytes and a per-tensor factor) go "
                                                       "with lut4 weights only");
    if (m.scale_type == ScaleType::k4 && m.scaling != Scaling::affine)
      bad("k4 scales need affine weights (each byte holds a group's 4-bit sub-scale and sub-min)");
    if (zero_points(m.scale_type) && m.scaling != Scaling::affine)
      bad(std::string(scale_type_name(m.scale_type)) + " scales need affine weights (their min set holds a zero "
                                                       "point per group)");
    if (m.format == WeightFormat::fp8 && group == 16)
      bad("fp8 group_size must be 32, 64 or 128 (or 0 for per-row), got 16");
  }
  if (m.shared_scales && (m.format != WeightFormat::fp8 || group <= 0))
    bad("shared scales (one per row block and group) go with grouped fp8 weights only");
  if (!cpu_features().supports(isa))
    bad(std::string("this CPU cannot run the ") + isa_name(isa) + " kernels: " + isa_refusal(isa));
  if (amx == AmxMode::native && isa != Isa::amx)
    bad("the native AMX GEMM needs isa amx, got " + std::string(isa_name(isa)));
  if (amx_min_tokens < 1) bad("amx_min_tokens must be >= 1, got " + std::to_string(amx_min_tokens));
}

}  // namespace hetmoe
