// DenseLinear and its jobs in hetmoe._C (hetmoe/cpu/linear.py is the Python face): the constructor from a
// LinearConfig given by keywords, and one LinearSpec per call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "dense/linear.h"
#include "python/bindings.h"

namespace hetmoe {
namespace bindings {

namespace {

// One call as Python describes it (hetmoe/cpu/linear.py CPULinear): tensors as addresses (0 = none) with their dtype
// flags and row strides in elements. The C++ twin is LinearCall.
struct LinearSpec {
  uintptr_t x = 0;  // [T, K] fp32, or bf16 with x_bf16
  bool x_bf16 = false;
  int64_t x_stride = 0;  // 0: K
  uintptr_t out = 0;     // [T, N] fp32, or bf16 with out_bf16
  bool out_bf16 = false;
  int64_t out_stride = 0;  // 0: N
  uintptr_t bias = 0;      // [N] fp32
  bool accumulate = false;
  uintptr_t norm_weight = 0;  // [K] fp32: RMSNorm of x first
  float norm_eps = 1e-6f;
  uintptr_t norm_out = 0;  // [T, K] in x's dtype: the normed rows, rounded as the eager norm (0 = none)
  int64_t norm_out_stride = 0;
  uintptr_t n_tokens_ptr = 0;  // one int64 read when the job runs (0: T)
  int64_t T = 0;               // rows of x and out (the capacity), and the token count without n_tokens_ptr
};

LinearCall make_call(const LinearSpec& s) {
  if (s.T < 0) throw std::invalid_argument("linear call: T must be >= 0, got " + std::to_string(s.T));
  LinearCall c;
  c.x = ptr<const void>(s.x);
  c.x_bf16 = s.x_bf16;
  c.x_stride = s.x_stride;
  c.out = ptr<void>(s.out);
  c.out_bf16 = s.out_bf16;
  c.out_stride = s.out_stride;
  c.bias = ptr<const float>(s.bias);
  c.accumulate = s.accumulate;
  c.norm = ptr<const float>(s.norm_weight);
  c.norm_eps = s.norm_eps;
  c.norm_out = ptr<void>(s.norm_out);
  c.norm_out_stride = s.norm_out_stride;
  c.n_tokens_ptr = ptr<const int64_t>(s.n_tokens_ptr);
  c.n_tokens = s.T;
  c.capacity = s.T;
  return c;
}

}  // namespace

void bind_linear(py::module_& m) {
  py::class_<LinearSpec> spec(m, "LinearSpec");
  spec.def(py::init([](const py::kwargs& fields) {  // LinearSpec(**fields): unknown names raise AttributeError
        py::object s = py::cast(LinearSpec{});
        for (auto item : fields) py::setattr(s, item.first, item.second);
        return s.cast<LinearSpec>();
      }))
      .def_readwrite("x", &LinearSpec::x)
      .def_readwrite("x_bf16", &LinearSpec::x_bf16)
      .def_readwrite("x_stride", &LinearSpec::x_stride)
      .def_readwrite("out", &LinearSpec::out)
      .def_readwrite("out_bf16", &LinearSpec::out_bf16)
      .def_readwrite("out_stride", &LinearSpec::out_stride)
      .def_readwrite("bias", &LinearSpec::bias)
      .def_readwrite("accumulate", &LinearSpec::accumulate)
      .def_readwrite("norm_weight", &LinearSpec::norm_weight)
      .def_readwrite("norm_eps", &LinearSpec::norm_eps)
      .def_readwrite("norm_out", &LinearSpec::norm_out)
      .def_readwrite("norm_out_stride", &LinearSpec::norm_out_stride)
      .def_readwrite("n_tokens_ptr", &LinearSpec::n_tokens_ptr)
      .def_readwrite("T", &LinearSpec::T);

  py::class_<LinearJob, Job, std::shared_ptr<LinearJob>>(m, "LinearJob");

  py::class_<DenseLinear, std::shared_ptr<DenseLinear>>(m, "DenseLinear")
      .def(py::init([](std::shared_ptr<ThreadPool> pool, int out_features, int in_features, const std::string& fmt,
                       int group, const std::string& isa, bool amx_emulated, int amx_min_tokens) {
             LinearConfig cfg;
             cfg.n = out_features;
             cfg.k = in_features;
             cfg.format = format_from_name(fmt);
             cfg.group = group;
             cfg.isa = isa_from_name(isa);
             cfg.amx = amx_emulated ? AmxMode::emulated : AmxMode::off;
             cfg.amx_min_tokens = amx_min_tokens;
             return std::make_shared<DenseLinear>(cfg, std::move(pool));
           }),
           py::arg("pool"), py::arg("out_features"), py::arg("in_features"), py::arg("weight_format"),
           py::arg("group_size"), py::arg("isa"), py::arg("amx_emulated") = false, py::arg("amx_min_tokens") = 4)
      .def_property("amx_min_tokens", &DenseLinear::amx_min_tokens, &DenseLinear::set_amx_min_tokens)
      .def(
          "load_rows",
          [](DenseLinear& lin, int r0, int n_rows, uintptr_t w) { lin.load_rows(r0, n_rows, ptr<const float>(w)); },
          py::arg("first_row"), py::arg("n_rows"), py::arg("weight"), py::call_guard<py::gil_scoped_release>())
      .def(
          "unpack", [](const DenseLinear& lin, uintptr_t w) { lin.unpack(ptr<float>(w)); }, py::arg("out"),
          py::call_guard<py::gil_scoped_release>())
      .def("fill_random", &DenseLinear::fill_random, py::arg("seed"), py::arg("std"),
           py::call_guard<py::gil_scoped_release>())
      .def("storage",
           [](const DenseLinear& lin) {
             py::list views;
             for (auto& [p, n] : lin.storage()) views.append(py::memoryview::from_memory(p, (py::ssize_t)n, false));
             return views;
           })
      .def("mark_loaded", &DenseLinear::mark_loaded)
      .def("checksum", &DenseLinear::checksum, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("loaded", &DenseLinear::loaded)
      .def_property_readonly("nbytes", &DenseLinear::nbytes)
      .def(
          "run", [](const DenseLinear& lin, const LinearSpec& s) { lin.run(make_call(s)); }, py::arg("spec"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "make_job",
          [](std::shared_ptr<DenseLinear> lin, const LinearSpec& s) {
            return std::make_shared<LinearJob>(std::move(lin), make_call(s));
          },
          py::arg("spec"))
      .def("info", [](const DenseLinear& lin) {
        const LinearConfig& c = lin.config();
        const MatrixShape& s = lin.shape();
        py::dict d;
        d["weight_format"] = format_name(c.format);
        if (s.has_scales())
          d["group_size"] = s.per_row ? 0 : s.group;  // 0 = per-row scales
        else
          d["group_size"] = py::none();
        d["isa"] = isa_name(c.isa);
        d["kernel"] = lin.kernel().name;
        d["activation"] = c.format == WeightFormat::bf16 ? "fp32" : wide_codes(c.format) ? "int16" : "int8";
        const AmxMode amx = lin.amx_mode();
        d["amx"] = amx == AmxMode::native ? "native" : amx == AmxMode::emulated ? "emulated" : "off";
        d["amx_kernel"] = amx != AmxMode::off ? py::cast(lin.kernel().gemm_name) : py::none();
        d["amx_min_tokens"] = amx != AmxMode::off ? py::cast(lin.amx_min_tokens()) : py::none();
        d["amx_activation"] =
            amx != AmxMode::off ? py::cast(c.format == WeightFormat::bf16 ? "bf16" : "int8") : py::none();
        d["out_features"] = c.n;
        d["in_features"] = c.k;
        d["nbytes"] = lin.nbytes();
        d["threads"] = lin.pool().size();
        return d;
      });
}

}  // namespace bindings
}  // namespace hetmoe
