// The units of work of the MoE job's two compute phases (gate+up with the gated activation, then down), how a phase is
// cut into them, and the code that runs one. The job pulls both phases' tasks from one list (moe/chunk_plan.h): a down
// task waits for its expert's gate+up tasks only, not for the whole phase.
//
// A task is (expert, row-block range, token range). Experts with at least `amx_min_tokens` tokens run on the
// AMX GEMM (kernels/amx/gemm.h), the others on the row-block kernels, on the same packed weights. Big expert
// tasks are split into sub-tasks of about equal cost (rows first, tokens when rows alone are too few), pulled
// dynamically from the pool's atomic task counter, heaviest first: a popular expert (skewed routing) is
// shared by all threads instead of leaving them idle behind it. A phase is cut into ~16 tasks per thread, or ~2
// when it only streams weights (decode: row-block experts with a few tokens each), and then its last tasks are
// cut smaller when it ends the job (down).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "moe/moe.h"

namespace hetmoe {

struct Task {
  int e;
  int rb0, rb1;  // row blocks of the phase's matrix (gate+up: one block of each)
  int m0, m1;    // positions among the expert's tokens (its slots first[e] + m0 .. first[e] + m1)
  bool amx;
  int group;  // index of its (expert, token range) in make_tasks' `groups`
};

// The tasks that share one (expert, token range): together they cover every row block of the phase for those
// tokens, so the last of them to finish holds complete rows of the phase's output.
struct TaskGroup {
  int e;
  int m0, m1;
  int n_tasks;
};

// How a phase is cut. `row_gran`: row blocks per AMX GEMM call (1 for gate+up, whose call takes the gate and
// up blocks together; 2 for down). `amx_max_tokens`: tokens per AMX task, so that its activation panel stays
// in L2 while the task's row blocks stream through.
struct TaskPlan {
  int n_blocks;
  int row_gran;
  int amx_max_tokens;
  int n_threads;
  bool cut_tail = true;  // a streaming phase's last tasks cut smaller (the tasks end the job's parallel work)
};

// Tasks for the experts in `active` (sorted by token count, descending); amx_experts: how many of the first
// ones run on AMX. `groups` (when given) receives the (expert, token range) groups the tasks' `group` index.
void make_tasks(const std::vector<int>& active, const std::vector<int>& count, int amx_experts, const TaskPlan& plan,
                std::vector<Task>& tasks, std::vector<TaskGroup>* groups = nullptr);

// What the tasks of one phase read. Slot s of expert e is first[e] + i for its i-th token.
struct PhaseInput {
  const uint8_t* const* rows;  // [n_slots] row-block kernel activation row of each slot
  AmxPanel amx;                // AMX experts' activations: the i-th token of expert e is panel row amx_first[e] + i
  const int* amx_first;        // [E] a multiple of 16 (AMX experts only)
  const int* first;            // [E]
  bool stream_out = false;     // down: y is read only after every task (no fused combine): written around the caches
};

// h[s, :] for the task's slots and rows: glu(gate x + bg, up x + bu) (ExpertsConfig glu, bias).   h: [n_slots, I]
void run_gate_up_task(const MoeExperts& ex, const Task& task, const PhaseInput& in, float* h, ThreadPool& pool,
                      int thread);
// y[s, :] for the task's slots and rows: down h (+ bd).             y: [n_slots, H]
void run_down_task(const MoeExperts& ex, const Task& task, const PhaseInput& in, float* y, ThreadPool& pool,
                   int thread);

}  // namespace hetmoe
