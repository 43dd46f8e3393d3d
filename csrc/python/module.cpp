// The Python module hetmoe._C, bound part by part (python/bindings.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "moe/moe.h"
#include "python/bindings.h"
#include "runtime/cpu_features.h"

namespace py = pybind11;
using namespace hetmoe;
using bindings::format_name;

PYBIND11_MODULE(_C, m) {
  m.doc() = "hetmoe CPU expert engine";

  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["flags"] = f.describe();
    d["max_isa"] = isa_name(max_isa());  // HETMOE_MAX_ISA (amx when unset)
    d["isa_cap"] = isa_cap_note();       // "" when unset
    d["best_isa"] = isa_name(f.best());
    py::list ok;
    for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::amx})
      if (f.supports(i)) ok.append(isa_name(i));
    d["supported_isas"] = ok;
    d["amx_unavailable"] = amx_unavailable_reason();  // "" when the AMX kernels can run
    d["amx_kernels_compiled"] = amx_kernels_compiled();
    py::dict amx_min;  // per weight format
    for (int f = 0; f < kWeightFormats; ++f)
      amx_min[format_name((WeightFormat)f)] = default_amx_min_tokens((WeightFormat)f);
    d["amx_min_tokens_default"] = amx_min;
    return d;
  });
  m.attr("LAYOUT_VERSION") = kLayoutVersion;
  {  // the packed layout's geometry (formats/layout.h), the one source of hetmoe/cpu/layout.py's constants
    py::dict layout;
    layout["rows_per_block"] = kRowsPerBlock;
    layout["line_bytes"] = kLineBytes;
    layout["bf16_group"] = kBf16Group;
    py::dict per_line;
    for (WeightFormat f :
         {WeightFormat::bf16, WeightFormat::int8, WeightFormat::int4, WeightFormat::lut4, WeightFormat::fp8})
      per_line[format_name(f)] = k_per_line(f);
    layout["k_per_line"] = per_line;
    py::dict planes;  // bit-plane formats: (values of K per unit, lines per unit, bits per code)
    for (WeightFormat f : {WeightFormat::int6, WeightFormat::int5, WeightFormat::int3, WeightFormat::int2})
      planes[format_name(f)] = py::make_tuple(planes_of(f).unit_k(), planes_of(f).lines, code_bits(f));
    layout["planes"] = planes;
    py::dict widths;  // bytes per stored scale, per scale dtype
    for (int t = 0; t < kScaleTypes; ++t) widths[bindings::kScaleTypeNames[t]] = scale_width((ScaleType)t);
    layout["scale_width"] = widths;
    py::dict min_widths;  // bytes per stored min of an affine matrix (the zero-point types: one int8 zero point)
    for (int t = 0; t < kScaleTypes; ++t) min_widths[bindings::kScaleTypeNames[t]] = min_width((ScaleType)t);
    layout["min_width"] = min_widths;
    layout["super_block"] = kSuperBlock;  // k8: elements of K per fp16 super scale (2 bytes per row)
    py::dict books;                       // lut4 codebooks: name -> 16 int8 values
    for (int c = 1; c < kLut4Codebooks; ++c) {
      py::list v;
      for (int i = 0; i < 16; ++i) v.append((int)codebook_values((Codebook)c)[i]);
      books[bindings::kCodebookNames[c]] = v;
    }
    layout["codebooks"] = books;
    py::dict grids;  // grid types: name -> (group, bytes per row and super-block held, bytes per block in the file)
    for (int c = kLut4Codebooks; c < kCodebooks; ++c)
      grids[bindings::kCodebookNames[c]] =
          py::make_tuple(grid_info((Codebook)c).group, grid_info((Codebook)c).row_bytes, grid_file_bytes((Codebook)c));
    layout["grids"] = grids;
    m.attr("LAYOUT") = layout;
  }

  bindings::bind_runtime(m);
  bindings::bind_stream(m);
  bindings::bind_kernels(m);
  bindings::bind_experts(m);
  bindings::bind_linear(m);
  bindings::bind_attention(m);
}
