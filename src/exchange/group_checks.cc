#include "exchange/group_checks.h"

namespace epx::detail {
namespace {

bool is_payload(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16; }

// An optional dense f32 [num_recv, topk] (weights of the received rows' slots).
Status check_slots(const TensorView& v, std::string_view name, const CombineShape& s) {
  if (!v.defined()) return Status::ok();
  EPX_RETURN_IF_ERROR(check_matrix(v, name, DType::kF32, s.num_recv, s.topk, s.device));
  if (s.num_recv > 1 && v.stride(0) != s.topk) return invalid_argument("{} must be dense, got {}", name, v.describe());
  return Status::ok();
}

}  // namespace

Status check_outside_combine_region(const TensorView& y_expanded, const std::byte* region, std::size_t bytes) {
  const auto* y_begin = static_cast<const std::byte*>(y_expanded.data());
  const std::byte* y_end = y_begin + y_expanded.size(0) * y_expanded.row_stride_bytes();
  if (y_begin < region + bytes && region < y_end)
    return invalid_argument("y_expanded lies in this Buffer's combine region, where combine_expanded writes its "
                            "partial sums; keep the expanded rows elsewhere");
  return Status::ok();
}

Status on_rank(int rank, Status status) {
  if (status.is_ok()) return status;
  return make_status(status.code(), "rank {}: {}", rank, status.message());
}

Status check_expanded_inputs(const BufferConfig& config, bool backward, const TensorView& y, const TensorView& weights,
                             const TensorView& grad_y, const TensorView& grad_weights, int64_t rows,
                             const CombineShape& s) {
  if (!backward && config.max_combine_dtype != DType::kF32)
    return failed_precondition("combine_expanded sums in fp32 and needs max_combine_dtype = f32, not {}",
                               dtype_name(config.max_combine_dtype));
  if (y.ndim() != 2 || !is_payload(y.dtype()))
    return invalid_argument("y_expanded must be a 2-D bf16 or f32 array, got {}", y.describe());
  EPX_RETURN_IF_ERROR(check_matrix(y, "y_expanded", y.dtype(), rows, config.hidden, s.device));
  EPX_RETURN_IF_ERROR(check_slots(weights, "weights", s));
  if (!backward) return Status::ok();
  EPX_RETURN_IF_ERROR(check_matrix(grad_y, "grad_y_expanded", DType::kF32, rows, config.hidden, s.device));
  return check_slots(grad_weights, "grad_weights", s);
}

Status check_dispatch_inputs(const BufferConfig& config, const DispatchInputs& in, Device device) {
  if (in.topk_idx.ndim() != 2)
    return invalid_argument("topk_idx must be 2-D [num_tokens, topk], got {}", in.topk_idx.describe());
  const int64_t num_tokens = in.topk_idx.size(0), topk = in.topk_idx.size(1);
  if (num_tokens > config.max_tokens_per_rank)
    return invalid_argument("num_tokens = {} is above max_tokens_per_rank = {}", num_tokens,
                            config.max_tokens_per_rank);
  if (topk < 1 || topk > config.max_topk)
    return invalid_argument("topk = {} is outside [1, max_topk = {}]", topk, config.max_topk);
  EPX_RETURN_IF_ERROR(check_matrix(in.topk_idx, "topk_idx", DType::kI32, num_tokens, topk, device));
  EPX_RETURN_IF_ERROR(check_matrix(in.x, "x", config.dtype, num_tokens, config.hidden, device));
  if (in.topk_weights.defined())
    EPX_RETURN_IF_ERROR(check_matrix(in.topk_weights, "topk_weights", DType::kF32, num_tokens, topk, device));
  return Status::ok();
}

Status check_combine_inputs(const BufferConfig& config, const TensorView& y, const TensorView& out,
                            const CombineOptions& o, const CombineShape& s) {
  if (y.ndim() != 2 || !is_payload(y.dtype()))
    return invalid_argument("y must be a 2-D bf16 or f32 array, got {}", y.describe());
  if (dtype_size(y.dtype()) > dtype_size(config.max_combine_dtype))
    return invalid_argument("y is {} but max_combine_dtype = {}; raise BufferConfig::max_combine_dtype",
                            dtype_name(y.dtype()), dtype_name(config.max_combine_dtype));
  EPX_RETURN_IF_ERROR(check_matrix(y, "y", y.dtype(), s.num_recv, config.hidden, s.device));
  if (out.ndim() != 2 || !is_payload(out.dtype()))
    return invalid_argument("out must be a 2-D bf16 or f32 array, got {}", out.describe());
  EPX_RETURN_IF_ERROR(check_matrix(out, "out", out.dtype(), s.num_tokens, config.hidden, s.device));
  if (o.bias.defined()) {
    if (o.bias.dtype() != DType::kF32 && o.bias.dtype() != out.dtype())
      return invalid_argument("bias must be f32 or the output's dtype {}, got {}", dtype_name(out.dtype()),
                              o.bias.describe());
    EPX_RETURN_IF_ERROR(check_matrix(o.bias, "bias", o.bias.dtype(), s.num_tokens, config.hidden, s.device));
  }
  if (o.grad_recv_topk_weights.defined() != o.grad_topk_weights.defined())
    return invalid_argument("grad_recv_topk_weights and grad_topk_weights go together; got only one");
  if (o.grad_recv_topk_weights.defined()) {
    EPX_RETURN_IF_ERROR(check_matrix(o.grad_recv_topk_weights, "grad_recv_topk_weights", DType::kF32, s.num_recv,
                                     s.topk, s.device));
    EPX_RETURN_IF_ERROR(
        check_matrix(o.grad_topk_weights, "grad_topk_weights", DType::kF32, s.num_tokens, s.topk, s.device));
    if ((s.num_recv > 1 && o.grad_recv_topk_weights.stride(0) != s.topk) ||
        (s.num_tokens > 1 && o.grad_topk_weights.stride(0) != s.topk))
      return invalid_argument("the weight gradients must be dense [rows, topk] arrays");
  }
  return Status::ok();
}

Status check_per_rank(std::size_t got, int num_ranks, std::string_view what) {
  if (got == static_cast<std::size_t>(num_ranks)) return Status::ok();
  return invalid_argument("{} must hold one entry per rank ({}), got {}", what, num_ranks, got);
}

Status validate_group_dispatch(const BufferConfig& config, std::span<const DispatchInputs> inputs,
                               std::span<const Device> devices) {
  const int R = static_cast<int>(devices.size());
  EPX_RETURN_IF_ERROR(check_per_rank(inputs.size(), R, "the dispatch inputs"));
  int64_t topk0 = -1;
  for (int r = 0; r < R; ++r) {
    const DispatchInputs& in = inputs[r];
    EPX_RETURN_IF_ERROR(on_rank(r, check_dispatch_inputs(config, in, devices[r])));
    if (r == 0) topk0 = in.topk_idx.size(1);
    if (in.topk_idx.size(1) != topk0)
      return invalid_argument("topk differs between ranks: rank 0 passes {} and rank {} passes {}", topk0, r,
                              in.topk_idx.size(1));
    if (in.topk_weights.defined() != inputs[0].topk_weights.defined())
      return invalid_argument("rank 0 {} topk_weights but rank {} {}; pass them on every rank or none",
                              inputs[0].topk_weights.defined() ? "passes" : "does not pass", r,
                              in.topk_weights.defined() ? "does" : "does not");
  }
  return Status::ok();
}

Status check_recv_capacity(std::span<const int32_t> counts, int num_ranks, int64_t max_recv) {
  for (int d = 0; d < num_ranks; ++d) {
    int64_t total = 0;
    for (int s = 0; s < num_ranks; ++s) total += counts[static_cast<std::size_t>(s) * num_ranks + d];
    if (total > max_recv)
      return resource_exhausted(
          "rank {} would receive {} rows but max_recv_tokens = {}; nothing was sent. Raise BufferConfig::max_recv_tokens",
          d, total, max_recv);
  }
  return Status::ok();
}

Status validate_group_combine(const BufferConfig& config, std::span<const TensorView> y,
                              std::span<const TensorView> out, std::span<const CombineOptions> options,
                              std::span<const CombineShape> shapes) {
  const int R = static_cast<int>(shapes.size());
  EPX_RETURN_IF_ERROR(check_per_rank(y.size(), R, "y"));
  EPX_RETURN_IF_ERROR(check_per_rank(out.size(), R, "out"));
  if (!options.empty()) EPX_RETURN_IF_ERROR(check_per_rank(options.size(), R, "the combine options"));
  static const CombineOptions kNone;
  const CombineOptions& first = options.empty() ? kNone : options[0];
  for (int r = 0; r < R; ++r) {
    const CombineShape& s = shapes[r];
    const CombineOptions& o = options.empty() ? kNone : options[r];
    EPX_RETURN_IF_ERROR(on_rank(r, check_combine_inputs(config, y[r], out[r], o, s)));
    if (y[r].dtype() != y[0].dtype())
      return invalid_argument("y differs between ranks: rank 0 has {} and rank {} has {}", dtype_name(y[0].dtype()),
                              r, dtype_name(y[r].dtype()));
    if (o.grad_recv_topk_weights.defined() != first.grad_recv_topk_weights.defined())
      return invalid_argument("rank 0 {} weight gradients but rank {} {}; pass them on every rank or none",
                              first.grad_recv_topk_weights.defined() ? "passes" : "does not pass", r,
                              o.grad_recv_topk_weights.defined() ? "does" : "does not");
  }
  return Status::ok();
}

}  // namespace epx::detail
