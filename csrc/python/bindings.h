// What the parts of the Python module hetmoe._C (python/module.cpp) share: the binders of each part, and how
// arguments cross. Tensors cross as raw addresses (validated by hetmoe/cpu/experts.py), so this extension links no
// libtorch. Invalid arguments raise ValueError (std::invalid_argument), other failures RuntimeError.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "formats/layout.h"

namespace hetmoe {
namespace bindings {

namespace py = pybind11;

// In module order: a part may use the classes of the parts before it.
void bind_runtime(py::module_& m);    // python/runtime.cpp: pools, jobs, NUMA topology and subpools, probes
void bind_stream(py::module_& m);     // python/stream.cpp: stream-ordered submit/sync (host functions, signals)
void bind_kernels(py::module_& m);    // python/kernels.cpp: the kernels' row ops and task split, for tests
void bind_experts(py::module_& m);    // python/experts.cpp: MoeExperts, NumaExperts and their jobs
void bind_linear(py::module_& m);     // python/linear.cpp: DenseLinear and its jobs
void bind_attention(py::module_& m);  // python/attention.cpp: decode attention over the KV cache

inline WeightFormat format_from_name(const std::string& s) {
  if (s == "bf16") return WeightFormat::bf16;
  if (s == "int8") return WeightFormat::int8;
  if (s == "int4") return WeightFormat::int4;
  if (s == "lut4") return WeightFormat::lut4;
  if (s == "fp8") return WeightFormat::fp8;
  if (s == "int6") return WeightFormat::int6;
  if (s == "int5") return WeightFormat::int5;
  if (s == "int3") return WeightFormat::int3;
  if (s == "int2") return WeightFormat::int2;
  if (s == "grid") return WeightFormat::grid;
  throw std::invalid_argument("unknown weight format '" + s +
                              "' (expected bf16, int8, int6, int5, int4, lut4, int3, int2, grid or fp8)");
}

// Scale types and codebooks by their Python names (hetmoe/cpu/experts.py SCALE_DTYPES, CODEBOOKS).
inline const char* const kScaleTypeNames[kScaleTypes] = {"fp32", "fp16",     "bf16",    "e8m0",    "k8",     "k4",
                                                         "e4m3", "e4m3_div", "fp32_zp", "fp16_zp", "bf16_zp"};
inline const char* const kCodebookNames[kCodebooks] = {"",      "e2m1",    "iq4nl", "iq2_xxs", "iq2_xs",
                                                       "iq2_s", "iq3_xxs", "iq3_s", "iq1_s",   "iq1_m"};
inline ScaleType scale_type_from_name(const std::string& s) {
  for (int i = 0; i < kScaleTypes; ++i)
    if (s == kScaleTypeNames[i]) return (ScaleType)i;
  throw std::invalid_argument(
      "unknown scale dtype '" + s +
      "' (expected fp32, fp16, bf16, e8m0, k8, k4, e4m3, e4m3_div, fp32_zp, fp16_zp or bf16_zp)");
}
inline Codebook codebook_from_name(const std::string& s) {
  for (int i = 0; i < kCodebooks; ++i)
    if (s == kCodebookNames[i]) return (Codebook)i;
  throw std::invalid_argument("unknown codebook '" + s +
                              "' (expected e2m1 or iq4nl; grid types: iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s, "
                              "iq1_m)");
}

template <typename T>
T* ptr(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

inline const char* format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::bf16: return "bf16";
    case WeightFormat::int8: return "int8";
    case WeightFormat::int4: return "int4";
    case WeightFormat::lut4: return "lut4";
    case WeightFormat::fp8: return "fp8";
    case WeightFormat::int6: return "int6";
    case WeightFormat::int5: return "int5";
    case WeightFormat::int3: return "int3";
    case WeightFormat::int2: return "int2";
    case WeightFormat::grid: return "grid";
  }
  return "?";
}

}  // namespace bindings
}  // namespace hetmoe
