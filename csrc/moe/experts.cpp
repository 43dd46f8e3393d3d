// MoeExperts (moe.h): the packed storage of one layer's experts, packing from fp32, random weights, the raw
// storage the converted-expert cache reads and writes, and its checksum.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "formats/activation.h"
#include "formats/pack.h"
#include "formats/storage.h"
#include "moe/moe.h"

namespace hetmoe {

// ---------------------------------------------------------------- storage

static void check_config(const ExpertsConfig& c) {
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  if (c.n_expert <= 0) bad("num_experts must be positive, got " + std::to_string(c.n_expert));
  if (c.hidden <= 0 || c.intermediate <= 0)
    bad("hidden_size and intermediate_size must be positive, got " + std::to_string(c.hidden) + " and " +
        std::to_string(c.intermediate));
  const WeightFormat down = c.down_format.value_or(c.format);
  if (down != c.format && (down == WeightFormat::bf16 || c.format == WeightFormat::bf16 || c.group <= 0 ||
                           down == WeightFormat::fp8 || c.format == WeightFormat::fp8))
    bad("gate/up and down of different formats must both be grouped int8/int4/lut4");
  const bool affine = c.gate_up_scaling == Scaling::affine || c.down_scaling == Scaling::affine;
  if (affine && c.format == WeightFormat::bf16) bad("affine scaling needs int8 or int4 weights, got bf16");
  check_kernel_choice(c.gate_up_format(), c.isa, c.amx, c.amx_min_tokens);
  check_kernel_choice(c.down_matrix_format(), c.isa, c.amx, c.amx_min_tokens);
  if ((c.gate_up_scaling == Scaling::affine && c.group <= 0) ||
      (c.down_scaling == Scaling::affine && (c.down_group != 0 ? c.down_group : c.group) <= 0))
    bad("affine scaling needs a group size (not per-row scales)");
  if (c.glu.kind != GluKind::swiglu && c.glu.kind != GluKind::clamped_swiglu)
    bad("unknown activation " + std::to_string((int)c.glu.kind));
  if (c.glu.kind == GluKind::clamped_swiglu && !(std::isfinite(c.glu.alpha) && std::isfinite(c.glu.limit) &&
                                                 std::isfinite(c.glu.offset) && c.glu.alpha > 0.f && c.glu.limit > 0.f))
    bad("clamped_swiglu needs a finite alpha > 0, limit > 0 and offset, got alpha " + std::to_string(c.glu.alpha) +
        ", limit " + std::to_string(c.glu.limit) + " and offset " + std::to_string(c.glu.offset));
  if (c.down_group != 0 && (c.group <= 0 || c.down_group < 0))
    bad("down_group_size needs grouped scales for gate/up too, got group_size " + std::to_string(c.group) +
        " and down_group_size " + std::to_string(c.down_group));
}

MoeExperts::MoeExperts(const ExpertsConfig& cfg, std::shared_ptr<ThreadPool> pool) : cfg_(cfg), pool_(std::move(pool)) {
  check_config(cfg_);
  if (cfg_.intermediate_full <= 0) cfg_.intermediate_full = cfg_.intermediate;
  if (cfg_.down_group == 0) cfg_.down_group = cfg_.group;
  gu_ = MatrixShape::make(cfg_.gate_up_format(), cfg_.intermediate, cfg_.hidden);
  down_ = MatrixShape::make(cfg_.down_matrix_format(), cfg_.hidden, cfg_.intermediate);
  gu_act_ = ActLayout::make(gu_);
  down_act_ = ActLayout::make(down_);
  // per-row int8/int4 on AMX: x in one group per token, h in groups of amx_row_group(I) (layout.h)
  gu_amx_act_ = ActLayout::make(gu_, true, gu_.per_row ? gu_.kp : 0);
  down_amx_act_ = ActLayout::make(down_, true, down_.per_row ? amx_row_group(cfg_.intermediate_full) : 0);
  if (cfg_.isa == Isa::amx && cfg_.amx == AmxMode::off) cfg_.amx = AmxMode::native;
  kernel_ = select_kernel(cfg_.format, cfg_.isa, cfg_.amx);
  down_kernel_ = select_kernel(down_.format, cfg_.isa, cfg_.amx);
  row_ops_ = select_row_ops(cfg_.isa);
  amx_min_tokens_.store(cfg_.amx_min_tokens);
  size_t E = cfg_.n_expert;
  gu_data_ = HugeBuffer(E * 2 * gu_.data_bytes());
  gu_scales_ = HugeBuffer(E * 2 * gu_.scale_bytes());
  down_data_ = HugeBuffer(E * down_.data_bytes());
  down_scales_ = HugeBuffer(E * down_.scale_bytes());
  if (cfg_.bias) {  // zeros until load_biases
    gu_bias_ = HugeBuffer(E * 2 * cfg_.intermediate * sizeof(float));
    down_bias_ = HugeBuffer(E * cfg_.hidden * sizeof(float));
    std::memset(gu_bias_.data(), 0, gu_bias_.size());
    std::memset(down_bias_.data(), 0, down_bias_.size());
  }
  loaded_.assign(E, 0);
}

void MoeExperts::set_amx_min_tokens(int n) {
  if (n < 1) throw std::invalid_argument("amx_min_tokens must be >= 1, got " + std::to_string(n));
  cfg_.amx_min_tokens = n;
  amx_min_tokens_.store(n);
}

size_t MoeExperts::bytes_per_expert() const {
  const size_t bias = cfg_.bias ? sizeof(float) * (2 * (size_t)cfg_.intermediate + cfg_.hidden) : 0;
  return 2 * (gu_.data_bytes() + gu_.scale_bytes()) + down_.data_bytes() + down_.scale_bytes() + bias;
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
  return RowBlock::at(gu_, gu_data_.data() + idx * gu_.block_bytes(),
                      gu_scales_.data() + idx * gu_.block_scale_bytes());
}

RowBlock MoeExperts::down_block(int e, int rb) const {
  size_t idx = (size_t)e * down_.n_blocks + rb;
  return RowBlock::at(down_, down_data_.data() + idx * down_.block_bytes(),
                      down_scales_.data() + idx * down_.block_scale_bytes());
}

void MoeExperts::pack_all(int e0, int n, const BlockPacker& pack, const char* failure) {
  if (e0 < 0 || n < 0 || e0 + n > cfg_.n_expert)
    throw std::invalid_argument("load: experts [" + std::to_string(e0) + ", " + std::to_string(e0 + n) +
                                ") are outside [0, " + std::to_string(cfg_.n_expert) + ")");
  const int gu_tasks = gu_.n_blocks * 2, per_expert = gu_tasks + down_.n_blocks;
  // A block whose source is refused fails its matrix (per expert) before anything is marked loaded.
  std::vector<std::atomic<int>> bad(n * 3);
  for (auto& b : bad) b.store(0);
  pool_->run_and_wait([&](ThreadPool& pool) {
    pool.parallel_for((int64_t)n * per_expert, [&](int64_t task, int) {
      int i = (int)(task / per_expert), b = (int)(task % per_expert), e = e0 + i;
      const MatrixShape& shape = b < gu_tasks ? gu_ : down_;
      int which = b < gu_tasks ? b % 2 : 2, rb = b < gu_tasks ? b / 2 : b - gu_tasks;
      size_t idx = which == 2 ? (size_t)e * down_.n_blocks + rb : ((size_t)e * gu_.n_blocks + rb) * 2 + which;
      uint8_t* data = (which == 2 ? down_data_ : gu_data_).data() + idx * shape.block_bytes();
      uint8_t* scales = (which == 2 ? down_scales_ : gu_scales_).data() + idx * shape.block_scale_bytes();
      if (!pack(i, which, shape, rb, data, scales)) bad[i * 3 + which].store(1);
    });
  });
  static const char* names[3] = {"gate", "up", "down"};
  for (int i = 0; i < n; ++i) {
    for (int m = 0; m < 3; ++m)
      if (bad[i * 3 + m].load())
        throw std::invalid_argument(std::string(names[m]) + " of expert " + std::to_string(e0 + i) + " " + failure);
    loaded_[e0 + i] = 1;
  }
}

void MoeExperts::load(int e0, int n, const float* gate, const float* up, const float* down) {
  if (gu_.format == WeightFormat::grid || down_.format == WeightFormat::grid)
    throw std::invalid_argument(kGridFromFloats);
  const size_t IH = (size_t)cfg_.intermediate * cfg_.hidden;
  pack_all(
      e0, n,
      [&](int i, int which, const MatrixShape& shape, int rb, uint8_t* data, uint8_t* scales) {
        const float* src = (which == 0 ? gate : which == 1 ? up : down) + i * IH;
        const int r0 = rb * kRowsPerBlock, r1 = std::min(shape.n, r0 + kRowsPerBlock);
        for (size_t v = (size_t)r0 * shape.k; v < (size_t)r1 * shape.k; ++v)
          if (!std::isfinite(src[v])) return false;
        pack_row_block(shape, src, rb, data, scales);
        return true;
      },
      "contains NaN or Inf");
}

void MoeExperts::load_codes(int e0, int n, const int8_t* const q[3], const float* const group_scales[3],
                            const float* const group_mins[3], const float* const factors[3]) {
  if (cfg_.format == WeightFormat::bf16 || gu_.per_row || down_.per_row)
    throw std::invalid_argument("load_codes: the experts' format must be grouped int8, int4, lut4 or fp8");
  for (int m = 0; m < 3; ++m)
    if ((m < 2 ? gu_ : down_).affine() && !group_mins[m])
      throw std::invalid_argument("load_codes: affine matrices need their mins");
  const size_t IH = (size_t)cfg_.intermediate * cfg_.hidden;
  if (cfg_.format == WeightFormat::fp8) {
    pack_all(
        e0, n,
        [&](int i, int which, const MatrixShape& shape, int rb, uint8_t* data, uint8_t* scales) {
          const uint8_t* codes = reinterpret_cast<const uint8_t*>(q[which]) + i * IH;
          return pack_row_block_fp8(shape, codes, group_scales[which] + i * (size_t)shape.n * shape.n_groups(), rb,
                                    data, scales);
        },
        "has an E4M3 NaN code (0x7F / 0xFF), a scale that is not finite or that its scale type does not hold "
        "exactly, or (shared scales) rows of one row block with different scales");
    return;
  }
  pack_all(
      e0, n,
      [&](int i, int which, const MatrixShape& shape, int rb, uint8_t* data, uint8_t* scales) {
        if (shape.format == WeightFormat::grid) {  // the file's blocks: [n][rows][n_supers] of grid_file_bytes
          const size_t per_expert = (size_t)shape.n * shape.n_supers() * grid_file_bytes(shape.codebook);
          return pack_row_block_grid(shape, reinterpret_cast<const uint8_t*>(q[which]) + i * per_expert, rb, data,
                                     scales);
        }
        const size_t per_expert_scales = (size_t)shape.n * shape.n_groups();
        const float* mins = shape.affine() ? group_mins[which] + i * per_expert_scales : nullptr;
        const float factor = factors && factors[which] ? factors[which][i] : 1.f;
        return pack_row_block_codes(shape, q[which] + i * IH, group_scales[which] + i * per_expert_scales, mins, rb,
                                    data, scales, factor);
      },
      "has a code outside its format's range, a scale or min that is not finite, or a scale its scale type does not "
      "hold exactly (grid: a block's d that is not finite)");
}

void MoeExperts::load_biases(int e0, int n, const float* gate, const float* up, const float* down) {
  if (!cfg_.bias) throw std::invalid_argument("load_biases: these experts were made without biases");
  if (e0 < 0 || n < 0 || e0 + n > cfg_.n_expert)
    throw std::invalid_argument("load_biases: experts [" + std::to_string(e0) + ", " + std::to_string(e0 + n) +
                                ") are outside [0, " + std::to_string(cfg_.n_expert) + ")");
  const size_t I = cfg_.intermediate, H = cfg_.hidden;
  static const char* names[3] = {"gate", "up", "down"};
  for (int i = 0; i < n; ++i)
    for (int m = 0; m < 3; ++m) {
      const float* src = m == 0 ? gate : m == 1 ? up : down;
      const size_t len = m < 2 ? I : H;
      if (!src) continue;
      for (size_t j = 0; j < len; ++j)
        if (!std::isfinite(src[i * len + j]))
          throw std::invalid_argument(std::string(names[m]) + " bias of expert " + std::to_string(e0 + i) +
                                      " contains NaN or Inf");
    }
  for (int i = 0; i < n; ++i) {
    float* gu = const_cast<float*>(gate_up_bias(e0 + i));
    std::memcpy(gu, gate + i * I, sizeof(float) * I);
    std::memcpy(gu + I, up + i * I, sizeof(float) * I);
    float* d = const_cast<float*>(down_bias(e0 + i));
    if (down)
      std::memcpy(d, down + i * H, sizeof(float) * H);
    else
      std::memset(d, 0, sizeof(float) * H);
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

void MoeExperts::fill_random(uint64_t seed, float std) {
  const RandomFill fill = RandomFill::make(gu_.format, std, gu_.codebook);
  const RandomFill down_fill = RandomFill::make(down_.format, std, down_.codebook);
  const int gu_tasks = gu_.n_blocks * 2, per_expert = gu_tasks + down_.n_blocks;
  pool_->run_and_wait([&](ThreadPool& pool) {
    pool.parallel_for((int64_t)cfg_.n_expert * per_expert, [&](int64_t task, int) {
      int e = (int)(task / per_expert), b = (int)(task % per_expert);
      uint64_t block_seed = seed * 0x2545F4914F6CDD1Dull + (uint64_t)task;
      if (b < gu_tasks) {
        RowBlock blk = gate_up_block(e, b / 2, b % 2);
        fill_random_block(gu_, b / 2, block_seed, fill, const_cast<uint8_t*>(blk.data),
                          const_cast<uint8_t*>(blk.scales));
      } else {
        RowBlock blk = down_block(e, b - gu_tasks);
        fill_random_block(down_, b - gu_tasks, block_seed, down_fill, const_cast<uint8_t*>(blk.data),
                          const_cast<uint8_t*>(blk.scales));
      }
    });
  });
  std::fill(loaded_.begin(), loaded_.end(), 1);
}

std::vector<std::pair<uint8_t*, size_t>> MoeExperts::storage() const {
  std::vector<std::pair<uint8_t*, size_t>> out = {{gu_data_.data(), gu_data_.size()},
                                                  {gu_scales_.data(), gu_scales_.size()},
                                                  {down_data_.data(), down_data_.size()},
                                                  {down_scales_.data(), down_scales_.size()}};
  if (cfg_.bias) {
    out.push_back({gu_bias_.data(), gu_bias_.size()});
    out.push_back({down_bias_.data(), down_bias_.size()});
  }
  return out;
}

void MoeExperts::mark_loaded(int e0, int n) {
  if (e0 < 0 || n < 0 || e0 + n > cfg_.n_expert)
    throw std::invalid_argument("mark_loaded: experts [" + std::to_string(e0) + ", " + std::to_string(e0 + n) +
                                ") are outside [0, " + std::to_string(cfg_.n_expert) + ")");
  std::fill(loaded_.begin() + e0, loaded_.begin() + e0 + n, 1);
}

uint64_t MoeExperts::checksum() const { return storage_checksum(*pool_, storage()); }

}  // namespace hetmoe
