#include "epx/exchange/low_latency.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "epx/core/buffer.h"
#include "core/guard.h"
#include "exchange/backend_state.h"
#include "exchange/config_check.h"
#include "exchange/operation_queue.h"
#include "exchange/cpu/row_kernels.h"

namespace epx {
namespace {

constexpr int kTagDispatch = 110;
constexpr int kTagCombine = 111;

std::atomic<uint64_t> g_next_ll_id{1};

// What a rank tells every peer in every call, in its signal words (same
// node) or in its message header (other nodes).
enum SignalStatus : int64_t {
  kSignalOk = 0,
  kSignalRejected = 1,  // the rank rejected its own input
  kSignalOverflow = 2,  // a = global expert, b = rows, c = capacity
};
// Signal words: [0] sequence number (published last, release/acquire),
// [1] status, [2..4] status details (combine: [2] = y's dtype, [3] = rows),
// [5] rows (dispatch: one per token the source sends this rank),
// [6..] (token, expert) pairs per local expert of the destination (dispatch).
constexpr int kSigSeq = 0, kSigStatus = 1, kSigA = 2, kSigB = 3, kSigRows = 5, kSigCounts = 6;  // [4]: c

bool is_payload_dtype(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16; }

int64_t load_acquire(int64_t* word) { return std::atomic_ref<int64_t>(*word).load(std::memory_order_acquire); }
void store_release(int64_t* word, int64_t value) {
  std::atomic_ref<int64_t>(*word).store(value, std::memory_order_release);
}

// One rank's peer-mapped region. Source s writes its dispatch rows for this
// rank into inbox s (one row per token, with the (local expert, k) pairs it
// goes to); the owner copies each into its experts' rows of recv_x.
struct LLRegion {
  std::byte* recv_x = nullptr;     // [E_max][R * capacity][row_bytes], written by the owner only
  std::byte* inbox = nullptr;      // [R][inbox_bytes]: a dispatch's rows of source s (DispatchBlock)
  int64_t* dispatch_sig = nullptr; // [R][sig_words], written by source s into row s
  std::byte* combine = nullptr;    // [max_tokens][max_topk][combine_row_bytes]
  int64_t* combine_sig = nullptr;  // [R][sig_words], written by owner d into row d
  int64_t* poison = nullptr;       // [8]: rank + 1 of a rank that failed mid-call

  static std::size_t carve(std::byte* base, std::size_t slots, std::size_t row_bytes, int num_ranks,
                           std::size_t inbox_bytes, std::size_t sig_words, std::size_t combine_slots,
                           std::size_t combine_row_bytes, LLRegion* out) {
    Carver c(base);
    LLRegion r;
    r.recv_x = c.take<std::byte>(slots * row_bytes);
    r.inbox = c.take<std::byte>(static_cast<std::size_t>(num_ranks) * inbox_bytes);
    r.dispatch_sig = c.take<int64_t>(static_cast<std::size_t>(num_ranks) * sig_words);
    r.combine = c.take<std::byte>(combine_slots * combine_row_bytes);
    r.combine_sig = c.take<int64_t>(static_cast<std::size_t>(num_ranks) * sig_words);
    r.poison = c.take<int64_t>(8);
    if (out) *out = r;
    return c.bytes();
  }
};

// One source's dispatch rows for one destination rank, in an inbox (same
// node) or after a message's header (other nodes): rows in token order,
//   row_meta [rows][2] i32: (token, number of pairs)
//   pairs    [pairs][2] i32: (local expert, k), a row's pairs in k order
//   weights  [pairs] f32, padded to 8 bytes (only with combine_per_rank:
//            the owner applies them)
//   x        [rows][row_bytes] (left out when the source is the owner: it
//            reads its own rows from x)
struct DispatchBlock {
  int32_t* row_meta = nullptr;
  int32_t* pairs = nullptr;
  float* weights = nullptr;
  std::byte* x = nullptr;
  static int64_t weight_words(int64_t pairs, bool weights) { return weights ? (pairs + 1) / 2 : 0; }
  static DispatchBlock at(std::byte* base, int64_t rows, int64_t pairs, bool weights) {
    DispatchBlock b;
    b.row_meta = reinterpret_cast<int32_t*>(base);
    b.pairs = b.row_meta + 2 * rows;
    b.weights = reinterpret_cast<float*>(b.pairs + 2 * pairs);
    b.x = base + (rows + pairs + weight_words(pairs, weights)) * 8;
    return b;
  }
  static std::size_t bytes(int64_t rows, int64_t pairs, bool weights, std::size_t row_bytes) {
    return static_cast<std::size_t>(rows + pairs + weight_words(pairs, weights)) * 8 +
           static_cast<std::size_t>(rows) * row_bytes;
  }
};

// Spins, then sleeps 20 us between polls. No sched_yield phase (unlike the
// MPI backend's waits): with more rank threads than cores, yielding handed
// the core to other processes and made a one-token call several times slower
// than sleeping.
void backoff(int& polls) {
  if (++polls < 256) return;
  std::this_thread::sleep_for(std::chrono::microseconds(20));
}

}  // namespace

struct LowLatencyBuffer::Impl : detail::BackendState<LowLatencyConfig> {
  using BackendState::BackendState;

  int num_local = 0;     // experts on this rank
  int max_local = 0;     // the most experts on any rank (region shape)
  int64_t capacity = 0;  // rows per (local expert, source)
  std::size_t sig_words = 0, header_bytes = 0;
  std::size_t inbox_bytes = 0;  // one source's DispatchBlock at its largest
  std::size_t peer_stride = 0;  // recv_staging bytes per remote source in dispatch (header + inbox)
  std::vector<LLRegion> regions;  // by rank; this node's ranks only

  // Sequence numbers: collective, so equal on every rank.
  int64_t combine_seq = 0;
  // The kind of the previous call. A call that follows one of its own kind
  // starts with a barrier: without the other kind between them, a fast peer
  // could overwrite signals (or recv_x) that a slow one has not read yet.
  enum class LastCall : uint8_t { kNone, kDispatch, kCombine } last_call = LastCall::kNone;
  bool dispatch_ok = false;         // the latest dispatch succeeded ...
  bool combined = false;            // ... and was combined already
  Status poisoned = Status::ok();

  // The latest dispatch, for its combine.
  int num_tokens = 0, topk = 0;
  std::vector<int32_t> topk_idx;      // [max_tokens][max_topk]
  std::vector<float> weights;         // [max_tokens][max_topk]
  std::vector<int64_t> own_row;       // [max_tokens][max_topk]: y row of a slot this rank's expert holds
  std::vector<int64_t> recv_counts;   // [R][max_local]: rows from source s for local expert e
  std::vector<int32_t> counts_out;    // [num_local]
  std::vector<int32_t> src_rank, src_idx, src_slot;  // [num_local][R * capacity]
  std::vector<int64_t> peer_status;   // [R][4]: status, a, b, c heard from each rank
  std::vector<int64_t> owner_dtype;   // [R]: the dtype of y each owner sent in combine

