// Private: the state of one Buffer (Buffer::Impl) and the helpers its
// operations share, for the files that implement them (buffer.cc: dispatch,
// combine and backward; combine_in_place.cc: the layer's combine_expanded).
#pragma once

#include <cstring>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "epx/core/buffer.h"
#include "epx/exchange/buffer.h"
#include "core/bf16_rows.h"
#include "core/guard.h"
#include "epx/core/memory.h"
#include "exchange/backend_state.h"
#include "exchange/config_check.h"
#include "exchange/exchange_plan.h"
#include "exchange/group_checks.h"
#include "exchange/handle_data.h"
#include "exchange/cpu/holder_sums.h"
#include "exchange/payload.h"
#include "exchange/cpu/row_copy.h"
#include "exchange/cpu/row_kernels.h"
#include "exchange/cpu/split_phase_state.h"
#include "exchange/waits.h"

namespace epx {
namespace buffer_detail {

inline constexpr int kTagPayload = 100;
inline constexpr int kTagMeta = 101;
inline constexpr int kTagCombine = 102;
inline constexpr int kTagCombineSlots = 103;


inline bool is_payload_dtype(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16; }

// One rank's peer-mapped region: the receive rows and their metadata, then the
// combine rows and the combine's per-slot values.
struct Region {
  std::byte* recv_x = nullptr;
  int32_t* src_idx = nullptr;
  int32_t* topk_idx = nullptr;     // [max_recv, K] local ids, K = the dispatch's topk
  float* topk_weights = nullptr;   // [max_recv, K]
  std::byte* combine = nullptr;    // [combine_rows, hidden] of the combine's dtype
  float* combine_slots = nullptr;  // [max_recv, K]
  // [max_recv, K]: the expanded row of each received row's slot k (-1: not
  // local), published by a receiver-weighted combine_expanded.
  int32_t* combine_rows = nullptr;

  // Returns the bytes; fills the pointers when base is not null.
  static std::size_t carve(std::byte* base, int64_t max_recv, std::size_t row_bytes, int max_topk,
                           int64_t combine_rows, std::size_t combine_row_bytes, Region* out) {
    Carver c(base);
    const auto rows = static_cast<std::size_t>(max_recv);
    Region r;
    r.recv_x = c.take<std::byte>(rows * row_bytes);
    r.src_idx = c.take<int32_t>(rows);
    r.topk_idx = c.take<int32_t>(rows * max_topk);
    r.topk_weights = c.take<float>(rows * max_topk);
    r.combine = c.take<std::byte>(static_cast<std::size_t>(combine_rows) * combine_row_bytes);
    r.combine_slots = c.take<float>(rows * max_topk);
    r.combine_rows = c.take<int32_t>(rows * max_topk);
    if (out) *out = r;
    return c.bytes();
  }
};

// A remote destination of this rank's rows: a rank of another node (flat) or
// the same-local-rank peer of another node (two-hop), with its rows staged
// contiguously.
struct RemoteTarget {
  int peer = 0;
  int64_t first_row = 0;  // in the staging buffers
  int64_t num_rows = 0;
  int64_t num_runs = 0;  // runs of consecutive tokens its rows make in x
  bool direct = false;   // rows sent as runs straight from x, not staged
};

// Consecutive tokens of x whose rows go to one remote target.
struct TokenRun {
  int target = 0;
  int first_token = 0;
  int num_tokens = 0;
};

// Sending a run costs a message; staging it costs a copy of its bytes. A
// message pays for itself above this many bytes on average (a 14 KB row is
// copied in about a microsecond, about what a message costs the transports).
inline constexpr std::size_t kDirectRunBytes = std::size_t{64} << 10;

// The sends of one operation. An operation that leaves early on an error
// aborts the world, so peers fail at once instead of at their deadlines, and
// waits for every send, so no peer copies from memory this rank reuses.
class SendGroup {
 public:
  SendGroup(Transport& transport, const Deadline& deadline, std::string_view op)
      : transport_(transport), deadline_(deadline), op_(op) {}
  ~SendGroup() {
    if (finished_) return;
    transport_.abort(aborted("rank {} left {} on an error", transport_.rank(), op_));
    for (Request& r : requests_) r.wait(deadline_).ignore();
  }
  SendGroup(const SendGroup&) = delete;
  SendGroup& operator=(const SendGroup&) = delete;

