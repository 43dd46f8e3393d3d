// Memory for packed expert weights and other large buffers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>

namespace hetmoe {

// Big, 64-byte aligned, zero-initialised memory (mmap; transparent huge pages requested).
class HugeBuffer {
 public:
  HugeBuffer() = default;
  explicit HugeBuffer(size_t bytes);
  ~HugeBuffer();
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  HugeBuffer(HugeBuffer&& o) noexcept : ptr_(o.ptr_), size_(o.size_) { o.ptr_ = nullptr, o.size_ = 0; }
  HugeBuffer& operator=(HugeBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(size_, o.size_);
    return *this;
  }
  uint8_t* data() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  uint8_t* ptr_ = nullptr;
  size_t size_ = 0;
};

}  // namespace hetmoe
