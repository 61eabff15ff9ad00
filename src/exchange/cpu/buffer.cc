#include "epx/exchange/buffer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <numeric>

#include "exchange/cpu/buffer_impl.h"
#include "exchange/operation_queue.h"
#include "exchange/cpu/dispatch_header.h"

namespace epx {

using buffer_detail::is_payload_dtype;
using buffer_detail::Region;

namespace {

std::atomic<uint64_t> g_next_buffer_id{1};

// Where each of this rank's tokens lands on each destination (h.counts must
// be set), and the rank and weight of each of its top-k experts, for the
// combine.
void plan_token_rows(const DispatchLayout& layout, const DispatchInputs& in, const ExpertPlacement& placement,
                     int num_ranks, int rank, detail::HandleData& h) {
  const int R = num_ranks, T = h.num_tokens, topk = h.topk;
  h.send_row.assign(static_cast<std::size_t>(T) * R, -1);
  std::vector<int64_t> next_row(R);
  for (int d = 0; d < R; ++d) next_row[d] = detail::block_base(h.counts, R, rank, d);
  for (int t = 0; t < T; ++t)
    for (int d = 0; d < R; ++d)
      if (layout.in_rank(t, d)) h.send_row[static_cast<std::size_t>(t) * R + d] = static_cast<int32_t>(next_row[d]++);
  h.topk_rank.resize(static_cast<std::size_t>(T) * topk);
  for (int t = 0; t < T; ++t) {
    const int32_t* row = in.topk_idx.row<int32_t>(t);
    for (int k = 0; k < topk; ++k) h.topk_rank[t * topk + k] = row[k] < 0 ? -1 : placement.rank_of(row[k]);
  }
  h.topk_weights.resize(h.has_weights ? static_cast<std::size_t>(T) * topk : 0);
  for (int t = 0; t < T && h.has_weights; ++t)
    std::copy_n(in.topk_weights.row<float>(t), topk, h.topk_weights.data() + static_cast<std::size_t>(t) * topk);
}

}  // namespace

int Handle::num_tokens() const { return data_ ? data_->num_tokens : 0; }
int64_t Handle::num_recv_tokens() const { return data_ ? data_->num_recv : 0; }
int Handle::topk() const { return data_ ? data_->topk : 0; }

Buffer::Buffer(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)),
      split_(std::make_unique<Split>()),
      ops_(std::make_unique<detail::OperationQueue>(impl_->config.timeout)) {}
Buffer::~Buffer() = default;

const BufferConfig& Buffer::config() const { return impl_->config; }
const ExpertPlacement& Buffer::placement() const { return impl_->placement; }
int Buffer::num_local_experts() const { return impl_->placement.num_local_experts(impl_->rank); }
bool Buffer::hierarchical() const { return impl_->hierarchical; }
std::size_t Buffer::region_bytes() const { return impl_->memory ? impl_->memory->size() : 0; }

int64_t Buffer::estimate_region_bytes(const BufferConfig& config, int num_ranks) {
  const int64_t rows = detail::max_recv_rows(config, num_ranks);
  auto payload = detail::PayloadFormat::of(config);
  auto gradients = detail::PayloadFormat::gradients_of(config);
  int64_t row_bytes = payload.is_ok() ? static_cast<int64_t>(payload->row_bytes())
                                      : int64_t{config.hidden} * static_cast<int64_t>(dtype_size(config.dtype));
  if (gradients.is_ok()) row_bytes = std::max(row_bytes, static_cast<int64_t>(gradients->row_bytes()));
  const int64_t combine_row_bytes = int64_t{config.hidden} * static_cast<int64_t>(dtype_size(config.max_combine_dtype));
  // Every row's share of the region, with room for the alignment padding.
  const int64_t per_row = saturating_sum(row_bytes + combine_row_bytes, int64_t{4} * (1 + 4 * int64_t{config.max_topk}));
  if (saturating_product({rows, per_row, 2}) == kMemoryUnbounded) return kMemoryUnbounded;
  const int64_t combine_rows = detail::combine_region_rows(config, num_ranks);
  if (saturating_product({combine_rows, combine_row_bytes, 2}) == kMemoryUnbounded) return kMemoryUnbounded;
  return static_cast<int64_t>(Region::carve(nullptr, rows, static_cast<std::size_t>(row_bytes), config.max_topk,
                                            combine_rows, static_cast<std::size_t>(combine_row_bytes), nullptr));
}