  // Scratch, sized once.
  std::vector<int64_t> send_counts;   // [R][max_local]
  std::vector<int64_t> fill;          // [R] (combine: rows staged per source)
  std::vector<int64_t> block_of;      // [R]: byte offset of each remote peer's message in send staging
  std::vector<int64_t> rows_to;       // [R]: dispatch rows (tokens) / combine rows to each rank
  std::vector<int64_t> pairs_to;      // [R]: (token, expert) pairs to each rank
  std::vector<int64_t> last_token;    // [R]: the latest token with a row to each rank
  std::vector<DispatchBlock> block_to;  // [R]: where this rank writes its rows for each rank
  std::vector<int> remote_slot;       // [R]: index among the remote ranks (dispatch recv staging)
  std::vector<int64_t> pairs_written; // [R]
  std::vector<int64_t> next_row;      // [max_local]: the next recv_x row of each local expert
  std::vector<int64_t> row_end;       // [max_local]: where the current source's rows of each expert end
  // combine_per_rank: the latest dispatch's rows by source, for the owner's
  // per-rank sums: row i of source s (its token, first slot k, pairs) and
  // each pair's y row and weight.
  struct HeldRow {
    int32_t token = 0, first_slot = 0;
    int64_t first_pair = 0, num_pairs = 0;
  };
  std::vector<HeldRow> held;              // [R][max_tokens]
  std::vector<int64_t> held_rows;         // [R]
  std::vector<int64_t> held_pair_row;     // [R][max_tokens * pairs_per_row]
  std::vector<float> held_pair_weight;    // [R][max_tokens * pairs_per_row]
  std::vector<Request> requests;
  AlignedBuffer send_staging, recv_staging;
  // One token's rows and weights for a sum (weighted_partial): [max_topk].
  std::vector<const std::byte*> sum_rows;
  std::vector<float> sum_weights;
  std::vector<DType> row_dtypes;
  std::vector<float> acc;  // [hidden]: rows of different dtypes, summed one at a time

  const LLRegion& local() const { return regions[rank]; }
  bool same_node(int r) const { return topology.same_node(r, rank); }
  std::byte* recv_row(int e, int64_t j) const {
    return local().recv_x + (static_cast<std::size_t>(e) * num_ranks * capacity + j) * row_bytes;
  }
  // Where source s's dispatch block for this rank lies once heard from.
  std::byte* inbox_of(int s) const {
    return same_node(s) ? local().inbox + static_cast<std::size_t>(s) * inbox_bytes
                        : recv_staging.data() + remote_slot[s] * peer_stride + header_bytes;
  }

  // create()'s steps after the ranks agreed on the config.
  void size_from_config();
  Status map_regions(const Deadline& deadline);
  Status allocate_private_staging(const Deadline& deadline);
  void size_scratch();
  Status validate_dispatch(const LowLatencyDispatchInputs& in) const;
  Status validate_combine(const TensorView& y, const LowLatencyHandle& handle, const TensorView& out) const;
  // Waits until `*word` reaches `want`, watching this rank's poison word.
  Status wait_signal(int64_t* word, int64_t want, const Deadline& deadline, std::string_view what, int peer) const;
  // A failure after the first write: poisons the node's ranks, the transport
  // and this buffer, waits for this rank's sends, returns `status`.
  Status fail(Status status, const Deadline& deadline);
  Status finish_sends(const Deadline& deadline) {
    for (Request& r : requests) EPX_RETURN_IF_ERROR(r.wait(deadline));
    requests.clear();
    return Status::ok();
  }
  // Hears from every rank in call `seq`: a same-node rank through its row of
  // `sig_rows` (in this rank's region), any other through one message with
  // `tag` into recv_staging (at remote_slot[peer] * peer_stride when
  // `per_peer`, else at its start), which `unpack(peer, sig, bytes)` takes
  // in; then `record(peer, sig)`. Same-node ranks first: their rows are
  // already here.
  template <typename Unpack, typename Record>
  Status hear_from_all(int64_t* sig_rows, int tag, int64_t seq, std::string_view what, bool per_peer,
                       const Deadline& deadline, Unpack&& unpack, Record&& record) {
    for (int pass = 0; pass < 2; ++pass) {
      for (int peer = 0; peer < num_ranks; ++peer) {
        if (same_node(peer) != (pass == 0)) continue;
        const int64_t* sig = nullptr;
        if (pass == 0) {
          int64_t* word = sig_rows + static_cast<std::size_t>(peer) * sig_words;
          Status st = wait_signal(word + kSigSeq, seq, deadline, what, peer);
          if (!st.is_ok()) return fail(std::move(st), deadline);
          sig = word;
        } else {
          const std::span<std::byte> area =
              per_peer ? std::span<std::byte>(recv_staging.data() + remote_slot[peer] * peer_stride, peer_stride)
                       : std::span<std::byte>(recv_staging.data(), recv_staging.size());
          auto got = transport.recv(peer, tag, area, deadline);
          if (!got.is_ok()) return fail(got.status(), deadline);
          sig = reinterpret_cast<const int64_t*>(area.data());
          if (*got < header_bytes || sig[kSigSeq] != seq)
            return fail(internal_error("{} message from rank {} was {} bytes for call {}, expected call {}: the ranks "
                                       "are out of step",
                                       what, peer, *got, *got < header_bytes ? -1 : sig[kSigSeq], seq),
                        deadline);
          Status st = unpack(peer, sig, *got);
          if (!st.is_ok()) return fail(std::move(st), deadline);
        }
        Status st = record(peer, sig);
        if (!st.is_ok()) return fail(std::move(st), deadline);
      }
    }
    return Status::ok();
  }
  // The per-expert counts of a dispatch signal from `peer` fit this rank's
  // slots (a mismatch would mean a bug, never a reason to write past them).
  Status check_counts(int peer, const int64_t* sig) const {
    int64_t pairs = 0;
    for (int e = 0; e < max_local; ++e) {
      const int64_t n = sig[kSigCounts + e];
      if (n < 0 || n > capacity || (e >= num_local && n > 0))
        return internal_error("rank {} announced {} rows for local expert {} of rank {} ({} experts, capacity {})",
                              peer, n, e, rank, num_local, capacity);
      pairs += n;
    }
    const int64_t rows = sig[kSigRows];
    if (rows < 0 || rows > config.max_tokens_per_rank || rows > pairs || pairs > rows * pairs_per_row())
      return internal_error("rank {} announced {} rows for {} (token, expert) pairs to rank {} (at most {} tokens, {} "
                            "pairs per token)",
                            peer, rows, pairs, rank, config.max_tokens_per_rank, pairs_per_row());
    return Status::ok();
  }
  int64_t announced_pairs(const int64_t* sig) const {
    int64_t n = 0;
    for (int e = 0; e < max_local; ++e) n += sig[kSigCounts + e];
    return n;
  }
  // A source's dispatch signal, once heard from: its row of dispatch_sig
  // inside the node, its message's header otherwise.
  const int64_t* dispatch_sig_of(int s) const {
    return same_node(s) ? local().dispatch_sig + static_cast<std::size_t>(s) * sig_words
                        : reinterpret_cast<const int64_t*>(recv_staging.data() + remote_slot[s] * peer_stride);
  }
  // The most local experts of one rank a token can go to.
  int64_t pairs_per_row() const { return std::min(config.max_topk, max_local); }
  // Enters a call of `kind`, after a barrier when `barrier` (see last_call).
  Status enter_call(LastCall kind, bool barrier, const Deadline& deadline) {
    if (barrier) {
      Status st = transport.barrier(deadline);
      if (!st.is_ok()) return fail(std::move(st), deadline);
    }
    last_call = kind;
    return Status::ok();
  }
  // Dispatch steps (dispatch_blocking runs them in this order).
  void count_rows(const LowLatencyDispatchInputs& in, int T, int K);
  void dispatch_status(const Status& local_status, int64_t* status) const;
  void place_blocks(bool send_rows);
  void write_rows(const LowLatencyDispatchInputs& in, int T, int K, ExchangeStats* stats);
  Status publish_dispatch(const int64_t* status, bool send_rows, int64_t seq, const Deadline& deadline,
                          ExchangeStats* stats);
  Status hear_dispatch(int64_t seq, const Deadline& deadline);
  Status check_dispatch_message(int src, const int64_t* sig, std::size_t bytes) const;
  Status record_dispatch_signal(int src, const int64_t* sig);
  Status expand_all(const LowLatencyDispatchInputs& in, int64_t* received, const Deadline& deadline);
  Status expand_from(int src, const int64_t* sig, const LowLatencyDispatchInputs& in);
  void finish_experts(int64_t* received);
  void keep_routing(const LowLatencyDispatchInputs& in, int T, int K);
  void fill_dispatch_result(int64_t seq, LowLatencyDispatchResult* out) const;
  // Combine steps (combine_blocking runs them in this order).
  void size_combine_messages(bool send_rows, std::size_t y_row);
  std::byte* combine_dst(int s, int t, int k, std::size_t y_row);
  void stage_pair_rows(const TensorView& y, std::size_t y_row);
  void stage_rank_sums(const TensorView& y, std::size_t y_row);
  Status publish_combine(bool send_rows, int64_t y_dtype, std::size_t y_row, int64_t seq, const Deadline& deadline);
  Status hear_combine(int64_t seq, const Deadline& deadline);
  Status record_combine_signal(int owner, const int64_t* sig);
  Status unpack_combine_message(int owner, const int64_t* sig, std::size_t bytes);
  void sum_combine(const TensorView& y, std::size_t y_row, const TensorView& out);
  void sum_mixed_rows(int n, std::byte* out, DType out_dtype);
  // The first slot of a token's top-k row `idx` (up to k) naming an expert of `owner`.
  int first_slot_on(const int32_t* idx, int k, int owner) const {
    for (int j = 0; j < k; ++j)
      if (idx[j] >= 0 && placement.rank_of(idx[j]) == owner) return j;
    return k;
  }
  // After hearing from every rank: waits for this rank's sends, then returns
  // its own error, else the one every rank returns (peer_error), else OK.
  Status finish_call(const Status& local_status, std::string_view op, const Deadline& deadline) {
    if (Status st = finish_sends(deadline); !st.is_ok()) return fail(std::move(st), deadline);
    EPX_RETURN_IF_ERROR(local_status);
    return peer_error(op);
  }
  // The error every rank returns after a call in which some rank rejected
  // its input or overflowed, in rank order so all ranks agree.
  Status peer_error(std::string_view op) const;
};

LowLatencyBuffer::LowLatencyBuffer(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)), ops_(std::make_unique<detail::OperationQueue>(impl_->config.timeout)) {}
LowLatencyBuffer::~LowLatencyBuffer() = default;

