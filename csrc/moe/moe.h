// The fused MoE layer on the CPU: the routed experts of one layer, packed, and the job that computes them.
//
// One call:  x [T, H], topk_ids [T, k], topk_weights [T, k]  ->  out [T, H] (overwritten or accumulated)
//   route    group (token, slot) pairs by expert; skip -1 ids, experts masked off (they live on the GPU) and,
//            under Expert Deferral, the slots of the other part (JobPart)
//   quantize x once per token for the weight format
//   experts  one list of tasks pulled dynamically by every pool thread:
//            gate+up of every active expert, split in (expert, row-block range, token range) tasks; the gated
//            activation h = silu(gate) * up (or the clamped SwiGLU, ExpertsConfig::glu; each expert's gate/up
//            biases added first when it has them) is applied in the same task, and the task that completes an
//            expert's rows quantizes them once per (token, expert);
//            then down of every active expert, same split (plus the expert's down bias); a down task waits until
//            its expert's h is quantized (no barrier between the two halves)
//   combine  out[t] (+)= sum_j topk_weights[t, j] * y[t, j], in slot order (deterministic): with a few tokens by
//            the down task that completes a run of output columns, with many after the tasks on every thread
// T is read when the job runs (through a pointer when given), so one prepared job serves every T up to its
// capacity; this is what lets a CUDA graph replay it.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "formats/activation.h"
#include "formats/layout.h"
#include "kernels/dispatch.h"
#include "moe/routing.h"
#include "runtime/cpu_features.h"
#include "runtime/huge_buffer.h"
#include "runtime/thread_pool.h"

namespace hetmoe {

// Experts with at least this many tokens in a call run on the AMX GEMM (where the engine has one), the
// others on the row-block kernels, on the same packed weights; overridable per layer
// (CPUExperts(amx_min_tokens=...)). From the crossover `hetmoe bench kernel --crossover` measures (AMX vs
// AVX-512 on the same layer, 1..32 tokens per expert; BENCHMARKS.md#amx-crossover): bf16 and int8 AMX win from
// 1 token per expert, kept at 4 so decode stays on the row-block kernels; int4 AMX (nibbles unpacked per tile)
// wins only from 32.
constexpr int kAmxMinTokens = 4;
constexpr int kAmxMinTokensInt4 = 32;
// fp8 AMX widens every line to bf16 per call (as int4 unpacks nibbles), where its AVX-512 row blocks pay one
// conversion per line per 4 tokens: its cut is not measured yet (no AMX machine at hand); 16 splits the two.
constexpr int kAmxMinTokensFp8 = 16;
inline int default_amx_min_tokens(WeightFormat f) {
  if (f == WeightFormat::fp8) return kAmxMinTokensFp8;
  // the bit-plane and grid formats expand their lines per call as int4 does
  return f == WeightFormat::int4 || f == WeightFormat::lut4 || plane_format(f) || f == WeightFormat::grid
             ? kAmxMinTokensInt4
             : kAmxMinTokens;
}

// The stages of one MoE job (see the top of this file), for the per-stage time profile.
enum class JobStage { route, quantize_x, experts, combine, count };
constexpr int kJobStages = (int)JobStage::count;
const char* job_stage_name(int stage);

// Wall time of each stage summed over the jobs run while profiling was on (MoeExperts::set_profiling): where a
// layer's time goes, for benchmarks. Off by default; when off a job reads no clock.
struct JobProfile {
  int64_t jobs = 0;
  int64_t ns[kJobStages] = {};
};

struct ExpertsConfig {
  int n_expert = 0;
  int hidden = 0;                            // H
  int intermediate = 0;                      // I
  WeightFormat format = WeightFormat::bf16;  // gate/up, and down unless down_format is set
  // down's own element format (e.g. int8 down beside int4 gate/up: GGUF's Q4_K_M); both then grouped int8/int4
  std::optional<WeightFormat> down_format;
  int group = 128;     // int8/int4: <= 0 means per-row scales; gate/up, and down unless down_group is set
  int down_group = 0;  // 0: group
  // int8/int4 codes of gate/up and of down (formats/layout.h); affine needs a group (not per row)
  Scaling gate_up_scaling = Scaling::symmetric;
  Scaling down_scaling = Scaling::symmetric;
  // how gate/up's and down's scales are stored, and (lut4) the codebook of each (formats/layout.h)
  ScaleType gate_up_scale_type = ScaleType::f32;
  ScaleType down_scale_type = ScaleType::f32;
  Codebook gate_up_codebook = Codebook::none;
  Codebook down_codebook = Codebook::none;
  // fp8: one scale per (row block, group) for its 16 rows (formats/layout.h shared scales; block FP8)
  bool gate_up_shared_scales = false;
  bool down_shared_scales = false;
  Isa isa = Isa::scalar;
  AmxMode amx = AmxMode::off;  // isa == amx implies native; emulated: tests only
  int amx_min_tokens = kAmxMinTokens;
  // The gated activation (formats/activation.h), and whether every expert has fp32 biases: gate and up [I] added
  // before the activation, down [H] added to the expert's output before the routing weight (gpt-oss).
  Glu glu;
  bool bias = false;
  // The whole expert's I when this config is one NUMA slice of it (0: `intermediate`): per-row int8/int4 experts on AMX
  // group h by amx_row_group of it, in every slice alike.
  int intermediate_full = 0;