  Status post(int peer, int tag, std::span<const std::byte> data) {
    EPX_ASSIGN_OR_RETURN(Request request, transport_.send_async(peer, tag, data));
    requests_.push_back(std::move(request));
    return Status::ok();
  }
  // Waits for every send; after an error the destructor still cleans up.
  Status finish() {
    for (Request& r : requests_) EPX_RETURN_IF_ERROR(r.wait(deadline_));
    finished_ = true;
    return Status::ok();
  }

 private:
  Transport& transport_;
  Deadline deadline_;
  std::string_view op_;
  std::vector<Request> requests_;
  bool finished_ = false;
};

// What one dispatch's move_rows moves, handed to each of its steps.
struct RowMove {
  const TensorView& x;
  const TensorView* topk_idx;      // null: rows only (a cached dispatch), no metadata
  const TensorView* topk_weights;  // null: no weights
  const detail::HandleData& h;
  std::size_t meta_bytes;  // per row, 0 without metadata
  detail::RowStores stores;
  const Deadline& deadline;
  ExchangeStats* stats;
  [[nodiscard]] bool with_meta() const { return topk_idx != nullptr; }
};

// What one combine_impl moves and sums, handed to each of its steps.
struct CombineMove {
  const detail::HandleData& h;
  const CombineOptions& options;
  DType ydtype;
  std::size_t yrow;  // bytes of a row of y
  std::size_t prow;  // bytes of a row on the wire (two-hop: f32 partials)
  bool slots;        // weight gradients travel with the rows
  const Deadline& deadline;
  std::vector<int64_t> stage_first;  // per remote source rank (flat) or node (two-hop): first staged row, -1: none
  int64_t stage_rows = 0;
};

// A message of the wrong size means the ranks disagree about the routes: a bug
// or a mismatched handle that slipped through; never corrupt memory over it.
inline Status expect_size(std::size_t got, std::size_t expected, int peer, std::string_view what) {
  if (got == expected) return Status::ok();
  return internal_error("{} from rank {} was {} bytes, expected {}", what, peer, got, expected);
}

// The handle's data, or an empty stand-in for a rank whose handle was
// rejected but which still takes part in the collective to tell the others.
inline const detail::HandleData& handle_data_or_empty(const Handle& handle) {
  static const detail::HandleData kEmpty;
  return handle.valid() ? handle.data() : kEmpty;
}

// How a holder of this node left its share of a holder-weighted
// combine_expanded: one f32 partial per received row in its combine region,
// or (in_place) its expanded rows there with row_of and weights published
// beside them, weighed and summed by whoever reads them.
struct HolderRows {
  bool in_place = false;
  const std::byte* combine = nullptr;
  const int32_t* row_of = nullptr;  // [num_recv, K]: expanded row of (received row, slot), -1: elsewhere
  const float* weights = nullptr;   // [num_recv, K]
  DType dtype = DType::kF32;        // of the rows in place
  std::size_t row_bytes = 0;        // of one row in the region (a partial: f32)
  int topk = 0;
  // The holder's part of its received row i; rows and weights (room for K)
  // hold its rows in place.
  [[nodiscard]] detail::HolderPart part(int64_t i, const std::byte** rows, float* weights_out) const;
};

// The top-k weights a weighted combine_expanded (or its backward) applies:
// `weights` when given ([rows, K] f32, dense), else the ones the dispatch
// carried (`dispatched`, when has_weights).
Status pick_weights(const TensorView& weights, int64_t rows, int K, const std::vector<float>& dispatched,
                    bool has_weights, std::string_view op, const float** w);

}  // namespace buffer_detail

struct Buffer::Impl : detail::BackendState<BufferConfig> {
  using BackendState::BackendState;

