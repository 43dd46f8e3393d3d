// Pairing and chaining of Expert Deferral's jobs (MoeJob::pair, moe.h): the immediate job of a pair starts its
// deferred job's tasks behind its own, and a deferred job appends the tasks of the next layer's immediate job.
#include "moe/deferral.h"

#include <immintrin.h>

#include <stdexcept>
#include <string>

namespace hetmoe {

namespace {
std::atomic<uint64_t> g_paired_runs{0}, g_chained_runs{0};
}  // namespace

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
