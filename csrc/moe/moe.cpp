#include "moe/moe.h"

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <stdexcept>

#include "formats/activation.h"
#include "formats/pack.h"
#include "moe/expert_tasks.h"

namespace hetmoe {

// ---------------------------------------------------------------- storage

HugeBuffer::HugeBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  // Map 2 MiB extra and trim to a 2 MiB-aligned range, so transparent huge pages can back all of it (fewer
  // TLB misses while streaming weights).
  constexpr size_t kHuge = 2u << 20;
  size_t span = bytes + kHuge;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    size_ = 0;
    throw std::runtime_error("cannot allocate " + std::to_string(bytes >> 20) + " MiB for expert weights");
  }
  uintptr_t start = reinterpret_cast<uintptr_t>(p), aligned = (start + kHuge - 1) & ~(uintptr_t)(kHuge - 1);
  if (aligned > start) munmap(p, aligned - start);
  size_t tail = start + span - (aligned + bytes);
  if (tail) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  ptr_ = reinterpret_cast<uint8_t*>(aligned);
  madvise(ptr_, bytes, MADV_HUGEPAGE);
}

HugeBuffer::~HugeBuffer() {
  if (ptr_) munmap(ptr_, size_);
}

static void check_config(const ExpertsConfig& c) {
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  if (c.n_expert <= 0) bad("num_experts must be positive, got " + std::to_string(c.n_expert));
  if (c.hidden <= 0 || c.intermediate <= 0)
    bad("hidden_size and intermediate_size must be positive, got " + std::to_string(c.hidden) + " and " +
        std::to_string(c.intermediate));
  if (c.format != WeightFormat::bf16) {
    bool per_row = c.format == WeightFormat::int8 && c.group <= 0;
    if (!per_row && c.group != 32 && c.group != 64 && c.group != 128)
      bad("group_size must be 32, 64 or 128" +
          std::string(c.format == WeightFormat::int8 ? " (or 0 for per-row)" : "") + ", got " +
          std::to_string(c.group));
  }
  if (!cpu_features().supports(c.isa))
    bad(std::string("this CPU cannot run the ") + isa_name(c.isa) + " kernels: " + isa_refusal(c.isa));
  if (c.amx == AmxMode::native && c.isa != Isa::amx)
    bad("the native AMX GEMM needs isa amx, got " + std::string(isa_name(c.isa)));
  if (c.amx_min_tokens < 1) bad("amx_min_tokens must be >= 1, got " + std::to_string(c.amx_min_tokens));
}

MoeExperts::MoeExperts(const ExpertsConfig& cfg, std::shared_ptr<ThreadPool> pool) : cfg_(cfg), pool_(std::move(pool)) {
  check_config(cfg_);
  if (cfg_.intermediate_full <= 0) cfg_.intermediate_full = cfg_.intermediate;
  gu_ = MatrixShape::make(cfg_.format, cfg_.intermediate, cfg_.hidden, cfg_.group);
  down_ = MatrixShape::make(cfg_.format, cfg_.hidden, cfg_.intermediate, cfg_.group);
  gu_act_ = ActLayout::make(gu_);
  down_act_ = ActLayout::make(down_);
  // per-row int8 on AMX: x in one group per token, h in groups of amx_row_group(I) (layout.h)
  gu_amx_act_ = ActLayout::make(gu_, true, gu_.per_row ? gu_.kp : 0);
  down_amx_act_ = ActLayout::make(down_, true, down_.per_row ? amx_row_group(cfg_.intermediate_full) : 0);
  if (cfg_.isa == Isa::amx && cfg_.amx == AmxMode::off) cfg_.amx = AmxMode::native;
  kernel_ = select_kernel(cfg_.format, cfg_.isa, cfg_.amx);
  row_ops_ = select_row_ops(cfg_.isa);
  amx_min_tokens_.store(cfg_.amx_min_tokens);
  size_t E = cfg_.n_expert;
  gu_data_ = HugeBuffer(E * 2 * gu_.data_bytes());
  gu_scales_ = HugeBuffer(E * 2 * gu_.scale_bytes());
  down_data_ = HugeBuffer(E * down_.data_bytes());
  down_scales_ = HugeBuffer(E * down_.scale_bytes());
  loaded_.assign(E, 0);
}

void MoeExperts::set_amx_min_tokens(int n) {
  if (n < 1) throw std::invalid_argument("amx_min_tokens must be >= 1, got " + std::to_string(n));
  cfg_.amx_min_tokens = n;
  amx_min_tokens_.store(n);
}

size_t MoeExperts::bytes_per_expert() const {
  return 2 * (gu_.data_bytes() + gu_.scale_bytes()) + down_.data_bytes() + down_.scale_bytes();
}

const char* job_stage_name(int stage) {
  static const char* names[kJobStages] = {"route", "quantize_x", "experts", "combine"};
  return stage >= 0 && stage < kJobStages ? names[stage] : "?";
}

JobProfile MoeExperts::profile() const {
  std::lock_guard<std::mutex> lk(profile_mu_);
  return profile_;
}

void MoeExperts::reset_profile() {
  std::lock_guard<std::mutex> lk(profile_mu_);
  profile_ = JobProfile{};
}

void MoeExperts::add_profile(const int64_t* ns, bool count_job) const {
  std::lock_guard<std::mutex> lk(profile_mu_);
  profile_.jobs += count_job;
  for (int i = 0; i < kJobStages; ++i) profile_.ns[i] += ns[i];
}

int MoeExperts::n_loaded() const { return (int)std::count(loaded_.begin(), loaded_.end(), 1); }

RowBlock MoeExperts::gate_up_block(int e, int rb, int which) const {
  size_t idx = ((size_t)e * gu_.n_blocks + rb) * 2 + which;
  RowBlock b;
  b.data = gu_data_.data() + idx * gu_.block_bytes();
  b.scales = gu_.has_scales() ? reinterpret_cast<const float*>(gu_scales_.data()) + idx * gu_.block_scales() : nullptr;
  b.kp = gu_.kp;
  b.group = gu_.group;
  return b;
}

