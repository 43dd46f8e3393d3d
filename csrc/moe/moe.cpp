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
      bad("group_size must be 32, 64 or 128" + std::string(c.format == WeightFormat::int8 ? " (or 0 for per-row)" : "") +
          ", got " + std::to_string(c.group));
  }
  if (c.isa == Isa::amx && !amx_unavailable_reason().empty())
    bad("this CPU cannot run the amx kernels: " + amx_unavailable_reason() + " (it has: " +
        cpu_features().describe() + ")");
  if (!cpu_features().supports(c.isa))
    bad(std::string("this CPU cannot run the ") + isa_name(c.isa) + " kernels (it has: " + cpu_features().describe() + ")");
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

void MoeExperts::add_profile(const int64_t* ns) const {
  std::lock_guard<std::mutex> lk(profile_mu_);
  ++profile_.jobs;
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
      float* scales = reinterpret_cast<float*>((which == 2 ? down_scales_ : gu_scales_).data()) + idx * shape.block_scales();
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
        fill_random_block(gu_, b / 2, block_seed, scale, bf16_exp, const_cast<uint8_t*>(blk.data), const_cast<float*>(blk.scales));
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

// Reads the clock at stage boundaries only while the experts are profiling; hands the sums over at the end.
class StageClock {
 public:
  explicit StageClock(const MoeExperts& ex) : ex_(ex), on_(ex.profiling()) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  void done(JobStage stage) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    ns_[(int)stage] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count();
    last_ = now;
  }
  ~StageClock() {
    if (on_) ex_.add_profile(ns_);
  }

 private:
  const MoeExperts& ex_;
  bool on_;
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
// Chunks of at most this many tokens combine inside the down phase (run_chunk).
constexpr int kFusedCombineTokens = 16;

template <class F>
void for_rows(ThreadPool& pool, int64_t n_rows, int64_t elems_per_row, const F& fn) {
  if (n_rows * elems_per_row <= kSerialElements) {
    for (int64_t i = 0; i < n_rows; ++i) fn(i, 0);
    return;
  }
  pool.parallel_for(n_rows, fn);
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

// The combine of whole rows, a token per task.
void combine(ThreadPool& pool, const RowOps& ops, const MoeCall& c, int H, int64_t t0, int nt,
             const std::vector<int>& pos, const float* y) {
  for_rows(pool, nt, (int64_t)H * (c.k + 1), [&](int64_t t, int th) {
    combine_rows(ops, c, H, t0, t, t + 1, pos, y, 0, H, reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * H)));
  });
}

// Countdowns over the tasks of a phase: the task that brings one to zero finishes what depends on all of them.
class Countdown {
 public:
  explicit Countdown(size_t n) : left_(n) {}
  void set(size_t i, int v) { left_[i].store(v, std::memory_order_relaxed); }
  void add(size_t i, int v) { left_[i].fetch_add(v, std::memory_order_relaxed); }
  bool zero(size_t i) const { return left_[i].load(std::memory_order_acquire) == 0; }
  // True for the caller that takes index i to zero; acquire-release, so it sees every other task's writes.
  bool arrive(size_t i) { return left_[i].fetch_sub(1, std::memory_order_acq_rel) == 1; }

 private:
  std::vector<std::atomic<int>> left_;
};

}  // namespace

void MoeJob::run(ThreadPool& pool) {
  StageClock clock(*experts_);
  int64_t T = call_.n_tokens_ptr ? *call_.n_tokens_ptr : call_.n_tokens;
  if (T < 0 || T > call_.capacity)
    throw std::invalid_argument("number of tokens " + std::to_string(T) + " is outside [0, " +
                                std::to_string(call_.capacity) + "], the capacity of this job's buffers");
  if (call_.logits) route_call(call_, experts_->config().n_expert, 0, T);
  for (int64_t t0 = 0; t0 < T; t0 += kTokensPerChunk)
    run_chunk(pool, t0, std::min(T, t0 + kTokensPerChunk), clock);
}

