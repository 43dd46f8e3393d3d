#include "moe/routing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "formats/activation.h"

namespace hetmoe {

namespace {

// The k largest of v[0..n) restricted to `allowed` (nullptr: all), descending; a later index never displaces an
// equal earlier one. Writes k indices to top (k <= n allowed entries).
void top_k(const float* v, int n, int k, const uint8_t* allowed, int* top) {
  int m = 0;
  for (int e = 0; e < n; ++e) {
    if (allowed && !allowed[e]) continue;
    if (m == k && !(v[e] > v[top[k - 1]])) continue;
    int i = m < k ? m++ : k - 1;
    while (i > 0 && v[e] > v[top[i - 1]]) top[i] = top[i - 1], --i;
    top[i] = e;
  }
}

void softmax_weights(const HostRouter& r, const float* row, int E, int k, const int* top, float* w) {
  const double m = row[top[0]];
  double z_all = 0, z_top = 0;
  for (int e = 0; e < E; ++e) z_all += std::exp((double)row[e] - m);
  for (int j = 0; j < k; ++j) z_top += std::exp((double)row[top[j]] - m);
  const double z = r.norm_topk_prob ? z_top : z_all;
  for (int j = 0; j < k; ++j) w[j] = (float)(std::exp((double)row[top[j]] - m) / z);
}

// Per-call scratch of the routers (allocated once per job, not per token).
struct RouteScratch {
  std::vector<float> row, s, b, group_score;
  std::vector<uint8_t> allowed;
  std::vector<int> groups;
  RouteScratch(int E, const HostRouter& r)
      : row(E), s(E), b(E), group_score(r.n_group), allowed(E), groups(r.topk_group) {}
};

// route_deepseek_v3, in fp32 like the PyTorch function.
void sigmoid_grouped(const HostRouter& r, const float* row, int E, int k, RouteScratch& sc, int* top, float* w) {
  std::vector<float>& s = sc.s;
  std::vector<float>& b = sc.b;
  std::vector<uint8_t>& allowed = sc.allowed;
  std::vector<float>& group_score = sc.group_score;
  const int G = r.n_group, per = E / G;
  for (int e = 0; e < E; ++e) {
    s[e] = 1.f / (1.f + std::exp(-row[e]));
    b[e] = s[e] + (r.bias ? r.bias[e] : 0.f);
  }
  for (int g = 0; g < G; ++g) {
    int best[2] = {0, 0};
    const int n2 = per < 2 ? per : 2;
    top_k(b.data() + g * per, per, n2, nullptr, best);
    group_score[g] = 0.f;
    for (int i = 0; i < n2; ++i) group_score[g] += b[g * per + best[i]];
  }
  top_k(group_score.data(), G, r.topk_group, nullptr, sc.groups.data());
  std::fill(allowed.begin(), allowed.end(), 0);
  for (int g : sc.groups) std::fill(allowed.begin() + g * per, allowed.begin() + (g + 1) * per, 1);
  top_k(b.data(), E, k, allowed.data(), top);
  float sum = 0.f;
  for (int j = 0; j < k; ++j) sum += w[j] = s[top[j]];
  for (int j = 0; j < k; ++j) {
    if (r.norm_topk_prob) w[j] = w[j] / (sum + 1e-20f);
    w[j] *= r.scaling;
  }
}

}  // namespace

void check_router(const HostRouter& r, int E, int k) {
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  if (k < 1 || k > E || k > kMaxRoutedTopK)
    bad("cannot route to the top " + std::to_string(k) + " of " + std::to_string(E) + " experts");
  if (r.score == RouteScore::sigmoid_grouped) {
    if (r.n_group < 1 || E % r.n_group != 0)
      bad("n_group " + std::to_string(r.n_group) + " does not divide the " + std::to_string(E) + " experts");
    if (r.topk_group < 1 || r.topk_group > r.n_group)
      bad("topk_group must be in [1, n_group = " + std::to_string(r.n_group) + "], got " +
          std::to_string(r.topk_group));
    if ((int64_t)r.topk_group * (E / r.n_group) < k)
      bad("topk_group " + std::to_string(r.topk_group) + " groups of " + std::to_string(E / r.n_group) +
          " experts hold fewer than top-k " + std::to_string(k));
  } else if (r.score != RouteScore::softmax) {
    bad("unknown router");
  }
}

void route_rows(const HostRouter& r, const void* logits, bool logits_bf16, int E, int k, void* ids, bool ids_int32,
                float* weights, int64_t t0, int64_t t1) {
  check_router(r, E, k);
  RouteScratch sc(E, r);
  std::vector<float>& row = sc.row;
  for (int64_t t = t0; t < t1; ++t) {
    if (logits_bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(logits) + t * E;
      for (int e = 0; e < E; ++e) row[e] = bf16_to_float(src[e]);
    } else {
      std::memcpy(row.data(), static_cast<const float*>(logits) + t * E, sizeof(float) * E);
    }
    int top[kMaxRoutedTopK];
    float* w = weights + t * k;
    bool finite = true;
    for (int e = 0; e < E; ++e) finite &= std::isfinite(row[e]);
    if (!finite) {
      for (int j = 0; j < k; ++j) top[j] = j, w[j] = NAN;
    } else if (r.score == RouteScore::softmax) {
      top_k(row.data(), E, k, nullptr, top);
      softmax_weights(r, row.data(), E, k, top, w);
    } else {
      sigmoid_grouped(r, row.data(), E, k, sc, top, w);
    }
    for (int j = 0; j < k; ++j) {
      if (ids_int32)
        static_cast<int32_t*>(ids)[t * k + j] = top[j];
      else
        static_cast<int64_t*>(ids)[t * k + j] = top[j];
    }
  }
}

}  // namespace hetmoe
