#include "runtime/topology.h"

#include <immintrin.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>
#include <mutex>
#include <set>
#include <stdexcept>

#include "runtime/cpu_features.h"

namespace hetmoe {

// ---------------------------------------------------------------- sysfs

std::vector<int> parse_cpu_list(const std::string& text) {
  std::string s = text;
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  std::vector<int> out;
  if (s.empty()) return out;
  auto bad = [&] { throw std::invalid_argument("malformed CPU/node list '" + s + "'"); };
  size_t i = 0;
  auto number = [&] {
    if (i >= s.size() || s[i] < '0' || s[i] > '9') bad();
    long v = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9')
      if ((v = v * 10 + (s[i++] - '0')) > (1 << 20)) bad();
    return (int)v;
  };
  for (;;) {
    int a = number(), b = a;
    if (i < s.size() && s[i] == '-') {
      ++i;
      if ((b = number()) < a) bad();
    }
    for (int v = a; v <= b; ++v) out.push_back(v);
    if (i == s.size()) break;
    if (s[i++] != ',') bad();
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

namespace {

// C stdio (see cpu_features.cpp: iostreams clash with torch's libstdc++ on some toolchains).
bool read_text(const std::string& path, std::string* out) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return false;
  char buf[4096];
  out->clear();
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out->append(buf, n);
  std::fclose(f);
  return true;
}

bool read_int(const std::string& path, int* v) {
  std::string s;
  if (!read_text(path, &s)) return false;
  return std::sscanf(s.c_str(), "%d", v) == 1;
}

std::vector<int> intersect(const std::vector<int>& a, const std::vector<int>& b) {
  std::vector<int> out;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

// One CPU per (package, core) among cpus, the lowest-numbered sibling; every CPU when topology is unreadable.
std::vector<int> physical_cores(const std::string& root, const std::vector<int>& cpus) {
  std::set<std::pair<int, int>> seen;
  std::vector<int> out;
  for (int cpu : cpus) {
    std::string base = root + "/cpu/cpu" + std::to_string(cpu) + "/topology/";
    int core = -1, pkg = -1;
    if (!read_int(base + "core_id", &core) || !read_int(base + "physical_package_id", &pkg)) return cpus;
    if (seen.insert({pkg, core}).second) out.push_back(cpu);
  }
  return out;
}

NumaTopology single_node(const std::string& root, const std::vector<int>& allowed, const std::string& why) {
  NumaTopology t;
  NumaNode n;
  n.cpus = allowed;
  n.cores = physical_cores(root, allowed);
  t.nodes.push_back(n);
  t.source = why;
  return t;
}

}  // namespace

int NumaTopology::n_cpu_nodes() const {
  return (int)std::count_if(nodes.begin(), nodes.end(), [](const NumaNode& n) { return !n.cores.empty(); });
}

int NumaTopology::n_memory_nodes() const {
  return (int)std::count_if(nodes.begin(), nodes.end(), [](const NumaNode& n) { return n.has_memory; });
}

int NumaTopology::nearest_memory_node(int i) const {
  if (nodes[i].has_memory) return nodes[i].id;
  const std::vector<int>& d = nodes[i].distance;
  if (d.size() != nodes.size()) return -1;
  int best = -1;
  for (size_t j = 0; j < nodes.size(); ++j)
    if (nodes[j].has_memory && (best < 0 || d[j] < d[best])) best = (int)j;
  return best < 0 ? -1 : nodes[best].id;
}

NumaTopology read_numa_topology(const std::string& root, const std::vector<int>& allowed_in) {
  std::vector<int> allowed = allowed_in;
  std::sort(allowed.begin(), allowed.end());
  allowed.erase(std::unique(allowed.begin(), allowed.end()), allowed.end());
  std::string text;
  if (!read_text(root + "/node/online", &text))
    return single_node(root, allowed, "no " + root + "/node/online (kernel without NUMA): one node");
  try {
    std::vector<int> ids = parse_cpu_list(text);
    if (ids.empty()) throw std::invalid_argument("no online node");
    std::vector<int> online;
    bool have_online = read_text(root + "/cpu/online", &text);
    if (have_online) online = parse_cpu_list(text);
    std::vector<int> with_memory;
    bool have_memory_list = read_text(root + "/node/has_memory", &text);
    if (have_memory_list) with_memory = parse_cpu_list(text);
    NumaTopology t;
    for (int id : ids) {
      std::string base = root + "/node/node" + std::to_string(id) + "/";
      NumaNode n;
      n.id = id;
      if (!read_text(base + "cpulist", &text)) throw std::invalid_argument("cannot read " + base + "cpulist");
      n.cpus = intersect(parse_cpu_list(text), allowed);
      if (have_online) n.cpus = intersect(n.cpus, online);
      n.cores = physical_cores(root, n.cpus);
      if (have_memory_list) {
        n.has_memory = std::binary_search(with_memory.begin(), with_memory.end(), id);
      } else {
        // Older kernels: a node without memory shows MemTotal 0 in its meminfo.
        long kb = -1;
        if (read_text(base + "meminfo", &text)) {
          const char* p = std::strstr(text.c_str(), "MemTotal:");
          if (p) std::sscanf(p + 9, "%ld", &kb);
        }
        n.has_memory = kb != 0;
      }
      if (read_text(base + "distance", &text)) {
        int v, used = 0;
        const char* p = text.c_str();
        while (std::sscanf(p, "%d%n", &v, &used) == 1) {
          n.distance.push_back(v);
          p += used;
        }
        if (n.distance.size() != ids.size()) n.distance.clear();  // not one entry per online node: unknown
      }
      t.nodes.push_back(std::move(n));
    }
    t.source = root + "/node";
    if (t.n_cpu_nodes() == 0) return single_node(root, allowed, "no node holds an allowed CPU: one node");
    return t;
  } catch (const std::invalid_argument& e) {
    return single_node(root, allowed, std::string("unreadable NUMA topology (") + e.what() + "): one node");
  }
}

std::vector<int> affinity_cpus() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0)
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
      if (CPU_ISSET(cpu, &mask)) out.push_back(cpu);
  if (out.empty()) out.push_back(0);
  return out;
}

const NumaTopology& system_numa_topology() {
  static const NumaTopology t = read_numa_topology("/sys/devices/system", affinity_cpus());
  return t;
}

// ---------------------------------------------------------------- planning

std::vector<SubpoolPlan> plan_subpools(const NumaTopology& topo, int n_subpools, int n_threads) {
  std::vector<int> cpu_nodes;  // indices into topo.nodes
  int total_cores = 0;
  for (size_t i = 0; i < topo.nodes.size(); ++i)
    if (!topo.nodes[i].cores.empty()) {
      cpu_nodes.push_back((int)i);
      total_cores += (int)topo.nodes[i].cores.size();
    }
  if (cpu_nodes.empty()) throw std::invalid_argument("numa: no CPU this process may use");
  const int N = (int)cpu_nodes.size();
  if (n_threads < 0) throw std::invalid_argument("numa: threads must be >= 1");
  if (n_threads == 0) n_threads = total_cores;
  if (n_subpools < 0) throw std::invalid_argument("numa: the number of subpools must be >= 1 (or auto)");
  if (n_subpools == 0) n_subpools = std::min(N, n_threads);
  if (n_subpools > n_threads)
    throw std::invalid_argument("numa: " + std::to_string(n_subpools) +
                                " subpools need at least as many threads, got " + std::to_string(n_threads));

  std::vector<SubpoolPlan> plans;
  if (n_subpools <= N) {
    for (int j = 0; j < n_subpools; ++j) {
      SubpoolPlan p;
      for (int i = j * N / n_subpools; i < (j + 1) * N / n_subpools; ++i) {
        const NumaNode& node = topo.nodes[cpu_nodes[i]];
        p.nodes.push_back(node.id);
        p.cpus.insert(p.cpus.end(), node.cores.begin(), node.cores.end());
      }
      p.memory_node = p.nodes.size() == 1 ? topo.nearest_memory_node(cpu_nodes[j * N / n_subpools]) : -1;
      plans.push_back(std::move(p));
    }
  } else {
    for (int i = 0; i < N; ++i) {
      const NumaNode& node = topo.nodes[cpu_nodes[i]];
      const int share = n_subpools / N + (i < n_subpools % N ? 1 : 0), n_cores = (int)node.cores.size();
      if (share > n_cores)
        throw std::invalid_argument("numa: cannot cut node " + std::to_string(node.id) + " (" +
                                    std::to_string(n_cores) + " cores) into " + std::to_string(share) + " subpools");
      for (int j = 0; j < share; ++j) {
        SubpoolPlan p;
        p.nodes.push_back(node.id);
        p.cpus.assign(node.cores.begin() + j * n_cores / share, node.cores.begin() + (j + 1) * n_cores / share);
        p.memory_node = topo.nearest_memory_node(cpu_nodes[i]);
        plans.push_back(std::move(p));
      }
    }
  }
  // Threads in proportion to cores (cumulative rounding), at least one each.
  int cum = 0, given = 0;
  for (auto& p : plans) {
    cum += (int)p.cpus.size();
    int upto = (int)((int64_t)n_threads * cum / total_cores);
    p.threads = upto - given;
    given = upto;
  }
  for (auto& p : plans)
    while (p.threads < 1) {
      auto most = std::max_element(plans.begin(), plans.end(),
                                   [](const SubpoolPlan& a, const SubpoolPlan& b) { return a.threads < b.threads; });
      --most->threads;
      ++p.threads;
    }
  return plans;
}

// ---------------------------------------------------------------- memory binding

std::string bind_memory(void* p, size_t bytes, int node) {
#ifdef SYS_mbind
  if (bytes == 0) return "";
  if (node < 0 || node >= 4096) return "no node " + std::to_string(node);
  constexpr int kMpolPreferred = 1;
  constexpr unsigned kMpolMfMove = 1u << 1;
  const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  uintptr_t b = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) & ~(page - 1);  // mappings are whole pages
  constexpr int kBits = 8 * sizeof(unsigned long);
  std::vector<unsigned long> mask(node / kBits + 1, 0);
  mask[node / kBits] |= 1ul << (node % kBits);
  // maxnode: the kernel reads maxnode - 1 bits (a historic off-by-one that every libnuma caller adds to).
  long rc =
      syscall(SYS_mbind, a, b - a, kMpolPreferred, mask.data(), (unsigned long)(mask.size() * kBits + 1), kMpolMfMove);
  if (rc == 0) return "";
  int err = errno;
  return std::string("mbind to node ") + std::to_string(node) + ": " + std::strerror(err);
#else
  return "mbind is not available on this platform";
#endif
}

