// Tensor parallelism of one MoE layer over NUMA subpools (runtime/topology.h), built around MoeExperts/MoeJob.
//
// Every expert's intermediate dimension I is cut into slices [i0, i1), one per subpool: slice s is an ordinary
// MoeExperts of intermediate size i1 - i0 holding rows [i0, i1) of gate and up and the matching columns
// [i0, i1) of down, on its subpool, with its memory on the subpool's node (mbind where the machine has several
// memory nodes, and first touched by that node's threads when packing). SwiGLU is elementwise in I and down
// is linear in I, so
//     out[t] = sum_j w[t, j] down_e h_e(x_t) = sum_s sum_j w[t, j] down_e[:, i0:i1] h_e(x_t)[i0:i1],
// and a call runs slice s's MoeJob on subpool s (all at once), each writing a partial [T, H] fp32 output,
// then adds the partials into out (onto its old value when accumulating) in slice order. The gated activation
// (either kind) is elementwise too, with its gate/up biases sliced alike; a down bias is held by slice 0 only
// (the other slices add zeros), so it enters the sum once.
//
// Slice boundaries are multiples of the quantization group (bf16: 32; per-row int8/int4: 128), itself a multiple
// of the 16-row block, so gate/up row blocks, down's scale groups and the groups in which the down input h is
// quantized are all the unsplit engine's: the packed bytes and every activation rounding are bitwise the
// same. What differs is fp32 summation order only: the down dot product over I becomes a sum of per-slice
// partial sums, and the weighted combine runs per slice (measured in tests/cpu/test_numa.py).
//
// Packing reads the full matrices (per-row int8/int4 scales need the whole row), so the slices hold exactly the
// bytes the unsplit engine would. The packed storage (what the converted-expert cache saves) is the slices'
// storage in slice order: it depends on the number of slices, and the cache key includes it.
//
// A job is submitted to subpool 0 like any job; T is read when it runs, then tokens go in chunks of
// kTpChunkTokens so the partial buffers (one per subpool, shared by all layers) stay bounded.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "moe/moe.h"
#include "runtime/topology.h"

namespace hetmoe {

constexpr int64_t kTpChunkTokens = 1024;

class NumaExperts {
 public:
  NumaExperts(const ExpertsConfig& cfg, std::shared_ptr<NumaPools> pools);

  // Same contracts as MoeExperts (moe.h), on full-size matrices: gate, up [n, I, H], down [n, H, I].
  void load(int e0, int n, const float* gate, const float* up, const float* down);
  void load_codes(int e0, int n, const int8_t* const q[3], const float* const group_scales[3],
                  const float* const group_mins[3], const float* const factors[3] = nullptr);
  void unpack(int e, float* gate, float* up, float* down) const;
  void load_biases(int e0, int n, const float* gate, const float* up, const float* down);  // full [n, I] / [n, H]
  void fill_random(uint64_t seed, float std);                // each slice its own stream (seed, slice)
  std::vector<std::pair<uint8_t*, size_t>> storage() const;  // the slices' ranges, slice after slice
  void mark_loaded(int e0, int n);
  uint64_t checksum() const;
  bool is_loaded(int e) const { return slices_[0]->is_loaded(e); }
  int n_loaded() const { return slices_[0]->n_loaded(); }
  size_t bytes_per_expert() const;
  int amx_min_tokens() const { return slices_[0]->amx_min_tokens(); }
  void set_amx_min_tokens(int n) {
    for (auto& s : slices_) s->set_amx_min_tokens(n);
  }

  const ExpertsConfig& config() const { return cfg_; }
  int n_slices() const { return (int)slices_.size(); }
  std::pair<int, int> bounds(int s) const { return bounds_[s]; }  // [i0, i1) of slice s
  const MoeExperts& slice(int s) const { return *slices_[s]; }
  const std::shared_ptr<MoeExperts>& slice_ptr(int s) const { return slices_[s]; }
  NumaPools& pools() const { return *pools_; }
  const std::shared_ptr<NumaPools>& pools_ptr() const { return pools_; }

 private:
  ExpertsConfig cfg_;
  std::shared_ptr<NumaPools> pools_;
  MatrixShape gu_, down_;  // unsplit shapes
  std::vector<std::pair<int, int>> bounds_;
  std::vector<std::shared_ptr<MoeExperts>> slices_;
};

// Slice boundaries: I cut into at most n parts of whole units (the group size), as even as possible.
std::vector<std::pair<int, int>> tp_slices(int intermediate, int unit, int n);

class NumaMoeJob : public Job {
 public:
  NumaMoeJob(std::shared_ptr<NumaExperts> experts, const MoeCall& call);
  void run(ThreadPool& pool) override;  // pool: subpool 0 of the experts' NumaPools

 private:
  void reduce(ThreadPool& pool0, int64_t t0, int64_t nt);
  std::shared_ptr<NumaExperts> experts_;
  MoeCall call_;
  std::vector<uint8_t> mask_;          // the skip mask as read at the start of the run: every slice sees the same
  std::vector<const float*> partial_;  // [n_slices] partial outputs of the current chunk, [nt, H] each
};

}  // namespace hetmoe
