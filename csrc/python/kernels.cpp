// The kernels' row ops at each ISA level, the MoE job's task split and the emulated AMX GEMM's loop variants, bound
// for tests; and GGUF's K-quant block decoder (hetmoe/load/gguf/kquants.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "formats/activation.h"
#include "formats/gguf_blocks.h"
#include "formats/layout.h"
#include "formats/lowbit.h"
#include "formats/pack.h"
#include "kernels/dispatch.h"
#include "kernels/row_ops.h"
#include "moe/expert_tasks.h"
#include "python/bindings.h"
#include "runtime/cpu_features.h"

namespace hetmoe {
namespace bindings {

namespace {

// A 1-d float32 buffer argument of the row-work bindings, and an ISA level this CPU runs.
py::buffer_info float_row(py::buffer x, const char* fn) {
  py::buffer_info b = x.request();
  if (b.format != py::format_descriptor<float>::format() || b.ndim != 1)
    throw std::invalid_argument(std::string(fn) + ": x must be a 1-d float32 buffer");
  return b;
}
// A C-contiguous 2-d float32 buffer argument: rows x cols.
py::buffer_info float_matrix(py::buffer x, const char* fn, const char* name) {
  py::buffer_info b = x.request();
  if (b.format != py::format_descriptor<float>::format() || b.ndim != 2 || b.strides[1] != (py::ssize_t)sizeof(float) ||
      b.strides[0] != b.shape[1] * (py::ssize_t)sizeof(float))
    throw std::invalid_argument(std::string(fn) + ": " + name + " must be a C-contiguous 2-d float32 buffer");
  return b;
}
// `bytes` zeroed bytes, 64-byte aligned.
std::unique_ptr<uint8_t, decltype(&std::free)> aligned_zeros(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, bytes > 0 ? bytes : 64) != 0) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return {static_cast<uint8_t*>(p), &std::free};
}
amx::GroupedLoop grouped_loop_from_name(const std::string& s) {
  if (s == "engine") return amx::GroupedLoop::engine;
  if (s == "two_set") return amx::GroupedLoop::two_set;
  if (s == "one_set") return amx::GroupedLoop::one_set;
  throw std::invalid_argument("unknown AMX loop '" + s + "' (expected engine, two_set or one_set)");
}
Isa runnable_isa(const std::string& isa) {
  const Isa level = isa_from_name(isa);
  if (!cpu_features().supports(level))
    throw std::invalid_argument("this CPU cannot run " + isa + ": " + isa_refusal(level));
  return level;
}

}  // namespace