  // gate/up's and down's matrix formats (down's group and format resolved: down_group 0 is group)
  MatrixFormat gate_up_format() const {
    return {format, group, gate_up_scaling, gate_up_scale_type, gate_up_codebook, gate_up_shared_scales};
  }
  MatrixFormat down_matrix_format() const {
    return {down_format.value_or(format),
            down_group != 0 ? down_group : group,
            down_scaling,
            down_scale_type,
            down_codebook,
            down_shared_scales};
  }
};

// The refusal of floats for grid experts (formats/layout.h: they hold a file's i-quant blocks as they are).
inline constexpr const char* kGridFromFloats =
    "grid weights hold a GGUF file's i-quant blocks as they are (load_codes); floats are not quantized into them";

class MoeExperts {
 public:
  MoeExperts(const ExpertsConfig& cfg, std::shared_ptr<ThreadPool> pool);

  // Packs experts [e0, e0 + n): gate, up fp32 [n, I, H]; down fp32 [n, H, I]. Runs on the pool and returns
  // when done; must not overlap with jobs of this layer in flight.
  void load(int e0, int n, const float* gate, const float* up, const float* down);
  // Packs experts [e0, e0 + n) from codes quantized already (formats/pack.h, pack_row_block_codes): q[m] int8
  // [n, rows, cols] and group_scales[m] fp32 [n, rows, cols / group] for m = gate, up, down, and for affine
  // matrices group_mins[m] of the same shape (null for symmetric ones). Grouped int8/int4/lut4 only; the kernels then
  // multiply by exactly q * scale (lut4: codebook[q] * scale; affine: scale * q - min). Scales with no exact form in
  // the matrix's scale type are refused as out-of-range codes are. fp8 experts take their E4M3 codes (bytes) the
  // same way (formats/pack.h pack_row_block_fp8: NaN codes refused as out-of-range codes are). A grid matrix takes
  // its GGUF blocks as the file stores them instead of codes (q[m]: [n, rows, rows' blocks] bytes, pack_row_block_grid;
  // its scales and mins unused). factors[m] (null: 1): fp32 [n], each expert's per-tensor scale of a matrix of e4m3
  // / e4m3_div scales (NVFP4's; formats/pack.h pack_row_block_codes), unread for other scale types.
  void load_codes(int e0, int n, const int8_t* const q[3], const float* const group_scales[3],
                  const float* const group_mins[3], const float* const factors[3] = nullptr);
  // The values the kernels multiply by, fp32: gate, up [I, H], down [H, I].
  void unpack(int e, float* gate, float* up, float* down) const;
  // Sets the biases of experts [e0, e0 + n) (config().bias): gate, up fp32 [n, I], down fp32 [n, H]; a null down
  // sets zeros (a NUMA slice other than the first, which adds it). Throws for experts without biases or values
  // that are not finite.
  void load_biases(int e0, int n, const float* gate, const float* up, const float* down);
  // Expert e's biases (null without): gate [I] then up [I]; down [H].
  const float* gate_up_bias(int e) const {
    return cfg_.bias ? reinterpret_cast<const float*>(gu_bias_.data()) + (size_t)e * 2 * cfg_.intermediate : nullptr;
  }
  const float* down_bias(int e) const {
    return cfg_.bias ? reinterpret_cast<const float*>(down_bias_.data()) + (size_t)e * cfg_.hidden : nullptr;
  }
  // Random weights for benchmarks, written straight into the packed layout (no fp32 source, no packing):
  // uniform quantized values with scales giving a weight std of about `std` (bf16: random magnitudes over
  // three octaves),
  // zero padding as packing writes it. Deterministic in `seed`. Marks every expert loaded.
  void fill_random(uint64_t seed, float std);