int64_t Buffer::expanded_rows_bound(const BufferConfig& config, int num_ranks, DType y_dtype) {
  int64_t local = (config.num_experts + num_ranks - 1) / std::max(num_ranks, 1);
  if (config.placement)
    for (int r = 0; r < num_ranks; ++r) local = std::max<int64_t>(local, config.placement->num_local_experts(r));
  const int64_t rows = saturating_sum(
      saturating_product({detail::max_recv_rows(config, num_ranks), std::min<int64_t>(config.max_topk, local)}),
      saturating_product({local, std::max(config.expert_alignment, 1) - 1}));
  const auto wide = static_cast<int64_t>(dtype_size(config.max_combine_dtype)), narrow = static_cast<int64_t>(dtype_size(y_dtype));
  return saturating_product({rows, narrow}) / wide + 1;
}

Result<std::unique_ptr<Buffer>> Buffer::create(Transport& transport, BufferConfig config) {
  return detail::guard("Buffer::create", [&] { return create_unguarded(transport, std::move(config)); });
}

Result<std::unique_ptr<Buffer>> Buffer::create_unguarded(Transport& transport, BufferConfig config) {
  const Topology& topo = transport.topology();
  const int num_ranks = topo.num_ranks();
  const Status local_status = detail::validate_buffer_config(&config, num_ranks);
  const Deadline deadline = Deadline::after(config.timeout.count() > 0 ? config.timeout : Milliseconds(30000));

  // Every rank must describe the same exchange.
  std::vector<int64_t> fields;
  if (local_status.is_ok()) {
    const int64_t max_recv = detail::max_recv_rows(config, num_ranks);
    const bool hierarchical = topo.num_nodes() > 1 && config.algorithm != DispatchAlgorithm::kFlat;
    fields = {config.num_experts, config.hidden, static_cast<int64_t>(config.dtype), config.max_topk, max_recv,
              config.expert_alignment, static_cast<int64_t>(config.max_combine_dtype), hierarchical ? 1 : 0,
              detail::placement_hash(*config.placement), static_cast<int64_t>(config.fp8_scales),
              config.record_waits ? 1 : 0, static_cast<int64_t>(config.gradient_dtype.value_or(config.dtype)),
              config.max_expanded_rows};
  }
  static constexpr const char* kNames[] = {"num_experts",      "hidden",           "dtype",
                                           "max_topk",         "max_recv_tokens",  "expert_alignment",
                                           "max_combine_dtype", "algorithm",       "placement (hash)",
                                           "fp8_scales",       "record_waits",     "gradient_dtype",
                                           "max_expanded_rows"};
  EPX_RETURN_IF_ERROR(
      detail::agree_on_config(transport, local_status, fields, kNames, "BufferConfig", "Buffer", deadline));

  ExpertPlacement placement = *config.placement;
  auto impl = std::make_unique<Impl>(transport, std::move(config), std::move(placement));
  Impl& m = *impl;
  m.id = g_next_buffer_id.fetch_add(1);
  m.rank = transport.rank();
  m.num_ranks = num_ranks;
  m.num_nodes = topo.num_nodes();
  m.ranks_per_node = topo.ranks_per_node();
  m.node = topo.node_of(m.rank);
  m.local_rank = topo.local_rank_of(m.rank);
  m.hierarchical = m.num_nodes > 1 && m.config.algorithm != DispatchAlgorithm::kFlat;
  m.max_recv = detail::max_recv_rows(m.config, num_ranks);
  m.payload = *detail::PayloadFormat::of(m.config);
  m.gradients = *detail::PayloadFormat::gradients_of(m.config);
  m.row_bytes = m.payload.row_bytes();
  m.combine_row_bytes = static_cast<std::size_t>(m.config.hidden) * dtype_size(m.config.max_combine_dtype);
  m.combine_rows = detail::combine_region_rows(m.config, num_ranks);
  // Receive rows of either format fit (an fp8 Buffer's gradients are wider).
  const std::size_t region_row_bytes = std::max(m.row_bytes, m.gradients.row_bytes());

  const std::size_t bytes =
      Region::carve(nullptr, m.max_recv, region_row_bytes, m.config.max_topk, m.combine_rows, m.combine_row_bytes, nullptr);
  EPX_ASSIGN_OR_RETURN(m.memory, transport.map_peer_memory(bytes, deadline));
  m.regions.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r)
    if (topo.same_node(r, m.rank))
      Region::carve(m.memory->peer(r), m.max_recv, region_row_bytes, m.config.max_topk, m.combine_rows,
                    m.combine_row_bytes, &m.regions[r]);
  return std::unique_ptr<Buffer>(new Buffer(std::move(impl)));
}