const LowLatencyConfig& LowLatencyBuffer::config() const { return impl_->config; }
const ExpertPlacement& LowLatencyBuffer::placement() const { return impl_->placement; }
int LowLatencyBuffer::num_local_experts() const { return impl_->num_local; }
int64_t LowLatencyBuffer::rows_per_expert() const { return impl_->num_ranks * impl_->capacity; }
std::size_t LowLatencyBuffer::region_bytes() const { return impl_->memory ? impl_->memory->size() : 0; }
std::size_t LowLatencyBuffer::staging_bytes() const {
  return impl_->send_staging.size() + impl_->recv_staging.size();
}

namespace {

// The private staging of messages to and from other nodes.
Status allocate_staging(std::size_t send_bytes, std::size_t recv_bytes, AlignedBuffer* send, AlignedBuffer* recv) {
  EPX_ASSIGN_OR_RETURN(*send, AlignedBuffer::allocate(send_bytes, "the low-latency send staging"));
  EPX_ASSIGN_OR_RETURN(*recv, AlignedBuffer::allocate(recv_bytes, "the low-latency receive staging"));
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<LowLatencyBuffer>> LowLatencyBuffer::create(Transport& transport, LowLatencyConfig config) {
  return detail::guard("LowLatencyBuffer::create", [&] { return create_unguarded(transport, std::move(config)); });
}

namespace {

// The checks a config must pass on its own (placement resolved here).
Status check_low_latency_config(LowLatencyConfig& config, int num_ranks) {
  if (config.num_experts < 1) return invalid_argument("num_experts = {} must be at least 1", config.num_experts);
  if (config.hidden < 1) return invalid_argument("hidden = {} must be at least 1", config.hidden);
  if (!is_payload_dtype(config.dtype))
    return invalid_argument("dtype = {} is not a low-latency payload type; use bf16 or f32", dtype_name(config.dtype));
  if (!is_payload_dtype(config.max_combine_dtype))
    return invalid_argument("max_combine_dtype = {} must be bf16 or f32", dtype_name(config.max_combine_dtype));
  if (static_cast<std::size_t>(config.hidden) * 2 % 8 != 0)
    return invalid_argument("hidden = {} must be a multiple of 4 (rows are a multiple of 8 bytes)", config.hidden);
  if (config.max_topk < 1 || config.max_topk > config.num_experts)
    return invalid_argument("max_topk = {} is outside [1, num_experts = {}]", config.max_topk, config.num_experts);
  if (config.max_tokens_per_rank < 1)
    return invalid_argument("max_tokens_per_rank = {} must be at least 1", config.max_tokens_per_rank);
  if (config.capacity < 0 || config.capacity > config.max_tokens_per_rank)
    return invalid_argument("capacity = {} is outside [0 (the worst case), max_tokens_per_rank = {}]",
                            config.capacity, config.max_tokens_per_rank);
  if (config.timeout.count() <= 0) return invalid_argument("timeout = {} ms must be positive", config.timeout.count());
  return detail::resolve_placement(&config.placement, config.num_experts, num_ranks);
}

// Every rank must describe the same exchange: these fields, named below.
std::vector<int64_t> agreed_fields(const LowLatencyConfig& config) {
  return {config.num_experts,
          config.hidden,
          static_cast<int64_t>(config.dtype),
          config.max_tokens_per_rank,
          config.max_topk,
          config.capacity > 0 ? config.capacity : config.max_tokens_per_rank,
          static_cast<int64_t>(config.max_combine_dtype),
          detail::placement_hash(*config.placement),
          config.combine_per_rank ? 1 : 0};
}
constexpr const char* kAgreedFieldNames[] = {"num_experts",       "hidden",           "dtype",
                                             "max_tokens_per_rank", "max_topk",       "capacity",
                                             "max_combine_dtype", "placement (hash)", "combine_per_rank"};

std::size_t round_up_to_line(std::size_t n) { return (n + kCacheLine - 1) / kCacheLine * kCacheLine; }

}  // namespace

Result<std::unique_ptr<LowLatencyBuffer>> LowLatencyBuffer::create_unguarded(Transport& transport,
                                                                              LowLatencyConfig config) {
  const Status local_status = check_low_latency_config(config, transport.topology().num_ranks());
  const Deadline deadline = Deadline::after(config.timeout.count() > 0 ? config.timeout : Milliseconds(30000));
  const std::vector<int64_t> fields = local_status.is_ok() ? agreed_fields(config) : std::vector<int64_t>{};
  EPX_RETURN_IF_ERROR(detail::agree_on_config(transport, local_status, fields, kAgreedFieldNames, "LowLatencyConfig",
                                              "LowLatencyBuffer", deadline));
  ExpertPlacement placement = *config.placement;
  auto impl = std::make_unique<Impl>(transport, std::move(config), std::move(placement));
  impl->size_from_config();
  EPX_RETURN_IF_ERROR(impl->map_regions(deadline));
  EPX_RETURN_IF_ERROR(impl->allocate_private_staging(deadline));
  impl->size_scratch();
  return std::unique_ptr<LowLatencyBuffer>(new LowLatencyBuffer(std::move(impl)));
}

// Sizes that follow from the config and the placement.
void LowLatencyBuffer::Impl::size_from_config() {
  const LowLatencyConfig& c = config;
  id = g_next_ll_id.fetch_add(1);
  rank = transport.rank();
  num_ranks = topology.num_ranks();
  num_local = placement.num_local_experts(rank);
  for (int r = 0; r < num_ranks; ++r) max_local = std::max(max_local, placement.num_local_experts(r));
  capacity = c.capacity > 0 ? c.capacity : c.max_tokens_per_rank;
  row_bytes = static_cast<std::size_t>(c.hidden) * dtype_size(c.dtype);
  combine_row_bytes = static_cast<std::size_t>(c.hidden) * dtype_size(c.max_combine_dtype);
  sig_words = (kSigCounts + static_cast<std::size_t>(max_local) + 7) / 8 * 8;
  header_bytes = sig_words * sizeof(int64_t);
  inbox_bytes = round_up_to_line(DispatchBlock::bytes(c.max_tokens_per_rank, c.max_tokens_per_rank * pairs_per_row(),
                                                      c.combine_per_rank, row_bytes));
}

// The peer-mapped regions: each rank's expert slots, inboxes, signals and
// combine rows, carved alike on every rank of the node.
Status LowLatencyBuffer::Impl::map_regions(const Deadline& deadline) {
  const std::size_t slots = static_cast<std::size_t>(max_local) * num_ranks * capacity;
  const std::size_t combine_slots = static_cast<std::size_t>(config.max_tokens_per_rank) * config.max_topk;
  const std::size_t bytes = LLRegion::carve(nullptr, slots, row_bytes, num_ranks, inbox_bytes, sig_words,
                                            combine_slots, combine_row_bytes, nullptr);
  EPX_ASSIGN_OR_RETURN(memory, transport.map_peer_memory(bytes, deadline));
  regions.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r)
    if (topology.same_node(r, rank))
      LLRegion::carve(memory->peer(r), slots, row_bytes, num_ranks, inbox_bytes, sig_words, combine_slots,
                      combine_row_bytes, &regions[r]);
  return Status::ok();
}

// Private memory, all of it now. Dispatch: this rank's messages to all
// remote ranks hold at most T min(K, remote ranks) rows and T K pairs; one
// remote source's message is at most a header and an inbox, and each
// remote source has its own. Combine: a message to or from one remote rank
// holds at most min(T K, E_local capacity) rows, to all of them together at
// most remote ranks x that. Every rank learns whether every other got its staging.
Status LowLatencyBuffer::Impl::allocate_private_staging(const Deadline& deadline) {
  const LowLatencyConfig& c = config;
  const int num_remote = num_ranks - topology.ranks_per_node();
  const int64_t token_slots = static_cast<int64_t>(c.max_tokens_per_rank) * c.max_topk;
  const int64_t rows_per_peer = std::min<int64_t>(token_slots, static_cast<int64_t>(max_local) * capacity);
  const std::size_t combine_row = 8 + combine_row_bytes;
  peer_stride = round_up_to_line(header_bytes + inbox_bytes);
  std::size_t send_bytes = 0, recv_bytes = 0;
  if (num_remote > 0) {
    const int64_t dispatch_rows = static_cast<int64_t>(c.max_tokens_per_rank) * std::min(c.max_topk, num_remote);
    const int64_t combine_rows = std::min<int64_t>(static_cast<int64_t>(num_remote) * token_slots,
                                                   static_cast<int64_t>(num_local) * num_remote * capacity);
    // (+ 8 bytes per message: each pads its weights to 8 bytes)
    send_bytes = num_remote * (header_bytes + 8) +
                 std::max(DispatchBlock::bytes(dispatch_rows, token_slots, c.combine_per_rank, row_bytes),
                          static_cast<std::size_t>(combine_rows) * combine_row);
    recv_bytes = std::max(num_remote * peer_stride, header_bytes + static_cast<std::size_t>(rows_per_peer) * combine_row);
  }
  const Status staged = allocate_staging(send_bytes, recv_bytes, &send_staging, &recv_staging);
  return detail::agree_on_config(transport, staged, {}, {}, "staging memory", "LowLatencyBuffer", deadline);
}

// The per-operation scratch, sized once for the largest call.
void LowLatencyBuffer::Impl::size_scratch() {
  const LowLatencyConfig& c = config;
  const std::size_t R = num_ranks;
  const std::size_t combine_slots = static_cast<std::size_t>(c.max_tokens_per_rank) * c.max_topk;
  topk_idx.assign(combine_slots, -1);
  weights.assign(combine_slots, 0.0f);
  own_row.assign(combine_slots, 0);
  recv_counts.assign(R * max_local, 0);
  counts_out.assign(num_local, 0);
  const std::size_t out_rows = static_cast<std::size_t>(num_local) * R * capacity;
  src_rank.assign(out_rows, -1);
  src_idx.assign(out_rows, -1);
  src_slot.assign(out_rows, -1);
  peer_status.assign(R * 4, 0);
  owner_dtype.assign(R, 0);
  send_counts.assign(R * max_local, 0);
  fill.assign(R, 0);
  block_of.assign(R, 0);
  rows_to.assign(R, 0);
  pairs_to.assign(R, 0);
  last_token.assign(R, -1);
  block_to.assign(R, DispatchBlock{});
  remote_slot.assign(R, -1);
  for (int r = 0, i = 0; r < num_ranks; ++r)
    if (!topology.same_node(r, rank)) remote_slot[r] = i++;
  pairs_written.assign(R, 0);
  next_row.assign(max_local, 0);
  row_end.assign(max_local, 0);
  held_rows.assign(R, 0);
  if (c.combine_per_rank) {
    held.assign(R * c.max_tokens_per_rank, Impl::HeldRow{});
    held_pair_row.assign(R * c.max_tokens_per_rank * pairs_per_row(), 0);
    held_pair_weight.assign(R * c.max_tokens_per_rank * pairs_per_row(), 0.0f);
  }
  requests.reserve(R);
  sum_rows.assign(c.max_topk, nullptr);
  sum_weights.assign(c.max_topk, 0.0f);
  row_dtypes.assign(c.max_topk, DType::kF32);
  acc.assign(c.hidden, 0.0f);
}

Status LowLatencyBuffer::Impl::validate_dispatch(const LowLatencyDispatchInputs& in) const {
  if (in.topk_idx.ndim() != 2)
    return invalid_argument("topk_idx must be 2-D [num_tokens, topk], got {}", in.topk_idx.describe());
  const int64_t T = in.topk_idx.size(0), K = in.topk_idx.size(1);
  if (T > config.max_tokens_per_rank)
    return invalid_argument("num_tokens = {} is above max_tokens_per_rank = {}", T, config.max_tokens_per_rank);
  if (K < 1 || K > config.max_topk) return invalid_argument("topk = {} is outside [1, max_topk = {}]", K, config.max_topk);
  EPX_RETURN_IF_ERROR(check_matrix(in.topk_idx, "topk_idx", DType::kI32, T, K));
  EPX_RETURN_IF_ERROR(check_matrix(in.x, "x", config.dtype, T, config.hidden));
  if (in.topk_weights.defined()) EPX_RETURN_IF_ERROR(check_matrix(in.topk_weights, "topk_weights", DType::kF32, T, K));
  const int E = config.num_experts;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* row = in.topk_idx.row<int32_t>(t);
    for (int64_t k = 0; k < K; ++k) {
      if (row[k] < -1 || row[k] >= E)
        return invalid_argument("topk_idx[{}][{}] = {} is outside [0, {}) (or -1 for none)", t, k, row[k], E);
      for (int64_t j = 0; j < k; ++j)
        if (row[k] >= 0 && row[j] == row[k])
          return invalid_argument("topk_idx[{}] names expert {} twice (slots {} and {})", t, row[k], j, k);
    }
  }
  return Status::ok();
}