  // The packed storage as (pointer, bytes) ranges, in a fixed order: gate+up data, gate+up scales, down
  // data, down scales, and with biases gate+up biases, down biases. The converted-expert cache writes and reads these;
  // `mark_loaded` follows a read.
  std::vector<std::pair<uint8_t*, size_t>> storage() const;
  void mark_loaded(int e0, int n);
  // 64-bit hash of the packed storage (computed on the pool, independent of the thread count).
  uint64_t checksum() const;

  const ExpertsConfig& config() const { return cfg_; }
  const MatrixShape& gate_up_shape() const { return gu_; }
  const MatrixShape& down_shape() const { return down_; }
  const ActLayout& gate_up_act() const { return gu_act_; }
  const ActLayout& down_act() const { return down_act_; }
  const KernelEntry& kernel() const { return kernel_; }  // gate/up's
  const KernelEntry& down_kernel() const { return down_kernel_; }
  WeightFormat down_format() const { return down_.format; }
  const RowOps& row_ops() const { return row_ops_; }
  // AMX experts' activation rows (bf16 / int8; formats/activation.h quantize_activation_amx).
  const ActLayout& gate_up_amx_act() const { return gu_amx_act_; }
  const ActLayout& down_amx_act() const { return down_amx_act_; }
  AmxMode amx_mode() const { return kernel_.gemm ? cfg_.amx : AmxMode::off; }
  // Read when a job runs; change it between jobs (benchmarks compare both paths on the same weights).
  int amx_min_tokens() const { return amx_min_tokens_.load(std::memory_order_relaxed); }
  void set_amx_min_tokens(int n);
  // Per-stage wall time of the jobs (JobProfile); reset clears the sums.
  void set_profiling(bool on) { profiling_.store(on, std::memory_order_relaxed); }
  bool profiling() const { return profiling_.load(std::memory_order_relaxed); }
  JobProfile profile() const;
  void reset_profile();
  void add_profile(const int64_t* ns, bool count_job = true) const;
  bool uses_amx(int n_tokens) const { return kernel_.gemm != nullptr && n_tokens >= amx_min_tokens(); }
  size_t bytes_per_expert() const;  // weights + scales, as streamed by one decode step
  bool is_loaded(int e) const { return loaded_[e] != 0; }
  int n_loaded() const;
  ThreadPool& pool() const { return *pool_; }
  const std::shared_ptr<ThreadPool>& pool_ptr() const { return pool_; }

  // Row block rb of gate (which = 0) or up (which = 1) of expert e; gate and up blocks alternate in memory so
  // a phase-1 task streams one contiguous range.
  RowBlock gate_up_block(int e, int rb, int which) const;
  RowBlock down_block(int e, int rb) const;

 private:
  // Runs pack(i, matrix, shape, row block, data, scales) -> accepted, for every row block of experts [e0, e0 + n)
  // on the pool; a refused block fails its matrix with "<matrix> of expert E <failure>".
  using BlockPacker = std::function<bool(int, int, const MatrixShape&, int, uint8_t*, uint8_t*)>;
  void pack_all(int e0, int n, const BlockPacker& pack, const char* failure);

