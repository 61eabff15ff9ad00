// combine_expanded weighted by the receivers (CombineWeights::kReceiver):
// each token's rank reads its tokens' expanded rows where the holders left
// them (same node) or as messages (other nodes) and sums w * y in top-k
// order.
#include "epx/exchange/buffer.h"

#include <algorithm>
#include <cstring>

#include "exchange/cpu/buffer_impl.h"

namespace epx {

using buffer_detail::expect_size;
using buffer_detail::is_payload_dtype;
using buffer_detail::kTagCombine;
using buffer_detail::pick_weights;
using buffer_detail::SendGroup;

Status Buffer::Impl::check_receiver_combine(const TensorView& y, const detail::HandleData& h, const TensorView& out,
                                            const TensorView& weights, const CombineOptions& options,
                                            const float** w) const {
  if (hierarchical)
    return invalid_argument("CombineOptions::weights_at = kReceiver takes the flat path, but this Buffer is two-hop "
                            "({} nodes x {} ranks); use kHolder, or BufferConfig::algorithm = kFlat",
                            num_nodes, ranks_per_node);
  if (options.partial_dtype != DType::kF32)
    return invalid_argument("partial_dtype = {} applies to holder partials; with weights_at = kReceiver the rows "
                            "travel unweighted in y's dtype", dtype_name(options.partial_dtype));
  if (options.bias.defined() || options.grad_recv_topk_weights.defined() || options.grad_topk_weights.defined())
    return invalid_argument("combine_expanded with weights_at = kReceiver takes no bias and no weight gradients");
  const int64_t rows = h.expanded().num_rows();
  if (y.ndim() != 2 || !is_payload_dtype(y.dtype()) || dtype_size(y.dtype()) > dtype_size(config.max_combine_dtype))
    return invalid_argument("y_expanded must be a 2-D bf16 or f32 array no wider than max_combine_dtype = {}, got {}",
                            dtype_name(config.max_combine_dtype), y.describe());
  EPX_RETURN_IF_ERROR(check_matrix(y, "y_expanded", y.dtype(), rows, config.hidden));
  EPX_RETURN_IF_ERROR(check_expanded_capacity(rows, y.dtype(), "combine_expanded"));
  if (y.data() != local().combine && rows > 0 &&
      !detail::check_outside_combine_region(y, local().combine, combine_bytes()).is_ok())
    return invalid_argument("y_expanded overlaps the combine region but is not the view combine_expanded_input returned");
  if (y.data() == local().combine && y.stride(0) != config.hidden)
    return invalid_argument("y_expanded in the combine region must be dense, got {}", y.describe());
  if (out.ndim() != 2 || !is_payload_dtype(out.dtype()))
    return invalid_argument("out must be a 2-D bf16 or f32 array, got {}", out.describe());
  EPX_RETURN_IF_ERROR(check_matrix(out, "out", out.dtype(), h.num_tokens, config.hidden));
  return pick_weights(weights, h.num_tokens, h.topk, h.topk_weights, h.has_weights, "combine_expanded", w);
}

// Flat, to each source rank on another node: the expanded rows of its
// tokens, in (its token, slot) order.
Status Buffer::Impl::post_receiver_rows(const detail::HandleData& h, std::size_t yrow, SendGroup& sends) {
  const int R = num_ranks, K = h.topk;
  const std::vector<int64_t>& row_of = h.expanded().row_of;
  std::vector<int64_t> first(R, 0), count(R, 0);
  int64_t total = 0;
  for (int s = 0; s < R; ++s) {
    if (topology.same_node(s, rank)) continue;
    const int64_t base = block_base(h, R, s, rank), n = h.counts[static_cast<std::size_t>(s) * R + rank];
    first[s] = total;
    for (int64_t i = base * K; i < (base + n) * K; ++i) count[s] += row_of[i] >= 0 ? 1 : 0;
    total += count[s];
  }
  EPX_RETURN_IF_ERROR(send_payload.reserve(total * yrow, "the expanded rows for other nodes"));
  for (int s = 0; s < R; ++s) {
    if (count[s] == 0) continue;
    const int64_t base = block_base(h, R, s, rank), n = h.counts[static_cast<std::size_t>(s) * R + rank];
    std::byte* dst = send_payload.data() + first[s] * yrow;
    for (int64_t i = base * K; i < (base + n) * K; ++i)
      if (row_of[i] >= 0) std::memcpy(dst, local().combine + row_of[i] * yrow, yrow), dst += yrow;
    EPX_RETURN_IF_ERROR(sends.post(s, kTagCombine, {send_payload.data() + first[s] * yrow, count[s] * yrow}));
  }
  return Status::ok();
}

// Flat, from each holder on another node: its rows of this rank's (token,
// slot) pairs, staged in recv_payload from (*stage_first)[d] (-1: none).
Status Buffer::Impl::recv_receiver_rows(const detail::HandleData& h, std::size_t yrow, std::vector<int64_t>* stage_first,
                                        const Deadline& deadline) {
  const int R = num_ranks;
  std::vector<int64_t> count(R, 0);
  for (const int32_t d : h.topk_rank)
    if (d >= 0 && !topology.same_node(d, rank)) ++count[d];
  stage_first->assign(R, -1);
  int64_t total = 0;
  for (int d = 0; d < R; ++d)
    if (count[d] > 0) (*stage_first)[d] = total, total += count[d];
  EPX_RETURN_IF_ERROR(recv_payload.reserve(total * yrow, "the expanded rows from other nodes"));
  for (int d = 0; d < R; ++d) {
    if (count[d] == 0) continue;
    const std::size_t bytes = count[d] * yrow;
    EPX_ASSIGN_OR_RETURN(std::size_t got,
                         recv_from(d, kTagCombine, {recv_payload.data() + (*stage_first)[d] * yrow, bytes}, deadline));
    EPX_RETURN_IF_ERROR(expect_size(got, bytes, d, "expanded combine rows"));
  }
  return Status::ok();
}

// out[t] = 0 + w[t, 0] * y[t, 0] + ... + w[t, K-1] * y[t, K-1] in fp32, slots
// without an expert left out, one rounding to out's dtype.
void Buffer::Impl::sum_receiver_rows(const detail::HandleData& h, DType ydtype, const std::vector<int64_t>& stage_first,
                                     const float* w, const TensorView& out) const {
  const int R = num_ranks, K = h.topk, H = config.hidden;
  const std::size_t yrow = static_cast<std::size_t>(H) * dtype_size(ydtype);
  std::vector<int64_t> next(stage_first);
  std::vector<const std::byte*> rows(static_cast<std::size_t>(K));
  std::vector<float> weights(static_cast<std::size_t>(K));
  for (int t = 0; t < h.num_tokens; ++t) {
    int n = 0;
    for (int k = 0; k < K; ++k) {
      const int d = h.topk_rank[static_cast<std::size_t>(t) * K + k];
      if (d < 0) continue;
      if (topology.same_node(d, rank)) {
        const int64_t recv_row = h.send_row[static_cast<std::size_t>(t) * R + d];
        rows[n] = regions[d].combine + regions[d].combine_rows[recv_row * K + k] * yrow;
      } else {
        rows[n] = recv_payload.data() + next[d]++ * yrow;
      }
      weights[n++] = w[static_cast<std::size_t>(t) * K + k];
    }
    detail::weighted_partial(out.row<std::byte>(t), out.dtype(), rows.data(), weights.data(), n, ydtype, H);
  }
}

Status Buffer::Impl::combine_receiver(Status local_status, const TensorView& y, const detail::HandleData& h,
                                      const TensorView& out, const float* w) {
  constexpr std::string_view kOp = "combine_expanded";
  constexpr int64_t kReceiverWord = 2;  // in combine_impl's header, where it holds the weight-gradient flag
  ScopedSpan span(config.tracer, rank, std::string(kOp));
  const Deadline deadline = Deadline::after(config.timeout);
  const DType ydtype = local_status.is_ok() ? y.dtype() : DType::kF32;
  const std::size_t yrow = static_cast<std::size_t>(config.hidden) * dtype_size(ydtype);
  start_op();
  std::vector<int64_t> all;
  EPX_RETURN_IF_ERROR(
      gather_header(local_status, {static_cast<int64_t>(ydtype), kReceiverWord, h.dispatch_seq}, &all, kOp, deadline));
  const std::size_t stride = all.size() / num_ranks;
  EPX_RETURN_IF_ERROR(check_same_dispatch(all, stride, 3, kOp));
  for (int r = 0; r < num_ranks; ++r)
    if (all[r * stride + 1] != static_cast<int64_t>(ydtype) || all[r * stride + 2] != kReceiverWord)
      return invalid_argument("combine_expanded inputs differ between ranks: rank {} weighs by the receiver with y {} "
                              "and rank {} {} with y {}", rank, dtype_name(ydtype), r,
                              all[r * stride + 2] == kReceiverWord ? "too" : "weighs by the holder",
                              dtype_name(static_cast<DType>(all[r * stride + 1])));
  SendGroup sends(transport, deadline, kOp);
  EPX_RETURN_IF_ERROR(post_receiver_rows(h, yrow, sends));
  std::vector<int64_t> stage_first;
  EPX_RETURN_IF_ERROR(recv_receiver_rows(h, yrow, &stage_first, deadline));
  sum_receiver_rows(h, ydtype, stage_first, w, out);
  EPX_RETURN_IF_ERROR(sends.finish());
  // No rank may overwrite its combine region while a peer still reads it.
  return close_op(deadline);
}

}  // namespace epx
