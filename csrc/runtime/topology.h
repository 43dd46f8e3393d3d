// NUMA topology (read from sysfs; no libnuma), memory binding (the mbind system call), and thread subpools
// bound to nodes.
//
// Subpools are separate ThreadPools, one per node (or per share of a node when more subpools than nodes are
// asked for, e.g. 2 on a one-node machine for tests), each pinned to its node's physical cores. Separate pools
// rather than one pool cut into groups, because everything a MoE job synchronizes on -- parallel_for's task
// counter, the barrier between the gate+up and the down phase, the scratch buffers -- then stays inside one
// node: no cache line bounces between sockets per task, a slower node never holds the other's phase barrier,
// and scratch memory is first touched (so placed) by the node that uses it. MoeJob runs unchanged on each
// subpool; the tensor-parallel layer (moe/split_experts.h) coordinates them.
//
// Subpool 0 is the face of the set: jobs are submitted to it, so submit/sync/pending and the CUDA host
// functions (stream/host_funcs.h) work exactly as with a single pool. A job running on subpool 0 hands work to the
// others with fan_out() and waits for it. The other subpools run nothing but what fan_out and run_on_all hand
// them, and that work never waits on anything, so no cycle of waits (deadlock) can form.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/thread_pool.h"

namespace hetmoe {

struct NumaNode {
  int id = 0;
  std::vector<int> cpus;   // online CPUs of the node that this process may run on, ascending
  std::vector<int> cores;  // one CPU per physical core among them (the lowest-numbered sibling), ascending
  bool has_memory = true;
  std::vector<int> distance;  // to each node of NumaTopology::nodes, same order (empty when unknown)
};

struct NumaTopology {
  std::vector<NumaNode> nodes;  // ascending id; memory-only nodes (no allowed CPU) are listed too
  std::string source;           // what was read, or why there is a single synthetic node
  int n_cpu_nodes() const;      // nodes with at least one allowed core
  int n_memory_nodes() const;
  // The memory node nearest to nodes[i] (itself when it has memory; smallest distance, then lowest id);
  // -1 when it has none and distances are unknown.
  int nearest_memory_node(int i) const;
};

// "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}; "" -> {}. Throws std::invalid_argument on a malformed list.
std::vector<int> parse_cpu_list(const std::string& text);

// Reads root/node (node*/cpulist, has_memory, distance) and root/cpu (online, cpu*/topology) -- root is
// /sys/devices/system on a real machine, a fake tree in tests. `allowed`: the CPUs this process may use
// (its affinity mask). Without root/node (a kernel without NUMA) or with unreadable node files, the result
// is one node holding every allowed CPU, and `source` says why.
NumaTopology read_numa_topology(const std::string& root, const std::vector<int>& allowed);
std::vector<int> affinity_cpus();            // the calling thread's affinity mask
const NumaTopology& system_numa_topology();  // of this machine and process, read once

struct SubpoolPlan {
  std::vector<int> nodes;  // ids of the CPU nodes it runs on
  std::vector<int> cpus;   // the physical cores it may use (one CPU each)
  int threads = 0;
  int memory_node = -1;  // node its memory should live on; -1: several nodes or unknown (first touch decides)
};

// Splits the machine into n_subpools (0 = auto: one per CPU node, at most n_threads) with n_threads in all
// (0 = one per physical core), threads spread in proportion to the cores of each subpool. Fewer subpools than
// nodes: consecutive nodes are merged. More: each node's cores are cut into equal contiguous shares. Throws
// std::invalid_argument when it cannot be done (more subpools than threads or than cores).
std::vector<SubpoolPlan> plan_subpools(const NumaTopology& topo, int n_subpools, int n_threads);

// Asks the kernel to place [p, p + bytes) on `node` (MPOL_PREFERRED, moving pages already there). Returns ""
// on success, else the reason (no mbind in this kernel, refused by a sandbox, no such node).
std::string bind_memory(void* p, size_t bytes, int node);

class NumaPools {
 public:
  // One ThreadPool per plan. pin: pin the threads to the plan's CPUs. bind: place memory with mbind (only
  // meaningful, and only done, when the machine has more than one memory node).
  NumaPools(std::vector<SubpoolPlan> plans, bool pin, int spin_us, bool bind);
  ~NumaPools();
  NumaPools(const NumaPools&) = delete;
  NumaPools& operator=(const NumaPools&) = delete;

  int size() const { return (int)pools_.size(); }
  int n_threads() const;
  ThreadPool& pool(int s) const { return *pools_[s]; }
  const std::shared_ptr<ThreadPool>& pool_ptr(int s) const { return pools_[s]; }
  const SubpoolPlan& plan(int s) const { return plans_[s]; }

  // From a job running on subpool 0: fn(s, pool s) for s in [0, n) at once (s = 0 on the calling thread);
  // returns when all are done and then rethrows the first error (lowest s).
  void fan_out(int n, const std::function<void(int, ThreadPool&)>& fn);
  // From a thread that is none of the pools' own: fn(s, pool s) for s in [0, n), each queued as a job
  // behind the jobs already on that pool; waits for all, rethrows the first error.
  void run_on_all(int n, const std::function<void(int, ThreadPool&)>& fn);

  // Binds memory meant for subpool s to its node (when binding is on and the plan names one node). A refusal
  // is reported once on stderr and remembered in binding(); it never fails the caller.
  void bind(int s, void* p, size_t bytes);
  std::string binding() const;  // how memory is placed, in words

  // Partial-output buffer of subpool s for tensor-parallel jobs (moe/split_experts.h). Only from work fan_out runs on
  // subpool s; jobs on subpool 0 run one at a time, so one buffer per subpool serves every layer.
  uint8_t* partial(int s, size_t bytes) { return partial_[s]->get(bytes); }

 private:
  std::vector<SubpoolPlan> plans_;
  std::vector<std::shared_ptr<ThreadPool>> pools_;
  std::vector<std::unique_ptr<Scratch>> partial_;
  bool bind_ = false;
  std::string bind_error_;
};

}  // namespace hetmoe
