// The route stage on the CPU. A MoE job handed the router's logits (MoeCall::logits) routes its tokens itself and
// writes the top-k ids and weights: a hybrid decode step then copies the logits to the host instead of running the
// top-k on the GPU (hetmoe/moe/stream.py). Two routers, each the CPU twin of a function in hetmoe/moe/router.py:
//   softmax          route_softmax: softmax over the experts, top-k, optionally renormalised (Mixtral, Qwen2/3-MoE);
//   sigmoid_grouped  route_deepseek_v3: sigmoid scores; experts chosen by score + correction bias within the
//                    topk_group groups whose two best biased scores sum highest; weighted by the unbiased score
//                    (renormalised if norm_topk_prob) times the scaling factor (DeepSeek-V3/R1, Kimi-K2).
// Ties between equal values go to the lower expert (or group) id. A token with a non-finite logit gets the first k
// ids and NaN weights, so that its output is NaN rather than silently finite.
#pragma once
#include <cstdint>

namespace hetmoe {

enum class RouteScore : int { softmax = 0, sigmoid_grouped = 1 };

constexpr int kMaxRoutedTopK = 64;  // the jobs' own bound (moe.h kMaxTopK)

struct HostRouter {
  RouteScore score = RouteScore::softmax;
  bool norm_topk_prob = false;
  int n_group = 1;              // sigmoid_grouped: groups of n_expert / n_group experts
  int topk_group = 1;           // sigmoid_grouped: groups kept per token
  float scaling = 1.f;          // sigmoid_grouped: routed_scaling_factor
  const float* bias = nullptr;  // sigmoid_grouped: e_score_correction_bias [n_expert] (nullptr: zeros)
};

// Throws std::invalid_argument when the router cannot route k of n_expert experts.
void check_router(const HostRouter& r, int n_expert, int k);

// Routes tokens [t0, t1): logits [*, n_expert] fp32 or bf16 -> ids [*, k] (int32 or int64) and weights [*, k].
void route_rows(const HostRouter& r, const void* logits, bool logits_bf16, int n_expert, int k, void* ids,
                bool ids_int32, float* weights, int64_t t0, int64_t t1);

}  // namespace hetmoe
