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
  Isa best() const;       // the highest level whose kernels may run here
  bool supports(Isa isa) const;  // amx: also compiled in and permitted (amx_unavailable_reason() is empty)
  std::string describe() const;
};

const CpuFeatures& cpu_features();

// Why the AMX kernels cannot run here ("" when they can): no AMX in CPUID, the OS does not enable the tile
// state in XCR0, this build lacks the AMX kernels (compiler without -mamx-*), or the kernel refused
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). The permission is asked once per process, here.
const std::string& amx_unavailable_reason();
// Asks the permission on the calling thread before its first tile instruction (once per thread, cached; the
// grant is per process, so this only fails where amx_unavailable_reason() is not empty).
bool amx_thread_ready();

// One logical CPU id per physical core this process may run on, grouped by package. Falls back to the
// affinity mask when /sys topology is unreadable.
std::vector<int> physical_core_cpus();

}  // namespace hetmoe