// ---------------------------------------------------------------- pools

namespace {

std::mutex g_bind_mu;  // bind_error_ of every NumaPools, and the one warning per process
bool g_bind_warned = false;

// A borrowed job that runs fn(s, pool) and keeps its error instead of throwing it into the pool.
struct FanJob : Job {
  const std::function<void(int, ThreadPool&)>* fn = nullptr;
  int s = 0;
  std::exception_ptr err;
  void run(ThreadPool& pool) override {
    try {
      (*fn)(s, pool);
    } catch (...) {
      err = std::current_exception();
    }
  }
};

// Waits for job `id` of `pool`. Spins first: the waiting thread is a pinned worker whose core has nothing else
// to do, and the others usually finish within microseconds of it; then sleeps.
void wait_spinning(ThreadPool& pool, uint64_t id) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
  int spins = 0;
  while (pool.completed() < id) {
    _mm_pause();
    if (++spins % 256 == 0 && std::chrono::steady_clock::now() > deadline) {
      pool.wait_for(id);
      return;
    }
  }
}

}  // namespace

NumaPools::NumaPools(std::vector<SubpoolPlan> plans, bool pin, int spin_us, bool bind) : plans_(std::move(plans)) {
  if (plans_.empty()) throw std::invalid_argument("numa: no subpool");
  int total = 0;
  for (auto& p : plans_) total += p.threads;
  // A thread waiting in sync may spin only if some core has no pinned worker.
  const bool caller_may_spin = total < (int)physical_core_cpus().size();
  for (auto& p : plans_) {
    if (p.threads < 1) throw std::invalid_argument("numa: every subpool needs at least one thread");
    pools_.push_back(
        std::make_shared<ThreadPool>(p.threads, pin ? p.cpus : std::vector<int>{}, spin_us, caller_may_spin));
    partial_.emplace_back(new Scratch());
  }
  std::set<int> mem;
  for (auto& p : plans_)
    if (p.memory_node >= 0) mem.insert(p.memory_node);
  bind_ = bind && system_numa_topology().n_memory_nodes() > 1 && mem.size() > 1;
}

