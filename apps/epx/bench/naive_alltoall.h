// The baseline a user would otherwise write: Megatron's all-to-all token
// dispatcher, on an epx Transport.
//
// Dispatch replicates each token once per (token, expert) pair, packs the
// copies by destination rank (then local expert, then token) into this
// rank's peer-mapped send region, exchanges the sizes with one all-to-all
// and the payload with one all-to-all-v (inside a node each receiver copies
// its slices out of its peers' send regions; across nodes the slices travel
// as messages), and sorts the received chunks into expert-major order.
// Combine reverses it: expert-major rows back to rank-major, all-to-all-v
// back, and out[t] = sum over k of w[t, k] * row(t, k), accumulated in fp32
// in top-k order.
//
// It is a reference for speed, not a library API: it keeps the routes of the
// last dispatch for the next combine, like Megatron's dispatcher object.
//
//   EPX_ASSIGN_OR_RETURN(auto naive, epx::bench::NaiveAllToAll::create(transport, config));
//   epx::bench::NaiveDispatchResult recv;
//   EPX_RETURN_IF_ERROR(naive->dispatch(x, topk_idx, &recv));
//   EPX_RETURN_IF_ERROR(naive->combine(recv.recv_x, topk_weights, out));
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/core/buffer.h"
#include "epx/core/clock.h"
#include "epx/core/tensor.h"
#include "epx/exchange/placement.h"

namespace epx::bench {

struct NaiveConfig {
  int num_experts = 0;
  int hidden = 0;
  DType dtype = DType::kBF16;  // payload: kF32 or kBF16
  int max_topk = 8;
  // (token, expert) pairs one rank may send or receive in one call; the same
  // on every rank. The three row buffers are this many rows each.
  int64_t max_rows = 0;
  std::optional<ExpertPlacement> placement{};  // default: contiguous blocks of E / R
  Milliseconds timeout{30000};
};

struct NaiveDispatchResult {
  // [num_recv_rows, H] in this rank's private buffer, grouped by local
  // expert, then source rank, then source token: valid until the next call.
  TensorView recv_x;
  std::vector<int64_t> num_recv_tokens_per_expert;  // [E_local]
  int64_t rows_sent = 0;      // (token, expert) pairs this rank sent
  int64_t rows_received = 0;  // pairs it received
};

class NaiveAllToAll {
 public:
  // Collective: maps the send regions. ResourceExhausted/InvalidArgument on a bad config.
  static Result<std::unique_ptr<NaiveAllToAll>> create(Transport& transport, NaiveConfig config);
  // Bytes one rank allocates for `config` (three buffers of max_rows rows).
  [[nodiscard]] static std::size_t bytes_needed(const NaiveConfig& config);
  ~NaiveAllToAll();
  NaiveAllToAll(const NaiveAllToAll&) = delete;
  NaiveAllToAll& operator=(const NaiveAllToAll&) = delete;

  // Collective. x [T, H] of config.dtype, topk_idx [T, K] i32 (-1 = none).
  [[nodiscard]] Status dispatch(const TensorView& x, const TensorView& topk_idx, NaiveDispatchResult* out);
  // Collective, along the routes of the last dispatch. y [num_recv_rows, H]
  // of config.dtype in the order of recv_x (it may be recv_x itself);
  // topk_weights [T, K] f32 or undefined (all 1); out [T, H] of config.dtype.
  [[nodiscard]] Status combine(const TensorView& y, const TensorView& topk_weights, const TensorView& out);

  // Two private buffers of max_rows rows, free between calls: scratch for the
  // memcpy reference so a benchmark need not allocate twice.
  [[nodiscard]] std::span<std::byte> scratch(int i) const;
  [[nodiscard]] std::size_t bytes() const;

 private:
  NaiveAllToAll(Transport& transport, NaiveConfig config, ExpertPlacement placement);
  // Aborts the transport with `status` (peers stop waiting) and returns it.
  Status fail(Status status);
  // Dispatch steps, in order.
  [[nodiscard]] Status check_dispatch(const TensorView& x, const TensorView& topk_idx) const;
  [[nodiscard]] std::vector<int64_t> count_pairs(const TensorView& topk_idx) const;
  std::vector<int64_t> plan_send(const std::vector<int64_t>& counts);
  void pack(const TensorView& x, const TensorView& topk_idx, std::vector<int64_t>& cursor);
  [[nodiscard]] Status exchange_sizes(const std::vector<int64_t>& counts, const Deadline& deadline);
  template <typename Fn>
  void for_each_chunk(Fn&& fn) const;
  [[nodiscard]] Status exchange(const std::byte* send_base, const std::vector<int64_t>& send_offset,
                                const std::vector<int64_t>& send_rows, std::byte* recv_base,
                                const std::vector<int64_t>& recv_offset, const std::vector<int64_t>& recv_rows,
                                const std::vector<int64_t>& peer_offset, int tag, const Deadline& deadline);

  Transport& transport_;
  NaiveConfig config_;
  ExpertPlacement placement_;
  std::size_t row_bytes_ = 0;
  int max_local_experts_ = 0;
  std::unique_ptr<PeerMemory> send_region_;  // rank-major send rows, readable by the node's peers
  AlignedBuffer recv_rows_;                  // rank-major received rows (dispatch), returned rows (combine)
  AlignedBuffer sorted_rows_;                // expert-major received rows

  // Routes of the last dispatch.
  bool dispatched_ = false;
  int num_tokens_ = 0;
  int topk_ = 0;
  std::vector<int64_t> slot_row_;         // [T, K]: send row of (t, k), -1 for none
  std::vector<int64_t> send_offset_;      // [R] first send row for rank d
  std::vector<int64_t> send_rows_;        // [R]
  std::vector<int64_t> recv_offset_;      // [R] first rank-major row from rank s
  std::vector<int64_t> recv_rows_count_;  // [R]
  std::vector<int64_t> recv_chunk_;       // [R, max_local_experts] rows from s for local expert j
  std::vector<int64_t> peer_send_offset_; // [R] where rank s put my rows in its send region
  int64_t num_recv_ = 0;
};

}  // namespace epx::bench
