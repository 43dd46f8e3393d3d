// The attention block of one GQA decode step on the engine's threads, fused into one job: from the q/k/v
// projections' output of B tokens (one per sequence) to the attention output, ready for o_proj.
//
// For token b (cache row rows[b], position positions[b]) and each head row r of qkv[b] ([n_head + 2 n_kv_head, d]:
// q heads, k heads, v heads):
//     q, k heads:  x = q_norm / k_norm weight * x / sqrt(mean(x^2) + eps)        (when the weights are given)
//                  x = x * cos[b] + [x2, x1] * sin[b]                            (RoPE, rotate-half; sin is signed)
//     k, v heads:  written into the cache at (rows[b], positions[b])
// then decode_attention (dense/attention.h) of the roped q over positions <= positions[b] into out [B, n_head, d].
// Arithmetic in fp32 with the rounding points of the eager PyTorch path (hetmoe/layers/attention.py GQAAttention):
// when qkv is bf16, each step's result is rounded to bf16 as the torch ops round it (the norm's output, its
// product with the weight, both RoPE products and their sum); no multiply-add is contracted (fp32 RoPE is bitwise
// the eager one). The roped q and k are written back into qkv (the attention reads q from there).
#pragma once
#include <cstdint>

#include "runtime/thread_pool.h"

namespace hetmoe {

// One call. Addresses with strides in elements; every last dim is contiguous.
struct DecodeBlockArgs {
  void* qkv = nullptr;  // [B, (n_head + 2 n_kv_head) d], rows qkv_stride_b apart; overwritten (roped q and k)
  int64_t qkv_stride_b = 0;
  bool qkv_bf16 = false;
  int B = 0, n_head = 0, n_kv_head = 0, d = 0;
  const float* q_norm = nullptr;  // [d] or null: no q/k norm (both or neither)
  const float* k_norm = nullptr;  // [d]
  float norm_eps = 1e-6f;
  const void* cos = nullptr;  // [B, d] rows cs_stride_b apart
  const void* sin = nullptr;  // [B, d] signed sin: [-sin, sin]
  int64_t cs_stride_b = 0;
  bool cs_bf16 = false;
  void* k_cache = nullptr;  // [rows, cap, n_kv_head, d] of one layer
  void* v_cache = nullptr;
  int64_t k_strides[3] = {0, 0, 0}, v_strides[3] = {0, 0, 0};  // row, position, head
  bool kv_bf16 = false;
  int64_t n_rows = 0, cap = 0;
  const int64_t* rows = nullptr;       // [B]
  const int64_t* positions = nullptr;  // [B], 0..cap-1
  float scale = 1.0f;
  void* out = nullptr;  // [B, n_head, d]
  int64_t out_stride_b = 0, out_stride_h = 0;
  bool out_bf16 = false;
};

// Checks the arguments (std::invalid_argument naming what is wrong), then runs on the pool's threads. Call it
// inside a job (the coordinator thread), as decode_attention.
void decode_block(ThreadPool& pool, const DecodeBlockArgs& a);

}  // namespace hetmoe
