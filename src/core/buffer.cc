#include "epx/core/buffer.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "core/guard.h"

namespace epx {
namespace {

// `bytes` rounded up to `alignment`, or nullptr (also for a failure injected by a test).
std::byte* allocate_raw(std::size_t bytes, std::size_t alignment, bool zero) {
  EPX_CHECK((alignment & (alignment - 1)) == 0);
  if (bytes > std::numeric_limits<std::size_t>::max() - alignment) return nullptr;
  if (detail::take_injected_allocation_failure()) return nullptr;
  const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  auto* data = static_cast<std::byte*>(std::aligned_alloc(alignment, rounded));
  if (data != nullptr && zero) std::memset(data, 0, rounded);
  return data;
}

}  // namespace

Result<AlignedBuffer> AlignedBuffer::allocate(std::size_t bytes, std::string_view what, std::size_t alignment,
                                              bool zero) {
  if (bytes == 0) return AlignedBuffer(Adopt{}, nullptr, 0, alignment);
  std::byte* data = allocate_raw(bytes, alignment, zero);
  if (data == nullptr) return resource_exhausted("could not allocate {} bytes for {}: out of memory", bytes, what);
  return AlignedBuffer(Adopt{}, data, bytes, alignment);
}

AlignedBuffer::AlignedBuffer(std::size_t bytes, std::size_t alignment, bool zero) : alignment_(alignment) {
  if (bytes == 0) return;
  data_ = allocate_raw(bytes, alignment, zero);
  if (data_ == nullptr) throw std::bad_alloc();
  size_ = bytes;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

Status AlignedBuffer::reserve(std::size_t bytes, std::string_view what) {
  if (bytes <= size_) return Status::ok();
  EPX_ASSIGN_OR_RETURN(AlignedBuffer grown, allocate(bytes, what, alignment_));
  grown.swap(*this);
  return Status::ok();
}

}  // namespace epx
