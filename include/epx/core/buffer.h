// Aligned host memory and the carving of one allocation into typed regions.
//
// AlignedBuffer owns a block of host memory aligned to a cache line (or a
// page). Carver computes the byte size of a structured region and hands out
// typed pointers into it with the same code, so the size and the pointers can
// never disagree:
//
//   auto carve = [&](epx::Carver& c) {
//     rows = c.take<std::byte>(num_rows * row_bytes);
//     idx  = c.take<int32_t>(num_rows);
//   };
//   epx::Carver sizer(nullptr); carve(sizer);                 // count
//   EPX_ASSIGN_OR_RETURN(epx::AlignedBuffer mem, epx::AlignedBuffer::allocate(sizer.bytes(), "the rows"));
//   epx::Carver carver(mem.data()); carve(carver);            // point
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>

#include "epx/core/status.h"

namespace epx {

inline constexpr std::size_t kCacheLine = 64;

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Allocates `bytes` aligned to `alignment` (a power of two); zero-filled
  // when `zero` is set. ResourceExhausted where the memory is not there:
  // "could not allocate 1099511627776 bytes for <what>: out of memory".
  static Result<AlignedBuffer> allocate(std::size_t bytes, std::string_view what, std::size_t alignment = kCacheLine,
                                        bool zero = false);
  // The same, throwing std::bad_alloc on failure like operator new: for tests
  // and benchmarks; epx's own code uses allocate().
  explicit AlignedBuffer(std::size_t bytes, std::size_t alignment = kCacheLine, bool zero = false);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept { swap(other); }
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    AlignedBuffer(std::move(other)).swap(*this);
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  [[nodiscard]] std::byte* data() const { return data_; }
  template <typename T>
  [[nodiscard]] T* as() const { return reinterpret_cast<T*>(data_); }
  [[nodiscard]] std::size_t size() const { return size_; }
  // Grows to at least `bytes` (contents are not kept); never shrinks.
  // ResourceExhausted naming `bytes` and `what` if that memory is not there
  // (the buffer is then unchanged).
  [[nodiscard]] Status reserve(std::size_t bytes, std::string_view what);

  void swap(AlignedBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(alignment_, other.alignment_);
  }

 private:
  struct Adopt {};
  AlignedBuffer(Adopt, std::byte* data, std::size_t size, std::size_t alignment)
      : data_(data), size_(size), alignment_(alignment) {}
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t alignment_ = kCacheLine;
};

// Lays out consecutive aligned sections. With a null base it only counts.
class Carver {
 public:
  explicit Carver(std::byte* base) : base_(base) {}

  template <typename T>
  T* take(std::size_t count, std::size_t alignment = kCacheLine) {
    offset_ = (offset_ + alignment - 1) / alignment * alignment;
    T* out = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += count * sizeof(T);
    return out;
  }
  [[nodiscard]] std::size_t bytes() const { return (offset_ + kCacheLine - 1) / kCacheLine * kCacheLine; }

 private:
  std::byte* base_;
  std::size_t offset_ = 0;
};

}  // namespace epx
