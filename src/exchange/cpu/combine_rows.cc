// Buffer::Impl::combine_impl, the combine's data movement: each holder puts
// its rows in its combine region, same-node tokens read them there, remote
// ones get them as messages (flat: per holder; two-hop: summed per node by
// the forwarder first), and every token's rows are summed in the documented
// order: holders by ascending rank (flat) or one group per node, ascending.
#include <cstring>

#include "exchange/cpu/buffer_impl.h"

namespace epx {

using buffer_detail::CombineMove;
using buffer_detail::expect_size;
using buffer_detail::kTagCombine;
using buffer_detail::kTagCombineSlots;
using buffer_detail::Region;
using buffer_detail::SendGroup;

Status Buffer::Impl::combine_impl(Status local_status, const TensorView& y, const detail::HandleData& h,
                                  const TensorView& out, const CombineOptions& options, std::string_view op) {
  ScopedSpan span(config.tracer, rank, std::string(op));
  const Deadline deadline = Deadline::after(config.timeout);
  const bool slots = local_status.is_ok() && options.grad_recv_topk_weights.defined();
  const DType ydtype = local_status.is_ok() ? y.dtype() : DType::kF32;
  const std::size_t yrow = static_cast<std::size_t>(config.hidden) * dtype_size(ydtype);
  start_op();
  if (local_status.is_ok()) put_in_combine_region(y, h, options, slots, yrow);
  EPX_RETURN_IF_ERROR(gather_combine_header(local_status, ydtype, slots, h, op, deadline));

  CombineMove m{.h = h,
                .options = options,
                .ydtype = ydtype,
                .yrow = yrow,
                .prow = hierarchical ? static_cast<std::size_t>(config.hidden) * sizeof(float) : yrow,
                .slots = slots,
                .deadline = deadline,
                .stage_first = std::vector<int64_t>(hierarchical ? num_nodes : num_ranks, -1)};
  SendGroup sends(transport, deadline, op);
  if (hierarchical) {
    EPX_RETURN_IF_ERROR(reduce_and_send_for_other_nodes(m, sends));
  } else {
    EPX_RETURN_IF_ERROR(send_combine_rows(m, sends));
  }
  EPX_RETURN_IF_ERROR(receive_combine_rows(m));
  sum_tokens(m, out);
  EPX_RETURN_IF_ERROR(sends.finish());
  // No rank may overwrite its combine region while a peer still reads it.
  return close_op(deadline);
}

// Puts y (and the weight gradients' slots) in this rank's combine region, where peers read it.
void Buffer::Impl::put_in_combine_region(const TensorView& y, const detail::HandleData& h,
                                         const CombineOptions& options, bool slots, std::size_t yrow) {
  const Region& mine = local();
  std::byte* region = combine_for_writing();
  if (y.data() != region)
    for (int64_t i = 0; i < h.num_recv; ++i) std::memcpy(region + i * yrow, y.row<std::byte>(i), yrow);
  if (slots)
    for (int64_t i = 0; i < h.num_recv; ++i)
      std::memcpy(mine.combine_slots + i * h.topk, options.grad_recv_topk_weights.row<float>(i),
                  sizeof(float) * h.topk);
}

// The ranks agree on the dispatch, y's dtype and whether weight gradients come.
Status Buffer::Impl::gather_combine_header(const Status& local_status, DType ydtype, bool slots,
                                           const detail::HandleData& h, std::string_view op,
                                           const Deadline& deadline) {
  std::vector<int64_t> all;
  EPX_RETURN_IF_ERROR(gather_header(local_status, {static_cast<int64_t>(ydtype), slots ? 1 : 0, h.dispatch_seq}, &all,
                                    op, deadline));
  const std::size_t stride = all.size() / num_ranks;
  EPX_RETURN_IF_ERROR(check_same_dispatch(all, stride, 3, op));
  for (int r = 0; r < num_ranks; ++r)
    if (all[r * stride + 1] != static_cast<int64_t>(ydtype) || all[r * stride + 2] != (slots ? 1 : 0))
      return invalid_argument("{} inputs differ between ranks: rank {} has y {}{} and rank {} has y {}{}", op, rank,
                              dtype_name(ydtype), slots ? " with weight gradients" : "", r,
                              dtype_name(static_cast<DType>(all[r * stride + 1])),
                              all[r * stride + 2] == 2   ? " weighted by the receiver"
                              : all[r * stride + 2] == 1 ? " with weight gradients"
                              : all[r * stride + 2] != 0 ? " weighted by the holder into f32 partials"
                                                         : "");
  return Status::ok();
}

// Flat: sends each remote source the block of rows this rank holds for it,
// and sets where each remote holder's rows for this rank's tokens will land.
Status Buffer::Impl::send_combine_rows(CombineMove& m, SendGroup& sends) {
  const int R = num_ranks, K = m.h.topk;
  const Region& mine = local();
  for (int s = 0; s < R; ++s) {
    if (topology.same_node(s, rank)) continue;
    const int64_t n = m.h.counts[static_cast<std::size_t>(s) * R + rank];
    if (n == 0) continue;
    const int64_t base = block_base(m.h, R, s, rank);
    EPX_RETURN_IF_ERROR(sends.post(s, kTagCombine, {mine.combine + base * m.yrow, n * m.yrow}));
    if (m.slots)
      EPX_RETURN_IF_ERROR(
          sends.post(s, kTagCombineSlots, std::as_bytes(std::span(mine.combine_slots + base * K, n * K))));
  }
  for (int d = 0; d < R; ++d) {
    if (topology.same_node(d, rank) || m.h.counts[static_cast<std::size_t>(rank) * R + d] == 0) continue;
    m.stage_first[d] = m.stage_rows;
    m.stage_rows += m.h.counts[static_cast<std::size_t>(rank) * R + d];
  }
  return Status::ok();
}

// Two-hop, as forwarder: sums inside this node the rows of each remote
// peer's tokens into one f32 partial per token and sends it; sets where each
// remote node's partials for this rank's tokens will land.
Status Buffer::Impl::reduce_and_send_for_other_nodes(CombineMove& m, SendGroup& sends) {
  const detail::HandleData& h = m.h;
  int64_t fwd_rows = 0;
  std::vector<int64_t> fwd_first(num_nodes, 0);
  for (int n = 0; n < num_nodes; ++n) {
    fwd_first[n] = fwd_rows;
    if (n != node) fwd_rows += h.node_counts[static_cast<std::size_t>(topology.rank_of(n, local_rank)) * num_nodes + node];
  }
  EPX_RETURN_IF_ERROR(send_payload.reserve(fwd_rows * m.prow, "the combine rows reduced for other nodes"));
  // The f32 partials pass the cache at large sizes (117 MB per rank at 4096
  // tokens, hidden 7168): streamed, their lines are not read for ownership.
  const detail::RowStores stores =
      detail::row_stores_for(static_cast<std::size_t>(fwd_rows) * m.prow * static_cast<std::size_t>(ranks_per_node));
  EPX_RETURN_IF_ERROR(
      send_meta.reserve(fwd_rows * h.topk * sizeof(float), "the combine slots reduced for other nodes"));
  for (int n = 0; n < num_nodes; ++n) {
    if (n == node) continue;
    const int s = topology.rank_of(n, local_rank);
    const int64_t rows = h.node_counts[static_cast<std::size_t>(s) * num_nodes + node];
    if (rows == 0) continue;
    auto* part = reinterpret_cast<float*>(send_payload.data()) + fwd_first[n] * config.hidden;
    auto* part_slots = reinterpret_cast<float*>(send_meta.data()) + fwd_first[n] * h.topk;
    sum_node_rows_for(m, n, rows, stores, part, part_slots);
    if (stores == detail::RowStores::kStreamed) detail::finish_streamed_rows();  // before the peer reads them
    EPX_RETURN_IF_ERROR(sends.post(s, kTagCombine, std::as_bytes(std::span(part, rows * config.hidden))));
    if (m.slots)
      EPX_RETURN_IF_ERROR(sends.post(s, kTagCombineSlots, std::as_bytes(std::span(part_slots, rows * h.topk))));
  }
  for (int n = 0; n < num_nodes; ++n) {
    const int64_t rows = h.node_counts[static_cast<std::size_t>(rank) * num_nodes + n];
    if (n == node || rows == 0) continue;
    m.stage_first[n] = m.stage_rows;
    m.stage_rows += rows;
  }
  return Status::ok();
}

// Two-hop: the partials of the `rows` tokens node n's peer forwarded here:
// each the sum of this node's holders' rows (ascending local rank), and
// their weight gradients' slots.
void Buffer::Impl::sum_node_rows_for(const CombineMove& m, int n, int64_t rows, detail::RowStores stores,
                                     float* part, float* part_slots) {
  const int H = config.hidden, K = m.h.topk;
  const std::vector<int32_t>& fwd_row = m.h.forward.row[n];
  std::vector<const std::byte*> holders(ranks_per_node);
  std::vector<detail::SumGroup> groups(ranks_per_node);
  for (int64_t j = 0; j < rows; ++j) {
    int num_groups = 0;
    for (int l = 0; l < ranks_per_node; ++l) {
      const int32_t row = fwd_row[j * ranks_per_node + l];
      if (row < 0) continue;
      holders[num_groups] = regions[topology.rank_of(node, l)].combine + row * m.yrow;
      groups[num_groups] = {&holders[num_groups], 1, m.ydtype};
      ++num_groups;
    }
    detail::sum_row(reinterpret_cast<std::byte*>(part + j * H), DType::kF32, std::span(groups.data(), num_groups),
                    nullptr, DType::kF32, H, stores);
    if (m.slots)
      for (int k = 0; k < K; ++k) {
        const int l = m.h.forward.slot[n][j * K + k];
        part_slots[j * K + k] =
            l < 0 ? 0.0f : regions[topology.rank_of(node, l)].combine_slots[fwd_row[j * ranks_per_node + l] * K + k];
      }
  }
}

// Receives the remote contributions to this rank's tokens into recv_payload
// (and their weight gradients' slots into recv_meta), at m.stage_first.
Status Buffer::Impl::receive_combine_rows(const CombineMove& m) {
  const int K = m.h.topk;
  EPX_RETURN_IF_ERROR(recv_payload.reserve(m.stage_rows * m.prow, "the combine rows from other nodes"));
  EPX_RETURN_IF_ERROR(recv_meta.reserve(m.stage_rows * K * sizeof(float), "the combine slots from other nodes"));
  for (std::size_t i = 0; i < m.stage_first.size(); ++i) {
    if (m.stage_first[i] < 0) continue;
    const int peer = hierarchical ? topology.rank_of(static_cast<int>(i), local_rank) : static_cast<int>(i);
    const int64_t rows = hierarchical ? m.h.node_counts[static_cast<std::size_t>(rank) * num_nodes + i]
                                      : m.h.counts[static_cast<std::size_t>(rank) * num_ranks + i];
    EPX_ASSIGN_OR_RETURN(std::size_t got, recv_from(peer, kTagCombine,
                                                    {recv_payload.data() + m.stage_first[i] * m.prow, rows * m.prow},
                                                    m.deadline));
    EPX_RETURN_IF_ERROR(expect_size(got, rows * m.prow, peer, "combine rows"));
    if (!m.slots) continue;
    EPX_ASSIGN_OR_RETURN(got, recv_from(peer, kTagCombineSlots,
                                        {recv_meta.data() + m.stage_first[i] * K * sizeof(float),
                                         rows * K * sizeof(float)},
                                        m.deadline));
    EPX_RETURN_IF_ERROR(expect_size(got, rows * K * sizeof(float), peer, "combine weight gradients"));
  }
  return Status::ok();
}

// Sums each of this rank's tokens in the documented order into out (plus
// the bias), and gathers its weight gradients when asked.
void Buffer::Impl::sum_tokens(CombineMove& m, const TensorView& out) {
  const int R = num_ranks;
  TokenSums sums{.d_base = std::vector<int64_t>(R, 0),
                 .next = std::vector<int64_t>(m.stage_first.size(), 0),
                 .node_row = std::vector<int64_t>(num_nodes, -1),
                 .rows = std::vector<const std::byte*>(R),
                 .groups = std::vector<detail::SumGroup>(R)};
  for (int d = 0; d < R; ++d) sums.d_base[d] = block_base(m.h, R, rank, d);
  const std::byte* bias = nullptr;
  for (int t = 0; t < m.h.num_tokens; ++t) {
    const int32_t* send_row = m.h.send_row.data() + static_cast<std::size_t>(t) * R;
    const int num_groups = hierarchical ? node_groups(m, send_row, sums) : holder_groups(m, send_row, sums);
    if (m.options.bias.defined()) bias = m.options.bias.row<std::byte>(t);
    detail::sum_row(out.row<std::byte>(t), out.dtype(), std::span(sums.groups.data(), num_groups), bias,
                    m.options.bias.dtype(), config.hidden);
    if (m.slots) gather_weight_gradients(m, t, send_row, sums);
  }
}

// Flat: one group per holder of the token, ascending rank; returns the groups.
int Buffer::Impl::holder_groups(const CombineMove& m, const int32_t* send_row, TokenSums& s) {
  int num_rows = 0;
  for (int d = 0; d < num_ranks; ++d) {
    if (send_row[d] < 0) continue;
    s.rows[num_rows] = topology.same_node(d, rank)
                           ? regions[d].combine + send_row[d] * m.yrow
                           : recv_payload.data() + (m.stage_first[d] + send_row[d] - s.d_base[d]) * m.prow;
    s.groups[num_rows] = {&s.rows[num_rows], 1, m.ydtype};
    ++num_rows;
  }
  return num_rows;
}

// Two-hop: one group per node, ascending: this node's holders, or a remote
// node's partial (its staged row noted in s.node_row); returns the groups.
int Buffer::Impl::node_groups(const CombineMove& m, const int32_t* send_row, TokenSums& s) {
  int num_rows = 0, num_groups = 0;
  for (int n = 0; n < num_nodes; ++n) {
    s.node_row[n] = -1;
    if (n == node) {
      const int first = num_rows;
      for (int l = 0; l < ranks_per_node; ++l) {
        const int d = topology.rank_of(n, l);
        if (send_row[d] >= 0) s.rows[num_rows++] = regions[d].combine + send_row[d] * m.yrow;
      }
      if (num_rows > first) s.groups[num_groups++] = {&s.rows[first], num_rows - first, m.ydtype};
      continue;
    }
    bool goes = false;
    for (int l = 0; l < ranks_per_node && !goes; ++l) goes = send_row[topology.rank_of(n, l)] >= 0;
    if (!goes) continue;
    s.node_row[n] = m.stage_first[n] + s.next[n]++;
    s.rows[num_rows] = recv_payload.data() + s.node_row[n] * m.prow;
    s.groups[num_groups++] = {&s.rows[num_rows++], 1, DType::kF32};
  }
  return num_groups;
}

// Token t's top-k weight gradients, from the slots its holders (or their
// node's forwarder) sent.
void Buffer::Impl::gather_weight_gradients(const CombineMove& m, int t, const int32_t* send_row,
                                           const TokenSums& s) {
  const int K = m.h.topk;
  const auto* staged_slots = reinterpret_cast<const float*>(recv_meta.data());
  float* g = m.options.grad_topk_weights.row<float>(t);
  for (int k = 0; k < K; ++k) {
    const int r = m.h.topk_rank[static_cast<std::size_t>(t) * K + k];
    if (r < 0) {
      g[k] = 0.0f;
    } else if (topology.same_node(r, rank)) {
      g[k] = regions[r].combine_slots[send_row[r] * K + k];
    } else if (hierarchical) {
      g[k] = staged_slots[s.node_row[topology.node_of(r)] * K + k];
    } else {
      g[k] = staged_slots[(m.stage_first[r] + send_row[r] - s.d_base[r]) * K + k];
    }
  }
}

}  // namespace epx
