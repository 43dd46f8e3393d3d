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

Scaling scaling_from_name(const std::string& s) {
  if (s == "symmetric") return Scaling::symmetric;
  if (s == "affine") return Scaling::affine;
  throw std::invalid_argument("unknown scaling '" + s + "' (expected symmetric or affine)");
}

const char* scaling_name(Scaling s) { return s == Scaling::affine ? "affine" : "symmetric"; }

// The experts' gated activation by name (formats/activation.h kGluNames); alpha, limit, offset: clamped_swiglu's.
Glu glu_from_name(const std::string& name, float alpha, float limit, float offset) {
  for (int k = 0; k < (int)(sizeof(kGluNames) / sizeof(kGluNames[0])); ++k)
    if (name == kGluNames[k]) return {(GluKind)k, alpha, limit, offset};
  throw std::invalid_argument("unknown activation '" + name + "' (expected swiglu or clamped_swiglu)");
}

// One MoE call as Python describes it to make_job (hetmoe/cpu/experts.py CPUExperts.prepare): tensors as addresses
// (Tensor.data_ptr(); 0 = none) with their dtype flags, shapes in the letters of moe/moe.h. The C++ twin is MoeCall;
// make_call converts one into the other and checks what can be checked without the tensors.
struct JobSpec {
  uintptr_t x = 0;  // [T, H] fp32, or bf16 with x_bf16
  bool x_bf16 = false;
  uintptr_t ids = 0;  // [T, k] int64, or int32 with ids_int32 (-1 = skip); written by a job that routes itself
  bool ids_int32 = false;
  uintptr_t weights = 0;  // [T, k] fp32; written by a job that routes itself
  int k = 0;
  uintptr_t out = 0;  // [T, H] fp32, or bf16 with out_bf16
  bool out_bf16 = false;
  bool accumulate = false;      // out (+)= the experts' sum
  uintptr_t n_tokens_ptr = 0;   // one int64 read when the job runs (the token count; 0: T)
  int64_t T = 0;                // rows of every buffer (the capacity), and the token count without n_tokens_ptr
  uintptr_t skip_mask = 0;      // [E] uint8/bool, nonzero = the CPU skips this expert; read when the job runs
  JobPart part = JobPart::all;  // which of each token's k slots the job computes (Expert Deferral)
  int defer = 0;                // d: the deferred part is each token's d lowest-weighted slots (parts other than all)
  uintptr_t addend = 0;         // [T, H] fp32 added to each token's sum after the experts
  // Routing on the CPU (moe/routing.h): with logits set, the job routes every token itself and writes ids, weights.
  uintptr_t logits = 0;  // [T, E] fp32, or bf16 with logits_bf16
  bool logits_bf16 = false;
  RouteScore router = RouteScore::softmax;
  bool norm_topk_prob = false;
  int n_group = 1;
  int topk_group = 1;
  float routed_scaling_factor = 1.f;
  uintptr_t correction_bias = 0;  // [E] fp32 (sigmoid_grouped; 0: zeros)
};

// Throws std::invalid_argument for a spec no job can run (MoeJob's constructor checks k and the deferral fields).
MoeCall make_call(const JobSpec& s, int n_expert) {
  if (s.T > 0 && (!s.x || !s.ids || !s.weights || !s.out))
    throw std::invalid_argument("make_job: x, ids, weights and out must be set for T > 0");
  if (s.T < 0) throw std::invalid_argument("make_job: T must be >= 0, got " + std::to_string(s.T));
  MoeCall call;
  call.x = ptr<const void>(s.x);
  call.x_bf16 = s.x_bf16;
  call.ids = ptr<const void>(s.ids);
  call.ids_int32 = s.ids_int32;
  call.weights = ptr<const float>(s.weights);
  call.k = s.k;
  call.out = ptr<void>(s.out);
  call.out_bf16 = s.out_bf16;
  call.accumulate = s.accumulate;
  call.n_tokens_ptr = ptr<const int64_t>(s.n_tokens_ptr);
  call.n_tokens = s.T;
  call.capacity = s.T;
  call.skip_mask = ptr<const uint8_t>(s.skip_mask);
  call.part = s.part;
  call.defer_lowest = s.defer;
  call.addend = ptr<const float>(s.addend);
  call.logits = ptr<const void>(s.logits);
  call.logits_bf16 = s.logits_bf16;
  call.router.score = s.router;
  call.router.norm_topk_prob = s.norm_topk_prob;
  call.router.n_group = s.n_group;
  call.router.topk_group = s.topk_group;
  call.router.scaling = s.routed_scaling_factor;
  call.router.bias = ptr<const float>(s.correction_bias);
  if (call.logits) check_router(call.router, n_expert, s.k);
  return call;
}

