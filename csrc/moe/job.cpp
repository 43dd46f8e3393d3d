// MoeJob (moe.h): the checks of a call, its routing on the host, and its run as a sequence of chunk plans.
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

#include "moe/chunk_plan.h"
#include "moe/deferral.h"
#include "moe/moe.h"

namespace hetmoe {

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

}  // namespace hetmoe
