// CPU feature detection (CPUID + XGETBV) and the machine's physical-core topology.
#pragma once
#include <string>
#include <vector>

namespace hetmoe {

// Instruction-set levels the kernels are written for, lowest first.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, amx = 3 };

const char* isa_name(Isa isa);
Isa isa_from_name(const std::string& name);  // throws std::invalid_argument

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, avx512_vnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool os_avx = false, os_avx512 = false, os_amx = false;
  Isa best() const;              // the highest level whose kernels may run here (at most max_isa())
  bool supports(Isa isa) const;  // within max_isa(); amx: also compiled in and permitted (amx_unavailable_reason())
  std::string describe() const;
};

const CpuFeatures& cpu_features();

// The highest level the engine may select in this process: the environment variable HETMOE_MAX_ISA (scalar,
// avx2, avx512 or amx; unset or empty: no cap), read once, at the first call. It lets any machine reproduce a
// smaller CPU (tests, bug reports). CpuFeatures::supports() and best() obey it; the flags stay the hardware's.
// Throws std::invalid_argument (naming the variable) on any other value, at this and every later call.
Isa max_isa();
// "" when no cap is set, else e.g. "HETMOE_MAX_ISA=avx2".
std::string isa_cap_note();
// Why `isa` cannot run here, as the end of a sentence starting "cannot run <isa>: " ("" when it can).
std::string isa_refusal(Isa isa);

// Why the AMX kernels cannot run here ("" when they can): no AMX in CPUID, the OS does not enable the tile
// state in XCR0, this build lacks the AMX kernels (compiler without -mamx-*), HETMOE_MAX_ISA caps the engine
// below amx, or the kernel refused arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). The permission is
// asked once per process, here.
const std::string& amx_unavailable_reason();
// Asks the permission on the calling thread before its first tile instruction (once per thread, cached; the
// grant is per process, so this only fails where amx_unavailable_reason() is not empty).
bool amx_thread_ready();

// One logical CPU id per physical core this process may run on, grouped by package. Falls back to the
// affinity mask when /sys topology is unreadable.
std::vector<int> physical_core_cpus();

}  // namespace hetmoe
