// The NUMA part of hetmoe._C (called from bindings.cpp): topology, subpools, tensor-parallel experts. The
// NumaExperts class mirrors MoeExperts method for method, so hetmoe/kernels.py drives either the same way.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "engine/numa.h"
#include "moe/numa.h"

namespace py = pybind11;

namespace hetmoe {

namespace {

WeightFormat parse_format(const std::string& s) {
  if (s == "bf16") return WeightFormat::bf16;
  if (s == "int8") return WeightFormat::int8;
  if (s == "int4") return WeightFormat::int4;
  throw std::invalid_argument("unknown weight format '" + s + "' (expected bf16, int8 or int4)");
}

template <typename T>
T* ptr(uintptr_t a) { return reinterpret_cast<T*>(a); }

py::list topology_list(const NumaTopology& t) {
  py::list nodes;
  for (const NumaNode& n : t.nodes) {
    py::dict d;
    d["id"] = n.id;
    d["cpus"] = n.cpus;
    d["cores"] = n.cores;
    d["has_memory"] = n.has_memory;
    d["distance"] = n.distance;
    nodes.append(d);
  }
  return nodes;
}

py::dict topology_dict(const NumaTopology& t) {
  py::dict d;
  d["nodes"] = topology_list(t);
  d["source"] = t.source;
  d["cpu_nodes"] = t.n_cpu_nodes();
  d["memory_nodes"] = t.n_memory_nodes();
  return d;
}

py::list plans_list(const std::vector<SubpoolPlan>& plans) {
  py::list out;
  for (const SubpoolPlan& p : plans) {
    py::dict d;
    d["nodes"] = p.nodes;
    d["cpus"] = p.cpus;
    d["threads"] = p.threads;
    d["memory_node"] = p.memory_node;
    out.append(d);
  }
  return out;
}

}  // namespace

void bind_numa(py::module_& m) {
  m.def("parse_cpu_list", &parse_cpu_list, py::arg("text"));
  m.def(
      "numa_topology",
      [](const std::string& root, py::object allowed) {
        if (root.empty() && allowed.is_none()) return topology_dict(system_numa_topology());
        std::vector<int> cpus = allowed.is_none() ? affinity_cpus() : allowed.cast<std::vector<int>>();
        return topology_dict(read_numa_topology(root.empty() ? "/sys/devices/system" : root, cpus));
      },
      py::arg("root") = "", py::arg("allowed") = py::none());
  m.def(
      "numa_plan",
      [](int n_subpools, int n_threads, const std::string& root, py::object allowed) {
        if (root.empty() && allowed.is_none())
          return plans_list(plan_subpools(system_numa_topology(), n_subpools, n_threads));
        std::vector<int> cpus = allowed.is_none() ? affinity_cpus() : allowed.cast<std::vector<int>>();
        return plans_list(plan_subpools(read_numa_topology(root.empty() ? "/sys/devices/system" : root, cpus),
                                        n_subpools, n_threads));
      },
      py::arg("subpools"), py::arg("threads"), py::arg("root") = "", py::arg("allowed") = py::none());
  // (ok, message): binds a fresh page range to `node` and touches it; for tests of the refusal path.
  m.def("numa_bind_probe", [](int node) {
    HugeBuffer buf(1 << 21);
    std::string err = bind_memory(buf.data(), buf.size(), node);
    buf.data()[0] = 1;
    return py::make_tuple(err.empty(), err);
  });

  py::class_<NumaMoeJob, Job, std::shared_ptr<NumaMoeJob>>(m, "NumaMoeJob");

  py::class_<NumaPools, std::shared_ptr<NumaPools>>(m, "NumaPools")
      .def(py::init([](int n_subpools, int n_threads, bool pin, int spin_us, bool bind) {
             return std::make_shared<NumaPools>(plan_subpools(system_numa_topology(), n_subpools, n_threads), pin,
                                                spin_us, bind);
           }),
           py::arg("subpools"), py::arg("threads") = 0, py::arg("pin") = true, py::arg("spin_us") = 500,
           py::arg("bind") = true)
      .def_property_readonly("size", &NumaPools::size)
      .def_property_readonly("threads", &NumaPools::n_threads)
      .def("pool", &NumaPools::pool_ptr, py::arg("s"))
      .def_property_readonly("plans", [](const NumaPools& p) {
        std::vector<SubpoolPlan> plans;
        for (int s = 0; s < p.size(); ++s) plans.push_back(p.plan(s));
        return plans_list(plans);
      })
      .def_property_readonly("binding", &NumaPools::binding)
      .def(
          "read_bandwidth",
          [](NumaPools& p, size_t bytes, int repeats, const std::string& isa) {
            return measure_read_bandwidth(p, bytes, repeats, isa_from_name(isa));
          },
          py::arg("bytes"), py::arg("repeats") = 5, py::arg("isa"), py::call_guard<py::gil_scoped_release>());

  py::class_<NumaExperts, std::shared_ptr<NumaExperts>>(m, "NumaExperts")
      .def(py::init([](std::shared_ptr<NumaPools> pools, int n_expert, int hidden, int inter, const std::string& fmt,
                       int group, const std::string& isa, bool amx_emulated, int amx_min_tokens) {
             ExpertsConfig c;
             c.n_expert = n_expert;
             c.hidden = hidden;
             c.intermediate = inter;
             c.format = parse_format(fmt);
             c.group = group;
             c.isa = isa_from_name(isa);
             c.amx = amx_emulated ? AmxMode::emulated : AmxMode::off;  // as MoeExperts' binding
             c.amx_min_tokens = amx_min_tokens;
             return std::make_shared<NumaExperts>(c, std::move(pools));
           }),
           py::arg("pools"), py::arg("num_experts"), py::arg("hidden_size"), py::arg("intermediate_size"),
           py::arg("weight_format"), py::arg("group_size"), py::arg("isa"), py::arg("amx_emulated") = false,
           py::arg("amx_min_tokens") = kAmxMinTokens)
      .def_property("amx_min_tokens", &NumaExperts::amx_min_tokens, &NumaExperts::set_amx_min_tokens)
      .def(
          "load",
          [](NumaExperts& ex, int e0, int n, uintptr_t gate, uintptr_t up, uintptr_t down) {
            ex.load(e0, n, ptr<const float>(gate), ptr<const float>(up), ptr<const float>(down));
          },
          py::call_guard<py::gil_scoped_release>())
      .def("unpack",
           [](const NumaExperts& ex, int e, uintptr_t gate, uintptr_t up, uintptr_t down) {
             ex.unpack(e, ptr<float>(gate), ptr<float>(up), ptr<float>(down));
           })
      .def("fill_random", &NumaExperts::fill_random, py::arg("seed"), py::arg("std"),
           py::call_guard<py::gil_scoped_release>())
      .def("storage",
           [](const NumaExperts& ex) {
             py::list views;
             for (auto& [p, n] : ex.storage()) views.append(py::memoryview::from_memory(p, (py::ssize_t)n, false));
             return views;
           })
      .def("mark_loaded", &NumaExperts::mark_loaded, py::arg("first_expert"), py::arg("n"))
      .def("checksum", &NumaExperts::checksum, py::call_guard<py::gil_scoped_release>())
      .def("is_loaded", &NumaExperts::is_loaded)
      .def_property_readonly("n_loaded", &NumaExperts::n_loaded)
      .def("info",
           [](std::shared_ptr<NumaExperts> ex) {
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
           })
      .def(
          "make_job",
          [](std::shared_ptr<NumaExperts> ex, uintptr_t x, bool x_bf16, uintptr_t ids, bool ids_int32, uintptr_t weights,
             int k, uintptr_t out, bool out_bf16, bool accumulate, uintptr_t n_tokens_ptr, int64_t n_tokens,
             int64_t capacity, uintptr_t skip_mask) {
            MoeCall c;
            c.x = ptr<const void>(x);
            c.x_bf16 = x_bf16;
            c.ids = ptr<const void>(ids);
            c.ids_int32 = ids_int32;
            c.weights = ptr<const float>(weights);
            c.k = k;
            c.out = ptr<void>(out);
            c.out_bf16 = out_bf16;
            c.accumulate = accumulate;
            c.n_tokens_ptr = ptr<const int64_t>(n_tokens_ptr);
            c.n_tokens = n_tokens;
            c.capacity = capacity;
            c.skip_mask = ptr<const uint8_t>(skip_mask);
            return std::make_shared<NumaMoeJob>(std::move(ex), c);
          },
          py::arg("x"), py::arg("x_bf16"), py::arg("ids"), py::arg("ids_int32"), py::arg("weights"), py::arg("k"),
          py::arg("out"), py::arg("out_bf16"), py::arg("accumulate"), py::arg("n_tokens_ptr"), py::arg("n_tokens"),
          py::arg("capacity"), py::arg("skip_mask"));
}

}  // namespace hetmoe
