// The runtime in hetmoe._C: thread pools and their jobs, NUMA topology and subpools, and the bandwidth probes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "python/bindings.h"
#include "runtime/bandwidth.h"
#include "runtime/cpu_features.h"
#include "runtime/huge_buffer.h"
#include "runtime/thread_pool.h"
#include "runtime/topology.h"

namespace hetmoe {
namespace bindings {

namespace {

// Tests: a job that holds the pool's coordinator until open(), so that every job submitted behind it is queued
// when it ends (pairing and chaining of deferral jobs then no longer depend on timing).
struct GateJob : Job {
  std::mutex mu;
  std::condition_variable cv;
  bool opened = false;
  void run(ThreadPool&) override {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return opened; });
  }
  void open() {
    {
      std::lock_guard<std::mutex> lk(mu);
      opened = true;
    }
    cv.notify_all();
  }
};

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

void bind_runtime(py::module_& m) {
  m.def("physical_core_cpus", &physical_core_cpus);
  py::class_<Job, std::shared_ptr<Job>>(m, "Job");
  py::class_<GateJob, Job, std::shared_ptr<GateJob>>(m, "GateJob").def(py::init<>()).def("open", &GateJob::open);
  py::class_<JobList, Job, std::shared_ptr<JobList>>(m, "JobList")
      .def(py::init<std::vector<std::shared_ptr<Job>>>(), py::arg("jobs"))
      .def("__len__", [](const JobList& l) { return l.jobs.size(); });

  py::class_<ThreadPool, std::shared_ptr<ThreadPool>>(m, "ThreadPool")
      .def(py::init<int, bool, int>(), py::arg("threads") = 0, py::arg("pin") = true, py::arg("spin_us") = 500)
      .def_property_readonly("size", &ThreadPool::size)
      .def_property_readonly("pinned_cpus", &ThreadPool::pinned_cpus)
      .def(
          "submit", [](ThreadPool& p, std::shared_ptr<Job> job) { return p.submit(std::move(job)); }, py::arg("job"))
      .def("sync", &ThreadPool::sync, py::arg("allow_pending") = 0, py::call_guard<py::gil_scoped_release>())
      .def("pending", &ThreadPool::pending)
      .def(
          "read_bandwidth",
          [](ThreadPool& p, size_t bytes, int repeats, const std::string& isa) {
            return measure_read_bandwidth(p, bytes, repeats, isa_from_name(isa));
          },
          py::arg("bytes"), py::arg("repeats") = 5, py::arg("isa"), py::call_guard<py::gil_scoped_release>())
      .def("amx_peak", &measure_amx_peak, py::arg("bf16"), py::arg("rounds") = 200000,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "borrowed_ids_seen",
          // Submits n borrowed jobs, each recording whether its id (ThreadPool::submit_borrowed's id_out) was
          // already stored when it ran; returns how many saw it (tests: every one must).
          [](ThreadPool& p, int n) {
            struct Probe : Job {
              std::atomic<uint64_t> id{0};
              bool seen = false;
              void run(ThreadPool&) override { seen = id.load(std::memory_order_acquire) != 0; }
            };
            std::vector<Probe> probes(n);
            uint64_t last = 0;
            for (Probe& j : probes) last = p.submit_borrowed(&j, &j.id);
            p.wait_for(last);
            int seen = 0;
            for (const Probe& j : probes) seen += j.seen;
            return seen;
          },
          py::arg("n"), py::call_guard<py::gil_scoped_release>());

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
}

}  // namespace bindings
}  // namespace hetmoe