// JobSpec(**fields): unknown names raise AttributeError (the class has no dynamic attributes).
void bind_job_spec(py::module_& m) {
  py::enum_<JobPart>(m, "JobPart")
      .value("all", JobPart::all)
      .value("immediate", JobPart::immediate)
      .value("deferred", JobPart::deferred);
  py::enum_<RouteScore>(m, "RouterKind")
      .value("softmax", RouteScore::softmax)
      .value("sigmoid_grouped", RouteScore::sigmoid_grouped);
  py::class_<JobSpec> c(m, "JobSpec");
  c.def(py::init([](const py::kwargs& fields) {
     py::object spec = py::cast(JobSpec{});
     for (auto item : fields) py::setattr(spec, item.first, item.second);
     return spec.cast<JobSpec>();
   }))
      .def_readwrite("x", &JobSpec::x)
      .def_readwrite("x_bf16", &JobSpec::x_bf16)
      .def_readwrite("ids", &JobSpec::ids)
      .def_readwrite("ids_int32", &JobSpec::ids_int32)
      .def_readwrite("weights", &JobSpec::weights)
      .def_readwrite("k", &JobSpec::k)
      .def_readwrite("out", &JobSpec::out)
      .def_readwrite("out_bf16", &JobSpec::out_bf16)
      .def_readwrite("accumulate", &JobSpec::accumulate)
      .def_readwrite("n_tokens_ptr", &JobSpec::n_tokens_ptr)
      .def_readwrite("T", &JobSpec::T)
      .def_readwrite("skip_mask", &JobSpec::skip_mask)
      .def_readwrite("part", &JobSpec::part)
      .def_readwrite("defer", &JobSpec::defer)
      .def_readwrite("addend", &JobSpec::addend)
      .def_readwrite("logits", &JobSpec::logits)
      .def_readwrite("logits_bf16", &JobSpec::logits_bf16)
      .def_readwrite("router", &JobSpec::router)
      .def_readwrite("norm_topk_prob", &JobSpec::norm_topk_prob)
      .def_readwrite("n_group", &JobSpec::n_group)
      .def_readwrite("topk_group", &JobSpec::topk_group)
      .def_readwrite("routed_scaling_factor", &JobSpec::routed_scaling_factor)
      .def_readwrite("correction_bias", &JobSpec::correction_bias);
}

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
// Job what make_job(JobSpec) returns (a job over a MoeCall).
template <typename Experts, typename Pools, typename JobT>
void bind_experts_common(py::class_<Experts, std::shared_ptr<Experts>>& c, const char* pools_arg) {
  c.def(py::init([](std::shared_ptr<Pools> pools, int n_expert, int hidden, int inter, const std::string& fmt,
                    int group, const std::string& isa, bool amx_emulated, int amx_min_tokens, int down_group,
                    const std::string& gate_up_scaling, const std::string& down_scaling, const std::string& down_fmt,
                    const std::string& gate_up_scale_dtype, const std::string& down_scale_dtype,
                    const std::string& gate_up_codebook, const std::string& down_codebook, bool gate_up_shared_scales,
                    bool down_shared_scales, const std::string& activation, float alpha, float limit, float offset,
                    bool bias) {
          ExpertsConfig cfg;
          cfg.n_expert = n_expert;
          cfg.hidden = hidden;
          cfg.intermediate = inter;
          cfg.format = format_from_name(fmt);
          cfg.group = group;
          cfg.down_group = down_group;
          if (!down_fmt.empty()) cfg.down_format = format_from_name(down_fmt);
          cfg.gate_up_scaling = scaling_from_name(gate_up_scaling);
          cfg.down_scaling = scaling_from_name(down_scaling);
          cfg.gate_up_scale_type = scale_type_from_name(gate_up_scale_dtype);
          cfg.down_scale_type = scale_type_from_name(down_scale_dtype);
          cfg.gate_up_codebook = codebook_from_name(gate_up_codebook);
          cfg.down_codebook = codebook_from_name(down_codebook);
          cfg.gate_up_shared_scales = gate_up_shared_scales;
          cfg.down_shared_scales = down_shared_scales;
          cfg.isa = isa_from_name(isa);
          cfg.amx = amx_emulated ? AmxMode::emulated : AmxMode::off;
          cfg.amx_min_tokens = amx_min_tokens;
          cfg.glu = glu_from_name(activation, alpha, limit, offset);
          cfg.bias = bias;
          return std::make_shared<Experts>(cfg, std::move(pools));
        }),
        py::arg(pools_arg), py::arg("num_experts"), py::arg("hidden_size"), py::arg("intermediate_size"),
        py::arg("weight_format"), py::arg("group_size"), py::arg("isa"), py::arg("amx_emulated") = false,
        py::arg("amx_min_tokens") = kAmxMinTokens, py::arg("down_group_size") = 0,
        py::arg("gate_up_scaling") = "symmetric", py::arg("down_scaling") = "symmetric", py::arg("down_format") = "",
        py::arg("gate_up_scale_dtype") = "fp32", py::arg("down_scale_dtype") = "fp32", py::arg("gate_up_codebook") = "",
        py::arg("down_codebook") = "", py::arg("gate_up_shared_scales") = false, py::arg("down_shared_scales") = false,
        py::arg("activation") = "swiglu", py::arg("alpha") = 1.f, py::arg("limit") = 0.f, py::arg("offset") = 1.f,
        py::arg("bias") = false)
      .def_property("amx_min_tokens", &Experts::amx_min_tokens, &Experts::set_amx_min_tokens)
      .def(
          "load",
          [](Experts& ex, int e0, int n, uintptr_t gate, uintptr_t up, uintptr_t down) {
            ex.load(e0, n, ptr<const float>(gate), ptr<const float>(up), ptr<const float>(down));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "load_codes",
          [](Experts& ex, int e0, int n, uintptr_t gq, uintptr_t gs, uintptr_t uq, uintptr_t us, uintptr_t dq,
             uintptr_t ds, uintptr_t gm, uintptr_t um, uintptr_t dm, uintptr_t gf, uintptr_t uf,
             uintptr_t df) {  // mins: 0 for symmetric matrices; factors: 0 but for e4m3 scales (fp32 [n])
            const int8_t* q[3] = {ptr<const int8_t>(gq), ptr<const int8_t>(uq), ptr<const int8_t>(dq)};
            const float* s[3] = {ptr<const float>(gs), ptr<const float>(us), ptr<const float>(ds)};
            const float* m[3] = {ptr<const float>(gm), ptr<const float>(um), ptr<const float>(dm)};
            const float* f[3] = {ptr<const float>(gf), ptr<const float>(uf), ptr<const float>(df)};
            ex.load_codes(e0, n, q, s, m, f);
          },
          py::arg("first_expert"), py::arg("n"), py::arg("gate_codes"), py::arg("gate_scales"), py::arg("up_codes"),
          py::arg("up_scales"), py::arg("down_codes"), py::arg("down_scales"), py::arg("gate_mins") = 0,
          py::arg("up_mins") = 0, py::arg("down_mins") = 0, py::arg("gate_factors") = 0, py::arg("up_factors") = 0,
          py::arg("down_factors") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "load_biases",
          [](Experts& ex, int e0, int n, uintptr_t gate, uintptr_t up, uintptr_t down) {
            ex.load_biases(e0, n, ptr<const float>(gate), ptr<const float>(up), ptr<const float>(down));
          },
          py::arg("first_expert"), py::arg("n"), py::arg("gate"), py::arg("up"), py::arg("down"))
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
          [](std::shared_ptr<Experts> ex, const JobSpec& spec) {
            return std::make_shared<JobT>(ex, make_call(spec, ex->config().n_expert));
          },
          py::arg("spec"));
}

}  // namespace

