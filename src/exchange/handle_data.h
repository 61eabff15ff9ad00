// Private: what a dispatch records for combine, backward and cached re-dispatch.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "epx/exchange/buffer.h"

namespace epx::detail {

// Two-hop forwarding done by this rank for the peers with its local rank on
// the other nodes, indexed by source node. row[n][j * ranks_per_node + l] is
// the row that message row j from node n took on local rank l (-1: none);
// slot[n][j * K + k] is the local rank holding slot k's expert (-1: none).
struct ForwardPlan {
  std::vector<std::vector<int32_t>> row;
  std::vector<std::vector<int32_t>> slot;
};

// Which dispatch made a handle, and of what: what a backend decides before
// it knows the counts (the CUDA backend passes it to fill_dispatch_result).
struct HandleIdentity {
  uint64_t buffer_id = 0;
  // Which dispatch of its Buffer made it: the same number on every rank, so
  // ranks passing handles of different dispatches are caught.
  int64_t dispatch_seq = 0;
  int rank = 0;
  int num_tokens = 0;
  int topk = 0;
  bool has_weights = false;
};

struct HandleData : HandleIdentity {

  // counts[s * R + d]: tokens rank s sends to rank d (deduplicated).
  std::vector<int32_t> counts;
  // node_counts[s * N + n]: tokens rank s sends to node n (deduplicated).
  std::vector<int32_t> node_counts;
  // send_row[t * R + d]: row of this rank's token t on rank d, or -1.
  std::vector<int32_t> send_row;
  // topk_rank[t * K + k]: rank holding the expert of slot k of token t, or -1.
  std::vector<int32_t> topk_rank;
  // [T, K]: the weights this rank dispatched (has_weights), for a
  // receiver-weighted combine_expanded.
  std::vector<float> topk_weights;

  ForwardPlan forward;

  // What this rank received, in receive order.
  int64_t num_recv = 0;
  std::vector<int32_t> recv_src_rank;
  std::vector<int32_t> recv_src_idx;
  std::vector<int32_t> recv_topk_idx;    // [num_recv, K] local ids
  std::vector<float> recv_topk_weights;  // [num_recv, K]
  std::vector<int32_t> num_recv_tokens_per_expert;  // aligned
  int num_local_experts = 0;
  int expert_alignment = 1;

  // The expanded layout, built on first use (most dispatches never need it).
  [[nodiscard]] const ExpandedLayout& expanded() const;
  // Forgets the expanded layout, for a handle whose storage is reused.
  void reset_expanded() {
    expanded_ready_ = false;
    y_spill.clear();
  }

  // The expanded rows a receiver-weighted combine_expanded of this handle
  // read from the combine region, copied here by the Buffer before a later
  // call overwrote them (empty: never overwritten); rows of y_spill_dtype.
  // Written and read only by the Buffer's operations, which run one at a time.
  mutable std::vector<std::byte> y_spill;
  mutable DType y_spill_dtype = DType::kF32;

 private:
  mutable std::mutex expanded_mutex_;
  mutable bool expanded_ready_ = false;
  mutable ExpandedLayout expanded_;
};

}  // namespace epx::detail
