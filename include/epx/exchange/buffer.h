// Buffer: dispatch and combine for one rank, on any Transport.
//
// A Buffer owns the peer-mapped receive and combine regions of its rank,
// sized once from a BufferConfig, and runs the exchange contract of
// docs/design.md:
//
//  - dispatch: rank r receives one row per (source token, rank r) pair,
//    deduplicated, ordered by (source rank, source token index), with the
//    token's top-k ids translated to r's local expert ids (-1 where the
//    expert lives elsewhere), its weights (0 there), its source, and
//    per-local-expert counts. Inside a node every source writes straight into
//    its peers' receive regions (one copy per (token, rank)); across nodes a
//    token crosses once per destination node, to the rank with the same local
//    rank, which forwards it inside its node (two-hop).
//  - combine: out[t] = sum over the ranks r holding t of y_r[row of t],
//    accumulated in fp32: flat, in ascending rank order; hierarchical, per
//    node in ascending rank order, then over nodes in ascending node order.
//    The same inputs on the same topology give the same bits on every run.
//  - backward: the gradient of dispatch is a combine, the gradient of
//    combine a cached dispatch.
//
// All ranks call each operation in the same order, each rank from one thread
// (the Buffers of one transport share its message tags: never drive two of
// them at once). Inputs are checked on the calling rank before anything is
// sent; a rank that rejects its input makes the others return Aborted; a peer
// that never arrives makes the others return DeadlineExceeded after
// `timeout`. Ranks that pass handles of different dispatches all get
// InvalidArgument.
//
// Lifetimes: recv_x (and the views dispatch_cached, combine_backward and
// combine_expanded_backward return) live in the rank's receive region and are
// overwritten by the next dispatch-like call of any kind; the combine_input
// view is overwritten by the next combine-like call. Copy what must survive.
//
//   epx::BufferConfig config{.num_experts = 256, .hidden = 7168, .dtype = epx::DType::kBF16,
//                            .max_tokens_per_rank = 4096};
//   EPX_ASSIGN_OR_RETURN(auto buffer, epx::Buffer::create(transport, config));
//   epx::DispatchResult recv;
//   EPX_RETURN_IF_ERROR(buffer->dispatch({.x = x, .topk_idx = idx, .topk_weights = w}, &recv));
//   ... experts turn recv.recv_x into y, ideally written straight into
//       buffer->combine_input(recv.handle, dtype) ...
//   EPX_RETURN_IF_ERROR(buffer->combine(y, recv.handle, out));
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/core/clock.h"
#include "epx/core/fp8.h"
#include "epx/core/tensor.h"
#include "epx/core/trace.h"
#include "epx/exchange/layout.h"
#include "epx/exchange/placement.h"