  bool hierarchical = false;
  int num_nodes = 0;
  int ranks_per_node = 0;
  int node = 0;
  int local_rank = 0;
  int64_t max_recv = 0;
  int64_t combine_rows = 0;  // rows of combine_row_bytes in the combine region
  detail::PayloadFormat payload;  // what a dispatch row holds (fp8: codes + scales)
  detail::PayloadFormat gradients;  // what the backward passes' rows hold (fp8: gradient_dtype)
  std::vector<buffer_detail::Region> regions;  // by rank; only this node's ranks are set

  // Private staging, grown as needed and kept between calls.
  AlignedBuffer send_payload, send_meta, recv_payload, recv_meta;
  AlignedBuffer fp8_stage;  // fp8: this rank's rows, quantised before they are sent
  DispatchLayout layout_scratch;
  // The last dispatch's handle data: reused (its vectors keep their capacity)
  // once nobody else holds it, so steady-state dispatches allocate nothing.
  std::shared_ptr<detail::HandleData> last_handle;
  // Who this rank waited for: the running operation's record, and the sum
  // take_waits hands out (asynchronous operations add to it on the progress
  // thread).
  detail::OpWaits op_waits;
  std::vector<int64_t> stamps;  // every rank's header or sync stamp
  std::mutex waits_mu;
  WaitRecord waits_sum;

  // The receiver-weighted combine_expanded whose expanded rows the combine
  // region holds (its handle and dispatch number), kept with the handle
  // before anything overwrites them.
  std::weak_ptr<const detail::HandleData> pinned_y;
  int64_t pinned_seq = 0;
  int64_t pinned_rows = 0;
  DType pinned_dtype = DType::kF32;

  const buffer_detail::Region& local() const { return regions[rank]; }
  std::size_t combine_bytes() const { return static_cast<std::size_t>(combine_rows) * combine_row_bytes; }
  // The combine region, to be written: the pinned expanded rows go to their
  // handle first (spill_pinned_y). Every writer of the region takes its
  // pointer from here, so none can overwrite rows a backward still needs.
  std::byte* combine_for_writing() {
    spill_pinned_y();
    return local().combine;
  }
  // The backward was the rows' last reader: nothing to keep for `h` any more.
  void release_y(const detail::HandleData& h) {
    if (pinned_y.lock().get() == &h) pinned_y.reset();
    std::vector<std::byte>().swap(h.y_spill);
  }
  void pin_y(const Handle& handle, int64_t rows, DType dtype) {
    pinned_y = handle.data_;
    pinned_seq = handle.data().dispatch_seq;
    pinned_rows = rows;
    pinned_dtype = dtype;
  }
  int meta_words(int topk, bool has_weights) const { return 1 + topk + (has_weights ? topk : 0); }

  // Row offset on rank d of the block that rank s sends it.
  static int64_t block_base(const detail::HandleData& h, int num_ranks, int s, int d) {
    return detail::block_base(h.counts, num_ranks, s, d);
  }