Status LowLatencyBuffer::Impl::wait_signal(int64_t* word, int64_t want, const Deadline& deadline, std::string_view what,
                                           int peer) const {
  for (int polls = 0;; backoff(polls)) {
    const int64_t got = load_acquire(word);
    if (got == want) return Status::ok();
    if (got > want)
      return internal_error("rank {} published {} number {} while rank {} waits for {}: the ranks' calls are out of step",
                            peer, what, got, rank, want);
    const int64_t failed = load_acquire(local().poison);
    if (failed != 0) return aborted("rank {} failed in a low-latency call, so rank {} stopped waiting for {} of rank {}",
                                    failed - 1, rank, what, peer);
    if (deadline.expired())
      return deadline_exceeded("rank {} waited {} ms for {} number {} of rank {}", rank, config.timeout.count(), what,
                               want, peer);
  }
}

Status LowLatencyBuffer::Impl::fail(Status status, const Deadline& deadline) {
  if (poisoned.is_ok())
    poisoned = aborted("the low-latency buffer failed earlier on rank {}: {}", rank, status.to_string());
  for (int r = 0; r < num_ranks; ++r)
    if (same_node(r) && r != rank) store_release(regions[r].poison, rank + 1);
  transport.abort(status);
  for (Request& r : requests) r.wait(deadline).ignore();
  requests.clear();
  return status;
}