namespace epx {

enum class DispatchAlgorithm : uint8_t {
  kAuto,          // hierarchical when the topology has more than one node
  kFlat,          // every (token, rank) pair travels directly, messages across nodes
  kHierarchical,  // two-hop: once per (token, node), forwarded inside the node
};

struct BufferConfig {
  int num_experts = 0;
  int hidden = 0;                      // elements per row
  DType dtype = DType::kBF16;          // dispatch payload: kF32, kBF16 or kFP8E4M3 (see fp8 below)
  // fp8 payloads (dtype = kFP8E4M3, hidden a multiple of 128): dispatch takes
  // x in bf16 or f32 and quantises each row on send (epx/core/fp8.h), one scale
  // per 128 channels of this format travelling in the row; recv_x is e4m3 and
  // recv_scales its scales. Combine stays bf16/f32; the backward passes
  // (combine_backward, combine_expanded_backward) carry gradients in
  // gradient_dtype.
  Fp8ScaleFormat fp8_scales = Fp8ScaleFormat::kF32;
  // fp8 Buffers: the dtype of the gradients the backward passes send, kBF16
  // or kF32 (the receive region then has room for rows of that size; each
  // operation moves only its own rows' bytes). Unset: the backward passes
  // are refused. Other Buffers: unset or dtype.
  std::optional<DType> gradient_dtype = std::nullopt;
  int max_topk = 8;                    // widest topk_idx accepted
  int max_tokens_per_rank = 0;         // inputs with more tokens are rejected
  int64_t max_recv_tokens = 0;         // rows one rank can receive; 0: num_ranks * max_tokens_per_rank
  int expert_alignment = 1;            // per-expert counts and expanded segments round up to this
  DType max_combine_dtype = DType::kF32;  // widest combine input; kBF16 halves the combine region
  // Rows of max_combine_dtype the combine region holds, when more than the
  // receive rows (max_recv_tokens): room for the expanded rows of a
  // receiver-weighted combine_expanded (one per (received token, local
  // expert), padding included; bf16 rows take half a f32 row). 0: the
  // receive rows only.
  int64_t max_expanded_rows = 0;
  std::optional<ExpertPlacement> placement;  // default: contiguous blocks of E / R
  DispatchAlgorithm algorithm = DispatchAlgorithm::kAuto;
  Milliseconds timeout{30000};         // for each whole operation
  Tracer* tracer = nullptr;            // spans "dispatch", "combine", ... per rank when set
  // Record who waited for whom (WaitRecord) in every operation. On by
  // default (it costs a timestamp in the header and one in the closing sync);
  // off only to measure that cost. Every rank must pass the same.
  bool record_waits = true;
};

// Who one rank waited for in exchange operations, per rank s of the
// Buffer's transport, in seconds (docs/operations.md, "Metrics: who waited
// for whom"):
//  - arrival[s]: this rank had arrived at an operation and waited for s to
//    arrive. Each rank stamps its arrival on the system clock into the
//    header the ranks exchange first; the wait is s's stamp minus this
//    rank's, clamped to [0, the time this rank spent in that exchange].
//    Exact between processes of one host; across hosts as good as their
//    clock sync (NTP: about a millisecond, PTP: microseconds).
//  - data[s]: both had arrived and this rank was blocked on s's data: in the
//    receives of s's rows (two-hop: s is the peer that sent or forwarded
//    them) and in the closing sync, where ranks exchange "done" stamps in
//    place of a barrier and the wait for s is clamped as above.
// blocked is the time this rank was blocked on others in all: the longest
// arrival wait, every receive, the closing sync's longest wait; so
// blocked >= arrival[s] + data[s] for every s. Never counts this rank itself.
struct WaitRecord {
  std::vector<double> arrival, data;  // [num_ranks]
  double blocked = 0;
  int64_t num_ops = 0;  // operations summed
  void clear(int num_ranks);  // zeros of num_ranks entries
  // Adds `other` (an empty record takes its size; sizes must match).
  WaitRecord& operator+=(const WaitRecord& other);
};

// What one rank moved in one operation.
struct ExchangeStats {
  int64_t rows_sent = 0;                  // (token, destination rank) pairs from this rank
  int64_t rows_received = 0;              // rows this rank ended with
  int64_t intra_node_payload_bytes = 0;   // row bytes this rank copied inside its node
  int64_t inter_node_payload_bytes = 0;   // row bytes this rank sent to other nodes
  int64_t inter_node_meta_bytes = 0;      // routing metadata sent with them
  double seconds = 0;
  WaitRecord waits;                       // empty when BufferConfig::record_waits is off
};

namespace detail {
struct HandleData;
struct PendingState;
class OperationQueue;
}

// What a dispatch decided: the routes, counts and receive metadata. Combine,
// the backward passes and a cached re-dispatch take it and skip the layout
// and count exchange. Cheap to copy (shared, immutable).
class Handle {
 public:
  Handle() = default;
  explicit Handle(std::shared_ptr<const detail::HandleData> data) : data_(std::move(data)) {}
  [[nodiscard]] bool valid() const { return data_ != nullptr; }
  [[nodiscard]] int num_tokens() const;         // tokens this rank dispatched
  [[nodiscard]] int64_t num_recv_tokens() const;  // rows this rank received
  [[nodiscard]] int topk() const;
  [[nodiscard]] const detail::HandleData& data() const { return *data_; }

