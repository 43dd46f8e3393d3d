#include "moe/split_experts.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>

#include "formats/activation.h"
#include "formats/pack.h"
#include "kernels/dispatch.h"

namespace hetmoe {

std::vector<std::pair<int, int>> tp_slices(int intermediate, int unit, int n) {
  if (intermediate <= 0 || unit <= 0 || n <= 0) return {{0, intermediate}};
  const int n_units = (intermediate + unit - 1) / unit, n_slices = std::min(n, n_units);
  std::vector<std::pair<int, int>> out;
  for (int s = 0; s < n_slices; ++s) {
    int u0 = (int)((int64_t)n_units * s / n_slices), u1 = (int)((int64_t)n_units * (s + 1) / n_slices);
    out.push_back({u0 * unit, std::min(intermediate, u1 * unit)});
  }
  return out;
}

// ---------------------------------------------------------------- experts

NumaExperts::NumaExperts(const ExpertsConfig& cfg, std::shared_ptr<NumaPools> pools)
    : cfg_(cfg), pools_(std::move(pools)) {
  if (!pools_) throw std::invalid_argument("NumaExperts: no subpools");
  // The unit every boundary is a multiple of: the down matrix's scale group (bf16: the K padding unit; per-row
  // int8/int4: the AMX activation group of h, formats/layout.h amx_row_group; k8 scales: the super-block, so a
  // slice's super scales are the file's).
  const int down_group = cfg_.down_group != 0 ? cfg_.down_group : cfg_.group;
  const int unit = cfg_.format == WeightFormat::bf16 ? kBf16Group
                   : down_group <= 0                 ? amx_row_group(cfg_.intermediate)
                   : cfg_.down_scale_type == ScaleType::k8 ||
                           cfg_.down_format.value_or(cfg_.format) == WeightFormat::grid  // whole blocks of the file
                       ? kSuperBlock
                       : std::max(down_group, kRowsPerBlock);
  bounds_ = tp_slices(cfg_.intermediate, unit, pools_->size());
  for (size_t s = 0; s < bounds_.size(); ++s) {
    ExpertsConfig c = cfg_;
    c.intermediate = bounds_[s].second - bounds_[s].first;
    c.intermediate_full = cfg_.intermediate;
    slices_.push_back(std::make_shared<MoeExperts>(c, pools_->pool_ptr((int)s)));  // validates the config
    // Before anything touches the pages: they then fault in on the subpool's node.
    for (auto& [p, n] : slices_.back()->storage()) pools_->bind((int)s, p, n);
  }
  gu_ = MatrixShape::make(cfg_.gate_up_format(), cfg_.intermediate, cfg_.hidden);
  down_ = MatrixShape::make(cfg_.down_matrix_format(), cfg_.hidden, cfg_.intermediate);
}

size_t NumaExperts::bytes_per_expert() const {
  size_t n = 0;
  for (auto& s : slices_) n += s->bytes_per_expert();
  return n;
}

namespace {

bool all_finite(const float* p, size_t n) {
  bool ok = true;
  for (size_t i = 0; i < n; ++i) ok &= std::isfinite(p[i]);
  return ok;
}

}  // namespace

void NumaExperts::load(int e0, int n, const float* gate, const float* up, const float* down) {
  if (gu_.format == WeightFormat::grid || down_.format == WeightFormat::grid)
    throw std::invalid_argument(kGridFromFloats);
  if (e0 < 0 || n < 0 || e0 + n > cfg_.n_expert)
    throw std::invalid_argument("load: experts [" + std::to_string(e0) + ", " + std::to_string(e0 + n) +
                                ") are outside [0, " + std::to_string(cfg_.n_expert) + ")");
  if (n == 0) return;
  const int H = cfg_.hidden, I = cfg_.intermediate;
  const size_t IH = (size_t)I * H;
  const WeightFormat fmt = down_.format;  // the format of the down slices packed below
  std::vector<std::atomic<int>> bad((size_t)n * 3);
  for (auto& b : bad) b.store(0);
  // Each slice is packed by its own subpool's threads: the first touch of its pages is on its node.
  pools_->run_on_all(n_slices(), [&](int s, ThreadPool& pool) {
    const MoeExperts& sl = *slices_[s];
    const int i0 = bounds_[s].first, Is = bounds_[s].second - i0, rb0 = i0 / kRowsPerBlock;
    const MatrixShape& sd = sl.down_shape();
    const int gu_tasks = 2 * sl.gate_up_shape().n_blocks, per_expert = gu_tasks + sd.n_blocks;
    pool.parallel_for((int64_t)n * per_expert, [&](int64_t task, int th) {
      const int i = (int)(task / per_expert), b = (int)(task % per_expert), e = e0 + i;
      if (b < gu_tasks) {
        // gate/up: whole row blocks of the full matrix, packed exactly as the unsplit engine packs them
        const int which = b % 2, rb = rb0 + b / 2;
        const float* src = (which ? up : gate) + i * IH;
        const int r0 = rb * kRowsPerBlock, r1 = std::min(I, r0 + kRowsPerBlock);
        if (!all_finite(src + (size_t)r0 * H, (size_t)(r1 - r0) * H)) {
          bad[i * 3 + which].store(1);
          return;
        }
        RowBlock blk = sl.gate_up_block(e, b / 2, which);
        pack_row_block(gu_, src, rb, const_cast<uint8_t*>(blk.data), const_cast<uint8_t*>(blk.scales));
        return;
      }
      // down: columns [i0, i0 + Is) of row block rb
      const int rb = b - gu_tasks, r0 = rb * kRowsPerBlock, nr = std::min(kRowsPerBlock, H - r0);
      const float* src = down + i * IH;
      for (int r = 0; r < nr; ++r)
        if (!all_finite(src + (size_t)(r0 + r) * I + i0, Is)) {
          bad[i * 3 + 2].store(1);
          return;
        }
      RowBlock blk = sl.down_block(e, rb);
      uint8_t* data = const_cast<uint8_t*>(blk.data);
      uint8_t* scales = const_cast<uint8_t*>(blk.scales);
      if (down_.per_row) {
        // Per-row scales (fp32) come from the whole row: pack the full row block, keep this slice's lines and groups.
        const size_t data_bytes = down_.block_bytes();
        uint8_t* tmp = pool.thread_scratch(th, data_bytes + down_.block_scale_bytes());
        uint8_t* tmp_scales = tmp + data_bytes;
        pack_row_block(down_, src, rb, tmp, tmp_scales);
        std::memcpy(data, tmp + (size_t)(i0 / k_per_line(fmt)) * kLineBytes, sd.block_bytes());
        std::memcpy(scales, tmp_scales + (size_t)(i0 / down_.group) * kRowsPerBlock * sizeof(float),
                    sd.block_scale_bytes());
      } else {
        // Scales are per group and groups are whole: the slice's columns packed alone give the same bytes.
        float* tmp = reinterpret_cast<float*>(pool.thread_scratch(th, sizeof(float) * nr * Is));
        for (int r = 0; r < nr; ++r)
          std::memcpy(tmp + (size_t)r * Is, src + (size_t)(r0 + r) * I + i0, sizeof(float) * Is);
        pack_row_block(MatrixShape::make(sd.matrix_format(), nr, Is), tmp, 0, data, scales);
      }
    });
  });
  static const char* names[3] = {"gate", "up", "down"};
  for (int i = 0; i < n; ++i)
    for (int m = 0; m < 3; ++m)
      if (bad[i * 3 + m].load())
        throw std::invalid_argument(std::string(names[m]) + " of expert " + std::to_string(e0 + i) +
                                    " contains NaN or Inf");
  for (auto& sl : slices_) sl->mark_loaded(e0, n);
}

void NumaExperts::load_codes(int e0, int n, const int8_t* const q[3], const float* const group_scales[3],
                             const float* const group_mins[3], const float* const factors[3]) {
  if (cfg_.format == WeightFormat::bf16 || gu_.per_row || down_.per_row)
    throw std::invalid_argument("load_codes: the experts' format must be grouped int8, int4, lut4 or fp8");
  const int H = cfg_.hidden, I = cfg_.intermediate, gg = gu_.group, gd = down_.group;
  if (H % gg || I % gd)
    throw std::invalid_argument("load_codes: hidden and intermediate sizes must be multiples of the group");
  const size_t IH = (size_t)I * H;
  // grid matrices take the file's blocks (formats/pack.h pack_row_block_grid): bytes per block and per row
  const bool gu_grid = gu_.format == WeightFormat::grid, down_grid = down_.format == WeightFormat::grid;
  const size_t gu_row = gu_grid ? (size_t)gu_.n_supers() * grid_file_bytes(gu_.codebook) : 0;
  const size_t down_block = down_grid ? grid_file_bytes(down_.codebook) : 0, down_row = down_block * down_.n_supers();
  std::vector<int8_t> down_q;
  std::vector<float> down_s, down_m;
  for (int i = 0; i < n; ++i)
    for (int s = 0; s < n_slices(); ++s) {
      // slice s: rows [i0, i1) of gate and up (contiguous), columns [i0, i1) of down (copied out; whole groups, for a
      // grid down whole blocks of 256: the unit of the slices)
      const int i0 = bounds_[s].first, Is = bounds_[s].second - i0;
      const size_t n_g = Is / gd;
      if (down_grid) {
        const size_t slice_row = (size_t)(Is / kSuperBlock) * down_block,
                     skip = (size_t)(i0 / kSuperBlock) * down_block;
        down_q.resize((size_t)H * slice_row);
        const int8_t* dq = q[2] + i * (size_t)H * down_row;
        for (int r = 0; r < H; ++r)
          std::memcpy(down_q.data() + (size_t)r * slice_row, dq + (size_t)r * down_row + skip, slice_row);
      } else {
        down_q.resize((size_t)H * Is);
        down_s.resize((size_t)H * n_g);
        down_m.resize(group_mins[2] ? (size_t)H * n_g : 0);
        const int8_t* dq = q[2] + i * IH;
        const size_t d_off = i * IH / gd;
        for (int r = 0; r < H; ++r) {
          std::memcpy(down_q.data() + (size_t)r * Is, dq + (size_t)r * I + i0, Is);
          const size_t src = d_off + (size_t)r * (I / gd) + i0 / gd;
          std::memcpy(down_s.data() + (size_t)r * n_g, group_scales[2] + src, sizeof(float) * n_g);
          if (group_mins[2]) std::memcpy(down_m.data() + (size_t)r * n_g, group_mins[2] + src, sizeof(float) * n_g);
        }
      }
      const size_t gu_off = i * IH / gg + (size_t)i0 * (H / gg);
      const int8_t* sq[3] = {q[0] + i * IH + (size_t)i0 * H, q[1] + i * IH + (size_t)i0 * H, down_q.data()};
      if (gu_grid)
        for (int m = 0; m < 2; ++m) sq[m] = q[m] + (i * (size_t)I + i0) * gu_row;
      const float* ss[3] = {gu_grid ? nullptr : group_scales[0] + gu_off, gu_grid ? nullptr : group_scales[1] + gu_off,
                            down_grid ? nullptr : down_s.data()};
      const float* sm[3] = {group_mins[0] ? group_mins[0] + gu_off : nullptr,
                            group_mins[1] ? group_mins[1] + gu_off : nullptr,
                            group_mins[2] && !down_grid ? down_m.data() : nullptr};
      const float* sf[3];  // each slice's rows of expert i keep its per-tensor factors
      for (int m = 0; m < 3; ++m) sf[m] = factors && factors[m] ? factors[m] + i : nullptr;
      slices_[s]->load_codes(e0 + i, 1, sq, ss, sm, sf);
    }
}

void NumaExperts::unpack(int e, float* gate, float* up, float* down) const {
  const int H = cfg_.hidden, I = cfg_.intermediate;
  for (int s = 0; s < n_slices(); ++s) {
    const int i0 = bounds_[s].first, Is = bounds_[s].second - i0;
    std::vector<float> d((size_t)H * Is);
    slices_[s]->unpack(e, gate + (size_t)i0 * H, up + (size_t)i0 * H, d.data());
    for (int h = 0; h < H; ++h) std::memcpy(down + (size_t)h * I + i0, d.data() + (size_t)h * Is, sizeof(float) * Is);
  }
}

void NumaExperts::load_biases(int e0, int n, const float* gate, const float* up, const float* down) {
  // Slice s: gate/up biases [i0, i1); the down bias is added once, by slice 0 (the others hold zeros).
  const int I = cfg_.intermediate;
  for (int s = 0; s < n_slices(); ++s) {
    const int i0 = bounds_[s].first, Is = bounds_[s].second - i0;
    std::vector<float> g((size_t)n * Is), u((size_t)n * Is);
    for (int i = 0; i < n; ++i) {
      std::memcpy(g.data() + (size_t)i * Is, gate + (size_t)i * I + i0, sizeof(float) * Is);
      std::memcpy(u.data() + (size_t)i * Is, up + (size_t)i * I + i0, sizeof(float) * Is);
    }
    slices_[s]->load_biases(e0, n, g.data(), u.data(), s == 0 ? down : nullptr);
  }
}

void NumaExperts::fill_random(uint64_t seed, float std) {
  // Each slice fills itself on its own subpool (run_and_wait there), all at once.
  std::vector<std::exception_ptr> errs(slices_.size());
  std::vector<std::thread> threads;
  for (size_t s = 0; s < slices_.size(); ++s)
    threads.emplace_back([&, s] {
      try {
        slices_[s]->fill_random(seed + 0x9E3779B97F4A7C15ull * s, std);
      } catch (...) {
        errs[s] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

std::vector<std::pair<uint8_t*, size_t>> NumaExperts::storage() const {
  std::vector<std::pair<uint8_t*, size_t>> out;
  for (auto& s : slices_)
    for (auto& r : s->storage()) out.push_back(r);
  return out;
}

void NumaExperts::mark_loaded(int e0, int n) {
  for (auto& s : slices_) s->mark_loaded(e0, n);
}

uint64_t NumaExperts::checksum() const {
  uint64_t h = 0xCBF29CE484222325ull ^ (uint64_t)slices_.size();
  for (auto& s : slices_) h = (h ^ s->checksum()) * 0x100000001B3ull + (h >> 29);
  return h;
}

// ---------------------------------------------------------------- the job

NumaMoeJob::NumaMoeJob(std::shared_ptr<NumaExperts> experts, const MoeCall& call)
    : experts_(std::move(experts)), call_(call) {
  check_call(call_);
  mask_.assign(call_.skip_mask ? experts_->config().n_expert : 0, 0);
  partial_.assign(experts_->n_slices(), nullptr);
}

void NumaMoeJob::run(ThreadPool& pool) {
  NumaPools& pools = experts_->pools();
  if (&pool != &pools.pool(0))
    throw std::logic_error("a tensor-parallel MoE job must run on subpool 0 of its experts' subpools");
  const int64_t T = call_.n_tokens_ptr ? *call_.n_tokens_ptr : call_.n_tokens;
  if (T < 0 || T > call_.capacity)
    throw std::invalid_argument("number of tokens " + std::to_string(T) + " is outside [0, " +
                                std::to_string(call_.capacity) + "], the capacity of this job's buffers");
  const int E = experts_->config().n_expert, H = experts_->config().hidden, k = call_.k;
  if (call_.logits) route_call(call_, E, 0, T);  // once here; the slices read the ids it wrote
  // Ids are checked here, once, so the error names the token in the whole call (slices see one chunk).
  for (int64_t i = 0; i < T * k; ++i) {
    int64_t id =
        call_.ids_int32 ? static_cast<const int32_t*>(call_.ids)[i] : static_cast<const int64_t*>(call_.ids)[i];
    if (id < -1 || id >= E)
      throw std::invalid_argument("topk_ids[" + std::to_string(i / k) + ", " + std::to_string(i % k) + "] = " +
                                  std::to_string(id) + " is not an expert id in [0, " + std::to_string(E) + ") or -1");
  }
  if (call_.skip_mask) std::memcpy(mask_.data(), call_.skip_mask, mask_.size());
  const size_t x_row = (size_t)H * (call_.x_bf16 ? 2 : 4), id_row = (size_t)k * (call_.ids_int32 ? 4 : 8);
  for (int64_t t0 = 0; t0 < T; t0 += kTpChunkTokens) {
    const int64_t nt = std::min(T - t0, kTpChunkTokens);
    pools.fan_out(experts_->n_slices(), [&](int s, ThreadPool& p) {
      float* part = reinterpret_cast<float*>(pools.partial(s, sizeof(float) * (size_t)nt * H));
      partial_[s] = part;
      MoeCall c = call_;
      c.x = static_cast<const uint8_t*>(call_.x) + t0 * x_row;
      c.ids = static_cast<const uint8_t*>(call_.ids) + t0 * id_row;
      c.weights = call_.weights + t0 * k;
      c.out = part;
      c.out_bf16 = false;
      c.accumulate = false;
      c.logits = nullptr;
      c.addend = nullptr;
      c.n_tokens_ptr = nullptr;
      c.n_tokens = c.capacity = nt;
      c.skip_mask = call_.skip_mask ? mask_.data() : nullptr;
      MoeJob(experts_->slice_ptr(s), c).run(p);
    });
    reduce(pool, t0, nt);
  }
}

// Below this many partial elements the reduction runs on the calling thread (a decode step's few rows cost
// less than waking the subpools).
constexpr int64_t kSerialReduceElements = 1 << 16;

void NumaMoeJob::reduce(ThreadPool& pool0, int64_t t0, int64_t nt) {
  const int n = experts_->n_slices(), H = experts_->config().hidden;
  // out[t] = (old out[t] when accumulating) + partial_0[t] + partial_1[t] + ... (+ addend[t]), in fp32, then stored.
  auto row = [&](int64_t t, int th, ThreadPool& p) {
    const size_t off = (size_t)t * H;
    const float* p0 = partial_[0] + off;
    if (call_.out_bf16) {
      uint16_t* dst = static_cast<uint16_t*>(call_.out) + (t0 + t) * H;
      float* acc = reinterpret_cast<float*>(p.thread_scratch(th, sizeof(float) * H));
      if (call_.accumulate)
        for (int i = 0; i < H; ++i) acc[i] = bf16_to_float(dst[i]) + p0[i];
      else
        std::memcpy(acc, p0, sizeof(float) * H);
      for (int s = 1; s < n; ++s) {
        const float* ps = partial_[s] + off;
        for (int i = 0; i < H; ++i) acc[i] += ps[i];
      }
      if (call_.addend)
        for (int i = 0; i < H; ++i) acc[i] += call_.addend[(t0 + t) * H + i];
      experts_->slice(0).row_ops().f32_to_bf16(acc, H, dst);
    } else {
      float* dst = static_cast<float*>(call_.out) + (t0 + t) * H;
      if (call_.accumulate)
        for (int i = 0; i < H; ++i) dst[i] += p0[i];
      else
        std::memcpy(dst, p0, sizeof(float) * H);
      for (int s = 1; s < n; ++s) {
        const float* ps = partial_[s] + off;
        for (int i = 0; i < H; ++i) dst[i] += ps[i];
      }
      if (call_.addend)
        for (int i = 0; i < H; ++i) dst[i] += call_.addend[(t0 + t) * H + i];
    }
  };
  if (nt * H * n <= kSerialReduceElements) {
    for (int64_t t = 0; t < nt; ++t) row(t, 0, pool0);
    return;
  }
  // Each subpool reduces a share of the rows with all its threads.
  experts_->pools().fan_out(n, [&](int s, ThreadPool& p) {
    const int64_t r0 = nt * s / n, r1 = nt * (s + 1) / n;
    p.parallel_for(r1 - r0, [&](int64_t i, int th) { row(r0 + i, th, p); });
  });
}

}  // namespace hetmoe