Status LowLatencyBuffer::Impl::peer_error(std::string_view op) const {
  for (int r = 0; r < num_ranks; ++r) {
    const int64_t* st = &peer_status[static_cast<std::size_t>(r) * 4];
    if (st[0] == kSignalRejected)
      return aborted("rank {} rejected its low-latency {} input, so the call failed on every rank", r, op);
    if (st[0] == kSignalOverflow)
      return resource_exhausted(
          "expert {} would receive {} rows from rank {} but the low-latency capacity is {} rows per (expert, source "
          "rank); rank {} sent nothing. Raise LowLatencyConfig::capacity",
          st[1], st[2], r, st[3], r);
  }
  return Status::ok();
}

// Rows per (destination, local expert), and per destination its rows (one
// per token that goes there) and its (token, expert) pairs.
void LowLatencyBuffer::Impl::count_rows(const LowLatencyDispatchInputs& in, int T, int K) {
  std::fill(send_counts.begin(), send_counts.end(), 0);
  std::fill(rows_to.begin(), rows_to.end(), 0);
  std::fill(pairs_to.begin(), pairs_to.end(), 0);
  std::fill(last_token.begin(), last_token.end(), -1);
  for (int t = 0; t < T; ++t) {
    const int32_t* row = in.topk_idx.row<int32_t>(t);
    for (int k = 0; k < K; ++k) {
      if (row[k] < 0) continue;
      const int d = placement.rank_of(row[k]);
      ++send_counts[static_cast<std::size_t>(d) * max_local + placement.local_id(row[k])];
      ++pairs_to[d];
      if (last_token[d] != t) {
        last_token[d] = t;
        ++rows_to[d];
      }
    }
  }
}

// Where this rank's block for each rank goes: into the peer's inbox inside
// the node, after the message header in the send staging for other nodes.
void LowLatencyBuffer::Impl::place_blocks(bool send_rows) {
  std::size_t staged = 0;
  for (int d = 0; d < num_ranks; ++d) {
    if (!send_rows) rows_to[d] = pairs_to[d] = 0;
    std::byte* base = nullptr;
    if (same_node(d)) {
      base = regions[d].inbox + static_cast<std::size_t>(rank) * inbox_bytes;
    } else {
      block_of[d] = static_cast<int64_t>(staged);
      base = send_staging.data() + staged + header_bytes;
      staged += header_bytes + DispatchBlock::bytes(rows_to[d], pairs_to[d], config.combine_per_rank, row_bytes);
    }
    block_to[d] = DispatchBlock::at(base, rows_to[d], pairs_to[d], config.combine_per_rank);
  }
  EPX_CHECK(staged <= send_staging.size());
}

// Each token's row once per destination rank, with the (local expert, k)
// pairs it goes to there in k order. Rows for this rank stay in x.
void LowLatencyBuffer::Impl::write_rows(const LowLatencyDispatchInputs& in, int T, int K, ExchangeStats* stats) {
  std::fill(last_token.begin(), last_token.end(), -1);
  std::fill(fill.begin(), fill.end(), 0);  // rows written to each rank
  std::fill(pairs_written.begin(), pairs_written.end(), 0);
  for (int t = 0; t < T; ++t) {
    const int32_t* row = in.topk_idx.row<int32_t>(t);
    const float* w = in.topk_weights.defined() ? in.topk_weights.row<float>(t) : nullptr;
    for (int k = 0; k < K; ++k) {
      if (row[k] < 0) continue;
      const int d = placement.rank_of(row[k]);
      DispatchBlock& b = block_to[d];
      if (last_token[d] != t) {
        last_token[d] = t;
        const int64_t i = fill[d]++;
        b.row_meta[2 * i] = t;
        b.row_meta[2 * i + 1] = 0;
        if (d != rank) std::memcpy(b.x + i * row_bytes, in.x.row<std::byte>(t), row_bytes);
        ++stats->rows_sent;
        if (d != rank && same_node(d)) stats->intra_node_payload_bytes += static_cast<int64_t>(row_bytes);
      }
      const int64_t j = pairs_written[d]++;
      b.pairs[2 * j] = placement.local_id(row[k]);
      b.pairs[2 * j + 1] = k;
      if (config.combine_per_rank) b.weights[j] = w ? w[k] : 1.0f;
      ++b.row_meta[2 * (fill[d] - 1) + 1];
    }
  }
}

// The counts and the status, then the sequence number (inside the node) or
// the message (other nodes).
Status LowLatencyBuffer::Impl::publish_dispatch(const int64_t* status, bool send_rows, int64_t seq,
                                                const Deadline& deadline, ExchangeStats* stats) {
  for (int d = 0; d < num_ranks; ++d) {
    const bool near = same_node(d);
    int64_t* sig = near ? regions[d].dispatch_sig + static_cast<std::size_t>(rank) * sig_words
                        : reinterpret_cast<int64_t*>(send_staging.data() + block_of[d]);
    std::copy(status, status + 4, sig + kSigStatus);
    sig[kSigRows] = rows_to[d];
    for (int e = 0; e < max_local; ++e)
      sig[kSigCounts + e] = send_rows ? send_counts[static_cast<std::size_t>(d) * max_local + e] : 0;
    if (near) {
      store_release(sig + kSigSeq, seq);
      continue;
    }
    sig[kSigSeq] = seq;
    const std::size_t payload = static_cast<std::size_t>(rows_to[d]) * row_bytes;
    const std::size_t n = header_bytes + DispatchBlock::bytes(rows_to[d], pairs_to[d], config.combine_per_rank, row_bytes);
    auto request = transport.send_async(d, kTagDispatch, {send_staging.data() + block_of[d], n});
    if (!request.is_ok()) return fail(request.status(), deadline);
    requests.push_back(std::move(*request));
    stats->inter_node_payload_bytes += static_cast<int64_t>(payload);
    stats->inter_node_meta_bytes += static_cast<int64_t>(n - payload);
  }
  return Status::ok();
}