RowBlock MoeExperts::down_block(int e, int rb) const {
  size_t idx = (size_t)e * down_.n_blocks + rb;
  RowBlock b;
  b.data = down_data_.data() + idx * down_.block_bytes();
  b.scales =
      down_.has_scales() ? reinterpret_cast<const float*>(down_scales_.data()) + idx * down_.block_scales() : nullptr;
  b.kp = down_.kp;
  b.group = down_.group;
  return b;
}

void MoeExperts::load(int e0, int n, const float* gate, const float* up, const float* down) {
  if (e0 < 0 || n < 0 || e0 + n > cfg_.n_expert)
    throw std::invalid_argument("load: experts [" + std::to_string(e0) + ", " + std::to_string(e0 + n) +
                                ") are outside [0, " + std::to_string(cfg_.n_expert) + ")");
  const int gu_tasks = gu_.n_blocks * 2, per_expert = gu_tasks + down_.n_blocks;
  const size_t IH = (size_t)cfg_.intermediate * cfg_.hidden;
  // Non-finite source values are refused (per matrix) before anything is marked loaded.
  std::vector<std::atomic<int>> bad(n * 3);
  for (auto& b : bad) b.store(0);
  pool_->run_and_wait([&](ThreadPool& pool) {
    pool.parallel_for((int64_t)n * per_expert, [&](int64_t task, int) {
      int i = (int)(task / per_expert), b = (int)(task % per_expert), e = e0 + i;
      const MatrixShape& shape = b < gu_tasks ? gu_ : down_;
      int which = b < gu_tasks ? b % 2 : 2, rb = b < gu_tasks ? b / 2 : b - gu_tasks;
      const float* src = (which == 0 ? gate : which == 1 ? up : down) + i * IH;
      const int r0 = rb * kRowsPerBlock, r1 = std::min(shape.n, r0 + kRowsPerBlock);
      for (size_t v = (size_t)r0 * shape.k; v < (size_t)r1 * shape.k; ++v)
        if (!std::isfinite(src[v])) {
          bad[i * 3 + which].store(1);
          return;
        }
      size_t idx = which == 2 ? (size_t)e * down_.n_blocks + rb : ((size_t)e * gu_.n_blocks + rb) * 2 + which;
      uint8_t* data = (which == 2 ? down_data_ : gu_data_).data() + idx * shape.block_bytes();
      float* scales =
          reinterpret_cast<float*>((which == 2 ? down_scales_ : gu_scales_).data()) + idx * shape.block_scales();
      pack_row_block(shape, src, rb, data, scales);
    });
  });
  static const char* names[3] = {"gate", "up", "down"};
  for (int i = 0; i < n; ++i) {
    for (int m = 0; m < 3; ++m)
      if (bad[i * 3 + m].load())
        throw std::invalid_argument(std::string(names[m]) + " of expert " + std::to_string(e0 + i) +
                                    " contains NaN or Inf");
    loaded_[e0 + i] = 1;
  }
}

void MoeExperts::unpack(int e, float* gate, float* up, float* down) const {
  if (e < 0 || e >= cfg_.n_expert) throw std::invalid_argument("unpack: expert " + std::to_string(e) + " out of range");
  if (!loaded_[e]) throw std::runtime_error("unpack: expert " + std::to_string(e) + " is not loaded");
  for (int rb = 0; rb < gu_.n_blocks; ++rb) {
    RowBlock g = gate_up_block(e, rb, 0), u = gate_up_block(e, rb, 1);
    unpack_row_block(gu_, g.data, g.scales, rb, gate);
    unpack_row_block(gu_, u.data, u.scales, rb, up);
  }
  for (int rb = 0; rb < down_.n_blocks; ++rb) {
    RowBlock d = down_block(e, rb);
    unpack_row_block(down_, d.data, d.scales, rb, down);
  }
}

// ---------------------------------------------------------------- random weights, raw storage

namespace {

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// One row block of random quantized values in the packed layout; elements outside [n, k] get the padding value.
void fill_random_block(const MatrixShape& s, int rb, uint64_t seed, float scale, int bf16_exp, uint8_t* data,
                       float* scales) {
  const int kpl = k_per_line(s.format);
  uint64_t state = seed;
  for (int line = 0; line < s.lines_per_block(); ++line) {
    for (int r = 0; r < kRowsPerBlock; ++r) {
      const bool row_ok = rb * kRowsPerBlock + r < s.n;
      const uint64_t bits = splitmix64(state);
      uint8_t* dst = data + (size_t)line * kLineBytes + 4 * r;
      const int k0 = line * kpl;
      if (s.format == WeightFormat::bf16) {
        for (int h = 0; h < 2; ++h) {
          const uint64_t b = bits >> (16 * h);
          // sign, one of three exponents from bf16_exp up (times [1, 2) from the mantissa), 7 mantissa bits
          uint16_t v = (uint16_t)(((b & 1) << 15) | ((bf16_exp + (b >> 1) % 3) << 7) | ((b >> 8) & 0x7F));
          if (!row_ok || k0 + h >= s.k) v = 0;
          std::memcpy(dst + 2 * h, &v, 2);
        }
      } else if (s.format == WeightFormat::int8) {
        for (int b = 0; b < 4; ++b) {
          const int q = (int)((bits >> (16 * b)) % 255) - 127;
          dst[b] = (uint8_t)((row_ok && k0 + b < s.k ? q : 0) + 128);
        }
      } else {
        for (int b = 0; b < 4; ++b) {
          const bool lo_ok = row_ok && k0 + b < s.k, hi_ok = row_ok && k0 + 4 + b < s.k;
          const uint8_t lo = lo_ok ? (bits >> (8 * b)) & 0xF : 8, hi = hi_ok ? (bits >> (8 * b + 4)) & 0xF : 8;
          dst[b] = (uint8_t)(lo | (hi << 4));
        }
      }
    }
  }
  for (size_t i = 0; i < s.block_scales(); ++i) scales[i] = scale;
}

}  // namespace