 private:
  friend class Buffer;  // keeps a weak reference to a handle whose rows it holds
  std::shared_ptr<const detail::HandleData> data_;
};

struct DispatchInputs {
  TensorView x;             // [T, H] of config.dtype (fp8 Buffers: bf16 or f32)
  TensorView topk_idx;      // [T, K] i32 global expert ids, -1 = none
  TensorView topk_weights;  // optional [T, K] f32
};

struct DispatchResult {
  // [num_recv, H], in this rank's receive region: valid until the next
  // dispatch (cached or not) on this Buffer. fp8: e4m3 codes, rows
  // recv_x.stride(0) bytes apart, and recv_scales [num_recv, H / 128] (f32
  // or ue8m0) in the same rows; dequantize_fp8(recv_x, recv_scales, out)
  // turns them into bf16 or f32. Undefined recv_scales for bf16 / f32.
  TensorView recv_x;
  TensorView recv_scales;
  // The rest lives in the handle and stays valid as long as it does.
  TensorView recv_topk_idx;      // [num_recv, K] i32 local ids, -1 where the expert is elsewhere
  TensorView recv_topk_weights;  // [num_recv, K] f32, 0 where -1; undefined without input weights
  TensorView recv_src_rank;      // [num_recv] i32
  TensorView recv_src_idx;       // [num_recv] i32 token index on the source rank
  std::vector<int32_t> num_recv_tokens_per_expert;  // [E_local], each rounded up to expert_alignment
  Handle handle;
  ExchangeStats stats;
};

// Where combine_expanded applies the top-k weights.
enum class CombineWeights : uint8_t {
  // Each holder rank sums w * y over its local slots into one partial per
  // (token, rank), rounded to partial_dtype, and the receiver sums the
  // partials in rank order (node order, two-hop).
  kHolder,
  // Holders leave each expert's output row unweighted, in y's dtype, in
  // their combine region (the expanded layout); each receiver sums
  // w[t, k] * y[t, k] in fp32 over k = 0..K-1 with its own dispatched
  // weights, one rounding to out's dtype. The bits depend on neither the
  // number of ranks nor which rank holds which expert. Flat path only
  // (two-hop Buffers: InvalidArgument); no bias, no weight gradients, and
  // partial_dtype stays f32.
  kReceiver,
};

struct CombineOptions {
  TensorView bias;  // optional [T, H], f32 or the output dtype, added after the sum
  // Optional dispatch-backward of the weights: grad_recv_topk_weights
  // [num_recv, K] f32 in, grad_topk_weights [T, K] f32 out; slot k of token t
  // takes the value from the rank holding expert topk_idx[t][k] (0 for -1).
  TensorView grad_recv_topk_weights;
  TensorView grad_topk_weights;
  // combine_expanded only: the dtype its per-(token, rank) partial rows are
  // rounded to and sent in, f32 (exact) or bf16 (half the bytes, each partial
  // rounded once); no wider than max_combine_dtype; every rank passes the same.
  DType partial_dtype = DType::kF32;
  // combine_expanded only: where the weights are applied; every rank passes
  // the same.
  CombineWeights weights_at = CombineWeights::kHolder;
};

// The expanded per-expert layout of one rank's received rows: one row per
// (received token, local expert), grouped by local expert in receive order,
// each group padded to expert_alignment with zero rows.
struct ExpandedLayout {
  std::vector<int64_t> expert_offsets;        // [E_local + 1]: group e is rows [offsets[e], offsets[e+1])
  std::vector<int32_t> num_tokens_per_expert; // [E_local], before padding
  std::vector<int64_t> row_of;                // [num_recv, K]: expanded row of (row, slot k), -1 if not local
  std::vector<int64_t> recv_row;              // [num_rows]: received row of each expanded row, -1 = padding
  [[nodiscard]] int64_t num_rows() const { return expert_offsets.empty() ? 0 : expert_offsets.back(); }
};

// An exchange operation started by one of Buffer's *_async calls. It runs on
// the Buffer's progress thread, so it moves on whatever the caller does
// meanwhile; wait() returns its status. Cheap to copy; a default PendingOp
// is finished and OK.
class PendingOp {
 public:
  PendingOp() = default;
  explicit PendingOp(std::shared_ptr<detail::PendingState> state) : state_(std::move(state)) {}
  // Whether the operation has finished (wait() would not block).
  [[nodiscard]] bool done() const;
  // The operation's status once it has finished. DeadlineExceeded if it has
  // not finished by `deadline`: it is still running (its own deadline is
  // BufferConfig::timeout from when it started), so wait again.
  [[nodiscard]] Status wait(const Deadline& deadline) const;
  // Waits until the latest moment the operation can end (its timeout, and
  // those of the operations queued before it): never longer, never hangs.
  [[nodiscard]] Status wait() const;

