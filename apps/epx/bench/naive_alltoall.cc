#include "naive_alltoall.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/simd_clones.h"
#include "epx/exchange/layout.h"

namespace epx::bench {

namespace {

constexpr int kTagDispatch = 0x4e41;  // "NA"
constexpr int kTagCombine = 0x4e42;

// The unpermute's row loops, compiled like epx's row kernels (the same
// AVX-512 / AVX2 / baseline clones, src/core/simd_clones.h), so the baseline
// is not a scalar loop for baseline x86-64 against epx's vector code.
EPX_SIMD_CLONES void add_weighted_row(float* acc, float w, const float* src, int64_t n) {
  for (int64_t c = 0; c < n; ++c) acc[c] += w * src[c];
}

EPX_SIMD_CLONES void add_weighted_row(float* acc, float w, const uint16_t* src, int64_t n) {
  for (int64_t c = 0; c < n; ++c) acc[c] += w * bf16_to_f32(src[c]);
}

EPX_SIMD_CLONES void store_row(float* dst, const float* acc, int64_t n) {
  for (int64_t c = 0; c < n; ++c) dst[c] = acc[c];
}

EPX_SIMD_CLONES void store_row(uint16_t* dst, const float* acc, int64_t n) {
  for (int64_t c = 0; c < n; ++c) dst[c] = f32_to_bf16(acc[c]);
}

// out = sum over k of w[k] * rows[k], in fp32 in slot order, stored as T.
template <typename T>
void unpermute(const std::byte* rows, std::size_t row_bytes, const std::vector<int64_t>& slot_row,
               const float* weights, int num_tokens, int topk, int64_t hidden, const TensorView& out) {
  std::vector<float> acc(hidden);
  for (int t = 0; t < num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < topk; ++k) {
      const int64_t r = slot_row[static_cast<std::size_t>(t) * topk + k];
      if (r < 0) continue;
      const float w = weights ? weights[static_cast<std::size_t>(t) * topk + k] : 1.0f;
      add_weighted_row(acc.data(), w, reinterpret_cast<const T*>(rows + r * row_bytes), hidden);
    }
    store_row(out.row<T>(t), acc.data(), hidden);
  }
}

}  // namespace

std::size_t NaiveAllToAll::bytes_needed(const NaiveConfig& config) {
  const std::size_t row_bytes = static_cast<std::size_t>(config.hidden) * dtype_size(config.dtype);
  return 3 * std::max<std::size_t>(static_cast<std::size_t>(std::max<int64_t>(config.max_rows, 0)) * row_bytes, kCacheLine);
}

Result<std::unique_ptr<NaiveAllToAll>> NaiveAllToAll::create(Transport& transport, NaiveConfig config) {
  if (config.hidden < 1) return invalid_argument("hidden = {} must be at least 1", config.hidden);
  if (config.dtype != DType::kF32 && config.dtype != DType::kBF16)
    return invalid_argument("dtype {} is not supported by the naive baseline (f32 or bf16)", dtype_name(config.dtype));
  if (config.max_rows < 0) return invalid_argument("max_rows = {} must be at least 0", config.max_rows);
  if (config.max_topk < 1) return invalid_argument("max_topk = {} must be at least 1", config.max_topk);
  Result<ExpertPlacement> placement = config.placement
                                          ? Result<ExpertPlacement>(*config.placement)
                                          : ExpertPlacement::contiguous(config.num_experts, transport.num_ranks());
  if (!placement.is_ok()) return placement.status();
  if (placement->num_ranks() != transport.num_ranks())
    return invalid_argument("the placement is for {} ranks but the transport has {}", placement->num_ranks(),
                            transport.num_ranks());
  std::unique_ptr<NaiveAllToAll> self(
      new NaiveAllToAll(transport, std::move(config), std::move(placement).value()));
  const std::size_t region = std::max<std::size_t>(static_cast<std::size_t>(self->config_.max_rows) * self->row_bytes_,
                                                   kCacheLine);
  EPX_ASSIGN_OR_RETURN(self->send_region_,
                       transport.map_peer_memory(region, Deadline::after(self->config_.timeout)));
  self->recv_rows_ = AlignedBuffer(region, 4096);
  self->sorted_rows_ = AlignedBuffer(region, 4096);
  return self;
}