// Copies source `src`'s rows into its experts' rows of recv_x, after those of
// lower source ranks (sources go in ascending rank), with their sources;
// checks the block against the counts `sig` announced.
Status LowLatencyBuffer::Impl::expand_from(int src, const int64_t* sig, const LowLatencyDispatchInputs& in) {
  const int64_t rows = sig[kSigRows], pairs = announced_pairs(sig);
  const DispatchBlock b = DispatchBlock::at(inbox_of(src), rows, pairs, config.combine_per_rank);
  const int64_t rows_per_expert = static_cast<int64_t>(num_ranks) * capacity;
  for (int e = 0; e < num_local; ++e)
    row_end[e] = next_row[e] + recv_counts[static_cast<std::size_t>(src) * max_local + e];
  int64_t pair = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int32_t t = b.row_meta[2 * i], n = b.row_meta[2 * i + 1];
    if (t < 0 || t >= config.max_tokens_per_rank || n < 1 || pair + n > pairs)
      return internal_error("rank {} sent rank {} a row for token {} with {} pairs after {} of {}", src, rank, t, n,
                            pair, pairs);
    const std::byte* x = src == rank ? in.x.row<std::byte>(t) : b.x + i * row_bytes;
    if (config.combine_per_rank) {
      HeldRow& h = held[static_cast<std::size_t>(src) * config.max_tokens_per_rank + i];
      h.token = t;
      h.first_slot = b.pairs[2 * pair + 1];
      h.first_pair = pair;
      h.num_pairs = n;
    }
    for (const int64_t last = pair + n; pair < last; ++pair) {
      const int32_t e = b.pairs[2 * pair], k = b.pairs[2 * pair + 1];
      if (e < 0 || e >= num_local || k < 0 || k >= config.max_topk || next_row[e] >= row_end[e])
        return internal_error("rank {} sent rank {} token {} for local expert {} slot {} beyond its announced counts",
                              src, rank, t, e, k);
      const int64_t j = next_row[e]++;
      std::memcpy(recv_row(e, j), x, row_bytes);
      const std::size_t o = static_cast<std::size_t>(e) * rows_per_expert + j;
      src_rank[o] = src;
      src_idx[o] = t;
      src_slot[o] = k;
      if (config.combine_per_rank) {
        const std::size_t p = static_cast<std::size_t>(src) * config.max_tokens_per_rank * pairs_per_row() + pair;
        held_pair_row[p] = static_cast<int64_t>(o);
        held_pair_weight[p] = b.weights[pair];
      }
    }
  }
  held_rows[src] = rows;
  for (int e = 0; e < num_local; ++e)
    if (next_row[e] != row_end[e])
      return internal_error("rank {} sent rank {} {} rows fewer than it announced for local expert {}", src, rank,
                            row_end[e] - next_row[e], e);
  return Status::ok();
}

// Counts and the -1 sources past them, once every source is in.
void LowLatencyBuffer::Impl::finish_experts(int64_t* received) {
  const int64_t rows_per_expert = static_cast<int64_t>(num_ranks) * capacity;
  *received = 0;
  for (int e = 0; e < num_local; ++e) {
    const std::size_t base = static_cast<std::size_t>(e) * rows_per_expert;
    const int64_t n = next_row[e];
    std::fill(src_rank.begin() + base + n, src_rank.begin() + base + rows_per_expert, -1);
    std::fill(src_idx.begin() + base + n, src_idx.begin() + base + rows_per_expert, -1);
    std::fill(src_slot.begin() + base + n, src_slot.begin() + base + rows_per_expert, -1);
    counts_out[e] = static_cast<int32_t>(n);
    *received += n;
  }
}

// The signal's status words: this rank's rejection of its own input, else
// the first expert over capacity, else OK.
void LowLatencyBuffer::Impl::dispatch_status(const Status& local_status, int64_t* status) const {
  status[0] = local_status.is_ok() ? kSignalOk : kSignalRejected;
  status[1] = status[2] = status[3] = 0;
  for (int e = 0; e < config.num_experts && status[0] == kSignalOk; ++e) {
    const int64_t n = send_counts[static_cast<std::size_t>(placement.rank_of(e)) * max_local + placement.local_id(e)];
    if (n > capacity) {
      status[0] = kSignalOverflow;
      status[1] = e;
      status[2] = n;
      status[3] = capacity;
    }
  }
}

// Hears from every rank (a remote source's message stays in its own part of
// the receive staging).
Status LowLatencyBuffer::Impl::hear_dispatch(int64_t seq, const Deadline& deadline) {
  return hear_from_all(
      local().dispatch_sig, kTagDispatch, seq, "a low-latency dispatch", true, deadline,
      [this](int src, const int64_t* sig, std::size_t bytes) { return check_dispatch_message(src, sig, bytes); },
      [this](int src, const int64_t* sig) { return record_dispatch_signal(src, sig); });
}

// A remote source's dispatch message: its counts fit, and its size is what
// they announce.
Status LowLatencyBuffer::Impl::check_dispatch_message(int src, const int64_t* sig, std::size_t bytes) const {
  EPX_RETURN_IF_ERROR(check_counts(src, sig));
  const std::size_t expected =
      header_bytes + DispatchBlock::bytes(sig[kSigRows], announced_pairs(sig), config.combine_per_rank, row_bytes);
  if (bytes != expected)
    return internal_error("low-latency dispatch message from rank {} was {} bytes for {} rows, expected {}", src,
                          bytes, sig[kSigRows], expected);
  return Status::ok();
}

// A source's status and per-expert counts, once heard from.
Status LowLatencyBuffer::Impl::record_dispatch_signal(int src, const int64_t* sig) {
  EPX_RETURN_IF_ERROR(check_counts(src, sig));
  std::copy(sig + kSigStatus, sig + kSigStatus + 4, &peer_status[static_cast<std::size_t>(src) * 4]);
  for (int e = 0; e < max_local; ++e) recv_counts[static_cast<std::size_t>(src) * max_local + e] = sig[kSigCounts + e];
  return Status::ok();
}

// Lays every source's rows out, in ascending source rank; `received` rows in all.
Status LowLatencyBuffer::Impl::expand_all(const LowLatencyDispatchInputs& in, int64_t* received,
                                          const Deadline& deadline) {
  std::fill(next_row.begin(), next_row.end(), 0);
  for (int s = 0; s < num_ranks; ++s) {
    Status st = expand_from(s, dispatch_sig_of(s), in);
    if (!st.is_ok()) return fail(std::move(st), deadline);
  }
  finish_experts(received);
  return Status::ok();
}

// What combine needs of this rank's own tokens: their experts and weights.
void LowLatencyBuffer::Impl::keep_routing(const LowLatencyDispatchInputs& in, int T, int K) {
  num_tokens = T;
  topk = K;
  const int MK = config.max_topk;
  for (int t = 0; t < T; ++t) {
    const int32_t* row = in.topk_idx.row<int32_t>(t);
    const float* w = in.topk_weights.defined() ? in.topk_weights.row<float>(t) : nullptr;
    for (int k = 0; k < K; ++k) {
      topk_idx[static_cast<std::size_t>(t) * MK + k] = row[k];
      weights[static_cast<std::size_t>(t) * MK + k] = w ? w[k] : 1.0f;
    }
  }
}

// The views of dispatch `seq`'s result (all but its stats).
void LowLatencyBuffer::Impl::fill_dispatch_result(int64_t seq, LowLatencyDispatchResult* out) const {
  const int64_t EN = num_local, rows_per_expert = num_ranks * capacity;
  out->recv_x = TensorView::contiguous(local().recv_x, config.dtype, {EN, rows_per_expert, config.hidden});
  out->num_recv_tokens_per_expert = TensorView::contiguous(counts_out.data(), DType::kI32, {EN});
  out->recv_src_rank = TensorView::contiguous(src_rank.data(), DType::kI32, {EN, rows_per_expert});
  out->recv_src_idx = TensorView::contiguous(src_idx.data(), DType::kI32, {EN, rows_per_expert});
  out->recv_src_slot = TensorView::contiguous(src_slot.data(), DType::kI32, {EN, rows_per_expert});
  out->handle = LowLatencyHandle{id, seq};
}