void MoeExperts::fill_random(uint64_t seed, float std) {
  // Standard deviation of the uniform quantized values: int8 q in [-127, 127], int4 q in [-8, 7].
  const float q_std = cfg_.format == WeightFormat::int8 ? 73.6f : 4.61f;
  const float scale = std / q_std;
  // bf16: magnitudes 2^e..2^(e+3) have a std of about 0.0316 * 2^(e+7)
  const int bf16_exp = 127 - 7 + (int)std::lround(std::log2(std::max(std, 1e-30f) / 0.0316f));
  if (bf16_exp < 1 || bf16_exp > 250) throw std::invalid_argument("fill_random: std out of range");
  const int gu_tasks = gu_.n_blocks * 2, per_expert = gu_tasks + down_.n_blocks;
  pool_->run_and_wait([&](ThreadPool& pool) {
    pool.parallel_for((int64_t)cfg_.n_expert * per_expert, [&](int64_t task, int) {
      int e = (int)(task / per_expert), b = (int)(task % per_expert);
      uint64_t block_seed = seed * 0x2545F4914F6CDD1Dull + (uint64_t)task;
      if (b < gu_tasks) {
        RowBlock blk = gate_up_block(e, b / 2, b % 2);
        fill_random_block(gu_, b / 2, block_seed, scale, bf16_exp, const_cast<uint8_t*>(blk.data),
                          const_cast<float*>(blk.scales));
      } else {
        RowBlock blk = down_block(e, b - gu_tasks);
        fill_random_block(down_, b - gu_tasks, block_seed, scale, bf16_exp, const_cast<uint8_t*>(blk.data),
                          const_cast<float*>(blk.scales));
      }
    });
  });
  std::fill(loaded_.begin(), loaded_.end(), 1);
}

std::vector<std::pair<uint8_t*, size_t>> MoeExperts::storage() const {
  return {{gu_data_.data(), gu_data_.size()},
          {gu_scales_.data(), gu_scales_.size()},
          {down_data_.data(), down_data_.size()},
          {down_scales_.data(), down_scales_.size()}};
}

void MoeExperts::mark_loaded(int e0, int n) {
  if (e0 < 0 || n < 0 || e0 + n > cfg_.n_expert)
    throw std::invalid_argument("mark_loaded: experts [" + std::to_string(e0) + ", " + std::to_string(e0 + n) +
                                ") are outside [0, " + std::to_string(cfg_.n_expert) + ")");
  std::fill(loaded_.begin() + e0, loaded_.begin() + e0 + n, 1);
}

uint64_t MoeExperts::checksum() const {
  constexpr size_t kChunk = 1u << 20;
  auto ranges = storage();
  std::vector<std::pair<const uint8_t*, size_t>> chunks;
  for (auto& [p, n] : ranges)
    for (size_t off = 0; off < n; off += kChunk) chunks.emplace_back(p + off, std::min(kChunk, n - off));
  std::vector<uint64_t> hashes(chunks.size());
  pool_->run_and_wait([&](ThreadPool& pool) {
    pool.parallel_for((int64_t)chunks.size(), [&](int64_t c, int) {
      const uint8_t* p = chunks[c].first;
      const size_t n = chunks[c].second;
      uint64_t h[4] = {1, 2, 3, 4};  // four independent lanes keep the loop bandwidth-bound
      size_t i = 0;
      for (; i + 32 <= n; i += 32)
        for (int l = 0; l < 4; ++l) {
          uint64_t w;
          std::memcpy(&w, p + i + 8 * l, 8);
          h[l] = (h[l] ^ w) * 0x100000001B3ull + (h[l] >> 29);
        }
      uint64_t acc = n;
      for (; i < n; ++i) acc = (acc ^ p[i]) * 0x100000001B3ull;
      for (int l = 0; l < 4; ++l) acc = (acc ^ h[l]) * 0x9E3779B97F4A7C15ull + (acc >> 31);
      hashes[c] = acc;
    });
  });
  uint64_t total = 0xCBF29CE484222325ull;
  for (uint64_t h : hashes) total = (total ^ h) * 0x100000001B3ull + (total >> 33);
  return total;
}

// ---------------------------------------------------------------- the job

MoeJob::MoeJob(std::shared_ptr<MoeExperts> experts, const MoeCall& call) : experts_(std::move(experts)), call_(call) {
  check_call(call_);
}

void check_call(const MoeCall& c) {
  if (c.k < 1 || c.k > kMaxTopK)
    throw std::invalid_argument("k (experts per token) must be in [1, " + std::to_string(kMaxTopK) + "], got " +
                                std::to_string(c.k));
  if (c.part != JobPart::all && (c.defer_lowest < 1 || c.defer_lowest >= c.k))
    throw std::invalid_argument("a deferral part needs 1 <= defer_lowest < k, got defer_lowest " +
                                std::to_string(c.defer_lowest) + " with k " + std::to_string(c.k));
  if (c.part == JobPart::all && c.defer_lowest != 0)
    throw std::invalid_argument("defer_lowest is set but the job computes all slots (part 'all')");
  if (c.logits && (!c.ids || !c.weights))
    throw std::invalid_argument("a job that routes from logits needs ids and weights buffers to write the routing to");
}

void route_call(const MoeCall& c, int E, int64_t t0, int64_t t1) {
  route_rows(c.router, c.logits, c.logits_bf16, E, c.k, const_cast<void*>(c.ids), c.ids_int32,
             const_cast<float*>(c.weights), t0, t1);
}

// Reads the clock at stage boundaries only while the experts are profiling; hands the sums over at the end
// (count_job: as one job; a plan made ahead for a queued job is not one).
class StageClock {
 public:
  explicit StageClock(const MoeExperts& ex, bool count_job = true) : ex_(ex), on_(ex.profiling()), job_(count_job) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  void done(JobStage stage) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    ns_[(int)stage] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count();
    last_ = now;
  }
  ~StageClock() {
    if (on_) ex_.add_profile(ns_, job_);
  }

 private:
  const MoeExperts& ex_;
  bool on_, job_;
  std::chrono::steady_clock::time_point last_;
  int64_t ns_[kJobStages] = {};
};

