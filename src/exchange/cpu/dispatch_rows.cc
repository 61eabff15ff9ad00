// Buffer::Impl::move_rows, the dispatch's data movement: this rank's rows
// (and, for a full dispatch, their metadata) to every destination, straight
// into same-node regions, through messages across nodes, forwarding what
// arrives for this node in two-hop mode.
#include <cstring>

#include "exchange/cpu/buffer_impl.h"

namespace epx {

using buffer_detail::expect_size;
using buffer_detail::kTagMeta;
using buffer_detail::kTagPayload;
using buffer_detail::RemoteTarget;
using buffer_detail::RowMove;
using buffer_detail::SendGroup;
using buffer_detail::TokenRun;

Status Buffer::Impl::move_rows(const TensorView& x, const TensorView* topk_idx, const TensorView* topk_weights,
                               const detail::HandleData& h, detail::ForwardPlan* plan, const Deadline& deadline,
                               ExchangeStats* stats) {
  const int R = num_ranks;
  const int mw = topk_idx ? meta_words(h.topk, h.has_weights) : 0;
  int64_t rows_out = 0;  // rows this rank's tokens make, as every rank of the node writes at once
  for (int d = 0; d < R; ++d) rows_out += h.counts[static_cast<std::size_t>(rank) * R + d];
  const RowMove m{.x = x,
                  .topk_idx = topk_idx,
                  .topk_weights = topk_weights,
                  .h = h,
                  .meta_bytes = static_cast<std::size_t>(mw) * 4,
                  .stores = detail::row_stores_for(static_cast<std::size_t>(rows_out) * row_bytes *
                                                   static_cast<std::size_t>(ranks_per_node)),
                  .deadline = deadline,
                  .stats = stats};
  copy_rows_inside_node(m);
  SendGroup sends(transport, deadline, "dispatch");
  EPX_RETURN_IF_ERROR(send_rows_to_other_nodes(m, sends));
  EPX_RETURN_IF_ERROR(hierarchical ? receive_and_forward(m, plan) : receive_from_other_nodes(m));
  if (m.stores == detail::RowStores::kStreamed) detail::finish_streamed_rows();
  return sends.finish();
}

// Inside the node: one copy per (token, rank), straight into the destination's region.
void Buffer::Impl::copy_rows_inside_node(const RowMove& m) {
  const int R = num_ranks, K = m.h.topk;
  for (int t = 0; t < m.h.num_tokens; ++t) {
    const std::byte* src = m.x.row<std::byte>(t);
    for (int l = 0; l < ranks_per_node; ++l) {
      const int d = topology.rank_of(node, l);
      const int32_t row = m.h.send_row[static_cast<std::size_t>(t) * R + d];
      if (row < 0) continue;
      detail::copy_row(regions[d].recv_x + static_cast<std::size_t>(row) * row_bytes, src, row_bytes, m.stores);
      if (m.with_meta())
        write_meta(d, row, K, t, m.topk_idx->row<int32_t>(t), m.topk_weights ? m.topk_weights->row<float>(t) : nullptr);
      ++m.stats->rows_sent;
      m.stats->intra_node_payload_bytes += static_cast<int64_t>(row_bytes);
    }
  }
}

// The remote destinations of this rank's rows, with their row counts and
// staging offsets; target_of maps a destination rank to its target.
std::vector<RemoteTarget> Buffer::Impl::remote_targets(const detail::HandleData& h, std::vector<int>* target_of) const {
  const int R = num_ranks;
  std::vector<RemoteTarget> targets;
  target_of->assign(R, -1);
  for (int d = 0; d < R; ++d) {
    if (topology.same_node(d, rank)) continue;
    const int n = topology.node_of(d);
    if (hierarchical) {
      const int peer = topology.rank_of(n, local_rank);
      if (d == topology.rank_of(n, 0))
        targets.push_back({peer, 0, h.node_counts[static_cast<std::size_t>(rank) * num_nodes + n]});
    } else {
      targets.push_back({d, 0, h.counts[static_cast<std::size_t>(rank) * R + d]});
    }
    (*target_of)[d] = static_cast<int>(targets.size()) - 1;
  }
  int64_t staged = 0;
  for (RemoteTarget& tg : targets) {
    tg.first_row = staged;
    staged += tg.num_rows;
  }
  return targets;
}

// Copies the rows of staged (not direct) targets, and every target's
// metadata, into the staging buffers; returns the rows staged per target.
std::vector<int64_t> Buffer::Impl::stage_remote_rows(const RowMove& m, const std::vector<RemoteTarget>& targets,
                                                     const std::vector<TokenRun>& runs) {
  const int K = m.h.topk;
  std::vector<int64_t> fill(targets.size(), 0);
  for (const TokenRun& run : runs) {
    const RemoteTarget& tg = targets[run.target];
    for (int t = run.first_token; t < run.first_token + run.num_tokens; ++t) {
      const int64_t slot = tg.first_row + fill[run.target]++;
      if (!tg.direct)
        detail::copy_row(send_payload.data() + slot * row_bytes, m.x.row<std::byte>(t), row_bytes, m.stores);
      if (m.with_meta()) {
        auto* meta = reinterpret_cast<int32_t*>(send_meta.data() + slot * m.meta_bytes);
        meta[0] = t;
        std::memcpy(meta + 1, m.topk_idx->row<int32_t>(t), sizeof(int32_t) * K);
        if (m.h.has_weights) std::memcpy(meta + 1 + K, m.topk_weights->row<float>(t), sizeof(float) * K);
      }
    }
  }
  return fill;
}

// Across nodes: stages rows per remote target (or sends runs of x as they
// are, where a message costs less than the copy) and posts the sends.
Status Buffer::Impl::send_rows_to_other_nodes(const RowMove& m, SendGroup& sends) {
  std::vector<int> target_of;
  std::vector<RemoteTarget> targets = remote_targets(m.h, &target_of);
  std::vector<TokenRun> runs;
  plan_remote_runs(m.h, target_of, &targets, &runs);
  const bool contiguous = m.x.ndim() == 2 && m.x.row_stride_bytes() == row_bytes;
  int64_t staged = 0;
  for (RemoteTarget& tg : targets) {
    tg.direct = contiguous && direct_send_pays(tg);
    staged += tg.num_rows;
  }
  EPX_RETURN_IF_ERROR(send_payload.reserve(static_cast<std::size_t>(staged) * row_bytes, "the rows to other nodes"));
  EPX_RETURN_IF_ERROR(send_meta.reserve(static_cast<std::size_t>(staged) * m.meta_bytes, "the metadata to other nodes"));
  const std::vector<int64_t> fill = stage_remote_rows(m, targets, runs);
  if (m.stores == detail::RowStores::kStreamed) detail::finish_streamed_rows();  // before the peers read them
  // Direct targets get their rows as runs straight from x, in token order.
  for (const TokenRun& run : runs) {
    if (!targets[run.target].direct) continue;
    const std::size_t n = static_cast<std::size_t>(run.num_tokens);
    EPX_RETURN_IF_ERROR(
        sends.post(targets[run.target].peer, kTagPayload, {m.x.row<std::byte>(run.first_token), n * row_bytes}));
  }
  for (std::size_t ti = 0; ti < targets.size(); ++ti) {
    const RemoteTarget& tg = targets[ti];
    EPX_CHECK_EQ(fill[ti], tg.num_rows);
    if (tg.num_rows == 0) continue;
    const std::size_t n = static_cast<std::size_t>(tg.num_rows);
    if (!tg.direct)
      EPX_RETURN_IF_ERROR(sends.post(tg.peer, kTagPayload, {send_payload.data() + tg.first_row * row_bytes, n * row_bytes}));
    m.stats->inter_node_payload_bytes += static_cast<int64_t>(n * row_bytes);
    if (m.with_meta()) {
      EPX_RETURN_IF_ERROR(
          sends.post(tg.peer, kTagMeta, {send_meta.data() + tg.first_row * m.meta_bytes, n * m.meta_bytes}));
      m.stats->inter_node_meta_bytes += static_cast<int64_t>(n * m.meta_bytes);
    }
    if (!hierarchical) m.stats->rows_sent += tg.num_rows;
  }
  return Status::ok();
}

// Flat: each remote source's block lands in place; its metadata is unpacked.
Status Buffer::Impl::receive_from_other_nodes(const RowMove& m) {
  const int R = num_ranks, K = m.h.topk;
  for (int s = 0; s < R; ++s) {
    if (topology.same_node(s, rank)) continue;
    const int64_t n = m.h.counts[static_cast<std::size_t>(s) * R + rank];
    if (n == 0) continue;
    const int64_t base = block_base(m.h, R, s, rank);
    EPX_RETURN_IF_ERROR(recv_rows(s, {local().recv_x + base * row_bytes, n * row_bytes}, m.deadline));
    if (!m.with_meta()) continue;
    EPX_RETURN_IF_ERROR(recv_meta.reserve(n * m.meta_bytes, "the dispatch metadata from another node"));
    EPX_ASSIGN_OR_RETURN(std::size_t got, recv_from(s, kTagMeta, {recv_meta.data(), n * m.meta_bytes}, m.deadline));
    EPX_RETURN_IF_ERROR(expect_size(got, n * m.meta_bytes, s, "dispatch metadata"));
    for (int64_t j = 0; j < n; ++j) {
      const auto* meta = reinterpret_cast<const int32_t*>(recv_meta.data() + j * m.meta_bytes);
      write_meta(rank, base + j, K, meta[0], meta + 1,
                 m.h.has_weights ? reinterpret_cast<const float*>(meta + 1 + K) : nullptr);
    }
  }
  return Status::ok();
}

// Two-hop: which ranks of this node each of the n rows forwarded by source
// rank s (of node src_node) goes to, and at which row: ascending local rank,
// rows in source order. Reads the rows' metadata from recv_meta.
void Buffer::Impl::plan_forwarded_rows(const RowMove& m, int s, int src_node, int64_t n,
                                       detail::ForwardPlan& plan) {
  const int R = num_ranks, K = m.h.topk;
  std::vector<int64_t> next_row(R);
  for (int l = 0; l < ranks_per_node; ++l) {
    const int d = topology.rank_of(node, l);
    next_row[d] = block_base(m.h, R, s, d);
  }
  std::vector<int32_t>& fwd_row = plan.row[src_node];
  fwd_row.assign(static_cast<std::size_t>(n) * ranks_per_node, -1);
  std::vector<int32_t>& fwd_slot = plan.slot[src_node];
  fwd_slot.assign(static_cast<std::size_t>(n) * K, -1);
  for (int64_t j = 0; j < n; ++j) {
    const auto* meta = reinterpret_cast<const int32_t*>(recv_meta.data() + j * m.meta_bytes);
    for (int k = 0; k < K; ++k) {
      const int32_t e = meta[1 + k];
      if (e < 0 || !topology.same_node(placement.rank_of(e), rank)) continue;
      fwd_slot[j * K + k] = topology.local_rank_of(placement.rank_of(e));
    }
    for (int k = 0; k < K; ++k) {
      const int l = fwd_slot[j * K + k];
      if (l < 0 || fwd_row[j * ranks_per_node + l] >= 0) continue;
      fwd_row[j * ranks_per_node + l] = 0;  // marked; numbered below in rank order
    }
    for (int l = 0; l < ranks_per_node; ++l) {
      if (fwd_row[j * ranks_per_node + l] < 0) continue;
      const int d = topology.rank_of(node, l);
      fwd_row[j * ranks_per_node + l] = static_cast<int32_t>(next_row[d]++);
    }
  }
}

// Two-hop: copies the n rows received from src_node (in recv_payload, their
// metadata in recv_meta) to the ranks of this node that fwd_row names.
void Buffer::Impl::forward_rows(const RowMove& m, const std::vector<int32_t>& fwd_row, int64_t n) {
  const int K = m.h.topk;
  for (int64_t j = 0; j < n; ++j) {
    const std::byte* src = recv_payload.data() + j * row_bytes;
    const auto* meta = m.with_meta() ? reinterpret_cast<const int32_t*>(recv_meta.data() + j * m.meta_bytes) : nullptr;
    for (int l = 0; l < ranks_per_node; ++l) {
      const int32_t row = fwd_row[j * ranks_per_node + l];
      if (row < 0) continue;
      const int d = topology.rank_of(node, l);
      detail::copy_row(regions[d].recv_x + static_cast<std::size_t>(row) * row_bytes, src, row_bytes, m.stores);
      if (meta)
        write_meta(d, row, K, meta[0], meta + 1, m.h.has_weights ? reinterpret_cast<const float*>(meta + 1 + K) : nullptr);
      m.stats->intra_node_payload_bytes += static_cast<int64_t>(row_bytes);
    }
  }
}

// Two-hop: rows from the same-local-rank peers of the other nodes are
// forwarded to every rank of this node that holds one of their experts. A
// full dispatch plans the forwarding (into `plan`); a cached one follows h.forward.
Status Buffer::Impl::receive_and_forward(const RowMove& m, detail::ForwardPlan* plan) {
  const int R = num_ranks;
  if (plan) {
    plan->row.assign(num_nodes, {});
    plan->slot.assign(num_nodes, {});
  }
  const detail::ForwardPlan& forward = plan ? *plan : m.h.forward;
  for (int src_node = 0; src_node < num_nodes; ++src_node) {
    if (src_node == node) continue;
    const int s = topology.rank_of(src_node, local_rank);
    const int64_t n = m.h.node_counts[static_cast<std::size_t>(s) * num_nodes + node];
    if (n == 0) continue;
    EPX_RETURN_IF_ERROR(recv_payload.reserve(n * row_bytes, "the rows forwarded from another node"));
    EPX_RETURN_IF_ERROR(recv_rows(s, {recv_payload.data(), n * row_bytes}, m.deadline));
    if (plan) {
      EPX_RETURN_IF_ERROR(recv_meta.reserve(n * m.meta_bytes, "the metadata forwarded from another node"));
      EPX_ASSIGN_OR_RETURN(std::size_t got, recv_from(s, kTagMeta, {recv_meta.data(), n * m.meta_bytes}, m.deadline));
      EPX_RETURN_IF_ERROR(expect_size(got, n * m.meta_bytes, s, "forwarded dispatch metadata"));
      plan_forwarded_rows(m, s, src_node, n, *plan);
    }
    forward_rows(m, forward.row[src_node], n);
  }
  // Rows this rank's tokens make on other nodes, counted at the source.
  for (int t = 0; t < m.h.num_tokens; ++t)
    for (int d = 0; d < R; ++d)
      if (!topology.same_node(d, rank) && m.h.send_row[static_cast<std::size_t>(t) * R + d] >= 0) ++m.stats->rows_sent;
  return Status::ok();
}

}  // namespace epx