Status LowLatencyBuffer::dispatch_blocking(const LowLatencyDispatchInputs& in, LowLatencyDispatchResult* out) {
  Impl& m = *impl_;
  if (!m.poisoned.is_ok()) return m.poisoned;
  Stopwatch watch;
  const Deadline deadline = Deadline::after(m.config.timeout);
  const Status local_status = out ? m.validate_dispatch(in) : invalid_argument("dispatch needs an output");
  const int64_t seq = ++m.dispatch_seq;
  m.dispatch_ok = false;
  m.combined = false;
  // No combine since the last dispatch: a peer may still read its inbox.
  EPX_RETURN_IF_ERROR(
      m.enter_call(Impl::LastCall::kDispatch, m.last_call == Impl::LastCall::kDispatch, deadline));

  const int T = local_status.is_ok() ? static_cast<int>(in.topk_idx.size(0)) : 0;
  const int K = local_status.is_ok() ? static_cast<int>(in.topk_idx.size(1)) : 0;
  m.count_rows(in, T, K);
  int64_t status[4];
  m.dispatch_status(local_status, status);
  const bool send_rows = status[0] == kSignalOk;
  ExchangeStats stats;
  m.place_blocks(send_rows);
  if (send_rows) m.write_rows(in, T, K, &stats);
  EPX_RETURN_IF_ERROR(m.publish_dispatch(status, send_rows, seq, deadline, &stats));
  EPX_RETURN_IF_ERROR(m.hear_dispatch(seq, deadline));
  EPX_RETURN_IF_ERROR(m.finish_call(local_status, "dispatch", deadline));
  int64_t received = 0;
  EPX_RETURN_IF_ERROR(m.expand_all(in, &received, deadline));
  m.keep_routing(in, T, K);
  m.dispatch_ok = true;

  m.fill_dispatch_result(seq, out);
  stats.rows_received = received;
  stats.seconds = watch.seconds();
  out->stats = stats;
  return Status::ok();
}

Status LowLatencyBuffer::Impl::validate_combine(const TensorView& y, const LowLatencyHandle& handle,
                                                const TensorView& out) const {
  if (handle.buffer_id != id || handle.seq != dispatch_seq || !dispatch_ok)
    return invalid_argument("the handle (dispatch {}) is not the latest successful dispatch ({}) of this buffer",
                            handle.seq, dispatch_seq);
  if (combined) return failed_precondition("dispatch {} was combined already; dispatch again first", handle.seq);
  if (!is_payload_dtype(y.dtype()) || dtype_size(y.dtype()) > dtype_size(config.max_combine_dtype))
    return invalid_argument("y is {}; combine takes bf16 or f32 up to max_combine_dtype = {}", dtype_name(y.dtype()),
                            dtype_name(config.max_combine_dtype));
  const int64_t rows = static_cast<int64_t>(num_ranks) * capacity;
  if (y.ndim() != 3 || y.size(0) != num_local || y.size(1) != rows || y.size(2) != config.hidden || !y.is_contiguous() ||
      y.device().kind != DeviceKind::kHost)
    return invalid_argument("y must be a dense host [{}, {}, {}] array (local experts, ranks x capacity, hidden), got {}",
                            num_local, rows, config.hidden, y.describe());
  if (!is_payload_dtype(out.dtype())) return invalid_argument("out is {}; use bf16 or f32", dtype_name(out.dtype()));
  return check_matrix(out, "out", out.dtype(), num_tokens, config.hidden);
}

Status LowLatencyBuffer::combine_blocking(const TensorView& y, const LowLatencyHandle& handle, const TensorView& out) {
  Impl& m = *impl_;
  if (!m.poisoned.is_ok()) return m.poisoned;
  const Deadline deadline = Deadline::after(m.config.timeout);
  const Status local_status = m.validate_combine(y, handle, out);
  const int64_t seq = ++m.combine_seq;
  // A combine after a combine: a peer may still read this rank's last signal.
  EPX_RETURN_IF_ERROR(
      m.enter_call(Impl::LastCall::kCombine, m.last_call != Impl::LastCall::kDispatch, deadline));
  const bool send_rows = local_status.is_ok();
  if (send_rows) m.combined = true;
  const std::size_t y_row = send_rows ? static_cast<std::size_t>(m.config.hidden) * dtype_size(y.dtype()) : 0;

  m.size_combine_messages(send_rows, y_row);
  if (send_rows) {
    if (m.config.combine_per_rank)
      m.stage_rank_sums(y, y_row);
    else
      m.stage_pair_rows(y, y_row);
  }
  // Signals only after the peers' rows are out of y. This rank's own rows
  // stay in y until the sum below (y may be recv_x, which only this rank's
  // next dispatch overwrites: peers write into its inbox).
  const int64_t y_dtype = send_rows ? static_cast<int64_t>(y.dtype()) : 0;
  EPX_RETURN_IF_ERROR(m.publish_combine(send_rows, y_dtype, y_row, seq, deadline));
  EPX_RETURN_IF_ERROR(m.hear_combine(seq, deadline));
  EPX_RETURN_IF_ERROR(m.finish_call(local_status, "combine", deadline));

  m.sum_combine(y, y_row, out);
  return Status::ok();
}

// Messages to other nodes: one per source rank, rows in (expert, row)
// order; where each lies in the send staging.
void LowLatencyBuffer::Impl::size_combine_messages(bool send_rows, std::size_t y_row) {
  int64_t staged = 0;
  for (int s = 0; s < num_ranks; ++s) {
    if (same_node(s)) continue;
    int64_t n = 0;
    if (config.combine_per_rank && send_rows) n = held_rows[s];
    for (int e = 0; e < num_local && send_rows && !config.combine_per_rank; ++e)
      n += recv_counts[static_cast<std::size_t>(s) * max_local + e];
    rows_to[s] = n;
    block_of[s] = staged;
    fill[s] = 0;
    staged += static_cast<int64_t>(header_bytes + n * (8 + y_row));
  }
  EPX_CHECK(static_cast<std::size_t>(staged) <= send_staging.size());
}

// The status and y's dtype to every source rank, then the sequence number
// (inside the node) or the message (other nodes).
Status LowLatencyBuffer::Impl::publish_combine(bool send_rows, int64_t y_dtype, std::size_t y_row, int64_t seq,
                                               const Deadline& deadline) {
  for (int s = 0; s < num_ranks; ++s) {
    const bool near = same_node(s);
    int64_t* sig = near ? regions[s].combine_sig + static_cast<std::size_t>(rank) * sig_words
                        : reinterpret_cast<int64_t*>(send_staging.data() + block_of[s]);
    sig[kSigStatus] = send_rows ? kSignalOk : kSignalRejected;
    sig[kSigA] = y_dtype;
    sig[kSigB] = near ? 0 : rows_to[s];
    if (near) {
      store_release(sig + kSigSeq, seq);
      continue;
    }
    sig[kSigSeq] = seq;
    const std::size_t n = header_bytes + static_cast<std::size_t>(rows_to[s]) * (8 + y_row);
    auto request = transport.send_async(s, kTagCombine, {send_staging.data() + block_of[s], n});
    if (!request.is_ok()) return fail(request.status(), deadline);
    requests.push_back(std::move(*request));
  }
  return Status::ok();
}