namespace {

constexpr int64_t kTokensPerChunk = 1024;  // bounds the scratch memory of very long prompts

inline void load_row_fp32(const RowOps& ops, const void* base, bool bf16, int64_t row, int n, float* dst) {
  if (bf16) {
    ops.bf16_to_f32(static_cast<const uint16_t*>(base) + row * n, n, dst);
  } else {
    std::memcpy(dst, static_cast<const float*>(base) + row * n, sizeof(float) * n);
  }
}

constexpr int kAmxScratchSlot = 8;  // pool scratch slots: AMX rows of x per token (8), the panels of x (9) and h (10)

// Tokens per AMX task: its activation panel (tokens x K), re-read for every row block of the task, stays
// within 1.5 MiB of the 2 MiB L2 (the GEMM's own weight chunk is 32 KB).
int amx_panel_tokens(const ActLayout& a) { return std::max<int>(32, (int)((3u << 19) / a.row_bytes) / 32 * 32); }

// Per-row work (quantizing, combining) of a decode step is cheaper on the coordinator alone than waking every
// thread for it; it goes parallel above this many elements.
constexpr int64_t kSerialElements = 1 << 13;

// A parallel task takes consecutive rows worth about this many elements (at least ~4 tasks per thread). A/B on the
// GPU machine (DeepSeek-V3 layer, T = 512, 16 threads): quantizing x into the AMX panels 2.16 / 2.18 ms with a row
// per task, 1.82 / 1.95 ms so (bf16: 3.59 / 3.58 -> 3.21 / 3.41).
constexpr int64_t kTaskElements = 1 << 14;

// fn(row, thread) for rows [0, n_rows): on the calling thread alone when the work is small or `serial` (another
// list of tasks is in flight on the pool), else as parallel tasks of consecutive rows.
template <class F>
void for_rows(ThreadPool& pool, int64_t n_rows, int64_t elems_per_row, const F& fn, bool serial = false) {
  if (serial || n_rows * elems_per_row <= kSerialElements) {
    for (int64_t i = 0; i < n_rows; ++i) fn(i, 0);
    return;
  }
  int64_t per_task = std::max<int64_t>(1, kTaskElements / std::max<int64_t>(1, elems_per_row));
  per_task = std::min(per_task, std::max<int64_t>(1, n_rows / (4 * pool.size())));
  const int64_t n_tasks = (n_rows + per_task - 1) / per_task;
  pool.parallel_for(n_tasks, [&](int64_t task, int th) {
    for (int64_t i = task * per_task, end = std::min(n_rows, i + per_task); i < end; ++i) fn(i, th);
  });
}

// in_part[j] = whether slot j of a token with weights w[0..k) belongs to `part` (JobPart): the d lowest weights by a
// stable ascending order with NaN last (torch's stable argsort) are the deferred part.
void select_part(const float* w, int k, int d, JobPart part, std::vector<uint8_t>& in_part) {
  int order[kMaxTopK];
  for (int j = 0; j < k; ++j) order[j] = j;
  std::stable_sort(order, order + k, [w](int a, int b) {
    if (std::isnan(w[a])) return false;
    return std::isnan(w[b]) || w[a] < w[b];
  });
  const uint8_t deferred = part == JobPart::deferred;
  for (int j = 0; j < k; ++j) in_part[j] = !deferred;
  for (int i = 0; i < d && i < k; ++i) in_part[order[i]] = deferred;
}

// out[t, c0:c1] (+)= sum_j weights[t, j] * y[slot(t, j), c0:c1] (+ addend[t, c0:c1]) for tokens [ta, tb) of the
// chunk, in j order so results depend neither on threads nor on how the columns are cut; acc: c1 - c0 floats.
void combine_rows(const RowOps& ops, const MoeCall& c, int H, int64_t t0, int64_t ta, int64_t tb,
                  const std::vector<int>& pos, const float* y, int c0, int c1, float* acc) {
  const int n = c1 - c0;
  for (int64_t t = ta; t < tb; ++t) {
    const size_t off = (size_t)(t0 + t) * H + c0;
    if (!c.accumulate)
      std::fill(acc, acc + n, 0.f);
    else if (c.out_bf16)
      ops.bf16_to_f32(static_cast<const uint16_t*>(c.out) + off, n, acc);
    else
      std::memcpy(acc, static_cast<const float*>(c.out) + off, sizeof(float) * n);
    for (int j = 0; j < c.k; ++j) {
      const int s = pos[(size_t)t * c.k + j];
      if (s >= 0) ops.axpy(c.weights[(t0 + t) * c.k + j], y + (size_t)s * H + c0, n, acc);
    }
    if (c.addend) ops.axpy(1.f, c.addend + off, n, acc);  // exactly acc + addend
    if (c.out_bf16)
      ops.f32_to_bf16(acc, n, static_cast<uint16_t*>(c.out) + off);
    else
      std::memcpy(static_cast<float*>(c.out) + off, acc, sizeof(float) * n);
  }
}

// Countdowns over the tasks of a phase: the task that brings one to zero finishes what depends on all of them.
class Countdown {
 public:
  void reset(size_t n) { left_ = std::vector<std::atomic<int>>(n); }
  void set(size_t i, int v) { left_[i].store(v, std::memory_order_relaxed); }
  void add(size_t i, int v) { left_[i].fetch_add(v, std::memory_order_relaxed); }
  bool zero(size_t i) const { return left_[i].load(std::memory_order_acquire) == 0; }
  // True for the caller that takes index i to zero; acquire-release, so it sees every other task's writes.
  bool arrive(size_t i) { return left_[i].fetch_sub(1, std::memory_order_acq_rel) == 1; }

 private:
  std::vector<std::atomic<int>> left_;
};

}  // namespace

