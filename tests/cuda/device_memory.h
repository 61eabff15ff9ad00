// Test helpers: device copies of host matrices and back, and the skip rule.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "epx/exchange/cuda_group.h"
#include "exchange/reference.h"

namespace epx::cuda_test {

// Skips the test (with the reason printed) when no CUDA device is usable.
#define EPX_SKIP_WITHOUT_GPU()                                                              \
  do {                                                                                      \
    const std::string epx_why_ = ::epx::cuda_unavailable_reason();                          \
    if (!epx_why_.empty()) GTEST_SKIP() << "skipped, no GPU here: " << epx_why_;            \
  } while (0)

// One cudaMalloc'd array on device 0, freed at the end of its scope.
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::size_t bytes) : bytes_(bytes) {
    EPX_CHECK(cudaMalloc(&ptr_, bytes_ > 0 ? bytes_ : 16) == cudaSuccess);
    EPX_CHECK(cudaMemset(ptr_, 0, bytes_ > 0 ? bytes_ : 16) == cudaSuccess);
  }
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceArray(DeviceArray&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  [[nodiscard]] void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

inline constexpr Device kGpu0{DeviceKind::kCuda, 0};

// A device copy of `m` and a [rows, cols] device view of it.
struct DeviceMatrix {
  DeviceArray memory;
  TensorView view;
};
inline DeviceMatrix upload(const exchange_test::Matrix& m) {
  DeviceMatrix d{DeviceArray(m.bytes().size()), {}};
  if (!m.bytes().empty())
    EPX_CHECK(cudaMemcpy(d.memory.get(), m.bytes().data(), m.bytes().size(), cudaMemcpyHostToDevice) == cudaSuccess);
  d.view = TensorView::contiguous(d.memory.get(), m.dtype(), {m.rows(), m.cols()}, kGpu0);
  return d;
}
template <typename T>
DeviceMatrix upload(const std::vector<T>& v, DType dtype, int64_t rows, int64_t cols) {
  DeviceMatrix d{DeviceArray(v.size() * sizeof(T)), {}};
  if (!v.empty()) EPX_CHECK(cudaMemcpy(d.memory.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  d.view = TensorView::contiguous(d.memory.get(), dtype, {rows, cols}, kGpu0);
  return d;
}
// A device matrix whose every element is `value` (so unwritten outputs show).
inline DeviceMatrix filled(DType dtype, int64_t rows, int64_t cols, float value) {
  return upload(exchange_test::Matrix::filled(dtype, rows, cols, value));
}
// A host copy of a dense 2-D (or 1-D, as [n, 1]) device view.
inline exchange_test::Matrix download(const TensorView& v) {
  const int64_t rows = v.size(0), cols = v.ndim() == 2 ? v.size(1) : 1;
  exchange_test::Matrix m(v.dtype(), rows, cols);
  for (int64_t r = 0; r < rows; ++r)
    EPX_CHECK(cudaMemcpy(m.row(r), v.row<std::byte>(r), m.row_bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
  return m;
}
template <typename T>
std::vector<T> download_vector(const TensorView& v) {
  const exchange_test::Matrix m = download(v);
  std::vector<T> out(m.bytes().size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), m.bytes().data(), m.bytes().size());
  return out;
}

}  // namespace epx::cuda_test
