#include "runtime/huge_buffer.h"

#include <sys/mman.h>

#include <stdexcept>
#include <string>

namespace hetmoe {

HugeBuffer::HugeBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  // Map 2 MiB extra and trim to a 2 MiB-aligned range, so transparent huge pages can back all of it (fewer
  // TLB misses while streaming weights).
  constexpr size_t kHuge = 2u << 20;
  size_t span = bytes + kHuge;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    size_ = 0;
    throw std::runtime_error("cannot allocate " + std::to_string(bytes >> 20) + " MiB for expert weights");
  }
  uintptr_t start = reinterpret_cast<uintptr_t>(p), aligned = (start + kHuge - 1) & ~(uintptr_t)(kHuge - 1);
  if (aligned > start) munmap(p, aligned - start);
  size_t tail = start + span - (aligned + bytes);
  if (tail) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  ptr_ = reinterpret_cast<uint8_t*>(aligned);
  madvise(ptr_, bytes, MADV_HUGEPAGE);
}

HugeBuffer::~HugeBuffer() {
  if (ptr_) munmap(ptr_, size_);
}

}  // namespace hetmoe
