// DenseLinear (dense/linear.h): the packed storage of one matrix, packing rows from fp32, random weights, the raw
// storage and its checksum. The call itself is in dense/linear_job.cpp.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "dense/linear.h"
#include "formats/pack.h"
#include "formats/storage.h"

namespace hetmoe {

namespace {

void check_config(const LinearConfig& c) {
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  if (c.n <= 0 || c.k <= 0)
    bad("out_features and in_features must be positive, got " + std::to_string(c.n) + " and " + std::to_string(c.k));
  check_kernel_choice(MatrixFormat{c.format, c.group}, c.isa, c.amx, c.amx_min_tokens);
}

// The shape of row block rb alone (its rows of W from row 0): packing and unpacking see one block of a matrix
// whose rows start at the block, so a caller can hand over any run of whole blocks.
MatrixShape block_shape(const MatrixShape& s, int rb) {
  MatrixShape b = s;
  b.n = std::min(kRowsPerBlock, s.n - rb * kRowsPerBlock);
  b.n_blocks = 1;
  return b;
}

}  // namespace

DenseLinear::DenseLinear(const LinearConfig& cfg, std::shared_ptr<ThreadPool> pool)
    : cfg_(cfg), pool_(std::move(pool)) {
  check_config(cfg_);
  if (!pool_) throw std::invalid_argument("DenseLinear needs a thread pool");
  shape_ = MatrixShape::make(cfg_.format, cfg_.n, cfg_.k, cfg_.group);
  act_ = ActLayout::make(shape_);
  // per-row int8/int4 on AMX: one activation group over the whole row (one scale per token), as the experts' x
  amx_act_ = ActLayout::make(shape_, true, shape_.per_row ? shape_.kp : 0);
  if (cfg_.isa == Isa::amx && cfg_.amx == AmxMode::off) cfg_.amx = AmxMode::native;
  kernel_ = select_kernel(cfg_.format, cfg_.isa, cfg_.amx);
  row_ops_ = select_row_ops(cfg_.isa);
  amx_min_tokens_.store(cfg_.amx_min_tokens);
  data_ = HugeBuffer(shape_.data_bytes());
  scales_ = HugeBuffer(shape_.scale_bytes());
  block_loaded_.assign(shape_.n_blocks, 0);
}

void DenseLinear::set_amx_min_tokens(int n) {
  if (n < 1) throw std::invalid_argument("amx_min_tokens must be >= 1, got " + std::to_string(n));
  cfg_.amx_min_tokens = n;
  amx_min_tokens_.store(n);
}

RowBlock DenseLinear::block(int rb) const {
  RowBlock b;
  b.data = data_.data() + (size_t)rb * shape_.block_bytes();
  b.scales = shape_.has_scales() ? scales_.data() + (size_t)rb * shape_.block_scale_bytes() : nullptr;
  b.kp = shape_.kp;
  b.group = shape_.group;
  return b;
}

void DenseLinear::load_rows(int r0, int n_rows, const float* w) {
  const int N = shape_.n;
  if (r0 < 0 || n_rows < 1 || (int64_t)r0 + n_rows > N)
    throw std::invalid_argument("load_rows: rows [" + std::to_string(r0) + ", " + std::to_string((int64_t)r0 + n_rows) +
                                ") are not a non-empty range inside [0, " + std::to_string(N) + ")");
  if (r0 % kRowsPerBlock != 0 || (n_rows % kRowsPerBlock != 0 && r0 + n_rows != N))
    throw std::invalid_argument("load_rows: rows [" + std::to_string(r0) + ", " + std::to_string(r0 + n_rows) +
                                ") must start at a multiple of 16 and hold a multiple of 16 rows unless they end at " +
                                std::to_string(N));
  if (!w) throw std::invalid_argument("load_rows: the weight pointer is null");
  const int rb0 = r0 / kRowsPerBlock, n_blk = (n_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const size_t K = shape_.k;
  std::vector<uint8_t> bad(n_blk, 0);
  pool_->run_and_wait([&](ThreadPool& pool) {
    pool.parallel_for(n_blk, [&](int64_t i, int) {
      const int rb = rb0 + (int)i;
      const MatrixShape s = block_shape(shape_, rb);
      const float* src = w + (size_t)i * kRowsPerBlock * K;
      for (size_t v = 0; v < (size_t)s.n * K; ++v)
        if (!std::isfinite(src[v])) {
          bad[i] = 1;
          return;
        }
      const RowBlock b = block(rb);
      pack_row_block(s, src, 0, const_cast<uint8_t*>(b.data), const_cast<uint8_t*>(b.scales));
    });
  });
  for (int i = 0; i < n_blk; ++i)
    if (bad[i])
      throw std::invalid_argument("load_rows: weight rows [" + std::to_string(r0 + i * kRowsPerBlock) + ", " +
                                  std::to_string(std::min(N, r0 + (i + 1) * kRowsPerBlock)) +
                                  ") contain NaN or Inf (this call's rows were not all loaded)");
  int added = 0;
  for (int i = 0; i < n_blk; ++i) {
    added += block_loaded_[rb0 + i] == 0;
    block_loaded_[rb0 + i] = 1;
  }
  n_loaded_blocks_.fetch_add(added, std::memory_order_release);
}

void DenseLinear::unpack(float* w) const {
  if (!w) throw std::invalid_argument("unpack: the output pointer is null");
  if (!loaded()) throw std::runtime_error("unpack: not every row of the linear is loaded");
  for (int rb = 0; rb < shape_.n_blocks; ++rb) {
    const RowBlock b = block(rb);
    unpack_row_block(block_shape(shape_, rb), b.data, b.scales, 0, w + (size_t)rb * kRowsPerBlock * shape_.k);
  }
}

void DenseLinear::fill_random(uint64_t seed, float std) {
  const RandomFill fill = RandomFill::make(cfg_.format, std);
  pool_->run_and_wait([&](ThreadPool& pool) {
    pool.parallel_for(shape_.n_blocks, [&](int64_t rb, int) {
      const RowBlock b = block((int)rb);
      fill_random_block(shape_, (int)rb, seed * 0x2545F4914F6CDD1Dull + (uint64_t)rb, fill,
                        const_cast<uint8_t*>(b.data), const_cast<uint8_t*>(b.scales));
    });
  });
  mark_loaded();
}

std::vector<std::pair<uint8_t*, size_t>> DenseLinear::storage() const {
  return {{data_.data(), data_.size()}, {scales_.data(), scales_.size()}};
}

void DenseLinear::mark_loaded() {
  std::fill(block_loaded_.begin(), block_loaded_.end(), 1);
  n_loaded_blocks_.store(shape_.n_blocks, std::memory_order_release);
}

uint64_t DenseLinear::checksum() const { return storage_checksum(*pool_, storage()); }

}  // namespace hetmoe