// Hears from every owner; rows from other nodes go into this rank's slots.
Status LowLatencyBuffer::Impl::hear_combine(int64_t seq, const Deadline& deadline) {
  return hear_from_all(
      local().combine_sig, kTagCombine, seq, "a low-latency combine", false, deadline,
      [this](int owner, const int64_t* sig, std::size_t bytes) { return unpack_combine_message(owner, sig, bytes); },
      [this](int owner, const int64_t* sig) { return record_combine_signal(owner, sig); });
}

// An owner's status and the dtype of the rows it sent.
Status LowLatencyBuffer::Impl::record_combine_signal(int owner, const int64_t* sig) {
  if (sig[kSigStatus] == kSignalOk && !is_payload_dtype(static_cast<DType>(sig[kSigA])))
    return internal_error("rank {} announced combine rows of dtype #{}", owner, sig[kSigA]);
  peer_status[static_cast<std::size_t>(owner) * 4] = sig[kSigStatus];
  owner_dtype[owner] = sig[kSigA];
  return Status::ok();
}

// A remote owner's message: each (token, slot) row into its combine slot.
Status LowLatencyBuffer::Impl::unpack_combine_message(int owner, const int64_t* sig, std::size_t bytes) {
  EPX_RETURN_IF_ERROR(record_combine_signal(owner, sig));
  const std::size_t row =
      sig[kSigStatus] == kSignalOk ? static_cast<std::size_t>(config.hidden) * dtype_size(static_cast<DType>(sig[kSigA]))
                                   : 0;
  const int64_t n = sig[kSigB];
  const std::size_t expected = header_bytes + static_cast<std::size_t>(n) * (8 + row);
  if (n < 0 || bytes != expected)
    return internal_error("low-latency combine message from rank {} was {} bytes for {} rows, expected {}", owner,
                          bytes, n, expected);
  const auto* meta = reinterpret_cast<const int32_t*>(recv_staging.data() + header_bytes);
  const std::byte* rows = recv_staging.data() + header_bytes + n * 8;
  for (int64_t i = 0; i < n; ++i) {
    const int t = meta[2 * i], k = meta[2 * i + 1];
    if (t < 0 || t >= num_tokens || k < 0 || k >= topk)
      return internal_error("rank {} sent a combine row for (token {}, slot {}) but rank {} has {} tokens of top-{}",
                            owner, t, k, rank, num_tokens, topk);
    std::memcpy(local().combine + (static_cast<std::size_t>(t) * config.max_topk + k) * combine_row_bytes,
                rows + i * row, row);
  }
  return Status::ok();
}

// Where the row for slot (t, k) of source s goes: its combine slot inside the
// node, the next row of its message otherwise (with its (t, k)).
std::byte* LowLatencyBuffer::Impl::combine_dst(int s, int t, int k, std::size_t y_row) {
  if (same_node(s)) return regions[s].combine + (static_cast<std::size_t>(t) * config.max_topk + k) * combine_row_bytes;
  std::byte* block = send_staging.data() + block_of[s];
  const int64_t i = fill[s]++;
  auto* meta = reinterpret_cast<int32_t*>(block + header_bytes) + 2 * i;
  meta[0] = t;
  meta[1] = k;
  return block + header_bytes + rows_to[s] * 8 + i * y_row;
}

// One row per (token, expert): y's rows as they are. This rank's own
// tokens' rows stay in y, read by sum_combine.
void LowLatencyBuffer::Impl::stage_pair_rows(const TensorView& y, std::size_t y_row) {
  const int64_t rows_per_expert = static_cast<int64_t>(num_ranks) * capacity;
  for (int e = 0; e < num_local; ++e) {
    const std::size_t base = static_cast<std::size_t>(e) * rows_per_expert;
    for (int64_t j = 0; j < counts_out[e]; ++j) {
      const int s = src_rank[base + j], t = src_idx[base + j], k = src_slot[base + j];
      if (s == rank) {
        own_row[static_cast<std::size_t>(t) * config.max_topk + k] = static_cast<int64_t>(base + j);
        continue;
      }
      std::memcpy(combine_dst(s, t, k, y_row), y.data_as<std::byte>() + (base + j) * y_row, y_row);
    }
  }
}

// combine_per_rank: one row per (source, token), at the token's first slot
// on this rank: sum over its slots k here, ascending, of w[t][k] * y(t, k) in
// fp32 from 0, rounded once to y's dtype.
void LowLatencyBuffer::Impl::stage_rank_sums(const TensorView& y, std::size_t y_row) {
  const std::size_t pairs_per_source = static_cast<std::size_t>(config.max_tokens_per_rank) * pairs_per_row();
  for (int s = 0; s < num_ranks; ++s) {
    for (int64_t i = 0; i < held_rows[s]; ++i) {
      const HeldRow& h = held[static_cast<std::size_t>(s) * config.max_tokens_per_rank + i];
      for (int64_t p = 0; p < h.num_pairs; ++p) {
        const std::size_t q = s * pairs_per_source + h.first_pair + p;
        sum_rows[p] = y.data_as<std::byte>() + held_pair_row[q] * y_row;
        sum_weights[p] = held_pair_weight[q];
      }
      detail::weighted_partial(combine_dst(s, h.token, h.first_slot, y_row), y.dtype(), sum_rows.data(),
                               sum_weights.data(), static_cast<int>(h.num_pairs), y.dtype(), config.hidden);
    }
  }
}

// out[t] = sum over k ascending of w[t][k] * y(t, k), in fp32; with
// combine_per_rank, the sum of the owners' rows in the order of their first
// slot k. One rounding to out's dtype. A token's rows are summed side by side
// (weighted_partial) when they share a dtype, as they do unless owners sent
// y of different dtypes; then one row at a time, with the same order.
void LowLatencyBuffer::Impl::sum_combine(const TensorView& y, std::size_t y_row, const TensorView& out) {
  const int MK = config.max_topk;
  for (int t = 0; t < num_tokens; ++t) {
    const int32_t* idx = &topk_idx[static_cast<std::size_t>(t) * MK];
    int n = 0;
    DType dtype = y.dtype();
    bool one_dtype = true;
    for (int k = 0; k < topk; ++k) {
      if (idx[k] < 0) continue;
      const std::size_t slot = static_cast<std::size_t>(t) * MK + k;
      const int owner = placement.rank_of(idx[k]);
      if (config.combine_per_rank && first_slot_on(idx, k, owner) != k) continue;
      const auto row_dtype = static_cast<DType>(owner_dtype[owner]);
      one_dtype = one_dtype && (n == 0 || row_dtype == dtype);
      dtype = row_dtype;
      const bool own = owner == rank && !config.combine_per_rank;
      sum_rows[n] = own ? y.data_as<std::byte>() + own_row[slot] * y_row : local().combine + slot * combine_row_bytes;
      sum_weights[n] = config.combine_per_rank ? 1.0f : weights[slot];
      row_dtypes[n++] = row_dtype;
    }
    if (one_dtype) {
      detail::weighted_partial(out.row<std::byte>(t), out.dtype(), sum_rows.data(), sum_weights.data(), n, dtype,
                               config.hidden);
    } else {
      sum_mixed_rows(n, out.row<std::byte>(t), out.dtype());
    }
  }
}

// One token's n rows of sum_rows (dtypes row_dtypes) weighted and added one
// at a time, in fp32 from 0, into out.
void LowLatencyBuffer::Impl::sum_mixed_rows(int n, std::byte* out, DType out_dtype) {
  std::fill(acc.begin(), acc.end(), 0.0f);
  for (int i = 0; i < n; ++i)
    detail::accumulate_weighted(acc.data(), sum_weights[i], sum_rows[i], row_dtypes[i], config.hidden);
  detail::store(out, out_dtype, acc.data(), config.hidden);
}

}  // namespace epx
