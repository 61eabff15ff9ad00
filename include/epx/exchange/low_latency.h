// LowLatencyBuffer: the low-latency dispatch and combine for decode steps.
//
// Every shape is fixed when the buffer is made and never depends on the
// routing, so a decode step can be replayed as is:
//
//  - dispatch: one row per (token, destination rank), with the (local
//    expert, k) pairs it goes to there, and no count exchange before the
//    payload. Source s writes its rows for rank d into d's inbox s (inside a
//    node) or sends them as one message (across nodes), then publishes its
//    per-expert counts with the call's sequence number (in the message
//    header across nodes). Every rank hears from every rank in every call,
//    even with no rows, so the counts travel with the payload and a rank with
//    no tokens needs nothing special. The owner then copies each row into
//    the rows of each of its experts the row names, sources in ascending
//    rank: recv_x [E_local, R * capacity, H] holds, for local expert e, rows
//    [0, num_recv_tokens_per_expert[e]) in (source rank, source token)
//    order, the same bits on every run.
//  - combine: y [E_local, R * capacity, H] (the experts' output, rows in
//    recv_x's order; it may be recv_x itself) goes back row by row, one per
//    (token, expert), into slot (token, k) of the source's combine region
//    (a source's own experts' rows are read from y in place); the source computes
//    out[t] = sum over k ascending of w[t][k] * y(t, k) in fp32 (slots with
//    expert -1 skipped), then one rounding to out's dtype.
//
// Memory is bounded by `capacity`, the rows one source rank may send one
// local expert in one call (default max_tokens_per_rank: the worst case). A
// call in which some source has more rows than that for some expert sends no
// rows from that source and returns ResourceExhausted on every rank, naming
// the expert, the count and the capacity; nothing is written past the
// region, and the next call works.
//
// Calls are collective and alternate: dispatch, combine, dispatch, ... A
// call that follows one of its own kind (a dispatch after a failed or
// un-combined dispatch, a combine after a combine) starts with a barrier, so
// no peer overwrites a signal or an inbox still in use. recv_x and the other
// views stay valid until this rank's next dispatch (peers write into this
// rank's inboxes, never into recv_x), so y may be recv_x itself.
// Inputs are checked on the calling rank; a rank that rejects its input
// still signals every peer, which returns Aborted, and the next call works.
// A failure in the middle of a call (a deadline, a peer that aborted)
// poisons the buffer and the transport: every later call returns Aborted.
//
// Each rank drives its buffer from one thread. The low-latency buffers of a
// transport share its message tags (110 and 111, apart from Buffer's): never
// drive two of them at once.
//
// Nothing is allocated after create(): regions and staging are sized for
// the worst case the config allows.
//
//   epx::LowLatencyConfig config{.num_experts = 256, .hidden = 7168, .max_tokens_per_rank = 128,
//                                .capacity = 32};
//   EPX_ASSIGN_OR_RETURN(auto ll, epx::LowLatencyBuffer::create(transport, config));
//   epx::LowLatencyDispatchResult recv;
//   EPX_RETURN_IF_ERROR(ll->dispatch({.x = x, .topk_idx = idx, .topk_weights = w}, &recv));
//   ... experts turn recv.recv_x into y [E_local, R * capacity, H] ...
//   EPX_RETURN_IF_ERROR(ll->combine(y, recv.handle, out));
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "epx/comm/transport.h"
#include "epx/core/clock.h"
#include "epx/core/tensor.h"
#include "epx/exchange/buffer.h"
#include "epx/exchange/placement.h"

