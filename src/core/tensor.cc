#include "epx/core/tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <vector>

namespace epx {

std::string device_name(const Device& device) {
  return device.kind == DeviceKind::kHost ? std::string("host") : fmt::format("cuda:{}", device.index);
}

TensorView::TensorView(const void* data, DType dtype, std::initializer_list<int64_t> sizes,
                       std::initializer_list<int64_t> strides, Device device)
    : data_(const_cast<void*>(data)), dtype_(dtype), device_(device), ndim_(static_cast<int>(sizes.size())) {
  EPX_CHECK_LE(sizes.size(), static_cast<std::size_t>(kMaxDims));
  EPX_CHECK_EQ(sizes.size(), strides.size());
  int d = 0;
  for (int64_t s : sizes) sizes_[d++] = s;
  d = 0;
  for (int64_t s : strides) strides_[d++] = s;
}

TensorView TensorView::contiguous(const void* data, DType dtype, std::initializer_list<int64_t> sizes,
                                  Device device) {
  TensorView view;
  view.data_ = const_cast<void*>(data);
  view.dtype_ = dtype;
  view.device_ = device;
  view.ndim_ = static_cast<int>(sizes.size());
  EPX_CHECK_LE(view.ndim_, kMaxDims);
  int d = 0;
  for (int64_t s : sizes) view.sizes_[d++] = s;
  int64_t stride = 1;
  for (int i = view.ndim_ - 1; i >= 0; --i) {
    view.strides_[i] = stride;
    stride *= view.sizes_[i];
  }
  return view;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim_; ++d) n *= sizes_[d];
  return ndim_ == 0 ? 0 : n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    if (sizes_[d] != 1 && strides_[d] != expected) return false;
    expected *= sizes_[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::vector<int64_t> sizes(sizes_.begin(), sizes_.begin() + ndim_);
  std::vector<int64_t> strides(strides_.begin(), strides_.begin() + ndim_);
  return fmt::format("{}[{}] (strides {})", dtype_name(dtype_), fmt::join(sizes, ", "), fmt::join(strides, ", "));
}

namespace {

Status check_matrix_shape(const TensorView& view, std::string_view name, DType dtype, int64_t rows, int64_t cols) {
  if (view.ndim() != 2) return invalid_argument("{} must be 2-D, got {}", name, view.describe());
  if (view.dtype() != dtype)
    return invalid_argument("{} must be {}, got {}", name, dtype_name(dtype), view.describe());
  if (view.size(0) != rows || view.size(1) != cols)
    return invalid_argument("{} must be [{}, {}], got {}", name, rows, cols, view.describe());
  if (view.stride(1) != 1 || (rows > 1 && view.stride(0) < cols))
    return invalid_argument("{} must have unit column stride and rows at least {} apart, got {}", name, cols,
                            view.describe());
  return Status::ok();
}

}  // namespace

Status check_matrix(const TensorView& view, std::string_view name, DType dtype, int64_t rows, int64_t cols) {
  EPX_RETURN_IF_ERROR(check_matrix_shape(view, name, dtype, rows, cols));
  if (view.device().kind != DeviceKind::kHost)
    return invalid_argument("{} lives on a GPU; this operation takes host memory", name);
  if (rows * cols > 0 && view.data() == nullptr) return invalid_argument("{} has no data pointer", name);
  return Status::ok();
}

Status check_matrix(const TensorView& view, std::string_view name, DType dtype, int64_t rows, int64_t cols,
                    Device device) {
  EPX_RETURN_IF_ERROR(check_matrix_shape(view, name, dtype, rows, cols));
  if (view.device() != device)
    return invalid_argument("{} must live on {} but lives on {}", name, device_name(device), device_name(view.device()));
  if (rows * cols > 0 && view.data() == nullptr) return invalid_argument("{} has no data pointer", name);
  return Status::ok();
}

}  // namespace epx
