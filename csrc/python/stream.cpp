// Stream-ordered submit/sync of CPU jobs (stream/host_funcs.h, stream/signals.h) in hetmoe._C.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "python/bindings.h"
#include "runtime/thread_pool.h"
#include "stream/driver.h"
#include "stream/fake_stream.h"
#include "stream/host_funcs.h"
#include "stream/signals.h"

namespace hetmoe {
namespace bindings {

namespace {

// HostFuncs and StreamSignals: the two ways of stream-ordered submit/sync (stream/host_funcs.h,
// stream/signals.h), bound with one Python face. Streams cross as raw handles
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

}  // namespace

void bind_stream(py::module_& m) {
  // CUDA host functions (stream/host_funcs.h). Streams cross as raw handles (torch.cuda.Stream.cuda_stream) or
  // as a FakeStream (tests without CUDA).
  m.def("cuda_hooks_available", &cuda_driver::available);
  m.def("cuda_hooks_error", [] { return cuda_driver::unavailable_reason(); });

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
  m.def("stream_signals_available", &cuda_driver::signals_available);
  m.def("stream_signals_error", [] { return cuda_driver::signals_unavailable_reason(); });
  bind_stream_work<StreamSignals>(m, "StreamSignals")
      .def_property_readonly("kicks", &StreamSignals::kicks)
      .def_property_readonly("slot_high_water", &StreamSignals::slot_high_water);
}

}  // namespace bindings
}  // namespace hetmoe