namespace epx {

struct LowLatencyConfig {
  int num_experts = 0;
  int hidden = 0;                     // elements per row
  DType dtype = DType::kBF16;         // dispatch payload: kF32 or kBF16
  int max_tokens_per_rank = 0;        // inputs with more tokens are rejected
  int max_topk = 8;                   // widest topk_idx accepted
  int capacity = 0;                   // rows per (local expert, source rank); 0: max_tokens_per_rank
  DType max_combine_dtype = DType::kF32;  // widest y accepted by combine
  std::optional<ExpertPlacement> placement;  // default: contiguous blocks of E / R
  Milliseconds timeout{30000};        // for each whole operation
  // Combine sends one row per (token, rank) instead of one per (token,
  // expert): the owner sums w[t][k] * y(t, k) over the token's slots k that
  // name its experts (k ascending, fp32, from 0) and rounds the sum once to
  // y's dtype; the source adds those rows in fp32 in the order of each
  // rank's first slot k. Dispatch carries the weights to the owners. Other
  // bits than the default's top-k sum (a rounding per (token, rank) when y
  // is bf16, another order), the normal mode's combine bytes.
  bool combine_per_rank = false;
};

// Names one dispatch; combine takes the latest one's.
struct LowLatencyHandle {
  uint64_t buffer_id = 0;
  int64_t seq = 0;  // the dispatch's number, equal on every rank
  [[nodiscard]] bool valid() const { return seq > 0; }
};

struct LowLatencyDispatchInputs {
  TensorView x;             // [T, H] of config.dtype, T <= max_tokens_per_rank (may be 0)
  TensorView topk_idx;      // [T, K] i32 global expert ids, -1 = none, no expert twice in a row
  TensorView topk_weights;  // optional [T, K] f32, used by combine; 1 when left out
};

// Views into the buffer, valid until the next dispatch.
struct LowLatencyDispatchResult {
  TensorView recv_x;                      // [E_local, R * capacity, H] of config.dtype
  TensorView num_recv_tokens_per_expert;  // [E_local] i32: valid rows of each expert
  TensorView recv_src_rank;               // [E_local, R * capacity] i32, -1 past the count
  TensorView recv_src_idx;                // token index on the source rank
  TensorView recv_src_slot;               // k: the slot of topk_idx that named this expert
  LowLatencyHandle handle;
  ExchangeStats stats;  // rows_sent: (token, destination rank) rows; rows_received: (token, expert) rows
};

class LowLatencyBuffer {
 public:
  // Collective: every rank of `transport` calls it with the same config.
  static Result<std::unique_ptr<LowLatencyBuffer>> create(Transport& transport, LowLatencyConfig config);
  ~LowLatencyBuffer();
  LowLatencyBuffer(const LowLatencyBuffer&) = delete;
  LowLatencyBuffer& operator=(const LowLatencyBuffer&) = delete;

  [[nodiscard]] const LowLatencyConfig& config() const;
  [[nodiscard]] const ExpertPlacement& placement() const;
  [[nodiscard]] int num_local_experts() const;
  // Rows per local expert in recv_x: num_ranks * capacity.
  [[nodiscard]] int64_t rows_per_expert() const;

  // Dispatch (collective). On an error `*out` is unspecified.
  [[nodiscard]] Status dispatch(const LowLatencyDispatchInputs& inputs, LowLatencyDispatchResult* out);
  // Combine (collective): y [E_local, R * capacity, H] (f32 or bf16, no wider
  // than max_combine_dtype; only rows below each expert's count are read)
  // -> out [T, H] (f32 or bf16) of the latest dispatch's tokens.
  [[nodiscard]] Status combine(const TensorView& y, const LowLatencyHandle& handle, const TensorView& out);

  // Asynchronous forms, as Buffer's (buffer.h): queued on this buffer's
  // progress thread, run in issue order, the blocking forms' bits and
  // errors (from PendingOp::wait); a blocking call first waits for the
  // queued ones. Send now, compute, receive with wait(): the peers' rows
  // arrive whatever the caller does meanwhile. Keep the arguments alive and
  // unchanged, and leave the transport alone, until wait() returns.
  [[nodiscard]] PendingOp dispatch_async(const LowLatencyDispatchInputs& inputs, LowLatencyDispatchResult* out);
  [[nodiscard]] PendingOp combine_async(const TensorView& y, const LowLatencyHandle& handle, const TensorView& out);

  // Bytes of peer-mapped memory and of private staging this rank holds.
  [[nodiscard]] std::size_t region_bytes() const;
  // Not while an asynchronous operation is queued (they resize the staging).
  [[nodiscard]] std::size_t staging_bytes() const;

 private:
  struct Impl;
  explicit LowLatencyBuffer(std::unique_ptr<Impl> impl);
  // create() without its guard (which turns an exception into a Status).
  static Result<std::unique_ptr<LowLatencyBuffer>> create_unguarded(Transport& transport, LowLatencyConfig config);
  Status dispatch_blocking(const LowLatencyDispatchInputs& inputs, LowLatencyDispatchResult* out);
  Status combine_blocking(const TensorView& y, const LowLatencyHandle& handle, const TensorView& out);
  std::unique_ptr<Impl> impl_;
  // Declared last, destroyed first: queued operations finish first.
  std::unique_ptr<detail::OperationQueue> ops_;
};

}  // namespace epx
