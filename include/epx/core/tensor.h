// TensorView: a non-owning view of a strided array of up to 4 dimensions.
//
// A view never owns or frees memory; it says where the data is (host or a
// GPU), its element type, shape and strides (in elements). Operations read the
// views they take as inputs and write the views they take as outputs.
//
//   std::vector<float> x(T * H);
//   auto view = epx::TensorView::contiguous(x.data(), epx::DType::kF32, {T, H});
//   float* row3 = view.row<float>(3);
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "epx/core/dtype.h"

namespace epx {

enum class DeviceKind : uint8_t { kHost, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kHost;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};
// "host" or "cuda:1".
std::string device_name(const Device& device);

class TensorView {
 public:
  static constexpr int kMaxDims = 4;

  TensorView() = default;
  TensorView(const void* data, DType dtype, std::initializer_list<int64_t> sizes,
             std::initializer_list<int64_t> strides, Device device = {});

  // A dense row-major view of `sizes`.
  static TensorView contiguous(const void* data, DType dtype, std::initializer_list<int64_t> sizes,
                               Device device = {});

  // A default-constructed view is undefined: an optional argument left out.
  [[nodiscard]] bool defined() const { return ndim_ > 0; }
  [[nodiscard]] void* data() const { return data_; }
  template <typename T>
  [[nodiscard]] T* data_as() const { return static_cast<T*>(data_); }
  [[nodiscard]] DType dtype() const { return dtype_; }
  [[nodiscard]] Device device() const { return device_; }
  [[nodiscard]] int ndim() const { return ndim_; }
  [[nodiscard]] int64_t size(int dim) const { return sizes_[dim]; }
  [[nodiscard]] int64_t stride(int dim) const { return strides_[dim]; }
  [[nodiscard]] int64_t numel() const;
  [[nodiscard]] bool is_contiguous() const;
  [[nodiscard]] std::size_t element_size() const { return dtype_size(dtype_); }
  // Bytes from one row (index along dim 0) to the next.
  [[nodiscard]] std::size_t row_stride_bytes() const { return static_cast<std::size_t>(strides_[0]) * element_size(); }
  // Address of row i (index along dim 0), typed.
  template <typename T = void>
  [[nodiscard]] T* row(int64_t i) const {
    return reinterpret_cast<T*>(static_cast<std::byte*>(data_) + i * static_cast<int64_t>(row_stride_bytes()));
  }
  // "bf16[128, 7168] (strides 7168, 1)".
  [[nodiscard]] std::string describe() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Device device_{};
  int ndim_ = 0;
  std::array<int64_t, kMaxDims> sizes_{};
  std::array<int64_t, kMaxDims> strides_{};
};

// Checks that `view` is a dense row-major host 2-D array [rows, cols] of
// `dtype`; `name` goes into the error message.
[[nodiscard]] Status check_matrix(const TensorView& view, std::string_view name, DType dtype,
                                  int64_t rows, int64_t cols);
// The same checks for a view that must live on `device` (a GPU backend's inputs).
[[nodiscard]] Status check_matrix(const TensorView& view, std::string_view name, DType dtype,
                                  int64_t rows, int64_t cols, Device device);

}  // namespace epx