Result<DispatchLayout> Buffer::get_layout(const TensorView& topk_idx) const {
  return detail::guard("get_layout", [&] { return compute_layout(topk_idx, impl_->placement, impl_->topology); });
}

Status Buffer::Impl::validate_dispatch(const DispatchInputs& in, const DispatchLayout* given) {
  if (in.topk_idx.ndim() != 2)
    return invalid_argument("topk_idx must be 2-D [num_tokens, topk], got {}", in.topk_idx.describe());
  const int64_t num_tokens = in.topk_idx.size(0);
  const int64_t topk = in.topk_idx.size(1);
  if (num_tokens > config.max_tokens_per_rank)
    return invalid_argument("num_tokens = {} is above max_tokens_per_rank = {}", num_tokens,
                            config.max_tokens_per_rank);
  if (topk < 1 || topk > config.max_topk)
    return invalid_argument("topk = {} is outside [1, max_topk = {}]", topk, config.max_topk);
  EPX_RETURN_IF_ERROR(payload.check_input(in.x, "x", num_tokens));
  if (in.topk_weights.defined())
    EPX_RETURN_IF_ERROR(check_matrix(in.topk_weights, "topk_weights", DType::kF32, num_tokens, topk));
  EPX_RETURN_IF_ERROR(compute_layout(in.topk_idx, placement, topology, &layout_scratch));
  // A layout from the caller must be this topk_idx's: the offsets every rank
  // computes come from it, so a stale one would misplace rows.
  if (given && (given->num_tokens != layout_scratch.num_tokens || given->num_ranks != layout_scratch.num_ranks ||
                given->num_tokens_per_rank != layout_scratch.num_tokens_per_rank ||
                given->num_tokens_per_node != layout_scratch.num_tokens_per_node ||
                given->num_tokens_per_expert != layout_scratch.num_tokens_per_expert ||
                given->is_token_in_rank != layout_scratch.is_token_in_rank))
    return invalid_argument("the layout passed to dispatch is not the layout of its topk_idx; pass get_layout(topk_idx) "
                            "or no layout");
  return Status::ok();
}