NaiveAllToAll::NaiveAllToAll(Transport& transport, NaiveConfig config, ExpertPlacement placement)
    : transport_(transport), config_(std::move(config)), placement_(std::move(placement)) {
  row_bytes_ = static_cast<std::size_t>(config_.hidden) * dtype_size(config_.dtype);
  for (int r = 0; r < placement_.num_ranks(); ++r)
    max_local_experts_ = std::max(max_local_experts_, placement_.num_local_experts(r));
}

NaiveAllToAll::~NaiveAllToAll() = default;

std::span<std::byte> NaiveAllToAll::scratch(int i) const {
  const AlignedBuffer& b = i == 0 ? recv_rows_ : sorted_rows_;
  return {b.data(), b.size()};
}

std::size_t NaiveAllToAll::bytes() const { return send_region_->size() + recv_rows_.size() + sorted_rows_.size(); }

Status NaiveAllToAll::exchange(const std::byte* send_base, const std::vector<int64_t>& send_offset,
                               const std::vector<int64_t>& send_rows, std::byte* recv_base,
                               const std::vector<int64_t>& recv_offset, const std::vector<int64_t>& recv_rows,
                               const std::vector<int64_t>& peer_offset, int tag, const Deadline& deadline) {
  const Topology& topo = transport_.topology();
  const int me = transport_.rank();
  const int num_ranks = topo.num_ranks();
  std::vector<Request> requests;
  for (int d = 0; d < num_ranks; ++d) {
    if (topo.same_node(me, d) || send_rows[d] == 0) continue;
    EPX_ASSIGN_OR_RETURN(Request request,
                         transport_.send_async(d, tag, {send_base + send_offset[d] * row_bytes_,
                                                        static_cast<std::size_t>(send_rows[d]) * row_bytes_}));
    requests.push_back(std::move(request));
  }
  // Everyone packed before the collective that precedes this call, so the
  // peers' send regions are complete: pull this rank's slices out of them.
  for (int step = 0; step < num_ranks; ++step) {
    const int s = (me + step) % num_ranks;
    if (recv_rows[s] == 0) continue;
    std::byte* dst = recv_base + recv_offset[s] * row_bytes_;
    const std::size_t bytes = static_cast<std::size_t>(recv_rows[s]) * row_bytes_;
    if (topo.same_node(me, s)) {
      std::memcpy(dst, send_region_->peer(s) + peer_offset[s] * row_bytes_, bytes);
    } else {
      EPX_ASSIGN_OR_RETURN(std::size_t got, transport_.recv(s, tag, {dst, bytes}, deadline));
      if (got != bytes)
        return internal_error("naive all-to-all: rank {} got {} bytes from rank {}, expected {}", me, got, s, bytes);
    }
  }
  for (Request& request : requests) EPX_RETURN_IF_ERROR(request.wait(deadline));
  // Nobody reuses its send region before every peer has read it.
  return transport_.barrier(deadline);
}

Status NaiveAllToAll::fail(Status status) {
  transport_.abort(status);
  return status;
}

Status NaiveAllToAll::check_dispatch(const TensorView& x, const TensorView& topk_idx) const {
  if (topk_idx.ndim() != 2) return invalid_argument("topk_idx must be 2-D, got {}", topk_idx.describe());
  const int64_t topk = topk_idx.size(1);
  if (topk > config_.max_topk) return invalid_argument("topk = {} is above max_topk = {}", topk, config_.max_topk);
  EPX_RETURN_IF_ERROR(check_matrix(x, "x", config_.dtype, topk_idx.size(0), config_.hidden));
  return validate_topk_idx(topk_idx, placement_.num_experts());
}

// The (token, expert) pairs per (destination rank, local expert).
std::vector<int64_t> NaiveAllToAll::count_pairs(const TensorView& topk_idx) const {
  const int el = max_local_experts_;
  std::vector<int64_t> counts(static_cast<std::size_t>(transport_.num_ranks()) * el, 0);
  for (int64_t t = 0; t < topk_idx.size(0); ++t)
    for (int64_t k = 0; k < topk_idx.size(1); ++k) {
      const int32_t e = topk_idx.row<int32_t>(t)[k];
      if (e >= 0) ++counts[static_cast<std::size_t>(placement_.rank_of(e)) * el + placement_.local_id(e)];
    }
  return counts;
}

