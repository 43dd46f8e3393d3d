// MoeExperts and NumaExperts in hetmoe._C: one Python face for both (the constructor's arguments and the methods
// both classes have are bound once, by bind_experts_common), so hetmoe/cpu/experts.py drives either the same way;
// and the jobs they make.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "moe/moe.h"
#include "moe/split_experts.h"
#include "python/bindings.h"

namespace hetmoe {
namespace bindings {

namespace {

// The MoeExperts a Python experts object runs on: itself, or a NUMA engine's slices.
inline std::vector<const MoeExperts*> engines_of(const MoeExperts& ex) { return {&ex}; }
template <typename Split>
std::vector<const MoeExperts*> engines_of(const Split& ex) {
  std::vector<const MoeExperts*> v;
  for (int s = 0; s < ex.n_slices(); ++s) v.push_back(&ex.slice(s));
  return v;
}

// Binds __init__(pool_or_pools, num_experts, hidden_size, intermediate_size, weight_format, group_size, isa,
// amx_emulated=False, amx_min_tokens=...) and the shared methods on `c`; Pools is what the constructor takes,
// Job what make_job returns (a job over a MoeCall).
template <typename Experts, typename Pools, typename JobT>
void bind_experts_common(py::class_<Experts, std::shared_ptr<Experts>>& c, const char* pools_arg) {
  c.def(py::init([](std::shared_ptr<Pools> pools, int n_expert, int hidden, int inter, const std::string& fmt,
                    int group, const std::string& isa, bool amx_emulated, int amx_min_tokens) {
          ExpertsConfig cfg;
          cfg.n_expert = n_expert;
          cfg.hidden = hidden;
          cfg.intermediate = inter;
          cfg.format = format_from_name(fmt);
          cfg.group = group;
          cfg.isa = isa_from_name(isa);
          cfg.amx = amx_emulated ? AmxMode::emulated : AmxMode::off;
          cfg.amx_min_tokens = amx_min_tokens;
          return std::make_shared<Experts>(cfg, std::move(pools));
        }),
        py::arg(pools_arg), py::arg("num_experts"), py::arg("hidden_size"), py::arg("intermediate_size"),
        py::arg("weight_format"), py::arg("group_size"), py::arg("isa"), py::arg("amx_emulated") = false,
        py::arg("amx_min_tokens") = kAmxMinTokens)
      .def_property("amx_min_tokens", &Experts::amx_min_tokens, &Experts::set_amx_min_tokens)
      .def(
          "load",
          [](Experts& ex, int e0, int n, uintptr_t gate, uintptr_t up, uintptr_t down) {
            ex.load(e0, n, ptr<const float>(gate), ptr<const float>(up), ptr<const float>(down));
          },
          py::call_guard<py::gil_scoped_release>())
      .def("unpack", [](const Experts& ex, int e, uintptr_t gate, uintptr_t up,
                        uintptr_t down) { ex.unpack(e, ptr<float>(gate), ptr<float>(up), ptr<float>(down)); })
      .def("fill_random", &Experts::fill_random, py::arg("seed"), py::arg("std"),
           py::call_guard<py::gil_scoped_release>())
      .def("storage",
           [](const Experts& ex) {
             py::list views;
             for (auto& [p, n] : ex.storage()) views.append(py::memoryview::from_memory(p, (py::ssize_t)n, false));
             return views;
           })
      .def("mark_loaded", &Experts::mark_loaded, py::arg("first_expert"), py::arg("n"))
      .def("checksum", &Experts::checksum, py::call_guard<py::gil_scoped_release>())
      .def("is_loaded", &Experts::is_loaded)
      .def("set_profiling",
           [](const Experts& ex, bool on) {
             for (const MoeExperts* e : engines_of(ex)) const_cast<MoeExperts*>(e)->set_profiling(on);
           })
      .def("reset_profile",
           [](const Experts& ex) {
             for (const MoeExperts* e : engines_of(ex)) const_cast<MoeExperts*>(e)->reset_profile();
           })
      .def("profile",
           [](const Experts& ex) {  // one dict per engine slice: jobs, and ns summed per stage
             py::list out;
             for (const MoeExperts* e : engines_of(ex)) {
               const JobProfile p = e->profile();
               py::dict d;
               d["jobs"] = p.jobs;
               for (int i = 0; i < kJobStages; ++i) d[job_stage_name(i)] = p.ns[i];
               out.append(d);
             }
             return out;
           })
      .def_property_readonly("n_loaded", &Experts::n_loaded)
      .def(
          "make_job",
          [](std::shared_ptr<Experts> ex, uintptr_t x, bool x_bf16, uintptr_t ids, bool ids_int32, uintptr_t weights,
             int k, uintptr_t out, bool out_bf16, bool accumulate, uintptr_t n_tokens_ptr, int64_t n_tokens,
             int64_t capacity, uintptr_t skip_mask, int defer_lowest, const std::string& part, uintptr_t logits,
             bool logits_bf16, bool norm_topk_prob, uintptr_t addend, const std::string& router, int n_group,
             int topk_group, float routed_scaling_factor, uintptr_t correction_bias) {
            MoeCall call;
            call.x = ptr<const void>(x);
            call.x_bf16 = x_bf16;
            call.ids = ptr<const void>(ids);
            call.ids_int32 = ids_int32;
            call.weights = ptr<const float>(weights);
            call.k = k;
            call.out = ptr<void>(out);
            call.out_bf16 = out_bf16;
            call.accumulate = accumulate;
            call.n_tokens_ptr = ptr<const int64_t>(n_tokens_ptr);
            call.n_tokens = n_tokens;
            call.capacity = capacity;
            call.skip_mask = ptr<const uint8_t>(skip_mask);
            call.defer_lowest = defer_lowest;
            call.logits = ptr<const void>(logits);
            call.logits_bf16 = logits_bf16;
            if (router == "softmax")
              call.router.score = RouteScore::softmax;
            else if (router == "sigmoid_grouped")
              call.router.score = RouteScore::sigmoid_grouped;
            else
              throw std::invalid_argument("router must be softmax or sigmoid_grouped, got '" + router + "'");
            call.router.norm_topk_prob = norm_topk_prob;
            call.router.n_group = n_group;
            call.router.topk_group = topk_group;
            call.router.scaling = routed_scaling_factor;
            call.router.bias = ptr<const float>(correction_bias);
            if (call.logits) check_router(call.router, ex->config().n_expert, k);
            call.addend = ptr<const float>(addend);
            if (part == "all")
              call.part = JobPart::all;
            else if (part == "immediate")
              call.part = JobPart::immediate;
            else if (part == "deferred")
              call.part = JobPart::deferred;
            else
              throw std::invalid_argument("part must be all, immediate or deferred, got '" + part + "'");
            return std::make_shared<JobT>(std::move(ex), call);
          },
          py::arg("x"), py::arg("x_bf16"), py::arg("ids"), py::arg("ids_int32"), py::arg("weights"), py::arg("k"),
          py::arg("out"), py::arg("out_bf16"), py::arg("accumulate"), py::arg("n_tokens_ptr"), py::arg("n_tokens"),
          py::arg("capacity"), py::arg("skip_mask"), py::arg("defer_lowest") = 0, py::arg("part") = "all",
          py::arg("logits") = 0, py::arg("logits_bf16") = false, py::arg("norm_topk_prob") = false,
          py::arg("addend") = 0, py::arg("router") = "softmax", py::arg("n_group") = 1, py::arg("topk_group") = 1,
          py::arg("routed_scaling_factor") = 1.f, py::arg("correction_bias") = 0);
}

}  // namespace

void bind_experts(py::module_& m) {
  py::class_<MoeJob, Job, std::shared_ptr<MoeJob>>(m, "MoeJob");
  py::class_<NumaMoeJob, Job, std::shared_ptr<NumaMoeJob>>(m, "NumaMoeJob");
  m.def("pair_deferral_jobs", &MoeJob::pair, py::arg("immediate"), py::arg("deferred"));
  m.def("paired_deferral_runs", &MoeJob::paired_runs);
  m.def("chained_deferral_runs", &MoeJob::chained_runs);

  py::class_<MoeExperts, std::shared_ptr<MoeExperts>> experts(m, "MoeExperts");
  bind_experts_common<MoeExperts, ThreadPool, MoeJob>(experts, "pool");
  experts.def("info", [](const MoeExperts& ex) {
    const ExpertsConfig& c = ex.config();
    py::dict d;
    d["weight_format"] = format_name(c.format);
    const MatrixShape& gu = ex.gate_up_shape();
    if (gu.has_scales())
      d["group_size"] = gu.per_row ? 0 : gu.group;  // 0 = per-row scales
    else
      d["group_size"] = py::none();
    d["isa"] = isa_name(c.isa);
    d["kernel"] = ex.kernel().name;
    d["activation"] = c.format == WeightFormat::bf16 ? "fp32" : c.format == WeightFormat::int8 ? "int16" : "int8";
    const AmxMode amx = ex.amx_mode();
    d["amx"] = amx == AmxMode::native ? "native" : amx == AmxMode::emulated ? "emulated" : "off";
    if (amx != AmxMode::off) {
      d["amx_kernel"] = ex.kernel().gemm_name;
      d["amx_min_tokens"] = ex.amx_min_tokens();
      d["amx_activation"] = c.format == WeightFormat::bf16 ? "bf16" : "int8";
    } else {
      d["amx_kernel"] = py::none();
      d["amx_min_tokens"] = py::none();
      d["amx_activation"] = py::none();
    }
    d["bytes_per_expert"] = ex.bytes_per_expert();
    d["threads"] = ex.pool().size();
    d["num_experts"] = c.n_expert;
    d["hidden_size"] = c.hidden;
    d["intermediate_size"] = c.intermediate;
    return d;
  });

  py::class_<NumaExperts, std::shared_ptr<NumaExperts>> numa_experts(m, "NumaExperts");
  bind_experts_common<NumaExperts, NumaPools, NumaMoeJob>(numa_experts, "pools");
  numa_experts.def("info", [](std::shared_ptr<NumaExperts> ex) {
    // MoeExperts.info() of slice 0 (format, kernel, ISA, activations), with the whole layer's sizes.
    py::dict d = py::cast(ex->slice_ptr(0)).attr("info")();
    d["intermediate_size"] = ex->config().intermediate;
    d["bytes_per_expert"] = ex->bytes_per_expert();
    d["threads"] = ex->pools().n_threads();
    d["numa_subpools"] = ex->pools().size();
    std::vector<std::pair<int, int>> b;
    for (int s = 0; s < ex->n_slices(); ++s) b.push_back(ex->bounds(s));
    d["numa_slices"] = b;
    d["numa_binding"] = ex->pools().binding();
    return d;
  });
}

}  // namespace bindings
}  // namespace hetmoe
