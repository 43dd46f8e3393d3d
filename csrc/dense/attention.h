// Decode attention over the contiguous KV cache (hetmoe/layers/kv_cache.py) on the engine's threads: one query
// token per sequence, each at its own position, GQA and MLA's absorbed form (two-part keys, the latent as value).
//
// For sequence b and query head h (kv head h / g, g = n_head / n_kv_head):
//     s[t]   = scale * (q[b,h] . k1[rows[b], t, kvh] + q2[b,h] . k2[rows[b], t, kvh])      for lo[b] <= t < lens[b]
//     out[b,h] = sum_t e^s[t] v[rows[b], t, kvh] / (sum_t e^s[t] + e^sinks[h])   (v = k1's first dv dims when v_is_k1)
// lo[b] = max(0, lens[b] - window) with a sliding window (the query at position p = lens[b] - 1 sees the window's
// positions p - window < t <= p, itself included: Transformers' sliding-window mask), else 0. The sink (gpt-oss,
// DeepSeek-V4) is a logit per head that joins the softmax's denominator and adds no value; without sinks the term is
// absent (a plain softmax).
// Softmax in fp32: exact within a task (the max of its scores first), merged across splits by their maxima. Work: tasks
// of (sequence, split of kKeysPerSplit keys, up to kHeadsPerTask query heads: the groups of several kv heads when
// groups are small, else a block of one group); each task reads its block of the cache once, in order, for all its
// query heads, and keeps its own max, sum and partial output; a second pass merges the splits of a sequence in split
// order. The split depends on the shapes and lengths only, so the result is bitwise the same for any thread count. The
// span loops (dense/attention_span.h) are compiled twice: portable and AVX2+FMA (kernels/avx2/attention.cpp), chosen
// once by the CPU's features (HETMOE_MAX_ISA caps them).
#pragma once
#include <algorithm>
#include <cstdint>

#include "runtime/thread_pool.h"

namespace hetmoe {

constexpr int64_t kKeysPerSplit = 256;
constexpr int kHeadsPerTask = 32;

// One decode attention call. Tensors are addresses with strides in elements; every last dim is contiguous.
// Key/value tensors hold one layer of the cache, [rows, cap, n_kv_head, d]; all three share one dtype.
struct AttentionArgs {
  const void* q = nullptr;   // [B, n_head, d1]
  const void* q2 = nullptr;  // [B, n_head, d2] or null (d2 = 0)
  int64_t q_stride_b = 0, q_stride_h = 0, q2_stride_b = 0, q2_stride_h = 0;
  bool q_bf16 = false;       // q and q2: bf16, else fp32
  const void* k1 = nullptr;  // [rows, cap, n_kv_head, d1]
  const void* k2 = nullptr;  // [rows, cap, n_kv_head, d2] or null
  const void* v = nullptr;   // [rows, cap, n_kv_head, dv] or null: v is k1 (dv <= d1)
  int64_t k1_strides[3] = {0, 0, 0}, k2_strides[3] = {0, 0, 0}, v_strides[3] = {0, 0, 0};  // row, position, head
  bool kv_bf16 = false;
  const int64_t* rows = nullptr;  // [B] cache row of each sequence
  const int64_t* lens = nullptr;  // [B] keys attended (position + 1), 1..cap
  int64_t n_rows = 0, cap = 0;
  int B = 0, n_head = 0, n_kv_head = 0, d1 = 0, d2 = 0, dv = 0;
  float scale = 1.0f;
  const float* sinks = nullptr;  // [n_head] fp32 or null: each head's sink logit (not scaled)
  int64_t window = 0;            // > 0: only the last `window` keys of each sequence are attended; 0: all of them
  void* out = nullptr;           // [B, n_head, dv]
  int64_t out_stride_b = 0, out_stride_h = 0;
  bool out_bf16 = false;
};

// Checks the arguments (std::invalid_argument naming what is wrong), then runs the call on the pool's threads.
// Call it inside a job (the coordinator thread): it uses pool.parallel_for and the pool's scratch.
void decode_attention(ThreadPool& pool, const AttentionArgs& a);

// Which span loops run here: "avx2" or "portable".
const char* attention_kernel_name();

// ---- the span loops' interface (dense/attention_span.h), one per ISA build ----

constexpr int kSpanKeys = 16;   // keys scored together (copied first when a row is not whole blocks of 16)
constexpr int kValueKeys = 64;  // keys accumulated while a block of the output stays in registers
constexpr int kLanes = 16;      // rows in the span's buffers are padded to a multiple of this many floats

inline int64_t pad_lanes(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// One task: n keys of one sequence for n_kv consecutive kv heads and G query heads of each, into m (the max score), l
// (the sum of e^(s - m)) and o (the sum of e^(s - m) v), all written by the span; query head j of kv head kv is row
// kv * G + j.
struct AttentionSpan {
  const float* q = nullptr;  // [n_kv * G][dk] fp32, dk = pad_lanes(d1) + pad_lanes(d2), zero padding
  int n_kv = 1, G = 0, d1 = 0, d2 = 0, dv = 0;
  const void* k1 = nullptr;  // first key of the span's first kv head (and its value when v is null)
  const void* k2 = nullptr;
  const void* v = nullptr;
  int64_t k1_step = 0, k2_step = 0, v_step = 0;  // elements from one position to the next
  int64_t k1_head = 0, k2_head = 0, v_head = 0;  // elements from one kv head to the next
  bool bf16 = false;
  int64_t n = 0;  // 1 .. kKeysPerSplit
  float scale = 1.0f;
  float* work = nullptr;  // span_work_floats(n_kv * G, ...) floats, 64-byte aligned
  float* m = nullptr;     // [n_kv * G]
  float* l = nullptr;     // [n_kv * G]
  float* o = nullptr;     // [n_kv * G][pad_lanes(dv)]
};

// n_head: the most query heads of a span (n_kv * G); its queries in load order, the scores of one kv head's G
// heads, and rows copied when their length is not a multiple of 16.
inline int64_t span_work_floats(int n_head, int d1, int d2, int dv) {
  const int64_t dk = pad_lanes(d1) + pad_lanes(d2);
  return n_head * dk + n_head * pad_lanes(kKeysPerSplit) + std::max(kSpanKeys * dk, kValueKeys * pad_lanes(dv));
}

using AttentionSpanFn = void (*)(const AttentionSpan& s);
void attention_span_portable(const AttentionSpan& s);
namespace avx2 {
void attention_span(const AttentionSpan& s);
}

}  // namespace hetmoe
