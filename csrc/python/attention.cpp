// Decode attention in hetmoe._C (hetmoe/cpu/attention.py is the Python face): one AttentionSpec per call, run on a
// pool's threads as a job after those already queued.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dense/attention.h"
#include "dense/decode_block.h"
#include "python/bindings.h"

namespace hetmoe {
namespace bindings {

namespace {

// One call as Python describes it: tensors as addresses (0 = none), strides in elements. The C++ twin is
// AttentionArgs (dense/attention.h).
struct AttentionSpec {
  uintptr_t q = 0, q2 = 0;                                 // [B, n_head, d1], [B, n_head, d2]
  std::vector<int64_t> q_strides{0, 0}, q2_strides{0, 0};  // (b, head)
  bool q_bf16 = false;
  uintptr_t k1 = 0, k2 = 0, v = 0;  // [rows, cap, n_kv_head, d]; v = 0: v is k1
  std::vector<int64_t> k1_strides{0, 0, 0}, k2_strides{0, 0, 0}, v_strides{0, 0, 0};  // (row, position, head)
  bool kv_bf16 = false;
  uintptr_t rows = 0, lens = 0;  // [B] int64
  int64_t n_rows = 0, cap = 0;
  int B = 0, n_head = 0, n_kv_head = 0, d1 = 0, d2 = 0, dv = 0;
  float scale = 1.0f;
  uintptr_t sinks = 0;  // [n_head] fp32 or 0: no sinks
  int64_t window = 0;   // 0: no sliding window
  uintptr_t out = 0;    // [B, n_head, dv]
  std::vector<int64_t> out_strides{0, 0};
  bool out_bf16 = false;
};

void copy_strides(const std::vector<int64_t>& from, int64_t* to, size_t n, const char* name) {
  if (from.size() != n)
    throw std::invalid_argument(std::string("decode_attention: ") + name + " needs " + std::to_string(n) +
                                " strides, got " + std::to_string(from.size()));
  for (size_t i = 0; i < n; ++i) to[i] = from[i];
}

AttentionArgs make_args(const AttentionSpec& s) {
  AttentionArgs a;
  int64_t st[2];
  a.q = ptr<const void>(s.q), a.q2 = ptr<const void>(s.q2), a.q_bf16 = s.q_bf16;
  copy_strides(s.q_strides, st, 2, "q_strides");
  a.q_stride_b = st[0], a.q_stride_h = st[1];
  copy_strides(s.q2_strides, st, 2, "q2_strides");
  a.q2_stride_b = st[0], a.q2_stride_h = st[1];
  a.k1 = ptr<const void>(s.k1), a.k2 = ptr<const void>(s.k2), a.v = ptr<const void>(s.v), a.kv_bf16 = s.kv_bf16;
  copy_strides(s.k1_strides, a.k1_strides, 3, "k1_strides");
  copy_strides(s.k2_strides, a.k2_strides, 3, "k2_strides");
  copy_strides(s.v_strides, a.v_strides, 3, "v_strides");
  a.rows = ptr<const int64_t>(s.rows), a.lens = ptr<const int64_t>(s.lens), a.n_rows = s.n_rows, a.cap = s.cap;
  a.B = s.B, a.n_head = s.n_head, a.n_kv_head = s.n_kv_head, a.d1 = s.d1, a.d2 = s.d2, a.dv = s.dv;
  a.scale = s.scale;
  a.sinks = ptr<const float>(s.sinks), a.window = s.window;
  a.out = ptr<void>(s.out), a.out_bf16 = s.out_bf16;
  copy_strides(s.out_strides, st, 2, "out_strides");
  a.out_stride_b = st[0], a.out_stride_h = st[1];
  return a;
}

// The fused GQA decode block (dense/decode_block.h) as Python describes it; the C++ twin is DecodeBlockArgs.
struct DecodeBlockSpec {
  uintptr_t qkv = 0;  // [B, (n_head + 2 n_kv_head) d]
  int64_t qkv_stride_b = 0;
  bool qkv_bf16 = false;
  int B = 0, n_head = 0, n_kv_head = 0, d = 0;
  uintptr_t q_norm = 0, k_norm = 0;  // fp32 [d] or 0
  float norm_eps = 1e-6f;
  uintptr_t cos = 0, sin = 0;  // [B, d]
  int64_t cs_stride_b = 0;
  bool cs_bf16 = false;
  uintptr_t k_cache = 0, v_cache = 0;                           // [rows, cap, n_kv_head, d]
  std::vector<int64_t> k_strides{0, 0, 0}, v_strides{0, 0, 0};  // (row, position, head)
  bool kv_bf16 = false;
  int64_t n_rows = 0, cap = 0;
  uintptr_t rows = 0, positions = 0;  // [B] int64
  float scale = 1.0f;
  uintptr_t out = 0;  // [B, n_head, d]
  std::vector<int64_t> out_strides{0, 0};
  bool out_bf16 = false;
};

DecodeBlockArgs make_block_args(const DecodeBlockSpec& s) {
  DecodeBlockArgs a;
  a.qkv = ptr<void>(s.qkv), a.qkv_stride_b = s.qkv_stride_b, a.qkv_bf16 = s.qkv_bf16;
  a.B = s.B, a.n_head = s.n_head, a.n_kv_head = s.n_kv_head, a.d = s.d;
  a.q_norm = ptr<const float>(s.q_norm), a.k_norm = ptr<const float>(s.k_norm), a.norm_eps = s.norm_eps;
  a.cos = ptr<const void>(s.cos), a.sin = ptr<const void>(s.sin), a.cs_stride_b = s.cs_stride_b;
  a.cs_bf16 = s.cs_bf16;
  a.k_cache = ptr<void>(s.k_cache), a.v_cache = ptr<void>(s.v_cache), a.kv_bf16 = s.kv_bf16;
  copy_strides(s.k_strides, a.k_strides, 3, "k_strides");
  copy_strides(s.v_strides, a.v_strides, 3, "v_strides");
  a.n_rows = s.n_rows, a.cap = s.cap;
  a.rows = ptr<const int64_t>(s.rows), a.positions = ptr<const int64_t>(s.positions);
  a.scale = s.scale;
  int64_t st[2];
  copy_strides(s.out_strides, st, 2, "out_strides");
  a.out = ptr<void>(s.out), a.out_stride_b = st[0], a.out_stride_h = st[1], a.out_bf16 = s.out_bf16;
  return a;
}

}  // namespace

void bind_attention(py::module_& m) {
  py::class_<AttentionSpec> spec(m, "AttentionSpec");
  spec.def(py::init([](const py::kwargs& fields) {  // AttentionSpec(**fields): unknown names raise AttributeError
    py::object s = py::cast(AttentionSpec{});
    for (auto item : fields) py::setattr(s, item.first, item.second);
    return s.cast<AttentionSpec>();
  }));
  spec.def_readwrite("q", &AttentionSpec::q)
      .def_readwrite("q2", &AttentionSpec::q2)
      .def_readwrite("q_strides", &AttentionSpec::q_strides)
      .def_readwrite("q2_strides", &AttentionSpec::q2_strides)
      .def_readwrite("q_bf16", &AttentionSpec::q_bf16)
      .def_readwrite("k1", &AttentionSpec::k1)
      .def_readwrite("k2", &AttentionSpec::k2)
      .def_readwrite("v", &AttentionSpec::v)
      .def_readwrite("k1_strides", &AttentionSpec::k1_strides)
      .def_readwrite("k2_strides", &AttentionSpec::k2_strides)
      .def_readwrite("v_strides", &AttentionSpec::v_strides)
      .def_readwrite("kv_bf16", &AttentionSpec::kv_bf16)
      .def_readwrite("rows", &AttentionSpec::rows)
      .def_readwrite("lens", &AttentionSpec::lens)
      .def_readwrite("n_rows", &AttentionSpec::n_rows)
      .def_readwrite("cap", &AttentionSpec::cap)
      .def_readwrite("B", &AttentionSpec::B)
      .def_readwrite("n_head", &AttentionSpec::n_head)
      .def_readwrite("n_kv_head", &AttentionSpec::n_kv_head)
      .def_readwrite("d1", &AttentionSpec::d1)
      .def_readwrite("d2", &AttentionSpec::d2)
      .def_readwrite("dv", &AttentionSpec::dv)
      .def_readwrite("scale", &AttentionSpec::scale)
      .def_readwrite("sinks", &AttentionSpec::sinks)
      .def_readwrite("window", &AttentionSpec::window)
      .def_readwrite("out", &AttentionSpec::out)
      .def_readwrite("out_strides", &AttentionSpec::out_strides)
      .def_readwrite("out_bf16", &AttentionSpec::out_bf16);

  m.def(
      "decode_attention",
      [](std::shared_ptr<ThreadPool> pool, const AttentionSpec& s) {
        const AttentionArgs a = make_args(s);
        pool->run_and_wait([&a](ThreadPool& p) { decode_attention(p, a); });
      },
      py::arg("pool"), py::arg("spec"), py::call_guard<py::gil_scoped_release>());
  m.def("attention_kernel", &attention_kernel_name);

  py::class_<DecodeBlockSpec> block(m, "DecodeBlockSpec");
  block.def(py::init([](const py::kwargs& fields) {
    py::object s = py::cast(DecodeBlockSpec{});
    for (auto item : fields) py::setattr(s, item.first, item.second);
    return s.cast<DecodeBlockSpec>();
  }));
  block.def_readwrite("qkv", &DecodeBlockSpec::qkv)
      .def_readwrite("qkv_stride_b", &DecodeBlockSpec::qkv_stride_b)
      .def_readwrite("qkv_bf16", &DecodeBlockSpec::qkv_bf16)
      .def_readwrite("B", &DecodeBlockSpec::B)
      .def_readwrite("n_head", &DecodeBlockSpec::n_head)
      .def_readwrite("n_kv_head", &DecodeBlockSpec::n_kv_head)
      .def_readwrite("d", &DecodeBlockSpec::d)
      .def_readwrite("q_norm", &DecodeBlockSpec::q_norm)
      .def_readwrite("k_norm", &DecodeBlockSpec::k_norm)
      .def_readwrite("norm_eps", &DecodeBlockSpec::norm_eps)
      .def_readwrite("cos", &DecodeBlockSpec::cos)
      .def_readwrite("sin", &DecodeBlockSpec::sin)
      .def_readwrite("cs_stride_b", &DecodeBlockSpec::cs_stride_b)
      .def_readwrite("cs_bf16", &DecodeBlockSpec::cs_bf16)
      .def_readwrite("k_cache", &DecodeBlockSpec::k_cache)
      .def_readwrite("v_cache", &DecodeBlockSpec::v_cache)
      .def_readwrite("k_strides", &DecodeBlockSpec::k_strides)
      .def_readwrite("v_strides", &DecodeBlockSpec::v_strides)
      .def_readwrite("kv_bf16", &DecodeBlockSpec::kv_bf16)
      .def_readwrite("n_rows", &DecodeBlockSpec::n_rows)
      .def_readwrite("cap", &DecodeBlockSpec::cap)
      .def_readwrite("rows", &DecodeBlockSpec::rows)
      .def_readwrite("positions", &DecodeBlockSpec::positions)
      .def_readwrite("scale", &DecodeBlockSpec::scale)
      .def_readwrite("out", &DecodeBlockSpec::out)
      .def_readwrite("out_strides", &DecodeBlockSpec::out_strides)
      .def_readwrite("out_bf16", &DecodeBlockSpec::out_bf16);
  m.def(
      "decode_block",
      [](std::shared_ptr<ThreadPool> pool, const DecodeBlockSpec& s) {
        const DecodeBlockArgs a = make_block_args(s);
        pool->run_and_wait([&a](ThreadPool& p) { decode_block(p, a); });
      },
      py::arg("pool"), py::arg("spec"), py::call_guard<py::gil_scoped_release>());
  // The same call as a job to submit as often as needed (a decode step's JobList): the spec's buffers are read
  // when it runs, and an invalid row or position is raised by the pool's next sync.
  m.def(
      "decode_block_job",
      [](const DecodeBlockSpec& s) -> std::shared_ptr<Job> {
        const DecodeBlockArgs a = make_block_args(s);
        return std::make_shared<FunctionJob>([a](ThreadPool& p) { decode_block(p, a); });
      },
      py::arg("spec"));
}

}  // namespace bindings
}  // namespace hetmoe