// Each destination's rows and where they start in the send region (by rank,
// then local expert); returns the first send row of each (rank, local expert).
std::vector<int64_t> NaiveAllToAll::plan_send(const std::vector<int64_t>& counts) {
  const int num_ranks = transport_.num_ranks(), el = max_local_experts_;
  std::vector<int64_t> cursor(counts.size());
  send_offset_.assign(num_ranks, 0);
  send_rows_.assign(num_ranks, 0);
  int64_t total = 0;
  for (int d = 0; d < num_ranks; ++d) {
    send_offset_[d] = total;
    for (int j = 0; j < el; ++j) {
      cursor[static_cast<std::size_t>(d) * el + j] = total;
      total += counts[static_cast<std::size_t>(d) * el + j];
    }
    send_rows_[d] = total - send_offset_[d];
  }
  return cursor;
}

// One copy of each token per (token, expert) pair into its send row; the
// routes (slot_row_) for combine.
void NaiveAllToAll::pack(const TensorView& x, const TensorView& topk_idx, std::vector<int64_t>& cursor) {
  const int el = max_local_experts_;
  num_tokens_ = static_cast<int>(topk_idx.size(0));
  topk_ = static_cast<int>(topk_idx.size(1));
  slot_row_.assign(static_cast<std::size_t>(num_tokens_) * topk_, -1);
  std::byte* send = send_region_->local();
  for (int t = 0; t < num_tokens_; ++t) {
    const std::byte* src = x.row<std::byte>(t);
    for (int k = 0; k < topk_; ++k) {
      const int32_t e = topk_idx.row<int32_t>(t)[k];
      if (e < 0) continue;
      const int64_t row = cursor[static_cast<std::size_t>(placement_.rank_of(e)) * el + placement_.local_id(e)]++;
      slot_row_[static_cast<std::size_t>(t) * topk_ + k] = row;
      std::memcpy(send + row * row_bytes_, src, row_bytes_);
    }
  }
}

// The sizes' all-to-all: block d = [my send offset for d, counts for d's
// local experts]. Sets where each source's rows land (rank-major) and its
// chunks per local expert.
Status NaiveAllToAll::exchange_sizes(const std::vector<int64_t>& counts, const Deadline& deadline) {
  const int num_ranks = transport_.num_ranks(), el = max_local_experts_, block = 1 + el;
  std::vector<int64_t> size_out(static_cast<std::size_t>(num_ranks) * block), size_in(size_out.size());
  for (int d = 0; d < num_ranks; ++d) {
    size_out[static_cast<std::size_t>(d) * block] = send_offset_[d];
    for (int j = 0; j < el; ++j)
      size_out[static_cast<std::size_t>(d) * block + 1 + j] = counts[static_cast<std::size_t>(d) * el + j];
  }
  EPX_RETURN_IF_ERROR(transport_.all_to_all(std::span<const int64_t>(size_out), std::span<int64_t>(size_in), deadline));
  peer_send_offset_.assign(num_ranks, 0);
  recv_offset_.assign(num_ranks, 0);
  recv_rows_count_.assign(num_ranks, 0);
  recv_chunk_.assign(static_cast<std::size_t>(num_ranks) * el, 0);
  num_recv_ = 0;
  for (int s = 0; s < num_ranks; ++s) {
    peer_send_offset_[s] = size_in[static_cast<std::size_t>(s) * block];
    recv_offset_[s] = num_recv_;
    for (int j = 0; j < el; ++j) {
      const int64_t n = size_in[static_cast<std::size_t>(s) * block + 1 + j];
      recv_chunk_[static_cast<std::size_t>(s) * el + j] = n;
      recv_rows_count_[s] += n;
    }
    num_recv_ += recv_rows_count_[s];
  }
  return Status::ok();
}

// fn(rank-major row, expert-major row, rows, local expert) for each
// non-empty chunk (the rows of one source for one local expert), in
// expert-major order: Megatron's sort_chunks_by_idxs, either way.
template <typename Fn>
void NaiveAllToAll::for_each_chunk(Fn&& fn) const {
  const int num_ranks = transport_.num_ranks(), el = max_local_experts_;
  std::vector<int64_t> chunk_start(recv_offset_);
  int64_t row = 0;
  for (int j = 0; j < el; ++j) {
    for (int s = 0; s < num_ranks; ++s) {
      const int64_t n = recv_chunk_[static_cast<std::size_t>(s) * el + j];
      if (n == 0) continue;
      fn(chunk_start[s], row, n, j);
      chunk_start[s] += n;
      row += n;
    }
  }
}

