// The Python module hetmoe._C. Tensors cross as raw addresses (validated by hetmoe/cpu/experts.py), so this
// extension links no libtorch. Invalid arguments raise ValueError (std::invalid_argument), other failures
// RuntimeError.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "moe/expert_tasks.h"
#include "moe/moe.h"
#include "python/experts.h"
#include "runtime/cpu_features.h"
#include "runtime/thread_pool.h"
#include "stream/host_funcs.h"
#include "stream/signals.h"

namespace py = pybind11;
using namespace hetmoe;

namespace hetmoe {
void bind_numa(py::module_& m);  // python/numa.cpp
}

namespace {

using bindings::format_from_name;
using bindings::ptr;

const char* format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::bf16: return "bf16";
    case WeightFormat::int8: return "int8";
    case WeightFormat::int4: return "int4";
  }
  return "?";
}

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

}  // namespace

// HostFuncs and StreamSignals: the two ways of stream-ordered submit/sync (csrc/stream/host_funcs.h,
// csrc/stream/signals.h), bound with one Python face. Streams cross as raw handles
// (torch.cuda.Stream.cuda_stream) or as a FakeStream (tests without CUDA).
template <typename Owner>
py::class_<Owner, std::shared_ptr<Owner>> bind_stream_work(py::module_& m, const char* name) {
  auto on = [](uintptr_t s) { return HostStream{s, nullptr}; };
  auto on_fake = [](FakeStream& s) { return HostStream{0, &s}; };
  using PoolPtr = std::shared_ptr<ThreadPool>;
  py::class_<Owner, std::shared_ptr<Owner>> c(m, name);
  c.def(py::init<>())
      .def(
          "submit",
          [on](Owner& h, uintptr_t stream, PoolPtr pool, std::shared_ptr<Job> job) {
            return h.enqueue_submit(on(stream), std::move(pool), std::move(job));
          },
          py::arg("stream"), py::arg("pool"), py::arg("job"))
      .def(
          "submit",
          [on_fake](Owner& h, FakeStream& stream, PoolPtr pool, std::shared_ptr<Job> job) {
            return h.enqueue_submit(on_fake(stream), std::move(pool), std::move(job));
          },
          py::arg("stream"), py::arg("pool"), py::arg("job"))
      .def(
          "sync",
          [on](Owner& h, uintptr_t stream, PoolPtr pool, int64_t allow_pending) {
            return h.enqueue_sync(on(stream), std::move(pool), allow_pending);
          },
          py::arg("stream"), py::arg("pool"), py::arg("allow_pending"))
      .def(
          "sync",
          [on_fake](Owner& h, FakeStream& stream, PoolPtr pool, int64_t allow_pending) {
            return h.enqueue_sync(on_fake(stream), std::move(pool), allow_pending);
          },
          py::arg("stream"), py::arg("pool"), py::arg("allow_pending"))
      .def("release_finished", &Owner::release_finished)
      .def("close", &Owner::close, py::call_guard<py::gil_scoped_release>())
      .def("__len__", &Owner::size)
      .def_property_readonly("n_captured", &Owner::n_captured)
      .def_property_readonly("n_not_run", &Owner::n_not_run);
  return c;
}

// A 1-d float32 buffer argument of the row-work bindings, and an ISA level this CPU runs.
static py::buffer_info float_row(py::buffer x, const char* fn) {
  py::buffer_info b = x.request();
  if (b.format != py::format_descriptor<float>::format() || b.ndim != 1)
    throw std::invalid_argument(std::string(fn) + ": x must be a 1-d float32 buffer");
  return b;
}
static Isa runnable_isa(const std::string& isa) {
  const Isa level = isa_from_name(isa);
  if (!cpu_features().supports(level))
    throw std::invalid_argument("this CPU cannot run " + isa + ": " + isa_refusal(level));
  return level;
}

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
    for (WeightFormat f : {WeightFormat::bf16, WeightFormat::int8, WeightFormat::int4})
      amx_min[format_name(f)] = default_amx_min_tokens(f);
    d["amx_min_tokens_default"] = amx_min;
    return d;
  });
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
  m.def("physical_core_cpus", &physical_core_cpus);
  m.attr("LAYOUT_VERSION") = kLayoutVersion;

  py::class_<Job, std::shared_ptr<Job>>(m, "Job");
  py::class_<MoeJob, Job, std::shared_ptr<MoeJob>>(m, "MoeJob");
  py::class_<GateJob, Job, std::shared_ptr<GateJob>>(m, "GateJob").def(py::init<>()).def("open", &GateJob::open);
  m.def("pair_deferral_jobs", &MoeJob::pair, py::arg("immediate"), py::arg("deferred"));
  m.def("paired_deferral_runs", &MoeJob::paired_runs);
  m.def("chained_deferral_runs", &MoeJob::chained_runs);

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

  // CUDA host functions (csrc/stream/host_funcs.h). Streams cross as raw handles (torch.cuda.Stream.cuda_stream) or
  // as a FakeStream (tests without CUDA).
  m.def("cuda_hooks_available", &cuda_hooks::available);
  m.def("cuda_hooks_error", [] { return cuda_hooks::unavailable_reason(); });

  py::class_<FakeStream, std::shared_ptr<FakeStream>>(m, "FakeStream")
      .def(py::init<>())
      .def("begin_capture", &FakeStream::begin_capture)
      .def("end_capture", &FakeStream::end_capture)
      .def_property_readonly("capturing", &FakeStream::capturing)
      .def("replay", &FakeStream::replay)
      .def("pause", &FakeStream::pause)
      .def("resume", &FakeStream::resume)
      .def("synchronize", &FakeStream::synchronize, py::call_guard<py::gil_scoped_release>());

  bind_stream_work<HostFuncs>(m, "HostFuncs");
  m.def("stream_signals_available", &cuda_hooks::signals_available);
  m.def("stream_signals_error", [] { return cuda_hooks::signals_unavailable_reason(); });
  bind_stream_work<StreamSignals>(m, "StreamSignals")
      .def_property_readonly("kicks", &StreamSignals::kicks)
      .def_property_readonly("slot_high_water", &StreamSignals::slot_high_water);

  py::class_<MoeExperts, std::shared_ptr<MoeExperts>> experts(m, "MoeExperts");
  bindings::bind_experts_common<MoeExperts, ThreadPool, MoeJob>(experts, "pool");
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

  bind_numa(m);
}
