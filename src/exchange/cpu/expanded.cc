// Buffer's expanded layout: the received rows grouped by local expert
// (expand), the experts' rows written into the combine region
// (combine_expanded_input) and published there for the readers of a weighted
// combine, kept (pinned, or spilled with the handle) for the backward.
#include "epx/exchange/buffer.h"

#include <algorithm>
#include <cstring>

#include "exchange/cpu/buffer_impl.h"

namespace epx {

using buffer_detail::is_payload_dtype;
using buffer_detail::Region;

const ExpandedLayout& Buffer::expanded_layout(const Handle& handle) const {
  EPX_CHECK(handle.valid());
  return handle.data().expanded();
}

Status Buffer::expand(const TensorView& recv_x, const Handle& handle, const TensorView& out) const {
  const Impl& m = *impl_;
  EPX_RETURN_IF_ERROR(m.check_handle(handle, "expand"));
  const detail::HandleData& h = handle.data();
  if (recv_x.ndim() != 2 || !is_payload_dtype(recv_x.dtype()))
    return invalid_argument("recv_x must be a 2-D bf16 or f32 array, got {}", recv_x.describe());
  EPX_RETURN_IF_ERROR(check_matrix(recv_x, "recv_x", recv_x.dtype(), h.num_recv, m.config.hidden));
  EPX_RETURN_IF_ERROR(check_matrix(out, "out", recv_x.dtype(), h.expanded().num_rows(), m.config.hidden));
  const std::size_t bytes = static_cast<std::size_t>(m.config.hidden) * recv_x.element_size();
  for (int64_t i = 0; i < h.expanded().num_rows(); ++i) {
    const int64_t src = h.expanded().recv_row[i];
    if (src < 0)
      std::memset(out.row<std::byte>(i), 0, bytes);
    else
      std::memcpy(out.row<std::byte>(i), recv_x.row<std::byte>(src), bytes);
  }
  return Status::ok();
}


void Buffer::Impl::spill_pinned_y() {
  const std::shared_ptr<const detail::HandleData> h = pinned_y.lock();
  pinned_y.reset();
  if (!h || h->dispatch_seq != pinned_seq) return;  // gone, or its storage reused by a later dispatch
  const std::size_t bytes = static_cast<std::size_t>(pinned_rows) * config.hidden * dtype_size(pinned_dtype);
  h->y_spill.assign(local().combine, local().combine + bytes);
  h->y_spill_dtype = pinned_dtype;
}

Status Buffer::Impl::check_expanded_capacity(int64_t rows, DType dtype, std::string_view op) const {
  const std::size_t row = static_cast<std::size_t>(config.hidden) * dtype_size(dtype);
  const auto fits = std::min<int64_t>(static_cast<int64_t>(combine_bytes() / row), INT32_MAX);
  if (rows <= fits) return Status::ok();
  const auto needed = static_cast<int64_t>((static_cast<std::size_t>(rows) * row + combine_row_bytes - 1) / combine_row_bytes);
  return invalid_argument("{} needs {} expanded rows of {} in the combine region, which holds {} such rows; raise "
                          "BufferConfig::max_expanded_rows to at least {} (rows of max_combine_dtype = {})",
                          op, rows, dtype_name(dtype), fits, needed, dtype_name(config.max_combine_dtype));
}

Status buffer_detail::pick_weights(const TensorView& weights, int64_t rows, int K, const std::vector<float>& dispatched,
                                   bool has_weights, std::string_view op, const float** w) {
  if (weights.defined()) {
    EPX_RETURN_IF_ERROR(check_matrix(weights, "weights", DType::kF32, rows, K));
    if (weights.stride(0) != K) return invalid_argument("weights must be dense, got {}", weights.describe());
    *w = weights.data_as<float>();
  } else if (has_weights) {
    *w = dispatched.data();
  } else {
    return invalid_argument("{} needs weights: none were dispatched and none were passed", op);
  }
  return Status::ok();
}

// Puts y's rows in this rank's combine region (unless they are there) and
// publishes each received row's expanded rows, where same-node peers read them.
void Buffer::Impl::place_expanded_rows(const TensorView& y, const Handle& handle) {
  const detail::HandleData& h = handle.data();
  const Region& mine = local();
  const std::size_t yrow = static_cast<std::size_t>(config.hidden) * y.element_size();
  const int64_t rows = y.size(0);
  if (y.data() != mine.combine) {
    std::byte* region = combine_for_writing();
    for (int64_t i = 0; i < rows; ++i) std::memcpy(region + i * yrow, y.row<std::byte>(i), yrow);
  }
  const std::vector<int64_t>& row_of = h.expanded().row_of;
  for (std::size_t i = 0; i < row_of.size(); ++i) mine.combine_rows[i] = static_cast<int32_t>(row_of[i]);
  pin_y(handle, rows, y.dtype());
}

Result<TensorView> Buffer::combine_expanded_input_blocking(const Handle& handle, DType dtype) {
  Impl& m = *impl_;
  EPX_RETURN_IF_ERROR(m.check_handle(handle, "combine_expanded_input"));
  if (!is_payload_dtype(dtype) || dtype_size(dtype) > dtype_size(m.config.max_combine_dtype))
    return invalid_argument("combine_expanded_input dtype {} must be bf16 or f32 and no wider than max_combine_dtype "
                            "= {}", dtype_name(dtype), dtype_name(m.config.max_combine_dtype));
  const int64_t rows = handle.data().expanded().num_rows();
  EPX_RETURN_IF_ERROR(m.check_expanded_capacity(rows, dtype, "combine_expanded_input"));
  return TensorView::contiguous(m.combine_for_writing(), dtype, {rows, m.config.hidden});
}

}  // namespace epx