NumaPools::~NumaPools() {
  // Subpool 0 first: its jobs may still be handing work to the others.
  if (!pools_.empty()) pools_[0].reset();
}

int NumaPools::n_threads() const {
  int n = 0;
  for (auto& p : pools_) n += p->size();
  return n;
}

void NumaPools::fan_out(int n, const std::function<void(int, ThreadPool&)>& fn) {
  if (n < 1 || n > size()) throw std::logic_error("fan_out: bad subpool count");
  std::vector<FanJob> jobs(n);
  std::vector<uint64_t> ids(n, 0);
  for (int s = 1; s < n; ++s) {
    jobs[s].fn = &fn;
    jobs[s].s = s;
    ids[s] = pools_[s]->submit_borrowed(&jobs[s]);
  }
  jobs[0].fn = &fn;
  jobs[0].run(*pools_[0]);
  for (int s = 1; s < n; ++s) wait_spinning(*pools_[s], ids[s]);
  for (auto& j : jobs)
    if (j.err) std::rethrow_exception(j.err);
}

void NumaPools::run_on_all(int n, const std::function<void(int, ThreadPool&)>& fn) {
  if (n < 1 || n > size()) throw std::logic_error("run_on_all: bad subpool count");
  std::vector<FanJob> jobs(n);
  std::vector<uint64_t> ids(n, 0);
  for (int s = 0; s < n; ++s) {
    jobs[s].fn = &fn;
    jobs[s].s = s;
    ids[s] = pools_[s]->submit_borrowed(&jobs[s]);
  }
  for (int s = 0; s < n; ++s) pools_[s]->wait_for(ids[s]);
  for (auto& j : jobs)
    if (j.err) std::rethrow_exception(j.err);
}

void NumaPools::bind(int s, void* p, size_t bytes) {
  if (!bind_ || plans_[s].memory_node < 0 || bytes == 0) return;
  std::string err = bind_memory(p, bytes, plans_[s].memory_node);
  if (err.empty()) return;
  std::lock_guard<std::mutex> lk(g_bind_mu);
  if (bind_error_.empty()) bind_error_ = err;
  if (!g_bind_warned) {
    g_bind_warned = true;
    std::fprintf(stderr, "hetmoe: NUMA memory binding refused (%s); expert slices are placed by first touch only\n",
                 err.c_str());
  }
}

std::string NumaPools::binding() const {
  std::lock_guard<std::mutex> lk(g_bind_mu);
  if (!bind_error_.empty()) return "first touch (mbind refused: " + bind_error_ + ")";
  if (bind_) return "mbind to each subpool's node, and first touch by its threads";
  if (system_numa_topology().n_memory_nodes() <= 1) return "one memory node: nothing to bind";
  return "first touch by each subpool's threads (subpools span several nodes)";
}

}  // namespace hetmoe