// One chunk of tokens of one call, from its routing to its combine. The constructor runs on the coordinator: it
// routes, quantizes x and cuts the work into tasks. run_task(i) (any pool thread, any order of pulling) runs one
// task, and finish() what is left after all of them (the combine of many tokens, or of a chunk without slots).
//
// The tasks: gate + up with SwiGLU -> h [n_slots, I], then down -> y [n_slots, H], in one list. An expert's down
// tasks wait (spinning) until its gate+up tasks are done and its h quantized; they come after every gate+up task
// and in the same expert order, so such a wait is at most the last gate+up task, and the threads stream weights
// from the first task to the last without a barrier between the phases. h is quantized once per (token, expert),
// in the format of the expert's path (AMX slots into their panel), by the gate+up task that completes the
// expert's rows for those tokens. With a few tokens (decode), y is combined a run of row blocks at a time by the
// down task that completes those blocks for every expert; with many, a combine that late would fall on the few
// threads running the last tasks, so finish() runs it on every thread.
class ChunkPlan {
 public:
  // Pool scratch slots from slot_base on (two plans in flight at once use different bases). serial: the
  // constructor runs its row work on the calling thread alone (another plan's tasks may be in flight).
  ChunkPlan(const MoeExperts& ex, const MoeCall& call, ThreadPool& pool, int64_t t0, int64_t t1, int slot_base,
            bool serial, StageClock& clock);
  int64_t n_tasks() const { return (int64_t)(tasks_.size() + down_tasks_.size()); }
  int64_t n_tokens() const { return nt_; }
  void run_task(int64_t ti, int th);
  const ThreadPool::TaskFn& task_fn() const { return fn_; }  // run_task, for the pool's list
  bool done() const { return tasks_left_.load(std::memory_order_acquire) == 0; }
  // A plan whose tasks start before the previous job's are done: its combine waits for combine_after_previous().
  void hold_combine() { combine_held_.store(true, std::memory_order_relaxed); }
  void combine_after_previous() { combine_held_.store(false, std::memory_order_release); }
  // Until every task has run (or one has failed).
  void wait() const {
    while (!done() && !failed()) _mm_pause();
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  void finish(ThreadPool& pool, bool serial);

 private:
  void quantize_h(int s, int th);

  const MoeExperts& ex_;
  const MoeCall& call_;
  ThreadPool& pool_;
  int64_t t0_;
  int nt_, E_, H_, I_, k_;
  const RowOps& ops_;
  std::vector<int> count_, pos_, active_, first_, slot_token_, amx_first_, panel_row_;
  std::vector<const uint8_t*> x_rows_, h_rows_;
  int n_slots_ = 0, n_amx_slots_ = 0;
  AmxPanel xa_, ha_;
  uint8_t* hq_ = nullptr;
  float *h_ = nullptr, *y_ = nullptr;
  bool fuse_combine_ = false;
  std::vector<Task> tasks_, down_tasks_;
  std::vector<TaskGroup> groups_;
  Countdown rows_left_, expert_left_, blocks_left_;
  std::atomic<int64_t> tasks_left_{0};
  std::atomic<bool> failed_{false};  // a gate+up task threw: the waits give up (the pool reports the error)
  std::atomic<bool> combine_held_{false};
  ThreadPool::TaskFn fn_ = [this](int64_t i, int th) { run_task(i, th); };
};

ChunkPlan::ChunkPlan(const MoeExperts& ex, const MoeCall& call, ThreadPool& pool, int64_t t0, int64_t t1, int slot_base,
                     bool serial, StageClock& clock)
    : ex_(ex), call_(call), pool_(pool), t0_(t0), nt_((int)(t1 - t0)), E_(ex.config().n_expert), H_(ex.config().hidden),
      I_(ex.config().intermediate), k_(call.k), ops_(ex.row_ops()) {
  const int E = E_, H = H_, k = k_, nt = nt_;
  const WeightFormat fmt = ex.config().format;

  // ---- route: count (token, slot) pairs per expert
  count_.assign(E, 0);
  pos_.assign((size_t)nt * k, -1);
  std::vector<uint8_t> in_part(k, 1);
  for (int t = 0; t < nt; ++t) {
    if (call.part != JobPart::all) select_part(call.weights + (t0 + t) * k, k, call.defer_lowest, call.part, in_part);
    for (int j = 0; j < k; ++j) {
      if (!in_part[j]) continue;
      int64_t idx = (t0 + t) * k + j;
      int64_t id =
          call.ids_int32 ? static_cast<const int32_t*>(call.ids)[idx] : static_cast<const int64_t*>(call.ids)[idx];
      if (id == -1) continue;
      if (id < -1 || id >= E)
        throw std::invalid_argument("topk_ids[" + std::to_string(t0 + t) + ", " + std::to_string(j) +
                                    "] = " + std::to_string(id) + " is not an expert id in [0, " + std::to_string(E) +
                                    ") or -1");
      if (call.skip_mask && call.skip_mask[id]) continue;
      pos_[(size_t)t * k + j] = (int)id;  // expert for now; becomes the slot below
      ++count_[id];
    }
  }
  for (int e = 0; e < E; ++e)
    if (count_[e]) {
      if (!ex.is_loaded(e))
        throw std::runtime_error("expert " + std::to_string(e) + " is routed to but was never loaded");
      active_.push_back(e);
    }
  std::stable_sort(active_.begin(), active_.end(), [&](int a, int b) { return count_[a] > count_[b]; });
  first_.assign(E, 0);
  std::vector<int> fill(E, 0);
  for (int e : active_) first_[e] = n_slots_, n_slots_ += count_[e];
  slot_token_.resize(n_slots_);
  for (int t = 0; t < nt; ++t)
    for (int j = 0; j < k; ++j) {
      int& p = pos_[(size_t)t * k + j];
      if (p < 0) continue;
      int s = first_[p] + fill[p]++;
      slot_token_[s] = t;
      p = s;
    }
  clock.done(JobStage::route);
  if (n_slots_ == 0) return;

  const ActLayout& ga = ex.gate_up_act();
  const ActLayout& da = ex.down_act();
  const MatrixShape& gu = ex.gate_up_shape();
  const MatrixShape& dn = ex.down_shape();
  const int n_threads = pool.size();
  // AMX experts: those with at least amx_min_tokens tokens. `active` is sorted by count, so they come first
  // and own the slots [0, n_amx_slots).
  int n_amx = 0;
  while (n_amx < (int)active_.size() && ex.uses_amx(count_[active_[n_amx]])) ++n_amx;
  n_amx_slots_ = n_amx ? first_[active_[n_amx - 1]] + count_[active_[n_amx - 1]] : 0;
  const ActLayout& gxa = ex.gate_up_amx_act();
  const ActLayout& dxa = ex.down_amx_act();
  x_rows_.resize(n_slots_);
  h_rows_.resize(n_slots_);
  // AMX experts' rows in the activation panels (layout.h AmxPanel): each expert starts a block of 16 rows;
  // panel_row[s] is slot s's row, and the rows that pad an expert's last block are zero.
  amx_first_.assign(E, 0);
  panel_row_.resize(n_amx_slots_);
  int n_panel = 0;
  for (int i = 0; i < n_amx; ++i) {
    const int e = active_[i];
    amx_first_[e] = n_panel;
    for (int m = 0; m < count_[e]; ++m) panel_row_[first_[e] + m] = n_panel + m;
    n_panel += (count_[e] + 15) / 16 * 16;
  }
  auto make_panel = [&](int slot, const ActLayout& a) {
    uint8_t* p = pool.scratch(slot, AmxPanel::tile_bytes(a, n_panel) + AmxPanel::meta_bytes_of(a, n_panel));
    const AmxPanel panel = AmxPanel::make(a, p, p + AmxPanel::tile_bytes(a, n_panel));
    for (int i = 0; i < n_amx; ++i) {
      const int e = active_[i];
      for (int r = amx_first_[e] + count_[e]; r % 16; ++r) panel.store(r, nullptr, a.scales_off);
    }
    return panel;
  };

  // ---- quantize x, once per token: for the row-block kernels into rows; for AMX experts also in their
  // format, then copied to every panel row of the token (an expert's tokens are consecutive A-tile rows)
  if (n_amx_slots_ < n_slots_) {
    uint8_t* xq = pool.scratch(slot_base + 0, (size_t)nt * ga.row_bytes);
    for_rows(
        pool, nt, H,
        [&](int64_t t, int th) {
          float* row = reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * H));
          load_row_fp32(ops_, call.x, call.x_bf16, t0 + t, H, row);
          ops_.quantize(fmt, false, row, H, ga, xq + t * ga.row_bytes);
        },
        serial);
    for (int s = n_amx_slots_; s < n_slots_; ++s) x_rows_[s] = xq + (size_t)slot_token_[s] * ga.row_bytes;
  }
  if (n_amx_slots_ > 0) {
    uint8_t* xt = pool.scratch(slot_base + kAmxScratchSlot, (size_t)nt * gxa.row_bytes);
    for_rows(
        pool, nt, H,
        [&](int64_t t, int th) {
          float* row = reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * H));
          load_row_fp32(ops_, call.x, call.x_bf16, t0 + t, H, row);
          ops_.quantize(fmt, true, row, H, gxa, xt + t * gxa.row_bytes);
        },
        serial);
    xa_ = make_panel(slot_base + kAmxScratchSlot + 1, gxa);
    for_rows(
        pool, n_amx_slots_, gxa.scales_off / 4,
        [&](int64_t s, int) { xa_.store(panel_row_[s], xt + (size_t)slot_token_[s] * gxa.row_bytes, gxa.scales_off); },
        serial);
  }
  clock.done(JobStage::quantize_x);

  fuse_combine_ = nt <= kFusedCombineTokens;
  if (n_amx_slots_ > 0) ha_ = make_panel(slot_base + kAmxScratchSlot + 2, dxa);
  hq_ = pool.scratch(slot_base + 2, (size_t)(n_slots_ - n_amx_slots_) * da.row_bytes);
  for (int s = n_amx_slots_; s < n_slots_; ++s) h_rows_[s] = hq_ + (size_t)(s - n_amx_slots_) * da.row_bytes;
  h_ = reinterpret_cast<float*>(pool.scratch(slot_base + 1, sizeof(float) * (size_t)n_slots_ * I_));
  y_ = reinterpret_cast<float*>(pool.scratch(slot_base + 3, sizeof(float) * (size_t)n_slots_ * H));

  make_tasks(active_, count_, n_amx, TaskPlan{gu.n_blocks, 1, amx_panel_tokens(gxa), n_threads, false}, tasks_,
             &groups_);
  make_tasks(active_, count_, n_amx, TaskPlan{dn.n_blocks, 2, amx_panel_tokens(dxa), n_threads}, down_tasks_);
  rows_left_.reset(groups_.size());
  expert_left_.reset(E);
  for (size_t g = 0; g < groups_.size(); ++g) {
    rows_left_.set(g, groups_[g].n_tasks);
    expert_left_.add(groups_[g].e, groups_[g].n_tasks);
  }
  blocks_left_.reset(dn.n_blocks);
  std::vector<int> covers(dn.n_blocks + 1, 0);  // tasks covering each row block, by differences
  for (const Task& t : down_tasks_) ++covers[t.rb0], --covers[t.rb1];
  for (int b = 0, c = 0; b < dn.n_blocks; ++b) blocks_left_.set(b, c += covers[b]);
  tasks_left_.store(n_tasks(), std::memory_order_relaxed);
}

