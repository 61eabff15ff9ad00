#include "epx/core/buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "epx/core/status.h"

namespace epx {

AlignedBuffer::AlignedBuffer(std::size_t bytes, std::size_t alignment, bool zero) : alignment_(alignment) {
  EPX_CHECK((alignment & (alignment - 1)) == 0);
  if (bytes == 0) return;
  const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  data_ = static_cast<std::byte*>(std::aligned_alloc(alignment, rounded));
  if (data_ == nullptr) throw std::bad_alloc();
  size_ = bytes;
  if (zero) std::memset(data_, 0, rounded);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

void AlignedBuffer::reserve(std::size_t bytes) {
  if (bytes <= size_) return;
  AlignedBuffer(bytes, alignment_).swap(*this);
}

}  // namespace epx