  // Starts recording the waits of an operation (op_waits).
  void start_op() { op_waits.start(config.record_waits, num_ranks, rank); }
  // Exchanges one header per rank whose first word says whether that rank's
  // input was valid; recording waits, its last word is the rank's arrival
  // stamp. Each rank's header is all->size() / num_ranks words. A rank that
  // rejected its input returns its own error; the others return Aborted:
  // nothing is sent by anyone.
  Status gather_header(const Status& local_status, std::vector<int64_t> words, std::vector<int64_t>* all,
                       std::string_view op, const Deadline& deadline) {
    words.insert(words.begin(), local_status.is_ok() ? 0 : 1);
    if (op_waits.on()) words.push_back(op_waits.stamp());
    all->assign(words.size() * num_ranks, 0);
    Stopwatch watch;
    EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const int64_t>(words), std::span<int64_t>(*all), deadline));
    if (!local_status.is_ok()) return local_status;
    for (int r = 0; r < num_ranks; ++r)
      if ((*all)[r * words.size()] != 0)
        return aborted("rank {} rejected its {} input, so no rank sent anything", r, op);
    if (op_waits.on()) {
      stamps.resize(num_ranks);
      for (int r = 0; r < num_ranks; ++r) stamps[r] = (*all)[(r + 1) * words.size() - 1];
      op_waits.header_done(stamps, watch.seconds());
    }
    return Status::ok();
  }
  // transport.recv, its blocked time recorded as a wait for `peer`'s data.
  Result<std::size_t> recv_from(int peer, int tag, std::span<std::byte> out, const Deadline& deadline) {
    const Clock::time_point since = op_waits.on() ? Clock::now() : Clock::time_point();
    Result<std::size_t> got = transport.recv(peer, tag, out, deadline);
    op_waits.received(peer, since);
    return got;
  }
  // The closing sync: no rank goes on before every rank has finished writing
  // into (and reading from) its node's regions. Recording waits, a gather of
  // "done" stamps says who this rank waited for; otherwise a barrier.
  Status close_op(const Deadline& deadline) {
    if (!op_waits.on()) return transport.barrier(deadline);
    const int64_t mine = op_waits.stamp();
    stamps.resize(num_ranks);
    Stopwatch watch;
    EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const int64_t>(&mine, 1), std::span<int64_t>(stamps), deadline));
    op_waits.sync_done(stamps, watch.seconds());
    std::lock_guard lock(waits_mu);
    waits_sum += op_waits.record();
    return Status::ok();
  }

  // Receives `out.size()` bytes of rows from `peer` (buffer_detail::kTagPayload), as one
  // message or as several (a sender sends direct targets' rows as runs).
  Status recv_rows(int peer, std::span<std::byte> out, const Deadline& deadline) {
    std::size_t done = 0;
    while (done < out.size()) {
      EPX_ASSIGN_OR_RETURN(std::size_t got, recv_from(peer, buffer_detail::kTagPayload, out.subspan(done), deadline));
      if (got == 0 || got % row_bytes != 0)
        return internal_error("a dispatch payload message from rank {} was {} bytes, not a positive multiple of the "
                              "{}-byte row; {} of {} bytes had arrived", peer, got, row_bytes, done, out.size());
      done += got;
    }
    return Status::ok();
  }
  // The runs of this rank's tokens per remote target (each token once per
  // target), in token order, and each target's num_runs.
  void plan_remote_runs(const detail::HandleData& h, const std::vector<int>& target_of,
                        std::vector<buffer_detail::RemoteTarget>* targets, std::vector<buffer_detail::TokenRun>* runs) const {
    const int R = num_ranks;
    std::vector<int> last_token(targets->size(), -2);
    std::vector<int64_t> open_run(targets->size(), -1);  // index in *runs
    for (int t = 0; t < h.num_tokens && !targets->empty(); ++t) {
      for (int d = 0; d < R; ++d) {
        const int ti = target_of[d];
        if (ti < 0 || h.send_row[static_cast<std::size_t>(t) * R + d] < 0 || last_token[ti] == t) continue;
        if (last_token[ti] == t - 1) {
          ++(*runs)[open_run[ti]].num_tokens;
        } else {
          open_run[ti] = static_cast<int64_t>(runs->size());
          runs->push_back({ti, t, 1});
          ++(*targets)[ti].num_runs;
        }
        last_token[ti] = t;
      }
    }
  }
  bool direct_send_pays(const buffer_detail::RemoteTarget& tg) const {
    return tg.num_runs > 0 &&
           static_cast<std::size_t>(tg.num_rows) * row_bytes >= static_cast<std::size_t>(tg.num_runs) * buffer_detail::kDirectRunBytes;
  }

  void write_meta(int dest, int64_t row, int topk, int32_t src_idx, const int32_t* topk_global,
                  const float* weights) {
    const buffer_detail::Region& r = regions[dest];
    r.src_idx[row] = src_idx;
    int32_t* idx = r.topk_idx + row * topk;
    float* w = r.topk_weights + row * topk;
    for (int k = 0; k < topk; ++k) {
      const int32_t e = topk_global[k];
      const bool here = e >= 0 && placement.rank_of(e) == dest;
      idx[k] = here ? placement.local_id(e) : -1;
      w[k] = here && weights ? weights[k] : 0.0f;
    }
  }

  Status validate_dispatch(const DispatchInputs& in, const DispatchLayout* given);
  // A full dispatch passes topk_idx and `plan` (filled here); a cached one
  // passes neither and follows h.forward.
  Status move_rows(const TensorView& x, const TensorView* topk_idx, const TensorView* topk_weights,
                   const detail::HandleData& h, detail::ForwardPlan* plan, const Deadline& deadline,
                   ExchangeStats* stats);
  // move_rows' steps (dispatch_rows.cc).
  void copy_rows_inside_node(const buffer_detail::RowMove& m);
  std::vector<buffer_detail::RemoteTarget> remote_targets(const detail::HandleData& h,
                                                          std::vector<int>* target_of) const;
  std::vector<int64_t> stage_remote_rows(const buffer_detail::RowMove& m,
                                         const std::vector<buffer_detail::RemoteTarget>& targets,
                                         const std::vector<buffer_detail::TokenRun>& runs);
  Status send_rows_to_other_nodes(const buffer_detail::RowMove& m, buffer_detail::SendGroup& sends);
  Status receive_from_other_nodes(const buffer_detail::RowMove& m);
  Status receive_and_forward(const buffer_detail::RowMove& m, detail::ForwardPlan* plan);
  void plan_forwarded_rows(const buffer_detail::RowMove& m, int s, int src_node, int64_t n, detail::ForwardPlan& plan);
  void forward_rows(const buffer_detail::RowMove& m, const std::vector<int32_t>& fwd_row, int64_t n);
  void finish_receive(detail::HandleData& h);
  // A rank whose local_status is an error takes part only to tell the others.
  // x_name names the caller's argument in error messages.
  // The backward passes' cached dispatch of gradients: dispatch_cached_impl
  // with the rows of `gradients` for its duration (operations run one at a time).
  Status dispatch_gradients(Status local_status, const TensorView& grad, const Handle& handle, TensorView* recv,
                            std::string_view op);
  Status dispatch_cached_impl(Status local_status, const TensorView& x, const Handle& handle, TensorView* recv_x,
                              std::string_view op, std::string_view x_name);
  Status check_handle(const Handle& handle, std::string_view op) const;
  // After a header whose word `index` (counting the validity flag) is the
  // handle's dispatch number: InvalidArgument on every rank if they differ.
  Status check_same_dispatch(const std::vector<int64_t>& all, std::size_t stride, std::size_t index,
                             std::string_view op) const;
  Status combine_impl(Status local_status, const TensorView& y, const detail::HandleData& h, const TensorView& out,
                      const CombineOptions& options, std::string_view op);
  // combine_impl's steps (combine_rows.cc).
  void put_in_combine_region(const TensorView& y, const detail::HandleData& h, const CombineOptions& options,
                             bool slots, std::size_t yrow);
  Status gather_combine_header(const Status& local_status, DType ydtype, bool slots, const detail::HandleData& h,
                               std::string_view op, const Deadline& deadline);
  Status send_combine_rows(buffer_detail::CombineMove& m, buffer_detail::SendGroup& sends);
  Status reduce_and_send_for_other_nodes(buffer_detail::CombineMove& m, buffer_detail::SendGroup& sends);
  void sum_node_rows_for(const buffer_detail::CombineMove& m, int n, int64_t rows, detail::RowStores stores,
                         float* part, float* part_slots);
  Status receive_combine_rows(const buffer_detail::CombineMove& m);
  // Scratch of sum_tokens, reused token after token.
  struct TokenSums {
    std::vector<int64_t> d_base;    // flat: first row of this rank's block on each holder
    std::vector<int64_t> next;      // two-hop: next staged row per node
    std::vector<int64_t> node_row;  // two-hop: staged row of the current token per node
    std::vector<const std::byte*> rows;
    std::vector<detail::SumGroup> groups;
  };
  void sum_tokens(buffer_detail::CombineMove& m, const TensorView& out);
  int holder_groups(const buffer_detail::CombineMove& m, const int32_t* send_row, TokenSums& s);
  int node_groups(const buffer_detail::CombineMove& m, const int32_t* send_row, TokenSums& s);
  void gather_weight_gradients(const buffer_detail::CombineMove& m, int t, const int32_t* send_row,
                               const TokenSums& s);
  // Checks the handle and the arguments (named y_name, out_name in messages), then combine_impl.
  Status combine_checked(const TensorView& y, const Handle& handle, const TensorView& out,
                         const CombineOptions& options, std::string_view op, std::string_view y_name,
                         std::string_view out_name) {
    Status local_status = check_handle(handle, op);
    if (local_status.is_ok())
      local_status = validate_combine(y, handle.data(), out, options, y_name, out_name);
    return combine_impl(local_status, y, buffer_detail::handle_data_or_empty(handle), out, options, op);
  }
  // combine_expanded with CombineWeights::kReceiver (buffer.cc, below).
  Status check_receiver_combine(const TensorView& y, const detail::HandleData& h, const TensorView& out,
                                const TensorView& weights, const CombineOptions& options, const float** w) const;
  Status check_expanded_capacity(int64_t rows, DType dtype, std::string_view op) const;
  void place_expanded_rows(const TensorView& y, const Handle& handle);
  Status combine_receiver(Status local_status, const TensorView& y, const detail::HandleData& h, const TensorView& out,
                          const float* w);
  Status post_receiver_rows(const detail::HandleData& h, std::size_t yrow, buffer_detail::SendGroup& sends);
  Status recv_receiver_rows(const detail::HandleData& h, std::size_t yrow, std::vector<int64_t>* stage_first,
                            const Deadline& deadline);
  void sum_receiver_rows(const detail::HandleData& h, DType ydtype, const std::vector<int64_t>& stage_first,
                         const float* w, const TensorView& out) const;
  Result<TensorView> backward_y(const TensorView& y, const Handle& handle) const;
  // combine_expanded with CombineWeights::kHolder (combine_expanded.cc).
  Status check_holder_combine(const TensorView& y, const detail::HandleData& h, const TensorView& out,
                              const TensorView& weights, const CombineOptions& options, const float** w) const;
  bool holder_rows_in_place(const TensorView& y) const;
  void publish_holder_weights(const detail::HandleData& h, const float* w);
  Status combine_holder(Status local_status, const TensorView& y, const detail::HandleData& h, const TensorView& out,
                        const CombineOptions& options);
  Status gather_holders(Status local_status, const TensorView& y, const detail::HandleData& h, bool in_place,
                        const Deadline& deadline, std::vector<buffer_detail::HolderRows>* holders);
  Status send_holder_partials(const detail::HandleData& h, const std::vector<buffer_detail::HolderRows>& holders,
                              buffer_detail::SendGroup& sends);
  Status send_node_sums(const detail::HandleData& h, const std::vector<buffer_detail::HolderRows>& holders,
                        buffer_detail::SendGroup& sends);
  Status recv_partials(const detail::HandleData& h, std::vector<int64_t>* stage_first, const Deadline& deadline);
  void sum_holder_parts(const detail::HandleData& h, const std::vector<buffer_detail::HolderRows>& holders,
                        const std::vector<int64_t>& stage_first, const TensorView& out, const TensorView& bias) const;
  // y_name and out_name name the caller's arguments in error messages.
  Status validate_combine(const TensorView& y, const detail::HandleData& h, const TensorView& out,
                          const CombineOptions& options, std::string_view y_name = "y",
                          std::string_view out_name = "out") const;

 private:
  // Copies the pinned expanded rows into their handle (if it still lives),
  // then forgets them; only combine_for_writing calls it.
  void spill_pinned_y();
};

}  // namespace epx