 private:
  std::shared_ptr<detail::PendingState> state_;
};

class Buffer {
 public:
  // Collective: every rank of `transport` calls it with the same config.
  static Result<std::unique_ptr<Buffer>> create(Transport& transport, BufferConfig config);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  [[nodiscard]] const BufferConfig& config() const;
  [[nodiscard]] const ExpertPlacement& placement() const;
  [[nodiscard]] int num_local_experts() const;
  // True when dispatch and combine take the two-hop path.
  [[nodiscard]] bool hierarchical() const;

  // Validates and computes the layout of topk_idx (no communication).
  [[nodiscard]] Result<DispatchLayout> get_layout(const TensorView& topk_idx) const;

  // Dispatch (collective). `layout`, when given, must be get_layout(topk_idx)
  // (checked: InvalidArgument otherwise). On an error `*out` is unspecified.
  [[nodiscard]] Status dispatch(const DispatchInputs& inputs, DispatchResult* out,
                                const DispatchLayout* layout = nullptr);
  // Re-sends new rows along the routes of `handle` (same tokens, same routing):
  // no layout, no count exchange. `recv_x` gets a view like DispatchResult::recv_x.
  [[nodiscard]] Status dispatch_cached(const TensorView& x, const Handle& handle, TensorView* recv_x);
  // fp8 Buffers: the scales of the rows in the receive region (those of the
  // last dispatch or dispatch_cached), like DispatchResult::recv_scales.
  // FailedPrecondition for bf16 / f32 Buffers.
  [[nodiscard]] Result<TensorView> recv_scales(const Handle& handle) const;

  // A [num_recv, H] view of `dtype` in this rank's combine region. Experts
  // that write their output there save combine one copy.
  [[nodiscard]] Result<TensorView> combine_input(const Handle& handle, DType dtype);
  // Combine (collective): y [num_recv, H] (f32 or bf16, rows in receive
  // order) -> out [T, H] of the caller's dtype.
  [[nodiscard]] Status combine(const TensorView& y, const Handle& handle, const TensorView& out,
                               const CombineOptions& options = {});

  // Backward of dispatch: grad_x [T, H] = combine(grad_recv_x), and through
  // options the gradient of the top-k weights.
  [[nodiscard]] Status dispatch_backward(const TensorView& grad_recv_x, const Handle& handle,
                                         const TensorView& grad_x, const CombineOptions& options = {});
  // Backward of combine: grad_y = the cached dispatch of grad_out (payload
  // dtype); a view of the receive region, so it replaces the forward recv_x.
  [[nodiscard]] Status combine_backward(const TensorView& grad_out, const Handle& handle, TensorView* grad_y);