void ChunkPlan::quantize_h(int s, int th) {
  const WeightFormat fmt = ex_.config().format;
  if (s < n_amx_slots_) {
    const ActLayout& dxa = ex_.down_amx_act();
    uint8_t* row = pool_.thread_scratch(th, dxa.row_bytes);
    ops_.quantize(fmt, true, h_ + (size_t)s * I_, I_, dxa, row);
    ha_.store(panel_row_[s], row, dxa.scales_off);
  } else {
    const ActLayout& da = ex_.down_act();
    ops_.quantize(fmt, false, h_ + (size_t)s * I_, I_, da, hq_ + (size_t)(s - n_amx_slots_) * da.row_bytes);
  }
}

void ChunkPlan::run_task(int64_t ti, int th) {
  struct Done {  // counts the task as run however it ends
    std::atomic<int64_t>& left;
    ~Done() { left.fetch_sub(1, std::memory_order_acq_rel); }
  } done{tasks_left_};
  const int64_t n_gu = (int64_t)tasks_.size();
  if (ti < n_gu) {
    const Task& task = tasks_[ti];
    try {
      run_gate_up_task(ex_, task, PhaseInput{x_rows_.data(), xa_, amx_first_.data(), first_.data()}, h_, pool_, th);
      if (rows_left_.arrive(task.group)) {
        const TaskGroup& g = groups_[task.group];
        for (int s = first_[g.e] + g.m0; s < first_[g.e] + g.m1; ++s) quantize_h(s, th);
      }
    } catch (...) {
      failed_.store(true, std::memory_order_relaxed);
      throw;
    }
    expert_left_.arrive(task.e);
    return;
  }
  const Task& task = down_tasks_[ti - n_gu];
  while (!expert_left_.zero(task.e)) {
    if (failed()) return;
    _mm_pause();
  }
  run_down_task(ex_, task, PhaseInput{h_rows_.data(), ha_, amx_first_.data(), first_.data(), !fuse_combine_}, y_, pool_,
                th);
  if (!fuse_combine_) return;
  while (combine_held_.load(std::memory_order_acquire)) _mm_pause();
  // combine each run of the task's blocks that it was the last to compute
  for (int b = task.rb0, run0 = -1; b <= task.rb1; ++b) {
    const bool mine = b < task.rb1 && blocks_left_.arrive(b);
    if (mine && run0 < 0) run0 = b;
    if (!mine && run0 >= 0) {
      const int c0 = run0 * kRowsPerBlock, c1 = std::min(H_, b * kRowsPerBlock);
      combine_rows(ops_, call_, H_, t0_, 0, nt_, pos_, y_, c0, c1,
                   reinterpret_cast<float*>(pool_.thread_scratch(th, sizeof(float) * (c1 - c0))));
      run0 = -1;
    }
  }
}

