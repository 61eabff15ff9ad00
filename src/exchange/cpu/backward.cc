// Buffer's backward passes: dispatch_backward (a combine of the gradients),
// combine_backward (a dispatch of them) and combine_expanded_backward (the
// gradients of the expanded rows and of the top-k weights, reading y where
// the forward left it).
#include "epx/exchange/buffer.h"

#include <algorithm>
#include <cstring>

#include "exchange/cpu/buffer_impl.h"

namespace epx {

using buffer_detail::is_payload_dtype;
using buffer_detail::pick_weights;

Status Buffer::dispatch_backward_blocking(const TensorView& grad_recv_x, const Handle& handle, const TensorView& grad_x,
                                     const CombineOptions& options) {
  return impl_->combine_checked(grad_recv_x, handle, grad_x, options, "dispatch_backward", "grad_recv_x", "grad_x");
}

Status Buffer::combine_backward_blocking(const TensorView& grad_out, const Handle& handle, TensorView* grad_y) {
  return impl_->dispatch_gradients(Status::ok(), grad_out, handle, grad_y, "combine_backward");
}

// The y rows the backward reads: y itself, or, for the combine_expanded_input
// view of a receiver-weighted combine whose rows were since overwritten, the
// copy kept with the handle.
Result<TensorView> Buffer::Impl::backward_y(const TensorView& y, const Handle& handle) const {
  const auto* begin = static_cast<const std::byte*>(y.data());
  if (y.size(0) == 0 || detail::check_outside_combine_region(y, local().combine, combine_bytes()).is_ok()) return y;
  const detail::HandleData& h = handle.data();
  const bool is_view = begin == local().combine && y.stride(0) == config.hidden;
  if (is_view && pinned_y.lock().get() == &h && pinned_seq == h.dispatch_seq && pinned_dtype == y.dtype() &&
      pinned_rows == y.size(0))
    return y;
  const std::size_t bytes = static_cast<std::size_t>(y.size(0)) * config.hidden * y.element_size();
  if (is_view && h.y_spill_dtype == y.dtype() && h.y_spill.size() == bytes)
    return TensorView::contiguous(h.y_spill.data(), y.dtype(), {y.size(0), config.hidden});
  return failed_precondition("y_expanded lies in this Buffer's combine region, but the rows there are not those a "
                             "combine_expanded of this handle read in place (overwritten since, or never "
                             "written by one); pass y from outside the region");
}


namespace {

// Received rows [first, first + count) of grad_partial, widened to f32 into g
// (count rows of n; bf16 exactly, through the vectorised to_f32).
void widen_rows(const TensorView& grad_partial, int64_t first, int64_t count, int n, float* g) {
  for (int64_t i = 0; i < count; ++i) {
    const std::byte* src = grad_partial.row<std::byte>(first + i);
    float* dst = g + i * n;
    if (grad_partial.dtype() == DType::kBF16) detail::to_f32(reinterpret_cast<const uint16_t*>(src), n, dst);
    else
      for (int c = 0; c < n; ++c) dst[c] = load_as_f32(src, grad_partial.dtype(), c);
  }
}

}  // namespace

Status Buffer::combine_expanded_backward_blocking(const TensorView& grad_out, const Handle& handle,
                                             const TensorView& y_expanded, const TensorView& weights,
                                             const TensorView& grad_y_expanded, const TensorView& grad_weights) {
  Impl& m = *impl_;
  constexpr std::string_view kOp = "combine_expanded_backward";
  Status local_status = m.check_handle(handle, kOp);
  if (local_status.is_ok()) local_status = m.gradients.check_gradient_payload(kOp);
  const float* w = nullptr;
  TensorView y_rows;  // y_expanded, or the copy of its rows kept with the handle
  if (local_status.is_ok()) {
    const detail::HandleData& h = handle.data();
    const int64_t rows = h.expanded().num_rows();
    local_status = [&]() -> Status {
      if (y_expanded.ndim() != 2 || !is_payload_dtype(y_expanded.dtype()))
        return invalid_argument("y_expanded must be a 2-D bf16 or f32 array, got {}", y_expanded.describe());
      EPX_RETURN_IF_ERROR(check_matrix(y_expanded, "y_expanded", y_expanded.dtype(), rows, m.config.hidden));
      EPX_ASSIGN_OR_RETURN(y_rows, m.backward_y(y_expanded, handle));
      EPX_RETURN_IF_ERROR(check_matrix(grad_y_expanded, "grad_y_expanded", DType::kF32, rows, m.config.hidden));
      if (grad_weights.defined())
        EPX_RETURN_IF_ERROR(check_matrix(grad_weights, "grad_weights", DType::kF32, h.num_recv, h.topk));
      return pick_weights(weights, h.num_recv, h.topk, h.recv_topk_weights, h.has_weights, kOp, &w);
    }();
  }
  // grad of each partial row = grad_out of its token, brought back along the dispatch routes.
  TensorView grad_partial;
  EPX_RETURN_IF_ERROR(m.dispatch_gradients(local_status, grad_out, handle, &grad_partial, kOp));
  const detail::HandleData& h = handle.data();
  const ExpandedLayout& layout = h.expanded();
  const int H = m.config.hidden, K = h.topk;
  for (int64_t row = 0; row < layout.num_rows(); ++row)
    if (layout.recv_row[row] < 0) std::fill_n(grad_y_expanded.row<float>(row), H, 0.0f);
  // A block of received rows at a time: their grad rows widened once, then
  // every <grad, y[row]> of the block (detail::column_order_dots: each in
  // column order, several at once), then grad_y. The dot products come first,
  // so grad_y_expanded may reuse y's memory.
  constexpr int64_t kBlock = 8;
  std::vector<float> g(static_cast<std::size_t>(kBlock) * H);
  std::vector<detail::DotJob> dots;
  for (int64_t first = 0; first < h.num_recv; first += kBlock) {
    const int64_t count = std::min(kBlock, h.num_recv - first);
    widen_rows(grad_partial, first, count, H, g.data());
    if (grad_weights.defined()) {
      dots.clear();
      for (int64_t i = first; i < first + count; ++i)
        for (int k = 0; k < K; ++k) {
          const int64_t row = layout.row_of[i * K + k];
          // d out / d w = <grad, y[row]>; a slot without an expert here has none.
          if (row < 0) grad_weights.row<float>(i)[k] = 0.0f;
          else dots.push_back({g.data() + (i - first) * H, y_rows.row<std::byte>(row), grad_weights.row<float>(i) + k});
        }
      detail::column_order_dots(dots, y_rows.dtype(), H);
    }
    for (int64_t i = first; i < first + count; ++i)
      for (int k = 0; k < K; ++k) {
        const int64_t row = layout.row_of[i * K + k];
        if (row < 0) continue;
        // d out / d y[row] = w.
        const float wk = w[i * K + k];
        const float* gi = g.data() + (i - first) * H;
        float* gy = grad_y_expanded.row<float>(row);
        for (int c = 0; c < H; ++c) gy[c] = wk * gi[c];
      }
  }
  m.release_y(h);
  return Status::ok();
}

}  // namespace epx
