// Expert Deferral's two jobs of one layer run as one list of tasks (MoeJob::pair, moe.h): what an immediate job
// leaves in flight for its deferred job and for the next layer's immediate job chained behind it.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>

#include "moe/chunk_plan.h"
#include "moe/moe.h"

namespace hetmoe {

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

}  // namespace hetmoe
