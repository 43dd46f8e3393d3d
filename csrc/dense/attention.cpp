// Decode attention on the engine's threads (dense/attention.h): the checks, the task split, the merge of a
// sequence's splits, and the portable build of the span loops.
#include "dense/attention.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "dense/attention_span.h"
#include "runtime/cpu_features.h"

namespace hetmoe {

void attention_span_portable(const AttentionSpan& s) { span_impl(s); }

namespace {

constexpr int kTaskSlot = 16;     // pool scratch: the task list
constexpr int kPartialSlot = 17;  // pool scratch: each task's m, l and output
constexpr int kMergeSlot = 18;    // pool scratch: the first task of each set of splits to merge

AttentionSpanFn span_fn() {
  static const AttentionSpanFn fn = cpu_features().supports(Isa::avx2) ? avx2::attention_span : attention_span_portable;
  return fn;
}

// keys kKeysPerSplit * split .. of sequence b, for query heads h0 .. h0 + nh (those of kv heads kv0 .. kv0 + n_kv)
struct Task {
  int b, kv0, n_kv, h0, nh;
  int64_t split, n_split;
};

void fail(const std::string& what) { throw std::invalid_argument("decode_attention: " + what); }

void check(const AttentionArgs& a) {
  if (a.B < 0) fail("B must be >= 0, got " + std::to_string(a.B));
  if (a.n_head < 1 || a.n_kv_head < 1 || a.n_head % a.n_kv_head)
    fail("n_head (" + std::to_string(a.n_head) + ") must be a positive multiple of n_kv_head (" +
         std::to_string(a.n_kv_head) + ")");
  if (a.d1 < 1 || a.d2 < 0 || a.dv < 1)
    fail("head dims must be d1 >= 1, d2 >= 0, dv >= 1; got " + std::to_string(a.d1) + ", " + std::to_string(a.d2) +
         ", " + std::to_string(a.dv));
  if ((a.d2 > 0) != (a.q2 != nullptr) || (a.d2 > 0) != (a.k2 != nullptr)) fail("q2 and k2 come together, with d2 > 0");
  if (!a.v && a.dv > a.d1)
    fail("v is k1, so dv (" + std::to_string(a.dv) + ") must be <= d1 (" + std::to_string(a.d1) + ")");
  if (a.window < 0) fail("window must be >= 0 (0: no window), got " + std::to_string(a.window));
  if (a.B == 0) return;
  if (!a.q || !a.k1 || !a.out || !a.rows || !a.lens) fail("q, k1, out, rows and lens must be given");
  for (int b = 0; b < a.B; ++b) {
    if (a.rows[b] < 0 || a.rows[b] >= a.n_rows)
      fail("rows[" + std::to_string(b) + "] = " + std::to_string(a.rows[b]) + " is outside the cache's " +
           std::to_string(a.n_rows) + " rows");
    if (a.lens[b] < 1 || a.lens[b] > a.cap)
      fail("lens[" + std::to_string(b) + "] = " + std::to_string(a.lens[b]) + " must be in 1.." +
           std::to_string(a.cap) + " (the cache's capacity)");
  }
}

// The first key sequence b attends: its window's first, or 0.
inline int64_t first_key(const AttentionArgs& a, int b) {
  return a.window > 0 ? std::max<int64_t>(0, a.lens[b] - a.window) : 0;
}

// Head h's sink joined to a softmax of max m and sum l (both relative to m): the sum and the max made relative to
// max(m, sink), l's new value returned and the factor e^(m - max) by which the output's sum is to be multiplied. No
// sink: l and 1 unchanged (multiplying by 1 is exact, so such a head's output is bitwise that of plain softmax).
inline float join_sink(const AttentionArgs& a, int h, float m, float& l) {
  if (!a.sinks) return 1.0f;
  const float sink = a.sinks[h], mx = std::max(m, sink);
  const float w = exp_neg(m - mx);
  l = l * w + exp_neg(sink - mx);
  return w;
}

// out[b, h] = acc * mult / l in the output's dtype (bf16: rounded to nearest even)
inline void store_out(const AttentionArgs& a, int b, int h, const float* acc, float l, float mult) {
  if (a.out_bf16) {
    uint16_t* o = static_cast<uint16_t*>(a.out) + b * a.out_stride_b + h * a.out_stride_h;
    for (int d = 0; d < a.dv; ++d) {
      const float x = acc[d] * mult / l;
      uint32_t u;
      std::memcpy(&u, &x, sizeof u);
      o[d] = (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)((u >> 16) | 0x40)  // NaN stays a (quiet) NaN
                                             : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
    }
  } else {
    float* o = static_cast<float*>(a.out) + b * a.out_stride_b + h * a.out_stride_h;
    for (int d = 0; d < a.dv; ++d) o[d] = acc[d] * mult / l;
  }
}

}  // namespace

const char* attention_kernel_name() { return span_fn() == attention_span_portable ? "portable" : "avx2"; }

void decode_attention(ThreadPool& pool, const AttentionArgs& a) {
  check(a);
  if (a.B == 0) return;
  // Query heads per task: whole groups of kv heads while they fit in kHeadsPerTask, else blocks of one group.
  const int g = a.n_head / a.n_kv_head;
  int kv_per_task = g >= kHeadsPerTask ? 1 : std::min(a.n_kv_head, kHeadsPerTask / g);
  // Short contexts (a decode step at a few hundred positions: one split per sequence) give fewer tasks than
  // threads: halve the kv heads per task until every thread has two (the same bits: heads are independent).
  auto splits_of = [&](int b) { return (a.lens[b] - first_key(a, b) + kKeysPerSplit - 1) / kKeysPerSplit; };
  int64_t n_splits = 0;
  for (int b = 0; b < a.B; ++b) n_splits += splits_of(b);
  while (kv_per_task > 1 && n_splits * ((a.n_kv_head + kv_per_task - 1) / kv_per_task) < 2 * (int64_t)pool.size())
    kv_per_task = (kv_per_task + 1) / 2;
  int hb = g >= kHeadsPerTask ? kHeadsPerTask : kv_per_task * g;  // the most query heads of a task
  // Still too few with one kv head a task (MLA's single latent head): halve the heads of a task too, while that
  // leaves a multiple of 4 (the span's blocks of 4 heads, so every head is computed by the same loops).
  while (kv_per_task == 1 && hb % 8 == 0 && n_splits * a.n_kv_head * ((g + hb - 1) / hb) < 2 * (int64_t)pool.size())
    hb /= 2;
  const int d1p = (int)pad_lanes(a.d1), dk = d1p + (int)pad_lanes(a.d2), dvp = (int)pad_lanes(a.dv);
  const int64_t part_floats = pad_lanes((int64_t)hb * (dvp + 2));  // m [hb], l [hb], o [hb][dvp]

  int64_t n_tasks = 0, per_split = 0;  // per_split: tasks of one split of a sequence
  for (int kv0 = 0; kv0 < a.n_kv_head; kv0 += kv_per_task) per_split += kv_per_task == 1 ? (g + hb - 1) / hb : 1;
  for (int b = 0; b < a.B; ++b) n_tasks += per_split * splits_of(b);
  Task* tasks = reinterpret_cast<Task*>(pool.scratch(kTaskSlot, sizeof(Task) * n_tasks));
  int64_t n = 0, n_merge = 0;
  for (int b = 0; b < a.B; ++b) {
    const int64_t n_split = splits_of(b);
    for (int kv0 = 0; kv0 < a.n_kv_head; kv0 += kv_per_task) {
      const int n_kv = std::min(kv_per_task, a.n_kv_head - kv0);
      for (int h0 = kv0 * g; h0 < (kv0 + n_kv) * g; h0 += hb) {
        const int nh = std::min(hb, (kv0 + n_kv) * g - h0);
        for (int64_t sp = 0; sp < n_split; ++sp) tasks[n++] = Task{b, kv0, n_kv, h0, nh, sp, n_split};
        n_merge += n_split > 1;
      }
    }
  }
  float* parts = reinterpret_cast<float*>(pool.scratch(kPartialSlot, sizeof(float) * part_floats * n_tasks));
  const size_t q_floats = (size_t)hb * dk;
  const size_t work_bytes = sizeof(float) * (q_floats + span_work_floats(hb, a.d1, a.d2, a.dv));
  const AttentionSpanFn span = span_fn();
  const size_t qe = a.q_bf16 ? 2 : 4, ke = a.kv_bf16 ? 2 : 4;

  pool.parallel_for(n_tasks, [&](int64_t i, int th) {
    const Task& t = tasks[i];
    float* qf = reinterpret_cast<float*>(pool.thread_scratch(th, work_bytes));
    for (int j = 0; j < t.nh; ++j) {
      const int h = t.h0 + j;
      row_to_f32(static_cast<const uint8_t*>(a.q) + (t.b * a.q_stride_b + h * a.q_stride_h) * qe, a.q_bf16, a.d1,
                 qf + (size_t)j * dk);
      if (a.d2)
        row_to_f32(static_cast<const uint8_t*>(a.q2) + (t.b * a.q2_stride_b + h * a.q2_stride_h) * qe, a.q_bf16, a.d2,
                   qf + (size_t)j * dk + d1p);
    }
    const int64_t row = a.rows[t.b], p0 = first_key(a, t.b) + t.split * kKeysPerSplit;
    auto at = [&](const void* base, const int64_t* st) -> const void* {
      return base ? static_cast<const uint8_t*>(base) + (row * st[0] + p0 * st[1] + t.kv0 * st[2]) * ke : nullptr;
    };
    AttentionSpan s;
    s.q = qf;
    s.n_kv = t.n_kv, s.G = t.nh / t.n_kv, s.d1 = a.d1, s.d2 = a.d2, s.dv = a.dv;
    s.k1 = at(a.k1, a.k1_strides), s.k2 = at(a.k2, a.k2_strides), s.v = at(a.v, a.v_strides);
    s.k1_step = a.k1_strides[1], s.k2_step = a.k2_strides[1], s.v_step = a.v_strides[1];
    s.k1_head = a.k1_strides[2], s.k2_head = a.k2_strides[2], s.v_head = a.v_strides[2];
    s.bf16 = a.kv_bf16;
    s.n = std::min(kKeysPerSplit, a.lens[t.b] - p0);
    s.scale = a.scale;
    s.work = qf + pad_lanes((int64_t)q_floats);
    float* part = parts + i * part_floats;
    s.m = part, s.l = part + hb, s.o = part + 2 * hb;
    span(s);
    if (t.n_split == 1)
      for (int j = 0; j < t.nh; ++j) {
        float l = s.l[j];
        const float mult = join_sink(a, t.h0 + j, s.m[j], l);
        store_out(a, t.b, t.h0 + j, s.o + (size_t)j * dvp, l, mult);
      }
  });
  if (n_merge == 0) return;

  // Merge: a sequence's splits (consecutive tasks) by their maxima, in split order.
  int64_t* first = reinterpret_cast<int64_t*>(pool.scratch(kMergeSlot, sizeof(int64_t) * n_merge));
  for (int64_t i = 0, k = 0; i < n_tasks; i += tasks[i].n_split)
    if (tasks[i].n_split > 1) first[k++] = i;
  pool.parallel_for(n_merge, [&](int64_t k, int th) {
    const Task& t0 = tasks[first[k]];
    float* acc = reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * (dvp + t0.n_split)));
    float* w = acc + dvp;
    for (int j = 0; j < t0.nh; ++j) {
      float mx = a.sinks ? a.sinks[t0.h0 + j] : -std::numeric_limits<float>::infinity();
      for (int64_t sp = 0; sp < t0.n_split; ++sp) mx = std::max(mx, parts[(first[k] + sp) * part_floats + j]);
      float l = a.sinks ? exp_neg(a.sinks[t0.h0 + j] - mx) : 0.0f;  // the sink's term first, then the splits'
      for (int64_t sp = 0; sp < t0.n_split; ++sp) {
        const float* part = parts + (first[k] + sp) * part_floats;
        w[sp] = exp_neg(part[j] - mx);
        l += part[hb + j] * w[sp];
      }
      std::fill(acc, acc + dvp, 0.0f);
      for (int64_t sp = 0; sp < t0.n_split; ++sp) {
        const float* o = parts + (first[k] + sp) * part_floats + 2 * hb + (size_t)j * dvp;
        for (int d = 0; d < dvp; ++d) acc[d] += o[d] * w[sp];
      }
      store_out(a, t0.b, t0.h0 + j, acc, l, 1.0f);
    }
  });
}

}  // namespace hetmoe