void MoeJob::run_chunk(ThreadPool& pool, int64_t t0, int64_t t1, StageClock& clock) {
  const MoeExperts& ex = *experts_;
  const ExpertsConfig& cfg = ex.config();
  const int E = cfg.n_expert, H = cfg.hidden, I = cfg.intermediate, k = call_.k;
  const int nt = (int)(t1 - t0);
  const WeightFormat fmt = cfg.format;
  const RowOps& ops = ex.row_ops();

  // ---- route: count (token, slot) pairs per expert
  std::vector<int> count(E, 0), pos((size_t)nt * k, -1);
  std::vector<uint8_t> in_part(k, 1);
  for (int t = 0; t < nt; ++t) {
    if (call_.part != JobPart::all) select_part(call_.weights + (t0 + t) * k, k, call_.defer_lowest, call_.part, in_part);
    for (int j = 0; j < k; ++j) {
      if (!in_part[j]) continue;
      int64_t idx = (t0 + t) * k + j;
      int64_t id = call_.ids_int32 ? static_cast<const int32_t*>(call_.ids)[idx] : static_cast<const int64_t*>(call_.ids)[idx];
      if (id == -1) continue;
      if (id < -1 || id >= E)
        throw std::invalid_argument("topk_ids[" + std::to_string(t0 + t) + ", " + std::to_string(j) + "] = " +
                                    std::to_string(id) + " is not an expert id in [0, " + std::to_string(E) +
                                    ") or -1");
      if (call_.skip_mask && call_.skip_mask[id]) continue;
      pos[(size_t)t * k + j] = (int)id;  // expert for now; becomes the slot below
      ++count[id];
    }
  }
  std::vector<int> active;
  for (int e = 0; e < E; ++e)
    if (count[e]) {
      if (!ex.is_loaded(e)) throw std::runtime_error("expert " + std::to_string(e) + " is routed to but was never loaded");
      active.push_back(e);
    }
  std::stable_sort(active.begin(), active.end(), [&](int a, int b) { return count[a] > count[b]; });
  std::vector<int> first(E, 0), fill(E, 0);
  int n_slots = 0;
  for (int e : active) first[e] = n_slots, n_slots += count[e];
  std::vector<int> slot_token(n_slots);
  for (int t = 0; t < nt; ++t)
    for (int j = 0; j < k; ++j) {
      int& p = pos[(size_t)t * k + j];
      if (p < 0) continue;
      int s = first[p] + fill[p]++;
      slot_token[s] = t;
      p = s;
    }

  const ActLayout& ga = ex.gate_up_act();
  const ActLayout& da = ex.down_act();
  const MatrixShape& gu = ex.gate_up_shape();
  const MatrixShape& dn = ex.down_shape();
  const int n_threads = pool.size();
  clock.done(JobStage::route);

  if (n_slots > 0) {
    // AMX experts: those with at least amx_min_tokens tokens. `active` is sorted by count, so they come first
    // and own the slots [0, n_amx_slots).
    int n_amx = 0;
    while (n_amx < (int)active.size() && ex.uses_amx(count[active[n_amx]])) ++n_amx;
    const int n_amx_slots = n_amx ? first[active[n_amx - 1]] + count[active[n_amx - 1]] : 0;
    const ActLayout& gxa = ex.gate_up_amx_act();
    const ActLayout& dxa = ex.down_amx_act();
    std::vector<const uint8_t*> x_rows(n_slots), h_rows(n_slots);
    // AMX experts' rows in the activation panels (layout.h AmxPanel): each expert starts a block of 16 rows;
    // panel_row[s] is slot s's row, and the rows that pad an expert's last block are zero.
    std::vector<int> amx_first(E, 0), panel_row(n_amx_slots);
    int n_panel = 0;
    for (int i = 0; i < n_amx; ++i) {
      const int e = active[i];
      amx_first[e] = n_panel;
      for (int m = 0; m < count[e]; ++m) panel_row[first[e] + m] = n_panel + m;
      n_panel += (count[e] + 15) / 16 * 16;
    }
    auto make_panel = [&](int slot, const ActLayout& a) {
      uint8_t* p = pool.scratch(slot, AmxPanel::tile_bytes(a, n_panel) + AmxPanel::meta_bytes_of(a, n_panel));
      const AmxPanel panel = AmxPanel::make(a, p, p + AmxPanel::tile_bytes(a, n_panel));
      for (int i = 0; i < n_amx; ++i) {
        const int e = active[i];
        for (int r = amx_first[e] + count[e]; r % 16; ++r) panel.store(r, nullptr, a.scales_off);
      }
      return panel;
    };

    // ---- quantize x, once per token: for the row-block kernels into rows; for AMX experts also in their
    // format, then copied to every panel row of the token (an expert's tokens are consecutive A-tile rows)
    if (n_amx_slots < n_slots) {
      uint8_t* xq = pool.scratch(0, (size_t)nt * ga.row_bytes);
      for_rows(pool, nt, H, [&](int64_t t, int th) {
        float* row = reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * H));
        load_row_fp32(ops, call_.x, call_.x_bf16, t0 + t, H, row);
        ops.quantize(fmt, false, row, H, ga, xq + t * ga.row_bytes);
      });
      for (int s = n_amx_slots; s < n_slots; ++s) x_rows[s] = xq + (size_t)slot_token[s] * ga.row_bytes;
    }
    AmxPanel xa;
    if (n_amx_slots > 0) {
      uint8_t* xt = pool.scratch(kAmxScratchSlot, (size_t)nt * gxa.row_bytes);
      for_rows(pool, nt, H, [&](int64_t t, int th) {
        float* row = reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * H));
        load_row_fp32(ops, call_.x, call_.x_bf16, t0 + t, H, row);
        ops.quantize(fmt, true, row, H, gxa, xt + t * gxa.row_bytes);
      });
      xa = make_panel(kAmxScratchSlot + 1, gxa);
      for_rows(pool, n_amx_slots, gxa.scales_off / 4, [&](int64_t s, int) {
        xa.store(panel_row[s], xt + (size_t)slot_token[s] * gxa.row_bytes, gxa.scales_off);
      });
    }
    clock.done(JobStage::quantize_x);

    // h is quantized once per (token, expert), in the format of the expert's path (AMX slots into their panel),
    // by the gate+up task that completes the expert's rows for those tokens. With a few tokens (decode), y is
    // combined a run of row blocks at a time by the down task that completes those blocks for every expert;
    // with many, a combine that late would fall on the few threads running the last tasks, so it runs after
    // them on every thread.
    const bool fuse_combine = nt <= kFusedCombineTokens;
    AmxPanel ha;
    if (n_amx_slots > 0) ha = make_panel(kAmxScratchSlot + 2, dxa);
    uint8_t* hq = pool.scratch(2, (size_t)(n_slots - n_amx_slots) * da.row_bytes);
    for (int s = n_amx_slots; s < n_slots; ++s) h_rows[s] = hq + (size_t)(s - n_amx_slots) * da.row_bytes;
    float* h = reinterpret_cast<float*>(pool.scratch(1, sizeof(float) * (size_t)n_slots * I));
    auto quantize_h = [&](int64_t s, int th) {
      if (s < n_amx_slots) {
        uint8_t* row = pool.thread_scratch(th, dxa.row_bytes);
        ops.quantize(fmt, true, h + (size_t)s * I, I, dxa, row);
        ha.store(panel_row[s], row, dxa.scales_off);
      } else {
        ops.quantize(fmt, false, h + (size_t)s * I, I, da, hq + (size_t)(s - n_amx_slots) * da.row_bytes);
      }
    };

    // ---- gate + up with SwiGLU -> h [n_slots, I], then down -> y [n_slots, H], as one list of tasks: an
    // expert's down tasks wait (spinning) until its gate+up tasks are done and its h quantized. The down tasks are
    // pulled after every gate+up task and in the same expert order, so such a wait is at most the last gate+up
    // task, and the threads stream weights from the first task to the last without a barrier between the phases.
    std::vector<Task> tasks, down_tasks;
    std::vector<TaskGroup> groups;
    make_tasks(active, count, n_amx, TaskPlan{gu.n_blocks, 1, amx_panel_tokens(gxa), n_threads, false}, tasks, &groups);
    make_tasks(active, count, n_amx, TaskPlan{dn.n_blocks, 2, amx_panel_tokens(dxa), n_threads}, down_tasks);
    Countdown rows_left(groups.size()), expert_left(E);
    for (int e : active) expert_left.set(e, 0);
    for (size_t g = 0; g < groups.size(); ++g) {
      rows_left.set(g, groups[g].n_tasks);
      expert_left.add(groups[g].e, groups[g].n_tasks);
    }
    Countdown blocks_left(dn.n_blocks);
    {
      std::vector<int> covers(dn.n_blocks + 1, 0);  // tasks covering each row block, by differences
      for (const Task& t : down_tasks) ++covers[t.rb0], --covers[t.rb1];
      for (int b = 0, c = 0; b < dn.n_blocks; ++b) blocks_left.set(b, c += covers[b]);
    }
    float* y = reinterpret_cast<float*>(pool.scratch(3, sizeof(float) * (size_t)n_slots * H));
    const PhaseInput in1{x_rows.data(), xa, amx_first.data(), first.data()};
    const PhaseInput in2{h_rows.data(), ha, amx_first.data(), first.data()};
    const int64_t n_gu = (int64_t)tasks.size();
    std::atomic<bool> failed{false};  // a gate+up task threw: the waits give up (parallel_for reports the error)
    auto run_task = [&](int64_t ti, int th) {
      if (ti < n_gu) {
        const Task& task = tasks[ti];
        try {
          run_gate_up_task(ex, task, in1, h, pool, th);
          if (rows_left.arrive(task.group)) {
            const TaskGroup& g = groups[task.group];
            for (int s = first[g.e] + g.m0; s < first[g.e] + g.m1; ++s) quantize_h(s, th);
          }
        } catch (...) {
          failed.store(true, std::memory_order_relaxed);
          throw;
        }
        expert_left.arrive(task.e);
        return;
      }
      const Task& task = down_tasks[ti - n_gu];
      while (!expert_left.zero(task.e)) {
        if (failed.load(std::memory_order_relaxed)) return;
        _mm_pause();
      }
      run_down_task(ex, task, in2, y, pool, th);
      if (!fuse_combine) return;
      // combine each run of the task's blocks that it was the last to compute
      for (int b = task.rb0, run0 = -1; b <= task.rb1; ++b) {
        const bool mine = b < task.rb1 && blocks_left.arrive(b);
        if (mine && run0 < 0) run0 = b;
        if (!mine && run0 >= 0) {
          const int c0 = run0 * kRowsPerBlock, c1 = std::min(H, b * kRowsPerBlock);
          combine_rows(ops, call_, H, t0, 0, nt, pos, y, c0, c1,
                       reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * (c1 - c0))));
          run0 = -1;
        }
      }
    };
    pool.parallel_for(n_gu + (int64_t)down_tasks.size(), run_task);
    clock.done(JobStage::experts);
    if (!fuse_combine) combine(pool, ops, call_, H, t0, nt, pos, y);
    clock.done(JobStage::combine);
    return;
  }
  combine(pool, ops, call_, H, t0, nt, pos, nullptr);
  clock.done(JobStage::combine);
}

}  // namespace hetmoe