  // The expanded layout of `handle`, built on first use and kept in the
  // handle: valid as long as the handle is. The handle must be valid.
  [[nodiscard]] const ExpandedLayout& expanded_layout(const Handle& handle) const;
  // Copies received rows into the expanded layout: out [layout.num_rows(), H]
  // of recv_x's dtype (bf16 or f32: dequantise fp8 rows first), padding rows
  // zero. Local; no communication.
  [[nodiscard]] Status expand(const TensorView& recv_x, const Handle& handle, const TensorView& out) const;
  // Weighted combine over the expanded layout (collective): each rank first
  // sums w[row, k] * y[row_of(row, k)] over its local slots in top-k order in
  // fp32 and rounds that partial once to options.partial_dtype (f32: exact;
  // bf16: to nearest even, half the bytes), then the partial rows are
  // combined as by combine() (an fp32 sum in the fixed order). `weights` is [num_recv, K]
  // f32; undefined means the dispatched recv_topk_weights.
  //
  // With options.weights_at = kReceiver the weights are applied by the
  // receiver (see CombineWeights): y_expanded (bf16 or f32) is copied into
  // the combine region unless it is already the view combine_expanded_input
  // returned, and `weights`, when given, is [T, K] f32 of this rank's own
  // tokens (undefined: the weights this rank dispatched).
  [[nodiscard]] Status combine_expanded(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                        const TensorView& weights = {}, const CombineOptions& options = {});
  // A [expanded rows, H] view of `dtype` (bf16 or f32) in this rank's
  // combine region, for a receiver-weighted combine_expanded: experts that
  // write y there save combine its copy. InvalidArgument naming the rows
  // needed and the rows the region holds when it is too small (raise
  // BufferConfig::max_expanded_rows). Overwritten by the next combine-like
  // call, except that combine_expanded_backward still finds it (below).
  [[nodiscard]] Result<TensorView> combine_expanded_input(const Handle& handle, DType dtype);

  // Backward of combine_expanded (collective): grad_out [T, H] of the payload
  // dtype comes back along the dispatch routes (a cached dispatch), then
  // locally grad_y_expanded[row_of(row, k)] = w[row, k] * grad_out[token of row]
  // (f32, padding rows 0) and, when grad_weights [num_recv, K] f32 is given,
  // grad_weights[row, k] = <grad_out[token], y_expanded[row_of(row, k)]>
  // summed in column order (0 where the slot is not local). `weights` as in
  // combine_expanded. Overwrites recv_x like any dispatch.
  //
  // y_expanded may be the combine_expanded_input view a receiver-weighted
  // combine_expanded of this handle read: when a later combine-like call
  // overwrote the region, that call first kept a copy of those rows with the
  // handle, and the backward reads the copy. The backward is the rows' last
  // reader: after it nothing is kept for the handle, and a second backward
  // with that view, like any other y_expanded inside the combine region,
  // returns FailedPrecondition.
  [[nodiscard]] Status combine_expanded_backward(const TensorView& grad_out, const Handle& handle,
                                                 const TensorView& y_expanded, const TensorView& weights,
                                                 const TensorView& grad_y_expanded,
                                                 const TensorView& grad_weights = {});

  // Asynchronous forms. Each queues the operation on this Buffer's progress
  // thread (one per Buffer, started on first use) and returns at once; the
  // operations of a Buffer run one at a time in the order they were issued,
  // and a blocking call first waits for those already queued. The result is
  // bit for bit the blocking form's. Until wait() returns, the arguments
  // (inputs, handles' routes, outputs) must stay valid and unchanged, and
  // the caller must not read the outputs nor use the transport for anything
  // else (its collectives would interleave with the operation's). Errors are
  // those of the blocking form, returned by wait(); a rank that never calls
  // wait() still completes the operation for its peers.
  [[nodiscard]] PendingOp dispatch_async(const DispatchInputs& inputs, DispatchResult* out,
                                         const DispatchLayout* layout = nullptr);
  [[nodiscard]] PendingOp dispatch_cached_async(const TensorView& x, const Handle& handle, TensorView* recv_x);
  [[nodiscard]] PendingOp combine_async(const TensorView& y, const Handle& handle, const TensorView& out,
                                        const CombineOptions& options = {});
  [[nodiscard]] PendingOp dispatch_backward_async(const TensorView& grad_recv_x, const Handle& handle,
                                                  const TensorView& grad_x, const CombineOptions& options = {});
  [[nodiscard]] PendingOp combine_backward_async(const TensorView& grad_out, const Handle& handle,
                                                 TensorView* grad_y);
  [[nodiscard]] PendingOp combine_expanded_async(const TensorView& y_expanded, const Handle& handle,
                                                 const TensorView& out, const TensorView& weights = {},
                                                 const CombineOptions& options = {});
  [[nodiscard]] PendingOp combine_expanded_backward_async(const TensorView& grad_out, const Handle& handle,
                                                          const TensorView& y_expanded, const TensorView& weights,
                                                          const TensorView& grad_y_expanded,
                                                          const TensorView& grad_weights = {});