Status Buffer::dispatch_blocking(const DispatchInputs& in, DispatchResult* out, const DispatchLayout* given) {
  Impl& m = *impl_;
  ScopedSpan span(m.config.tracer, m.rank, "dispatch");
  Stopwatch watch;
  const Deadline deadline = Deadline::after(m.config.timeout);
  const int R = m.num_ranks, N = m.num_nodes, E = m.config.num_experts;
  m.start_op();

  Status local_status = out ? m.validate_dispatch(in, given) : invalid_argument("dispatch needs an output");
  TensorView send_x;  // x, or its rows quantised (fp8)
  if (local_status.is_ok()) local_status = m.payload.stage(in.x, &m.fp8_stage, &send_x);
  const DispatchLayout* layout = &m.layout_scratch;  // equal to `given`, when given
  const bool has_weights = in.topk_weights.defined();
  std::vector<int64_t> words;
  if (local_status.is_ok())
    words = detail::dispatch_header_words(*layout, static_cast<int>(in.topk_idx.size(1)), has_weights);
  else
    words.assign(3 + R + N + E, 0);
  std::vector<int64_t> all;
  {
    ScopedSpan header_span(m.config.tracer, m.rank, "dispatch:header");
    EPX_RETURN_IF_ERROR(m.gather_header(local_status, words, &all, "dispatch", deadline));
  }
  const detail::DispatchHeaders headers(all, R, N, E);
  EPX_RETURN_IF_ERROR(headers.check_ranks_agree(m.rank));
  std::vector<int32_t> counts = headers.rank_counts();
  EPX_RETURN_IF_ERROR(detail::check_recv_capacity(counts, R, m.max_recv));
  // Past every check that could fail on good input: the caller's previous
  // result is being replaced, so its handle storage may be reused.
  if (out->handle.valid() && &out->handle.data() == m.last_handle.get()) out->handle = Handle();
  if (!m.last_handle || m.last_handle.use_count() > 1) m.last_handle = std::make_shared<detail::HandleData>();
  // The caller may have dropped its last copy on another thread (the
  // asynchronous forms run here on the progress thread): order its reads
  // before the writes that reuse the storage.
  std::atomic_thread_fence(std::memory_order_acquire);
  std::shared_ptr<detail::HandleData> h = m.last_handle;
  h->buffer_id = m.id;
  h->dispatch_seq = ++m.dispatch_seq;
  h->rank = m.rank;
  h->num_tokens = layout->num_tokens;
  h->topk = headers.topk(m.rank);
  h->has_weights = has_weights;
  h->counts = std::move(counts);
  h->node_counts = headers.node_counts();
  plan_token_rows(*layout, in, m.placement, R, m.rank, *h);
  const int topk = h->topk;

  ExchangeStats stats;
  {
    ScopedSpan copy_span(m.config.tracer, m.rank, "dispatch:copy");
    EPX_RETURN_IF_ERROR(m.move_rows(send_x, &in.topk_idx, has_weights ? &in.topk_weights : nullptr, *h, &h->forward,
                                    deadline, &stats));
  }
  {
    ScopedSpan sync_span(m.config.tracer, m.rank, "dispatch:sync");
    EPX_RETURN_IF_ERROR(m.close_op(deadline));
  }

  // Per-local-expert counts come from the senders' layouts.
  h->num_recv_tokens_per_expert =
      detail::aligned_recv_expert_counts(headers.expert_counts(), R, m.placement, m.rank, m.config.expert_alignment);
  m.finish_receive(*h);

  const int64_t num_recv = h->num_recv;
  out->recv_x = m.payload.values(m.local().recv_x, num_recv);
  out->recv_scales = m.payload.scales(m.local().recv_x, num_recv);
  out->recv_topk_idx = TensorView::contiguous(h->recv_topk_idx.data(), DType::kI32, {num_recv, topk});
  out->recv_topk_weights = has_weights ? TensorView::contiguous(h->recv_topk_weights.data(), DType::kF32, {num_recv, topk})
                                       : TensorView();
  out->recv_src_rank = TensorView::contiguous(h->recv_src_rank.data(), DType::kI32, {num_recv});
  out->recv_src_idx = TensorView::contiguous(h->recv_src_idx.data(), DType::kI32, {num_recv});
  out->num_recv_tokens_per_expert = h->num_recv_tokens_per_expert;
  stats.rows_received = num_recv;
  stats.seconds = watch.seconds();
  out->stats = stats;
  // Assigned, not copied with stats: the caller's vectors keep their capacity.
  if (m.op_waits.on()) out->stats.waits = m.op_waits.record();
  out->handle = Handle(std::move(h));
  return Status::ok();
}

