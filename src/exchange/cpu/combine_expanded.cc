// Buffer::combine_expanded with the weights applied by the holders
// (CombineWeights::kHolder, the exact default MoELayer runs).
//
// Each holder's share of a token is its partial: its local slots' expanded
// rows weighted and summed in top-k order. A holder whose expanded rows lie in
// its combine region (the view combine_expanded_input returned) publishes
// their row numbers and weights beside them, and whoever needs its partial
// (the token's rank on the same node, or the two-hop forwarder) weighs and
// sums the rows where they lie, 64 columns at a time in registers (the last
// columns of a row in L1): the partial is never written to memory. Only the
// partials for other nodes are written out, into the messages that carry
// them. A holder whose rows lie elsewhere writes one f32 partial per received
// row into its region. Either way the
// sums keep the order of docs/design.md, so the bits are the same; holders
// of both kinds may meet in one combine. bf16 partials and weight gradients
// take the partials-in-region path only (combine_impl).
#include <cstring>
#include <vector>

#include "core/guard.h"
#include "exchange/cpu/buffer_impl.h"
#include "exchange/group_checks.h"
#include "exchange/cpu/holder_sums.h"
#include "exchange/cpu/row_kernels.h"

namespace epx {

using buffer_detail::expect_size;
using buffer_detail::handle_data_or_empty;
using buffer_detail::HolderRows;
using buffer_detail::is_payload_dtype;
using buffer_detail::kTagCombine;
using buffer_detail::pick_weights;
using buffer_detail::SendGroup;

namespace {

constexpr std::string_view kOp = "combine_expanded";
// The flag word of the header (combine_impl's layout: rows' dtype, flag,
// dispatch number): how this holder left its share.
constexpr int64_t kHolderInPlace = 3;
constexpr int64_t kHolderPartials = 4;

// Each received row's partial into `partials` (this rank's combine region):
// its local slots' rows weighted, in top-k order, summed in fp32 and
// rounded once to the partials' dtype.
void write_expanded_partials(const detail::HandleData& h, const TensorView& y_expanded, const float* w,
                             const TensorView& partials) {
  const int K = h.topk, H = static_cast<int>(partials.size(1));
  const ExpandedLayout& layout = h.expanded();
  std::vector<const std::byte*> rows(static_cast<std::size_t>(K));
  std::vector<float> weights(static_cast<std::size_t>(K));
  for (int64_t i = 0; i < h.num_recv; ++i) {
    int n = 0;
    for (int k = 0; k < K; ++k) {
      const int64_t row = layout.row_of[i * K + k];
      if (row < 0) continue;
      rows[n] = y_expanded.row<std::byte>(row);
      weights[n++] = w[i * K + k];
    }
    detail::weighted_partial(partials.row<std::byte>(i), partials.dtype(), rows.data(), weights.data(), n,
                             y_expanded.dtype(), H);
  }
}

// Room for the parts of one token: one per rank, each with up to K rows.
struct PartScratch {
  PartScratch(int num_ranks, int topk)
      : topk(topk), parts(num_ranks), groups(num_ranks), rows(static_cast<std::size_t>(num_ranks) * topk),
        weights(static_cast<std::size_t>(num_ranks) * topk) {}
  // Holder v's part of its received row i, as the next part.
  detail::HolderPart& add(const HolderRows& v, int64_t i) {
    const std::size_t at = static_cast<std::size_t>(num_parts) * topk;
    parts[num_parts] = v.part(i, rows.data() + at, weights.data() + at);
    return parts[num_parts++];
  }
  detail::HolderPart& add_partial(const std::byte* partial) {
    parts[num_parts] = {.partial = partial};
    return parts[num_parts++];
  }
  void clear() { num_parts = num_groups = 0; }
  // The parts from `first` on, as one group.
  void group_from(int first) {
    if (num_parts > first) groups[num_groups++] = {&parts[first], num_parts - first};
  }
  std::span<const detail::PartGroup> group_span() const { return {groups.data(), static_cast<std::size_t>(num_groups)}; }