void ChunkPlan::finish(ThreadPool& pool, bool serial) {
  if (n_slots_ > 0 && fuse_combine_) return;
  for_rows(
      pool, nt_, (int64_t)H_ * (k_ + 1),
      [&](int64_t t, int th) {
        combine_rows(ops_, call_, H_, t0_, t, t + 1, pos_, y_, 0, H_,
                     reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * H_)));
      },
      serial);
}

// An immediate job and its deferred job (MoeJob::pair): what the immediate job leaves in flight for the other.
// Coordinator only, like everything a job does outside its tasks.
struct DeferralPair {
  std::atomic<const MoeJob*> imm{nullptr}, def{nullptr};  // cleared by the job's destructor
  std::unique_ptr<ChunkPlan> imm_plan, def_plan;
  int64_t imm_end = 0, def_end = 0;  // the end of each plan's tasks in the pool's list
  bool imm_chained = false;          // imm_plan's tasks are in the list already (MoeJob::chain_next)
  bool in_flight = false;            // the deferred tasks are running, the deferred job joins them
};

constexpr int kPairScratchBase = 16;  // the deferred plan's pool scratch slots while the immediate one's are in use
constexpr int kPairWaitUs = 20;       // how long an immediate job waits for its deferred job to be queued behind it
std::atomic<uint64_t> g_paired_runs{0}, g_chained_runs{0};

MoeJob::~MoeJob() {
  if (!pair_) return;
  const MoeJob* self = this;
  pair_->imm.compare_exchange_strong(self, nullptr);
  self = this;
  pair_->def.compare_exchange_strong(self, nullptr);
}

void MoeJob::pair(const std::shared_ptr<MoeJob>& imm, const std::shared_ptr<MoeJob>& def) {
  auto bad = [](const std::string& m) { throw std::invalid_argument("pair: " + m); };
  if (!imm || !def) bad("null job");
  const MoeCall &a = imm->call_, &b = def->call_;
  if (a.part != JobPart::immediate || b.part != JobPart::deferred)
    bad("the first job must compute the immediate part, the second the deferred part");
  if (imm->experts_ != def->experts_) bad("the two jobs are over different experts");
  if (a.defer_lowest != b.defer_lowest || a.k != b.k || a.x != b.x || a.x_bf16 != b.x_bf16 || a.ids != b.ids ||
      a.ids_int32 != b.ids_int32 || a.weights != b.weights || a.n_tokens_ptr != b.n_tokens_ptr ||
      a.n_tokens != b.n_tokens || a.capacity != b.capacity || a.skip_mask != b.skip_mask || a.out == b.out)
    bad("the two jobs must share x, the routing, the token count and the mask, and write different outputs");
  if (imm->pair_ || def->pair_) bad("a job is already paired");
  auto p = std::make_shared<DeferralPair>();
  p->imm.store(imm.get());
  p->def.store(def.get());
  imm->pair_ = def->pair_ = p;
}

void MoeJob::run(ThreadPool& pool) {
  if (pair_ && call_.part == JobPart::deferred && pair_->in_flight) return join_paired(pool);
  if (pair_ && call_.part == JobPart::immediate && pair_->imm_chained) return run_chained(pool);
  StageClock clock(*experts_);
  int64_t T = call_.n_tokens_ptr ? *call_.n_tokens_ptr : call_.n_tokens;
  if (T < 0 || T > call_.capacity)
    throw std::invalid_argument("number of tokens " + std::to_string(T) + " is outside [0, " +
                                std::to_string(call_.capacity) + "], the capacity of this job's buffers");
  if (call_.logits) route_call(call_, experts_->config().n_expert, 0, T);
  const bool may_pair = pair_ && call_.part == JobPart::immediate && T > 0 && T <= kFusedCombineTokens;
  for (int64_t t0 = 0; t0 < T; t0 += kTokensPerChunk) {
    auto plan =
        std::make_unique<ChunkPlan>(*experts_, call_, pool, t0, std::min(T, t0 + kTokensPerChunk), 0, false, clock);
    // asked once this job's own plan is made, giving the deferred job time to be queued (a hybrid step submits
    // it microseconds after this one)
    const MoeJob* def = may_pair ? pair_->def.load(std::memory_order_acquire) : nullptr;
    if (def && pool.next_job_is(def, kPairWaitUs)) return run_paired(pool, T, std::move(plan), *def, clock);
    pool.parallel_for(plan->n_tasks(), [&](int64_t i, int th) { plan->run_task(i, th); });
    clock.done(JobStage::experts);
    plan->finish(pool, false);
    clock.done(JobStage::combine);
  }
}