// Copies the receive metadata out of the region into the handle.
void Buffer::Impl::finish_receive(detail::HandleData& h) {
  const int R = num_ranks, K = h.topk;
  int64_t num_recv = 0;
  for (int s = 0; s < R; ++s) num_recv += h.counts[static_cast<std::size_t>(s) * R + rank];
  h.num_recv = num_recv;
  h.recv_src_rank.resize(num_recv);
  int64_t i = 0;
  for (int s = 0; s < R; ++s)
    for (int32_t j = 0; j < h.counts[static_cast<std::size_t>(s) * R + rank]; ++j) h.recv_src_rank[i++] = s;
  const Region& r = local();
  h.recv_src_idx.assign(r.src_idx, r.src_idx + num_recv);
  h.recv_topk_idx.assign(r.topk_idx, r.topk_idx + num_recv * K);
  if (h.has_weights) h.recv_topk_weights.assign(r.topk_weights, r.topk_weights + num_recv * K);
  h.num_local_experts = placement.num_local_experts(rank);
  h.expert_alignment = config.expert_alignment;
  h.reset_expanded();
}

const ExpandedLayout& detail::HandleData::expanded() const {
  std::lock_guard<std::mutex> lock(expanded_mutex_);
  if (expanded_ready_) return expanded_;
  build_expanded_layout(recv_topk_idx, num_recv, topk, num_local_experts, expert_alignment, &expanded_);
  expanded_ready_ = true;
  return expanded_;
}

Status Buffer::Impl::check_handle(const Handle& handle, std::string_view op) const {
  if (!handle.valid()) return invalid_argument("{} needs the handle of a dispatch; this one is empty", op);
  if (handle.data().buffer_id != id)
    return invalid_argument("{} got a handle made by another Buffer (id {}, this is {})", op, handle.data().buffer_id, id);
  return Status::ok();
}

Status Buffer::Impl::check_same_dispatch(const std::vector<int64_t>& all, std::size_t stride, std::size_t index,
                                         std::string_view op) const {
  for (int r = 1; r < num_ranks; ++r)
    if (all[r * stride + index] != all[index])
      return invalid_argument(
          "{} got handles of different dispatches: rank 0 passes dispatch #{} of this Buffer and rank {} passes #{}",
          op, all[index], r, all[r * stride + index]);
  return Status::ok();
}

Status Buffer::dispatch_cached_blocking(const TensorView& x, const Handle& handle, TensorView* recv_x) {
  return impl_->dispatch_cached_impl(Status::ok(), x, handle, recv_x, "dispatch_cached", "x");
}

Status Buffer::Impl::dispatch_cached_impl(Status local_status, const TensorView& x, const Handle& handle,
                                          TensorView* recv_x, std::string_view op, std::string_view x_name) {
  ScopedSpan span(config.tracer, rank, std::string(op));
  const Deadline deadline = Deadline::after(config.timeout);
  start_op();
  if (local_status.is_ok()) local_status = check_handle(handle, op);
  if (local_status.is_ok()) local_status = payload.check_input(x, x_name, handle.num_tokens());
  if (local_status.is_ok() && recv_x == nullptr) local_status = invalid_argument("{} needs an output", op);
  TensorView send_x;  // x, or its rows quantised (fp8)
  if (local_status.is_ok()) local_status = payload.stage(x, &fp8_stage, &send_x);
  std::vector<int64_t> all;
  EPX_RETURN_IF_ERROR(
      gather_header(local_status, {local_status.is_ok() ? handle.data().dispatch_seq : 0}, &all, op, deadline));
  EPX_RETURN_IF_ERROR(check_same_dispatch(all, all.size() / num_ranks, 1, op));
  const detail::HandleData& h = handle.data();
  ExchangeStats stats;
  EPX_RETURN_IF_ERROR(move_rows(send_x, nullptr, nullptr, h, nullptr, deadline, &stats));
  EPX_RETURN_IF_ERROR(close_op(deadline));
  *recv_x = payload.values(local().recv_x, h.num_recv);
  return Status::ok();
}

Status Buffer::Impl::dispatch_gradients(Status local_status, const TensorView& grad, const Handle& handle,
                                        TensorView* recv, std::string_view op) {
  if (local_status.is_ok()) local_status = gradients.check_gradient_payload(op);
  const detail::PayloadFormat forward = payload;
  payload = gradients;
  row_bytes = gradients.row_bytes();
  Status status = dispatch_cached_impl(std::move(local_status), grad, handle, recv, op, "grad_out");
  payload = forward;
  row_bytes = forward.row_bytes();
  return status;
}