  int topk;
  int num_parts = 0, num_groups = 0;
  std::vector<detail::HolderPart> parts;
  std::vector<detail::PartGroup> groups;
  std::vector<const std::byte*> rows;
  std::vector<float> weights;
};

}  // namespace

detail::HolderPart buffer_detail::HolderRows::part(int64_t i, const std::byte** rows, float* weights_out) const {
  if (!in_place) return {.partial = combine + static_cast<std::size_t>(i) * row_bytes};
  int n = 0;
  for (int k = 0; k < topk; ++k) {
    const int32_t row = row_of[i * topk + k];
    if (row < 0) continue;
    rows[n] = combine + static_cast<std::size_t>(row) * row_bytes;
    weights_out[n++] = weights[i * topk + k];
  }
  return {.rows = rows, .weights = weights_out, .num_rows = n, .row_dtype = dtype};
}

bool Buffer::Impl::holder_rows_in_place(const TensorView& y) const {
  return y.data() == local().combine && y.ndim() == 2 && y.stride(0) == config.hidden;
}

Status Buffer::Impl::check_holder_combine(const TensorView& y, const detail::HandleData& h, const TensorView& out,
                                          const TensorView& weights, const CombineOptions& options,
                                          const float** w) const {
  const DType partial_dtype = options.partial_dtype;
  if (!is_payload_dtype(partial_dtype) || dtype_size(partial_dtype) > dtype_size(config.max_combine_dtype))
    return invalid_argument("combine_expanded partial_dtype = {} must be bf16 or f32 and no wider than "
                            "max_combine_dtype = {}", dtype_name(partial_dtype), dtype_name(config.max_combine_dtype));
  if (y.ndim() != 2 || !is_payload_dtype(y.dtype()))
    return invalid_argument("y_expanded must be a 2-D bf16 or f32 array, got {}", y.describe());
  const int64_t rows = h.expanded().num_rows();
  EPX_RETURN_IF_ERROR(check_matrix(y, "y_expanded", y.dtype(), rows, config.hidden));
  if (holder_rows_in_place(y)) {
    if (partial_dtype != DType::kF32 || options.grad_recv_topk_weights.defined())
      return invalid_argument("y_expanded in the combine region (combine_expanded_input) is weighed where it lies, "
                              "which needs partial_dtype f32 and no weight gradients (got partial_dtype {}{}); pass "
                              "y_expanded from outside the region", dtype_name(partial_dtype),
                              options.grad_recv_topk_weights.defined() ? " and weight gradients" : "");
    EPX_RETURN_IF_ERROR(check_expanded_capacity(rows, y.dtype(), kOp));
  } else if (rows > 0 && !detail::check_outside_combine_region(y, local().combine, combine_bytes()).is_ok()) {
    return invalid_argument("y_expanded overlaps this Buffer's combine region but is not the view "
                            "combine_expanded_input returned; keep the expanded rows elsewhere or write them there");
  }
  EPX_RETURN_IF_ERROR(pick_weights(weights, h.num_recv, h.topk, h.recv_topk_weights, h.has_weights, kOp, w));
  const TensorView partial_view = TensorView::contiguous(local().combine, partial_dtype, {h.num_recv, config.hidden});
  return validate_combine(partial_view, h, out, options);
}

// The weights of this rank's rows in place, beside them, for their readers.
void Buffer::Impl::publish_holder_weights(const detail::HandleData& h, const float* w) {
  if (h.num_recv == 0) return;  // w may be null then
  std::memcpy(local().combine_slots, w, sizeof(float) * static_cast<std::size_t>(h.num_recv) * h.topk);
}

Status Buffer::combine_expanded_blocking(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                    const TensorView& weights, const CombineOptions& options) {
  Impl& m = *impl_;
  Status local_status = m.check_handle(handle, kOp);
  const detail::HandleData& h = handle_data_or_empty(handle);
  const float* w = nullptr;
  if (options.weights_at == CombineWeights::kReceiver) {
    if (local_status.is_ok()) local_status = m.check_receiver_combine(y_expanded, h, out, weights, options, &w);
    if (local_status.is_ok()) m.place_expanded_rows(y_expanded, handle);
    return m.combine_receiver(local_status, y_expanded, h, out, w);
  }
  if (local_status.is_ok()) local_status = m.check_holder_combine(y_expanded, h, out, weights, options, &w);
  const bool in_place = local_status.is_ok() && m.holder_rows_in_place(y_expanded);
  TensorView partial_view =
      TensorView::contiguous(m.local().combine, options.partial_dtype, {h.num_recv, m.config.hidden});
  if (in_place) {
    m.place_expanded_rows(y_expanded, handle);  // publishes row_of; the rows are there already
    m.publish_holder_weights(h, w);
  } else if (local_status.is_ok()) {
    partial_view = TensorView::contiguous(m.combine_for_writing(), options.partial_dtype, {h.num_recv, m.config.hidden});
    write_expanded_partials(h, y_expanded, w, partial_view);
  }
  if (options.partial_dtype != DType::kF32 || options.grad_recv_topk_weights.defined())
    return m.combine_impl(local_status, partial_view, h, out, options, kOp);
  return m.combine_holder(local_status, y_expanded, h, out, options);
}

// Exchanges the header and describes how each holder of this node left its share.
Status Buffer::Impl::gather_holders(Status local_status, const TensorView& y, const detail::HandleData& h,
                                    bool in_place, const Deadline& deadline, std::vector<HolderRows>* holders) {
  const DType rows_dtype = in_place ? y.dtype() : DType::kF32;
  std::vector<int64_t> all;
  EPX_RETURN_IF_ERROR(gather_header(local_status,
                                    {static_cast<int64_t>(rows_dtype), in_place ? kHolderInPlace : kHolderPartials,
                                     h.dispatch_seq},
                                    &all, kOp, deadline));
  const std::size_t stride = all.size() / num_ranks;
  EPX_RETURN_IF_ERROR(check_same_dispatch(all, stride, 3, kOp));
  holders->assign(num_ranks, {});
  for (int r = 0; r < num_ranks; ++r) {
    const int64_t flag = all[r * stride + 2];
    const auto dtype = static_cast<DType>(all[r * stride + 1]);
    if ((flag != kHolderInPlace && flag != kHolderPartials) || !is_payload_dtype(dtype))
      return invalid_argument("combine_expanded inputs differ between ranks: rank {} weighs by the holder with f32 "
                              "partials and rank {} {}", rank, r,
                              flag == 2 ? "weighs by the receiver" : "sends bf16 partials or asks for weight gradients");
    if (!topology.same_node(r, rank)) continue;
    HolderRows& v = (*holders)[r];
    v.in_place = flag == kHolderInPlace;
    v.combine = regions[r].combine;
    v.row_of = regions[r].combine_rows;
    v.weights = regions[r].combine_slots;
    v.dtype = dtype;
    v.row_bytes = static_cast<std::size_t>(config.hidden) * (v.in_place ? dtype_size(dtype) : sizeof(float));
    v.topk = h.topk;
  }
  return Status::ok();
}

Status Buffer::Impl::combine_holder(Status local_status, const TensorView& y, const detail::HandleData& h,
                                    const TensorView& out, const CombineOptions& options) {
  ScopedSpan span(config.tracer, rank, std::string(kOp));
  const Deadline deadline = Deadline::after(config.timeout);
  start_op();
  std::vector<HolderRows> holders;
  EPX_RETURN_IF_ERROR(
      gather_holders(local_status, y, h, local_status.is_ok() && holder_rows_in_place(y), deadline, &holders));
  SendGroup sends(transport, deadline, kOp);
  EPX_RETURN_IF_ERROR(hierarchical ? send_node_sums(h, holders, sends) : send_holder_partials(h, holders, sends));
  std::vector<int64_t> stage_first;
  EPX_RETURN_IF_ERROR(recv_partials(h, &stage_first, deadline));
  sum_holder_parts(h, holders, stage_first, out, options.bias);
  EPX_RETURN_IF_ERROR(sends.finish());
  // No rank may overwrite its combine region while a peer still reads it.
  return close_op(deadline);
}

// Flat: to each source rank on another node, this rank's partials of its
// tokens: from the region, or summed from the rows in place into a message.
Status Buffer::Impl::send_holder_partials(const detail::HandleData& h, const std::vector<HolderRows>& holders,
                                          SendGroup& sends) {
  const int R = num_ranks, H = config.hidden;
  const std::size_t prow = static_cast<std::size_t>(H) * sizeof(float);
  const HolderRows& me = holders[rank];
  int64_t staged = 0;
  for (int s = 0; s < R; ++s)
    if (me.in_place && !topology.same_node(s, rank)) staged += h.counts[static_cast<std::size_t>(s) * R + rank];
  EPX_RETURN_IF_ERROR(send_payload.reserve(staged * prow, "the combine partials for other nodes"));
  PartScratch scratch(1, h.topk);
  std::byte* next = send_payload.data();
  for (int s = 0; s < R; ++s) {
    const int64_t n = h.counts[static_cast<std::size_t>(s) * R + rank];
    if (topology.same_node(s, rank) || n == 0) continue;
    const int64_t base = block_base(h, R, s, rank);
    if (!me.in_place) {
      EPX_RETURN_IF_ERROR(sends.post(s, kTagCombine, {me.combine + base * prow, n * prow}));
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {
      scratch.clear();
      const detail::HolderPart& p = scratch.add(me, base + i);
      detail::weighted_partial(next + i * prow, DType::kF32, p.rows, p.weights, p.num_rows, p.row_dtype, H);
    }
    EPX_RETURN_IF_ERROR(sends.post(s, kTagCombine, {next, n * prow}));
    next += n * prow;
  }
  return Status::ok();
}

// Two-hop, as forwarder: to the same-local-rank peer of each other node, the
// sum over this node's holders (ascending) of their partials of its tokens.
Status Buffer::Impl::send_node_sums(const detail::HandleData& h, const std::vector<HolderRows>& holders,
                                    SendGroup& sends) {
  const int H = config.hidden;
  const std::size_t prow = static_cast<std::size_t>(H) * sizeof(float);
  int64_t fwd_rows = 0;
  std::vector<int64_t> fwd_first(num_nodes, 0);
  for (int n = 0; n < num_nodes; ++n) {
    fwd_first[n] = fwd_rows;
    if (n != node) fwd_rows += h.node_counts[static_cast<std::size_t>(topology.rank_of(n, local_rank)) * num_nodes + node];
  }
  EPX_RETURN_IF_ERROR(send_payload.reserve(fwd_rows * prow, "the combine rows reduced for other nodes"));
  const detail::RowStores stores =
      detail::row_stores_for(static_cast<std::size_t>(fwd_rows) * prow * static_cast<std::size_t>(ranks_per_node));
  PartScratch scratch(ranks_per_node, h.topk);
  for (int n = 0; n < num_nodes; ++n) {
    const int s = topology.rank_of(n, local_rank);
    const int64_t rows = n == node ? 0 : h.node_counts[static_cast<std::size_t>(s) * num_nodes + node];
    if (rows == 0) continue;
    const std::vector<int32_t>& fwd_row = h.forward.row[n];
    std::byte* part = send_payload.data() + fwd_first[n] * prow;
    for (int64_t j = 0; j < rows; ++j) {
      scratch.clear();
      for (int l = 0; l < ranks_per_node; ++l) {
        const int32_t row = fwd_row[j * ranks_per_node + l];
        if (row < 0) continue;
        scratch.add(holders[topology.rank_of(node, l)], row);
        scratch.group_from(scratch.num_parts - 1);  // each holder on its own, as the receiver adds them
      }
      detail::sum_parts(part + j * prow, DType::kF32, scratch.group_span(), nullptr, DType::kF32, H, stores);
    }
    if (stores == detail::RowStores::kStreamed) detail::finish_streamed_rows();  // before the peer reads them
    EPX_RETURN_IF_ERROR(sends.post(s, kTagCombine, {part, rows * prow}));
  }
  return Status::ok();
}

// The partials of this rank's tokens from other nodes, staged in recv_payload
// by holder (flat) or node (two-hop) from (*stage_first)[i] (-1: none).
Status Buffer::Impl::recv_partials(const detail::HandleData& h, std::vector<int64_t>* stage_first,
                                   const Deadline& deadline) {
  const int R = num_ranks;
  const std::size_t prow = static_cast<std::size_t>(config.hidden) * sizeof(float);
  auto rows_from = [&](int i) {
    return hierarchical ? h.node_counts[static_cast<std::size_t>(rank) * num_nodes + i]
                        : h.counts[static_cast<std::size_t>(rank) * R + i];
  };
  stage_first->assign(hierarchical ? num_nodes : R, -1);
  int64_t total = 0;
  for (int i = 0; i < static_cast<int>(stage_first->size()); ++i) {
    const bool remote = hierarchical ? i != node : !topology.same_node(i, rank);
    if (remote && rows_from(i) > 0) (*stage_first)[i] = total, total += rows_from(i);
  }
  EPX_RETURN_IF_ERROR(recv_payload.reserve(total * prow, "the combine rows from other nodes"));
  for (int i = 0; i < static_cast<int>(stage_first->size()); ++i) {
    if ((*stage_first)[i] < 0) continue;
    const int peer = hierarchical ? topology.rank_of(i, local_rank) : i;
    const std::size_t bytes = rows_from(i) * prow;
    EPX_ASSIGN_OR_RETURN(std::size_t got,
                         recv_from(peer, kTagCombine, {recv_payload.data() + (*stage_first)[i] * prow, bytes}, deadline));
    EPX_RETURN_IF_ERROR(expect_size(got, bytes, peer, "combine rows"));
  }
  return Status::ok();
}

// out[t] = the sum over t's holders in rank order (two-hop: per node, in node
// order) of their partials (+ bias), docs/design.md's order.
void Buffer::Impl::sum_holder_parts(const detail::HandleData& h, const std::vector<HolderRows>& holders,
                                    const std::vector<int64_t>& stage_first, const TensorView& out,
                                    const TensorView& bias) const {
  const int R = num_ranks, H = config.hidden;
  const std::size_t prow = static_cast<std::size_t>(H) * sizeof(float);
  std::vector<int64_t> d_base(R, 0), next(stage_first.size(), 0);
  for (int d = 0; d < R; ++d) d_base[d] = block_base(h, R, rank, d);
  PartScratch scratch(R, h.topk);
  for (int t = 0; t < h.num_tokens; ++t) {
    const int32_t* send_row = h.send_row.data() + static_cast<std::size_t>(t) * R;
    scratch.clear();
    for (int n = 0; n < (hierarchical ? num_nodes : R); ++n) {
      const int first = scratch.num_parts;
      if (!hierarchical) {  // one group per holder, ascending rank
        if (send_row[n] < 0) continue;
        if (topology.same_node(n, rank)) scratch.add(holders[n], send_row[n]);
        else scratch.add_partial(recv_payload.data() + (stage_first[n] + send_row[n] - d_base[n]) * prow);
      } else if (n == node) {  // this node's holders, summed on their own
        for (int l = 0; l < ranks_per_node; ++l)
          if (const int d = topology.rank_of(n, l); send_row[d] >= 0) scratch.add(holders[d], send_row[d]);
      } else {  // a remote node's partial, if the token went there
        bool goes = false;
        for (int l = 0; l < ranks_per_node && !goes; ++l) goes = send_row[topology.rank_of(n, l)] >= 0;
        if (goes) scratch.add_partial(recv_payload.data() + (stage_first[n] + next[n]++) * prow);
      }
      scratch.group_from(first);
    }
    detail::sum_parts(out.row<std::byte>(t), out.dtype(), scratch.group_span(),
                      bias.defined() ? bias.row<std::byte>(t) : nullptr, bias.dtype(), H);
  }
}

}  // namespace epx