Status NaiveAllToAll::dispatch(const TensorView& x, const TensorView& topk_idx, NaiveDispatchResult* out) {
  const Deadline deadline = Deadline::after(config_.timeout);
  const int me = transport_.rank();
  if (Status s = check_dispatch(x, topk_idx); !s.is_ok()) return fail(s);
  const std::vector<int64_t> counts = count_pairs(topk_idx);
  std::vector<int64_t> cursor = plan_send(counts);
  const int64_t total = send_offset_.back() + send_rows_.back();
  if (total > config_.max_rows)
    return fail(resource_exhausted("rank {} would send {} (token, expert) rows, above max_rows = {}", me, total,
                                   config_.max_rows));
  pack(x, topk_idx, cursor);
  EPX_RETURN_IF_ERROR(exchange_sizes(counts, deadline));
  if (num_recv_ > config_.max_rows)
    return fail(resource_exhausted("rank {} would receive {} (token, expert) rows, above max_rows = {}", me,
                                   num_recv_, config_.max_rows));

  // Payload: one all-to-all-v into rank-major order, then expert-major.
  EPX_RETURN_IF_ERROR(exchange(send_region_->local(), send_offset_, send_rows_, recv_rows_.data(), recv_offset_,
                               recv_rows_count_, peer_send_offset_, kTagDispatch, deadline));
  const int num_local = placement_.num_local_experts(me);
  out->num_recv_tokens_per_expert.assign(num_local, 0);
  std::byte* sorted = sorted_rows_.data();
  for_each_chunk([&](int64_t rank_row, int64_t expert_row, int64_t n, int j) {
    std::memcpy(sorted + expert_row * row_bytes_, recv_rows_.data() + rank_row * row_bytes_,
                static_cast<std::size_t>(n) * row_bytes_);
    if (j < num_local) out->num_recv_tokens_per_expert[j] += n;
  });
  out->recv_x = TensorView::contiguous(sorted, config_.dtype, {num_recv_, config_.hidden});
  out->rows_sent = total;
  out->rows_received = num_recv_;
  dispatched_ = true;
  return Status::ok();
}

Status NaiveAllToAll::combine(const TensorView& y, const TensorView& topk_weights, const TensorView& out) {
  const Deadline deadline = Deadline::after(config_.timeout);
  const int num_ranks = transport_.num_ranks();
  const int64_t hidden = config_.hidden;
  if (!dispatched_) return fail(failed_precondition("naive combine called before any dispatch"));
  if (Status s = check_matrix(y, "y", config_.dtype, num_recv_, hidden); !s.is_ok()) return fail(s);
  if (Status s = check_matrix(out, "out", config_.dtype, num_tokens_, hidden); !s.is_ok()) return fail(s);
  if (topk_weights.defined())
    if (Status s = check_matrix(topk_weights, "topk_weights", DType::kF32, num_tokens_, topk_); !s.is_ok())
      return fail(s);

  // Expert-major -> rank-major, into this rank's send region.
  std::byte* send = send_region_->local();
  for_each_chunk([&](int64_t rank_row, int64_t expert_row, int64_t n, int) {
    std::memcpy(send + rank_row * row_bytes_, y.row<std::byte>(expert_row), static_cast<std::size_t>(n) * row_bytes_);
  });
  // Where each peer put my rows (this all-to-all also says everyone has packed).
  std::vector<int64_t> back_offset(num_ranks);
  EPX_RETURN_IF_ERROR(
      transport_.all_to_all(std::span<const int64_t>(recv_offset_), std::span<int64_t>(back_offset), deadline));
  EPX_RETURN_IF_ERROR(exchange(send, recv_offset_, recv_rows_count_, recv_rows_.data(), send_offset_, send_rows_,
                               back_offset, kTagCombine, deadline));

  // Unpermute: weighted sum of the K returned rows of each token.
  const float* w = topk_weights.defined() ? topk_weights.data_as<const float>() : nullptr;
  if (config_.dtype == DType::kBF16) {
    unpermute<uint16_t>(recv_rows_.data(), row_bytes_, slot_row_, w, num_tokens_, topk_, hidden, out);
  } else {
    unpermute<float>(recv_rows_.data(), row_bytes_, slot_row_, w, num_tokens_, topk_, hidden, out);
  }
  return Status::ok();
}

}  // namespace epx::bench