void bind_kernels(py::module_& m) {
  // The MoE job's task split (moe/expert_tasks.h) for given per-expert token counts, sorted descending: tests.
  m.def(
      "plan_tasks",
      [](const std::vector<int>& counts, int amx_experts, int n_blocks, int row_gran, int amx_max_tokens, int n_threads,
         bool with_groups) -> py::object {
        std::vector<int> active(counts.size());
        for (size_t i = 0; i < counts.size(); ++i) active[i] = (int)i;
        std::vector<Task> tasks;
        std::vector<TaskGroup> groups;
        make_tasks(active, counts, amx_experts, TaskPlan{n_blocks, row_gran, amx_max_tokens, n_threads}, tasks,
                   &groups);
        py::list out, out_groups;
        for (const Task& t : tasks) {
          if (with_groups)
            out.append(py::make_tuple(t.e, t.rb0, t.rb1, t.m0, t.m1, t.amx, t.group));
          else
            out.append(py::make_tuple(t.e, t.rb0, t.rb1, t.m0, t.m1, t.amx));
        }
        if (!with_groups) return std::move(out);
        for (const TaskGroup& g : groups) out_groups.append(py::make_tuple(g.e, g.m0, g.m1, g.n_tasks));
        return py::make_tuple(out, out_groups);
      },
      py::arg("counts"), py::arg("amx_experts"), py::arg("n_blocks"), py::arg("row_gran"), py::arg("amx_max_tokens"),
      py::arg("n_threads"), py::arg("with_groups") = false);
  // The row work of a MoE job at one ISA level (kernels/row_ops.h), on contiguous fp32/bf16 buffers: tests compare
  // every level with the scalar one byte for byte.
  m.def(
      "row_quantize",
      [](const std::string& isa, const std::string& fmt, bool amx, int group, py::buffer x, bool one_group) {
        py::buffer_info b = float_row(x, "row_quantize");
        const Isa level = runnable_isa(isa);
        const int k = (int)b.shape[0];
        const MatrixShape shape = MatrixShape::make(bindings::format_from_name(fmt), kRowsPerBlock, k, group);
        const ActLayout a = ActLayout::make(shape, amx, one_group ? shape.kp : 0);
        std::string row(a.row_bytes, '\0');
        select_row_ops(level).quantize(shape.format, amx, static_cast<const float*>(b.ptr), k, a,
                                       reinterpret_cast<uint8_t*>(&row[0]));
        return py::bytes(row);
      },
      py::arg("isa"), py::arg("fmt"), py::arg("amx"), py::arg("group"), py::arg("x"), py::arg("one_group") = false);
  m.def(
      "fp8_to_bf16_lines",
      [](const std::string& isa, py::bytes lines) {  // fp8 lines -> the AMX GEMM's bf16 lines (dispatch.h), as bytes
        const std::string src = lines;
        if (src.size() % kLineBytes) throw std::invalid_argument("fp8_to_bf16_lines: whole 64-byte lines expected");
        const int n = (int)(src.size() / kLineBytes);
        auto in = aligned_zeros(src.size()), out = aligned_zeros(2 * src.size());
        std::memcpy(in.get(), src.data(), src.size());
        if (runnable_isa(isa) >= Isa::avx512)
          avx512::fp8_to_bf16_lines(in.get(), n, out.get());
        else
          scalar::fp8_to_bf16_lines(in.get(), n, out.get());
        return py::bytes(reinterpret_cast<const char*>(out.get()), 2 * src.size());
      },
      py::arg("isa"), py::arg("lines"));
  m.def(
      "row_bf16",
      [](const std::string& isa, py::buffer x) {  // fp32 -> bf16 bits (uint16) -> fp32, both through the ISA
        py::buffer_info b = float_row(x, "row_bf16");
        const Isa level = runnable_isa(isa);
        const int n = (int)b.shape[0];
        std::vector<uint16_t> bits(n);
        std::vector<float> back(n);
        const RowOps ops = select_row_ops(level);
        ops.f32_to_bf16(static_cast<const float*>(b.ptr), n, bits.data());
        ops.bf16_to_f32(bits.data(), n, back.data());
        return py::make_tuple(bits, back);
      },
      py::arg("isa"), py::arg("x"));
  m.def(
      "row_swiglu",
      [](const std::string& isa, py::buffer gate, py::buffer up) {  // silu(gate) * up through the ISA's row op
        py::buffer_info g = float_row(gate, "row_swiglu"), u = float_row(up, "row_swiglu");
        if (g.shape[0] != u.shape[0]) throw std::invalid_argument("row_swiglu: gate and up differ in length");
        const int n = (int)g.shape[0];
        std::vector<float> h(n);
        select_row_ops(runnable_isa(isa))
            .swiglu(static_cast<const float*>(g.ptr), static_cast<const float*>(u.ptr), n, h.data());
        return h;
      },
      py::arg("isa"), py::arg("gate"), py::arg("up"));
  m.def(
      "row_clamped_swiglu",
      [](const std::string& isa, py::buffer gate, py::buffer up, float alpha, float limit, float offset) {
        py::buffer_info g = float_row(gate, "row_clamped_swiglu"), u = float_row(up, "row_clamped_swiglu");
        if (g.shape[0] != u.shape[0]) throw std::invalid_argument("row_clamped_swiglu: gate and up differ in length");
        const int n = (int)g.shape[0];
        std::vector<float> h(n);
        select_row_ops(runnable_isa(isa))
            .clamped_swiglu(static_cast<const float*>(g.ptr), static_cast<const float*>(u.ptr), n, alpha, limit, offset,
                            h.data());
        return h;
      },
      py::arg("isa"), py::arg("gate"), py::arg("up"), py::arg("alpha"), py::arg("limit"), py::arg("offset") = 1.f);
  m.def(
      "row_copy_stream",
      [](const std::string& isa, py::buffer x, int offset) {  // x[offset:] copied to an aligned buffer at `offset`
        py::buffer_info b = float_row(x, "row_copy_stream");
        const int n = (int)b.shape[0];
        if (offset < 0 || offset > n) throw std::invalid_argument("row_copy_stream: offset out of range");
        void* p = nullptr;
        if (posix_memalign(&p, 64, sizeof(float) * (n + 16)) != 0) throw std::bad_alloc();
        std::unique_ptr<float, decltype(&std::free)> dst(static_cast<float*>(p), &std::free);
        std::fill(dst.get(), dst.get() + n, -1.f);
        select_row_ops(runnable_isa(isa))
            .copy_stream(static_cast<const float*>(b.ptr) + offset, n - offset, dst.get() + offset);
        stream_fence();
        return std::vector<float>(dst.get(), dst.get() + n);
      },
      py::arg("isa"), py::arg("x"), py::arg("offset") = 0);
  // One call of the emulated AMX GEMM (kernels/amx/gemm.h) in a variant of its loops (amx::GemmVariant): w fp32
  // [rows <= 32, k] packed as one or two row blocks, x fp32 [n_tok, k] quantized into an AMX panel as the experts
  // do; returns out [n_tok][16 * row blocks], flattened. Tests compare the variants' bits (test_amx_loops.py).
  m.def(
      "amx_emulated_gemm",
      [](const std::string& fmt, int group, py::buffer w, py::buffer x, const std::string& scaling,
         const std::string& loop, bool int4_signed, const std::string& scale_dtype, const std::string& codebook) {
        const char* fn = "amx_emulated_gemm";
        py::buffer_info wb = float_matrix(w, fn, "w"), xb = float_matrix(x, fn, "x");
        const int rows = (int)wb.shape[0], k = (int)wb.shape[1], n_tok = (int)xb.shape[0];
        if (rows < 1 || rows > 2 * kRowsPerBlock || k < 1 || xb.shape[1] != k || n_tok < 1)
          throw std::invalid_argument("amx_emulated_gemm: w must be [1..32, k], x [n_tok >= 1, k] with k >= 1");
        const WeightFormat f = bindings::format_from_name(fmt);
        if (scaling != "symmetric" && scaling != "affine")
          throw std::invalid_argument("unknown scaling '" + scaling + "' (expected symmetric or affine)");
        const Scaling sc = scaling == "affine" ? Scaling::affine : Scaling::symmetric;
        if (sc == Scaling::affine && (f == WeightFormat::bf16 || group <= 0))
          throw std::invalid_argument("amx_emulated_gemm: affine scaling needs int8/int4 with a group");
        const MatrixFormat mf{f, group, sc, scale_type_from_name(scale_dtype), codebook_from_name(codebook)};
        check_kernel_choice(mf, Isa::scalar, AmxMode::emulated, 1);  // the group, scale type, codebook
        const MatrixShape s = MatrixShape::make(mf, rows, k);
        const ActLayout a = ActLayout::make(s, true);
        const GemmKernel gemm = amx::emulated_gemm(f, amx::GemmVariant{grouped_loop_from_name(loop), int4_signed});
        constexpr int kOutStride = 32;  // floats per row of a GemmKernel's out
        const int n_blk = s.n_blocks, n_rows = (int)round_up(n_tok, 32);
        auto data = aligned_zeros(s.data_bytes());
        std::vector<uint8_t> scales(s.block_scale_bytes() * n_blk);
        auto tiles = aligned_zeros(AmxPanel::tile_bytes(a, n_rows));
        auto meta = aligned_zeros(AmxPanel::meta_bytes_of(a, n_rows));
        auto row = aligned_zeros(a.row_bytes);
        std::vector<float> out((size_t)n_rows * kOutStride);
        {
          py::gil_scoped_release unlocked;
          RowBlock blk[2];
          for (int j = 0; j < n_blk; ++j) {
            pack_row_block(s, static_cast<const float*>(wb.ptr), j, data.get() + j * s.block_bytes(),
                           scales.data() + j * s.block_scale_bytes());
            blk[j] = RowBlock::at(s, data.get() + j * s.block_bytes(), scales.data() + j * s.block_scale_bytes());
          }
          const AmxPanel panel = AmxPanel::make(a, tiles.get(), meta.get());
          for (int t = 0; t < n_tok; ++t) {
            quantize_activation_amx(f, static_cast<const float*>(xb.ptr) + (size_t)t * k, k, a, row.get());
            panel.store(t, row.get(), a.scales_off);
          }
          // the blocks as their own next call too: the prefetch walks its slices as in the engine (a no-op here)
          gemm(blk, n_blk, blk, n_blk, panel, a, n_tok, out.data());
        }
        std::vector<float> res((size_t)n_tok * 16 * n_blk);
        for (int t = 0; t < n_tok; ++t)
          std::memcpy(&res[(size_t)t * 16 * n_blk], &out[(size_t)t * kOutStride], sizeof(float) * 16 * n_blk);
        return res;
      },
      py::arg("fmt"), py::arg("group"), py::arg("w"), py::arg("x"), py::arg("scaling") = "symmetric",
      py::arg("loop") = "engine", py::arg("int4_signed") = true, py::arg("scale_dtype") = "fp32",
      py::arg("codebook") = "");
  // formats/pack.h store_row_set(exact) on k8 or k4 (`scale_dtype`): the first of `rows` rows of fp32 values
  // (n_groups per row, groups of `group`) whose super-blocks do not all split into sub-scales x fp16, or -1
  // (hetmoe/cpu/codes.py names the matrix)
  m.def(
      "two_level_first_inexact_row",
      [](const std::string& scale_dtype, uintptr_t values, int64_t rows, int n_groups, int group) -> int64_t {
        const ScaleType t = scale_type_from_name(scale_dtype);
        if (!two_level(t)) throw std::invalid_argument("two_level_first_inexact_row: k8 or k4, got " + scale_dtype);
        if (group <= 0 || kSuperBlock % group || n_groups < 0)
          throw std::invalid_argument("two_level_first_inexact_row: a group dividing 256");
        const Scaling scaling = t == ScaleType::k4 ? Scaling::affine : Scaling::symmetric;
        const MatrixShape s =
            MatrixShape::make({WeightFormat::int8, group, scaling, t}, kRowsPerBlock, n_groups * group);
        std::vector<uint8_t> set(s.block_scale_bytes());
        std::vector<float> v(n_groups);
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(v.data(), ptr<const float>(values) + r * n_groups, sizeof(float) * n_groups);
          if (!store_row_set(s, v.data(), 0, set.data(), false, true)) return r;
        }
        return -1;
      },
      py::arg("scale_dtype"), py::arg("values"), py::arg("rows"), py::arg("n_groups"), py::arg("group"),
      py::call_guard<py::gil_scoped_release>());
  // formats/lowbit.h lowbit_quantize on raw addresses (hetmoe/cpu/lowbit.py quantize sized every buffer and passes
  // the candidate denominators its reference search uses)
  m.def(
      "lowbit_quantize",
      [](uintptr_t w, int64_t rows, int64_t k, int group, int bits, bool affine, bool k8, uintptr_t importance,
         const std::vector<double>& denoms, int n_negated, int threads, uintptr_t codes, uintptr_t scales,
         uintptr_t mins) {
        if (group != 16 && group != 32 && group != 64 && group != 128)
          throw std::invalid_argument("lowbit_quantize: group must be 16, 32, 64 or 128");
        if (bits < 2 || bits > 8 || rows < 0 || k < 0 || k % group || (affine && !mins) || threads < 1)
          throw std::invalid_argument("lowbit_quantize: bits 2..8, rows >= 0, k a multiple of the group, threads >= 1");
        if (denoms.empty() || n_negated < 0 || n_negated > (int)denoms.size())
          throw std::invalid_argument("lowbit_quantize: at least one candidate, n_negated among them");
        std::vector<float> d(denoms.begin(), denoms.end());
        LowBitSearch p;
        p.bits = bits, p.affine = affine, p.group = group, p.k8 = k8, p.avx2 = cpu_features().supports(Isa::avx2);
        p.denoms = d.data(), p.n_cands = (int)d.size(), p.n_negated = n_negated;
        lowbit_quantize(p, ptr<const float>(w), rows, k, ptr<const float>(importance), threads, ptr<int8_t>(codes),
                        ptr<float>(scales), ptr<float>(mins));
      },
      py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("group"), py::arg("bits"), py::arg("affine"), py::arg("k8"),
      py::arg("importance"), py::arg("denoms"), py::arg("n_negated"), py::arg("threads"), py::arg("codes"),
      py::arg("scales"), py::arg("mins"), py::call_guard<py::gil_scoped_release>());
  // formats/gguf_blocks.h decode_kquant on raw addresses (the caller sized every buffer: hetmoe/load/gguf/kquants.py)
  m.def(
      "decode_kquant",
      [](const std::string& kind, uintptr_t raw, int64_t rows, int64_t cols, uintptr_t codes, uintptr_t scales,
         uintptr_t mins) {
        const KQuant k = kind == "Q4_K"   ? KQuant::q4_k
                         : kind == "Q5_K" ? KQuant::q5_k
                         : kind == "Q6_K" ? KQuant::q6_k
                         : kind == "Q3_K" ? KQuant::q3_k
                         : kind == "Q2_K" ? KQuant::q2_k
                                          : throw std::invalid_argument("decode_kquant: unknown type " + kind);
        if (rows < 0 || cols < 0 || cols % kQkK)
          throw std::invalid_argument("decode_kquant: rows of whole super-blocks of 256 values");
        decode_kquant(k, ptr<const uint8_t>(raw), rows, cols, ptr<int8_t>(codes), ptr<float>(scales), ptr<float>(mins));
      },
      py::arg("kind"), py::arg("raw"), py::arg("rows"), py::arg("cols"), py::arg("codes"), py::arg("scales"),
      py::arg("mins"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace bindings
}  // namespace hetmoe