// The immediate job of a pair whose deferred job is queued right behind it: the deferred part's tasks go into the
// same list, behind this job's own, and keep the workers streaming while this job completes (its output is what
// the GPU waits for) and the deferred job starts; that one then joins them. Ids and weights are this job's (it
// routed them), so the deferred part does not route again.
void MoeJob::run_paired(ThreadPool& pool, int64_t T, std::unique_ptr<ChunkPlan> plan, const MoeJob& def,
                        StageClock& clock) {
  DeferralPair& P = *pair_;
  P.imm_plan = std::move(plan);
  P.imm_end = P.imm_plan->n_tasks();
  pool.parallel_start(P.imm_end, P.imm_plan->task_fn(), true);
  g_paired_runs.fetch_add(1, std::memory_order_relaxed);
  append_deferred(pool, T, def, clock);
  complete_immediate(pool, clock);
}

// An immediate job whose plan the previous deferred job made and whose tasks are running already.
void MoeJob::run_chained(ThreadPool& pool) {
  DeferralPair& P = *pair_;
  P.imm_chained = false;
  StageClock clock(*experts_);  // its route and quantize_x stages were timed when the plan was made
  const MoeJob* def = P.def.load(std::memory_order_acquire);
  if (def && pool.next_job_is(def, kPairWaitUs)) {
    g_paired_runs.fetch_add(1, std::memory_order_relaxed);
    append_deferred(pool, P.imm_plan->n_tokens(), *def, clock);
  } else {
    P.in_flight = false;
  }
  complete_immediate(pool, clock);
}

void MoeJob::append_deferred(ThreadPool& pool, int64_t T, const MoeJob& def, StageClock& clock) {
  DeferralPair& P = *pair_;
  P.def_plan.reset();
  try {
    P.def_plan = std::make_unique<ChunkPlan>(*experts_, def.call_, pool, 0, T, kPairScratchBase, true, clock);
  } catch (...) {
    P.def_plan.reset();  // the deferred job runs on its own and reports the error
  }
  P.in_flight = P.def_plan != nullptr;
  if (P.in_flight) {
    const int64_t n = P.def_plan->n_tasks();
    P.def_end = pool.parallel_append(n, P.def_plan->task_fn(), true) + n;
  }
}

// Runs the immediate tasks still to take, waits for the rest of them and writes nothing more: the output is
// complete when this returns. Without deferred tasks in flight (or after a failure) the list is closed here.
void MoeJob::complete_immediate(ThreadPool& pool, StageClock& clock) {
  DeferralPair& P = *pair_;
  pool.parallel_help(P.imm_end);
  P.imm_plan->wait();
  if (!P.in_flight || P.imm_plan->failed()) {
    P.in_flight = false;
    pool.parallel_join();  // rethrows a task's error
  }
  clock.done(JobStage::experts);
  P.imm_plan->finish(pool, true);
  clock.done(JobStage::combine);
}

uint64_t MoeJob::paired_runs() { return g_paired_runs.load(std::memory_order_relaxed); }
uint64_t MoeJob::chained_runs() { return g_chained_runs.load(std::memory_order_relaxed); }

// While this deferred job's tasks run: when the job queued next is an immediate job of a pair with at most
// kFusedCombineTokens tokens, makes its plan (routing it first when it routes itself) and appends its tasks.
// Returns that plan, or null; `decided` is set once there is a next job to decide on (chained or not), so that
// it is asked once.
ChunkPlan* MoeJob::chain_next(ThreadPool& pool, bool& decided) {
  const MoeJob* next = dynamic_cast<const MoeJob*>(pool.next_job());
  if (!next) return nullptr;
  decided = true;
  if (!next->pair_ || next->call_.part != JobPart::immediate || next->pair_->imm_chained) return nullptr;
  const MoeCall& c = next->call_;
  const int64_t T = c.n_tokens_ptr ? *c.n_tokens_ptr : c.n_tokens;
  if (T < 1 || T > kFusedCombineTokens || T > c.capacity) return nullptr;
  DeferralPair& Q = *next->pair_;
  try {
    if (c.logits) route_call(c, next->experts_->config().n_expert, 0, T);
    StageClock clock(*next->experts_, false);
    auto plan = std::make_unique<ChunkPlan>(*next->experts_, c, pool, 0, T, 0, true, clock);
    plan->hold_combine();
    Q.imm_plan = std::move(plan);
  } catch (...) {
    return nullptr;  // the job runs as usual when its turn comes and reports the error then
  }
  const int64_t n = Q.imm_plan->n_tasks();
  Q.imm_end = pool.parallel_append(n, Q.imm_plan->task_fn(), true) + n;
  Q.imm_chained = true;
  g_chained_runs.fetch_add(1, std::memory_order_relaxed);
  return Q.imm_plan.get();
}

void MoeJob::join_paired(ThreadPool& pool) {
  DeferralPair& P = *pair_;
  StageClock clock(*experts_);
  P.in_flight = false;
  ChunkPlan* next = nullptr;
  bool decided = false;
  while (!P.def_plan->done()) {
    if (!decided) next = chain_next(pool, decided);
    if (pool.parallel_help(P.def_end, 1) == 0) _mm_pause();
  }
  if (next) next->combine_after_previous();                 // this job's output is complete
  if (!next || P.def_plan->failed()) pool.parallel_join();  // closes the list; rethrows a task's error
  clock.done(JobStage::experts);
  P.def_plan->finish(pool, next != nullptr);
  clock.done(JobStage::combine);
}

}  // namespace hetmoe
