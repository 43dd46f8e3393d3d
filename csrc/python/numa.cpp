// The NUMA part of hetmoe._C (called from python/module.cpp): topology, subpools, tensor-parallel experts. The
// NumaExperts class mirrors MoeExperts method for method, so hetmoe/cpu/experts.py drives either the same way.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "moe/split_experts.h"
#include "python/experts.h"
#include "runtime/topology.h"

namespace py = pybind11;

namespace hetmoe {

namespace {

using bindings::ptr;

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
      .def_property_readonly("plans",
                             [](const NumaPools& p) {
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

  py::class_<NumaExperts, std::shared_ptr<NumaExperts>> experts(m, "NumaExperts");
  bindings::bind_experts_common<NumaExperts, NumaPools, NumaMoeJob>(experts, "pools");
  experts.def("info", [](std::shared_ptr<NumaExperts> ex) {
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

}  // namespace hetmoe