  ExpertsConfig cfg_;
  std::shared_ptr<ThreadPool> pool_;
  MatrixShape gu_, down_;
  ActLayout gu_act_, down_act_, gu_amx_act_, down_amx_act_;
  KernelEntry kernel_, down_kernel_;
  RowOps row_ops_;
  std::atomic<int> amx_min_tokens_{kAmxMinTokens};
  std::atomic<bool> profiling_{false};
  mutable std::mutex profile_mu_;
  mutable JobProfile profile_;
  HugeBuffer gu_data_, gu_scales_, down_data_, down_scales_;
  HugeBuffer gu_bias_, down_bias_;  // fp32 [E, 2, I] and [E, H] (config().bias), else empty
  std::vector<uint8_t> loaded_;
};

// Which of each token's top-k slots a job computes under Expert Deferral (MoeCall::defer_lowest = d > 0): the d
// lowest-weighted slots of a token are its deferred part (among equal weights the earlier slot counts as the lower;
// NaN weights count as the highest), the other k - d its immediate part.
enum class JobPart : int { all = 0, immediate = 1, deferred = 2 };

// Arguments of one MoE call. Pointers are raw and must stay valid while the job can run.
struct MoeCall {
  const void* x = nullptr;  // [capacity, H] fp32 or bf16
  bool x_bf16 = false;
  const void* ids = nullptr;  // [capacity, k] int32 or int64
  bool ids_int32 = false;
  const float* weights = nullptr;  // [capacity, k]
  int k = 0;
  void* out = nullptr;  // [capacity, H] fp32 or bf16
  bool out_bf16 = false;
  bool accumulate = false;
  const int64_t* n_tokens_ptr = nullptr;  // if set, T is read from here when the job runs
  int64_t n_tokens = 0;                   // otherwise T
  int64_t capacity = 0;
  const uint8_t* skip_mask = nullptr;  // [E], nonzero = the CPU skips this expert
  int defer_lowest = 0;                // d (with part immediate or deferred)
  JobPart part = JobPart::all;
  // Routing on the CPU (moe/routing.h): when `logits` is set the job first routes every token itself with `router`
  // and *writes* ids and weights, which are then its outputs, not inputs.
  const void* logits = nullptr;  // [capacity, n_expert] fp32 or bf16, the router's logits
  bool logits_bf16 = false;
  HostRouter router;
  // [capacity, H] fp32 added to each token's weighted sum before it is stored (after the experts, so the sum is
  // (experts) + addend in that order): the previous layer's deferred output in a hybrid decode step.
  const float* addend = nullptr;
};

// Routes tokens [t0, t1) of `call` (its logits set) with call.router: writes call.ids and call.weights.
void route_call(const MoeCall& call, int n_expert, int64_t t0, int64_t t1);

class StageClock;

constexpr int kMaxTopK = kMaxRoutedTopK;  // experts per token a job takes
// Chunks of at most this many tokens combine inside the down tasks (moe/chunk_plan.h), and only such jobs pair.
constexpr int kFusedCombineTokens = 16;
// Throws std::invalid_argument when a call's k or deferral fields are out of range (every job's constructor runs it).
void check_call(const MoeCall& call);

struct DeferralPair;
class ChunkPlan;

class MoeJob : public Job {
 public:
  MoeJob(std::shared_ptr<MoeExperts> experts, const MoeCall& call);
  ~MoeJob() override;
  void run(ThreadPool& pool) override;

  // Pairs Expert Deferral's two jobs of one layer: `imm` (part immediate) and `def` (part deferred) over the same
  // experts, x, routing buffers and token count, writing different outputs. Submitted one right after the other to
  // the same pool (a hybrid decode step does), with at most kFusedCombineTokens tokens, they run as one list of
  // tasks: imm starts def's tasks behind its own and completes as soon as its own output is written, while the
  // workers go on with def's; def then joins them. The pool streams weights without the second job's start and
  // end. Submitted otherwise (def not queued right behind imm), each runs on its own as before.
  //
  // Chained pairs: when the next layer's immediate job is already queued while def's tasks run (the GPU was
  // quicker than def), def makes that job's plan and puts its tasks behind its own in the same list, so the
  // workers stream on from one layer into the next without a barrier. The chained job's combine waits for def to
  // be done (def's output may be its addend), and it completes, as always, after def.
  static void pair(const std::shared_ptr<MoeJob>& imm, const std::shared_ptr<MoeJob>& def);
  // How many times, in this process, an immediate job has run with its deferred job's tasks, and how many
  // immediate jobs were chained behind the previous deferred job (tests, benchmarks).
  static uint64_t paired_runs();
  static uint64_t chained_runs();

 private:
  void run_paired(ThreadPool& pool, int64_t T, std::unique_ptr<ChunkPlan> plan, const MoeJob& def, StageClock& clock);
  void run_chained(ThreadPool& pool);
  void append_deferred(ThreadPool& pool, int64_t T, const MoeJob& def, StageClock& clock);
  void complete_immediate(ThreadPool& pool, StageClock& clock);
  void join_paired(ThreadPool& pool);
  ChunkPlan* chain_next(ThreadPool& pool, bool& decided);
  std::shared_ptr<MoeExperts> experts_;
  MoeCall call_;
  std::shared_ptr<DeferralPair> pair_;
};

}  // namespace hetmoe