Result<TensorView> Buffer::recv_scales(const Handle& handle) const {
  const Impl& m = *impl_;
  EPX_RETURN_IF_ERROR(m.check_handle(handle, "recv_scales"));
  if (!m.payload.fp8())
    return failed_precondition("recv_scales: this Buffer's payload is {}, which has no scales", dtype_name(m.config.dtype));
  return m.payload.scales(m.local().recv_x, handle.num_recv_tokens());
}

Result<TensorView> Buffer::combine_input_blocking(const Handle& handle, DType dtype) {
  Impl& m = *impl_;
  EPX_RETURN_IF_ERROR(m.check_handle(handle, "combine_input"));
  if (!is_payload_dtype(dtype) || dtype_size(dtype) > dtype_size(m.config.max_combine_dtype))
    return invalid_argument("combine_input dtype {} must be bf16 or f32 and no wider than max_combine_dtype = {}",
                            dtype_name(dtype), dtype_name(m.config.max_combine_dtype));
  return TensorView::contiguous(m.combine_for_writing(), dtype, {handle.num_recv_tokens(), m.config.hidden});
}

Status Buffer::Impl::validate_combine(const TensorView& y, const detail::HandleData& h, const TensorView& out,
                                      const CombineOptions& options, std::string_view y_name,
                                      std::string_view out_name) const {
  if (y.ndim() != 2 || !is_payload_dtype(y.dtype()))
    return invalid_argument("{} must be a 2-D bf16 or f32 array, got {}", y_name, y.describe());
  if (dtype_size(y.dtype()) > dtype_size(config.max_combine_dtype))
    return invalid_argument("{} is {} but max_combine_dtype = {}; raise BufferConfig::max_combine_dtype", y_name,
                            dtype_name(y.dtype()), dtype_name(config.max_combine_dtype));
  EPX_RETURN_IF_ERROR(check_matrix(y, y_name, y.dtype(), h.num_recv, config.hidden));
  if (out.ndim() != 2 || !is_payload_dtype(out.dtype()))
    return invalid_argument("{} must be a 2-D bf16 or f32 array, got {}", out_name, out.describe());
  EPX_RETURN_IF_ERROR(check_matrix(out, out_name, out.dtype(), h.num_tokens, config.hidden));
  if (options.bias.defined()) {
    if (options.bias.dtype() != DType::kF32 && options.bias.dtype() != out.dtype())
      return invalid_argument("bias must be f32 or the output's dtype {}, got {}", dtype_name(out.dtype()),
                              options.bias.describe());
    EPX_RETURN_IF_ERROR(check_matrix(options.bias, "bias", options.bias.dtype(), h.num_tokens, config.hidden));
  }
  if (options.grad_recv_topk_weights.defined() != options.grad_topk_weights.defined())
    return invalid_argument("grad_recv_topk_weights and grad_topk_weights go together; got only one");
  if (options.grad_recv_topk_weights.defined()) {
    EPX_RETURN_IF_ERROR(check_matrix(options.grad_recv_topk_weights, "grad_recv_topk_weights", DType::kF32,
                                     h.num_recv, h.topk));
    EPX_RETURN_IF_ERROR(check_matrix(options.grad_topk_weights, "grad_topk_weights", DType::kF32, h.num_tokens, h.topk));
  }
  return Status::ok();
}

Status Buffer::combine_blocking(const TensorView& y, const Handle& handle, const TensorView& out,
                           const CombineOptions& options) {
  return impl_->combine_checked(y, handle, out, options, "combine", "y", "out");
}

void Buffer::take_waits(WaitRecord* sum) {
  Impl& m = *impl_;
  std::lock_guard lock(m.waits_mu);
  if (m.waits_sum.num_ops == 0) return;
  *sum += m.waits_sum;
  m.waits_sum.clear(m.num_ranks);
}

}  // namespace epx