  // Split forms: send now, receive later, any work in between (one split
  // dispatch and one split combine outstanding at a time). dispatch_send
  // starts the dispatch (the peers' rows arrive while the caller works);
  // dispatch_recv waits for it, with `deadline`, and hands out its result.
  // FailedPrecondition for a receive without a send or a second send before
  // the receive. DeadlineExceeded from a receive leaves the operation
  // outstanding: receive again.
  [[nodiscard]] Status dispatch_send(const DispatchInputs& inputs, const DispatchLayout* layout = nullptr);
  [[nodiscard]] Status dispatch_recv(DispatchResult* out, const Deadline& deadline);
  [[nodiscard]] Status combine_send(const TensorView& y, const Handle& handle, const TensorView& out,
                                    const CombineOptions& options = {});
  [[nodiscard]] Status combine_recv(const Deadline& deadline);

  // Adds the waits of every operation finished since the last call (all
  // kinds: blocking, asynchronous, split, backward) into `*sum`, then starts
  // anew. Nothing when record_waits is off. Call it between operations, or
  // after wait() of the asynchronous ones to be counted.
  void take_waits(WaitRecord* sum);

  // Bytes of peer-mapped memory this rank holds.
  [[nodiscard]] std::size_t region_bytes() const;
  // What region_bytes() will be for `config` on `num_ranks` ranks, computed
  // by the same carving as create(), before anything is allocated;
  // saturates at INT64_MAX for sizes no machine has.
  [[nodiscard]] static int64_t estimate_region_bytes(const BufferConfig& config, int num_ranks);
  // The max_expanded_rows that makes room for every receiver-weighted
  // combine_expanded with y of `y_dtype` on `num_ranks` ranks: the worst
  // case, max_recv rows times min(max_topk, local experts) plus each local
  // expert's alignment padding, in rows of max_combine_dtype.
  [[nodiscard]] static int64_t expanded_rows_bound(const BufferConfig& config, int num_ranks, DType y_dtype);

 private:
  struct Impl;
  struct Split;
  explicit Buffer(std::unique_ptr<Impl> impl);
  // create() without its guard (which turns an exception into a Status).
  static Result<std::unique_ptr<Buffer>> create_unguarded(Transport& transport, BufferConfig config);
  // The blocking operations themselves (the public forms first wait for the
  // queued asynchronous ones).
  Status dispatch_blocking(const DispatchInputs& inputs, DispatchResult* out, const DispatchLayout* layout);
  Status dispatch_cached_blocking(const TensorView& x, const Handle& handle, TensorView* recv_x);
  Result<TensorView> combine_input_blocking(const Handle& handle, DType dtype);
  Result<TensorView> combine_expanded_input_blocking(const Handle& handle, DType dtype);
  Status combine_blocking(const TensorView& y, const Handle& handle, const TensorView& out, const CombineOptions& options);
  Status dispatch_backward_blocking(const TensorView& grad_recv_x, const Handle& handle, const TensorView& grad_x,
                               const CombineOptions& options);
  Status combine_backward_blocking(const TensorView& grad_out, const Handle& handle, TensorView* grad_y);
  Status combine_expanded_blocking(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                              const TensorView& weights, const CombineOptions& options);
  Status combine_expanded_backward_blocking(const TensorView& grad_out, const Handle& handle, const TensorView& y_expanded,
                                       const TensorView& weights, const TensorView& grad_y_expanded,
                                       const TensorView& grad_weights);
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<Split> split_;
  // The blocking and asynchronous forms' queue. Declared last, destroyed
  // first: queued operations finish before the memory they use goes away.
  std::unique_ptr<detail::OperationQueue> ops_;
};

}  // namespace epx