void bind_experts(py::module_& m) {
  bind_job_spec(m);
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
    const MatrixShape& dn = ex.down_shape();
    if (gu.has_scales()) {
      d["group_size"] = gu.per_row ? 0 : gu.group;  // 0 = per-row scales
      d["down_group_size"] = dn.per_row ? 0 : dn.group;
    } else {
      d["group_size"] = py::none();
      d["down_group_size"] = py::none();
    }
    d["gate_up_scaling"] = scaling_name(gu.scaling);
    d["down_scaling"] = scaling_name(dn.scaling);
    // how the scales are stored and (lut4) the codebook; None where the matrix has none
    auto scale_dtype = [](const MatrixShape& m) -> py::object {
      return m.has_scales() ? py::cast(kScaleTypeNames[(int)m.scale_type]) : py::none();
    };
    auto codebook = [](const MatrixShape& m) -> py::object {
      return m.codebook != Codebook::none ? py::cast(kCodebookNames[(int)m.codebook]) : py::none();
    };
    d["gate_up_scale_dtype"] = scale_dtype(gu);
    d["down_scale_dtype"] = scale_dtype(dn);
    d["gate_up_codebook"] = codebook(gu);
    d["down_codebook"] = codebook(dn);
    d["gate_up_shared_scales"] = gu.shared_scales;
    d["down_shared_scales"] = dn.shared_scales;
    d["isa"] = isa_name(c.isa);
    d["kernel"] = ex.kernel().name;
    auto activation = [](WeightFormat f) { return float_activations(f) ? "fp32" : wide_codes(f) ? "int16" : "int8"; };
    d["activation"] = activation(c.format);
    d["down_weight_format"] = format_name(ex.down_format());
    d["down_kernel"] = ex.down_kernel().name;
    d["down_activation"] = activation(ex.down_format());
    const AmxMode amx = ex.amx_mode();
    d["amx"] = amx == AmxMode::native ? "native" : amx == AmxMode::emulated ? "emulated" : "off";
    if (amx != AmxMode::off) {
      d["amx_kernel"] = ex.kernel().gemm_name;
      d["amx_min_tokens"] = ex.amx_min_tokens();
      d["amx_activation"] = float_activations(c.format) ? "bf16" : "int8";
    } else {
      d["amx_kernel"] = py::none();
      d["amx_min_tokens"] = py::none();
      d["amx_activation"] = py::none();
    }
    d["glu"] = kGluNames[(int)c.glu.kind];
    d["glu_alpha"] = c.glu.kind == GluKind::clamped_swiglu ? py::cast(c.glu.alpha) : py::none();
    d["glu_limit"] = c.glu.kind == GluKind::clamped_swiglu ? py::cast(c.glu.limit) : py::none();
    d["glu_offset"] = c.glu.kind == GluKind::clamped_swiglu ? py::cast(c.glu.offset) : py::none();
    d["bias"] = c.bias;
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
