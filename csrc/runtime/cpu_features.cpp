#include "runtime/cpu_features.h"

#include <cpuid.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <cstdio>
#include <set>
#include <stdexcept>
#include <utility>

namespace hetmoe {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::amx: return "amx";
  }
  return "?";
}

Isa isa_from_name(const std::string& name) {
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::amx})
    if (name == isa_name(i)) return i;
  throw std::invalid_argument("unknown ISA '" + name + "' (expected scalar, avx2, avx512 or amx)");
}

static unsigned long long xgetbv0() {
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((unsigned long long)edx << 32) | eax;
}

static CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  bool avx = c & (1u << 28);
  if (osxsave && avx) {
    unsigned long long xcr0 = xgetbv0();
    f.os_avx = (xcr0 & 0x6) == 0x6;
    f.os_avx512 = (xcr0 & 0xe6) == 0xe6;
    f.os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG, XTILEDATA
  }
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = b & (1u << 5);
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512_vnni = c & (1u << 11);
    f.amx_bf16 = d & (1u << 22);
    f.amx_tile = d & (1u << 24);
    f.amx_int8 = d & (1u << 25);
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512_bf16 = a & (1u << 5);
  }
  return f;
}

// HETMOE_MAX_ISA, the one environment variable the C++ side reads: its value, or null when unset or empty.
static const char* max_isa_setting() {
  const char* v = std::getenv("HETMOE_MAX_ISA");
  return v == nullptr || *v == '\0' ? nullptr : v;
}

static Isa read_max_isa() {
  const char* v = max_isa_setting();
  if (v == nullptr) return Isa::amx;
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::amx})
    if (std::strcmp(v, isa_name(i)) == 0) return i;
  throw std::invalid_argument(std::string("HETMOE_MAX_ISA='") + v +
                              "' is not an ISA level: expected scalar, avx2, avx512 or amx (or unset for no cap)");
}

Isa max_isa() {
  static const Isa cap = read_max_isa();  // a throwing initialisation is retried (and throws) at the next call
  return cap;
}

std::string isa_cap_note() {
  return max_isa() == Isa::amx && max_isa_setting() == nullptr ? ""
                                                               : std::string("HETMOE_MAX_ISA=") + isa_name(max_isa());
}

bool CpuFeatures::supports(Isa isa) const {
  if (isa > max_isa()) return false;
  bool avx2_ok = os_avx && avx2 && fma && f16c;
  // The AVX-512 kernels use F/BW/VL/DQ and VNNI, never BF16 instructions (bf16 weights widen by shifts), so Ice Lake
  // and Cascade Lake servers, and VMs that hide avx512_bf16, run them; the AMX level (whose TU is built with BF16)
  // asks for BF16 too, which every AMX CPU has.
  bool avx512_ok = avx2_ok && os_avx512 && avx512f && avx512bw && avx512vl && avx512dq && avx512_vnni;
  switch (isa) {
    case Isa::scalar: return true;
    case Isa::avx2: return avx2_ok;
    case Isa::avx512: return avx512_ok;
    case Isa::amx: return avx512_ok && avx512_bf16 && amx_unavailable_reason().empty();
  }
  return false;
}

std::string isa_refusal(Isa isa) {
  const CpuFeatures& f = cpu_features();
  if (f.supports(isa)) return "";
  if (isa > max_isa()) return isa_cap_note() + " caps the engine at " + isa_name(max_isa());
  if (isa == Isa::amx && !amx_unavailable_reason().empty()) return amx_unavailable_reason();
  return "the CPU lacks its instructions (it has: " + f.describe() + ")";
}

Isa CpuFeatures::best() const {
  if (supports(Isa::amx)) return Isa::amx;
  if (supports(Isa::avx512)) return Isa::avx512;
  if (supports(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

std::string CpuFeatures::describe() const {
  std::string s;
  auto add = [&](bool on, const char* n) {
    if (on) s += (s.empty() ? "" : " ") + std::string(n);
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(f16c, "f16c");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512dq, "avx512dq");
  add(avx512_bf16, "avx512_bf16");
  add(avx512_vnni, "avx512_vnni");
  add(amx_tile, "amx_tile");
  add(amx_bf16, "amx_bf16");
  add(amx_int8, "amx_int8");
  return s;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

// Linux arch_prctl codes (asm/prctl.h) and the tile-data state component number.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

static bool request_amx(int* err) {
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0) return true;
  *err = errno;
  return false;
}

static std::string amx_reason() {
  const CpuFeatures& f = cpu_features();
  if (!(f.amx_tile && f.amx_bf16 && f.amx_int8)) return "the CPU has no AMX (amx_tile, amx_bf16, amx_int8)";
  if (!f.os_amx) return "the OS does not enable the AMX tile state (XCR0 bits 17, 18)";
  if (max_isa() < Isa::amx) return isa_cap_note() + " caps the engine below amx";
#ifndef HETMOE_HAVE_AMX
  return "this build has no AMX kernels (the compiler did not accept -mamx-tile -mamx-int8 -mamx-bf16)";
#else
  int err = 0;
  if (!request_amx(&err))
    return std::string("the kernel refused AMX: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: ") +
           std::strerror(err);
  return "";
#endif
}

const std::string& amx_unavailable_reason() {
  static const std::string reason = amx_reason();
  return reason;
}

bool amx_thread_ready() {
  static thread_local int state = 0;  // 0 unknown, 1 granted, -1 refused
  if (state == 0) {
    int err = 0;
    state = amx_unavailable_reason().empty() && request_amx(&err) ? 1 : -1;
  }
  return state == 1;
}

// C stdio rather than iostreams: some toolchains link libstdc++ statically into the extension, and its
// iostream state then clashes with the libstdc++ torch loaded first (seen as a crash on the GPU machine).
static bool read_int(const std::string& path, int* out) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return false;
  bool ok = std::fscanf(f, "%d", out) == 1;
  std::fclose(f);
  return ok;
}

std::vector<int> physical_core_cpus() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  std::vector<int> allowed;
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
      if (CPU_ISSET(cpu, &mask)) allowed.push_back(cpu);
  }
  if (allowed.empty()) allowed.push_back(0);
  std::set<std::pair<int, int>> seen;
  std::vector<std::pair<int, int>> cores;  // (package, cpu)
  for (int cpu : allowed) {
    std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    int core = -1, pkg = -1;
    if (!read_int(base + "core_id", &core) || !read_int(base + "physical_package_id", &pkg)) return allowed;
    if (seen.insert({pkg, core}).second) cores.push_back({pkg, cpu});
  }
  std::stable_sort(cores.begin(), cores.end(), [](auto& x, auto& y) { return x.first < y.first; });
  std::vector<int> out;
  for (auto& pc : cores) out.push_back(pc.second);
  return out;
}

}  // namespace hetmoe
