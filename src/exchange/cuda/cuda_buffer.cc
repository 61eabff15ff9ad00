#include "epx/exchange/cuda_buffer.h"

#include <cuda_runtime_api.h>

#include <atomic>

#include "epx/comm/cuda.h"
#include "epx/exchange/cuda_group.h"
#include "epx/core/buffer.h"
#include "exchange/backend_state.h"
#include "exchange/cuda/cuda_util.h"
#include "exchange/cuda/kernels.h"
#include "exchange/exchange_plan.h"
#include "exchange/group_checks.h"
#include "exchange/handle_data.h"
#include "exchange/operation_queue.h"
#include "exchange/host_staged_exchange.h"

namespace epx {
namespace {

// CudaBuffer handles carry ids with the two top bits 01, apart from Buffer's and CudaGroup's.
std::atomic<uint64_t> g_next_cuda_buffer_id{(1ull << 62) + 1};

// A rank's peer-mapped device region: what peers write (receive rows and
// metadata) and read (combine rows and weight gradients).
struct Region {
  detail::RecvRegion recv;
  std::byte* combine = nullptr;
  float* combine_slots = nullptr;

  static std::size_t carve(std::byte* base, int64_t max_recv, std::size_t row_bytes, int max_topk,
                           std::size_t combine_row_bytes, Region* out) {
    Carver c(base);
    const auto rows = static_cast<std::size_t>(max_recv);
    Region r;
    r.recv.carve(c, max_recv, row_bytes, max_topk);
    r.combine = c.take<std::byte>(rows * combine_row_bytes, 256);
    r.combine_slots = c.take<float>(rows * max_topk);
    if (out) *out = r;
    return c.bytes();
  }
};

// Host <-> device copies on one device, on a stream of their own, for the
// host-staged path between nodes. A stream that could not be made fails
// every call (allocation first, so StagedExchange::create reports it to all).
class CudaCopier final : public detail::DeviceCopier {
 public:
  explicit CudaCopier(int device) : device_(device) {
    cudaError_t err = cudaSetDevice(device);
    if (err == cudaSuccess) err = cudaStreamCreate(&stream_);
    if (err != cudaSuccess)
      status_ = internal_error("could not make a CUDA stream on device {}: {}", device, cudaGetErrorString(err));
  }
  ~CudaCopier() override {
    if (stream_ != nullptr && cudaSetDevice(device_) == cudaSuccess) cudaStreamDestroy(stream_);
  }
  [[nodiscard]] Device device() const override { return Device{DeviceKind::kCuda, device_}; }
  [[nodiscard]] Status copy_rows(void* dst, std::size_t dst_stride, const void* src, std::size_t src_stride,
                                 std::size_t row_bytes, int64_t rows) override {
    EPX_RETURN_IF_ERROR(status_);
    EPX_CUDA_CHECK(cudaSetDevice(device_));
    EPX_CUDA_CHECK(detail::copy_rows_async(dst, dst_stride, src, src_stride, row_bytes, rows, stream_));
    return Status::ok();
  }
  [[nodiscard]] Status sync() override {
    EPX_RETURN_IF_ERROR(status_);
    EPX_CUDA_CHECK(cudaSetDevice(device_));
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return Status::ok();
  }
  [[nodiscard]] Result<std::byte*> allocate(std::size_t bytes) override {
    EPX_RETURN_IF_ERROR(status_);
    blocks_.push_back(std::make_unique<detail::DeviceMemory>());
    EPX_RETURN_IF_ERROR(blocks_.back()->allocate(device_, bytes));
    return blocks_.back()->get();
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  Status status_ = Status::ok();
  std::vector<std::unique_ptr<detail::DeviceMemory>> blocks_;
};

}  // namespace

struct CudaBuffer::Impl : detail::BackendState<BufferConfig> {
  Impl(Transport& t, BufferConfig c, ExpertPlacement p, int d) : BackendState(t, std::move(c), std::move(p)), device(d) {}
  int device;
  int64_t max_recv = 0;
  cudaStream_t stream = nullptr;
  std::vector<Region> regions;  // by rank (all on this node)
  detail::DeviceMemory scratch_memory;
  detail::RankScratch scratch;
  // Across nodes: everything goes through host memory (and the members above stay unused).
  std::unique_ptr<detail::StagedExchange> staged;
  // The latest dispatch.
  int num_tokens = 0;
  int topk = 0;
  int64_t num_recv = 0;
  bool has_weights = false;
  // Its expanded layout, built on first use: host copy and device row maps
  // (row_of [num_recv, K], then recv_row [num_rows], int64).
  detail::DeviceExpandedLayout expanded;

  Device dev() const { return Device{DeviceKind::kCuda, device}; }
  detail::CombineShape shape() const { return {num_recv, num_tokens, topk, dev()}; }
  // Exchanges a validity flag and `words`: a rank that failed returns its
  // error, the others Aborted; nothing is sent by anyone.
  Status gather(const Status& local_status, std::vector<int64_t> words, std::vector<int64_t>* all,
                std::string_view op, const Deadline& deadline) {
    words.insert(words.begin(), local_status.is_ok() ? 0 : 1);
    all->assign(words.size() * num_ranks, 0);
    EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const int64_t>(words), std::span<int64_t>(*all), deadline));
    EPX_RETURN_IF_ERROR(local_status);
    for (int r = 0; r < num_ranks; ++r)
      if ((*all)[r * words.size()] != 0) return aborted("rank {} rejected its {} input, so no rank sent anything", r, op);
    return Status::ok();
  }
  Status check_handle(const Handle& handle, std::string_view op) const {
    if (!handle.valid()) return invalid_argument("{} needs the handle of a dispatch; this one is empty", op);
    if (handle.data().buffer_id != id) return invalid_argument("{} got a handle made by another Buffer", op);
    if (handle.data().dispatch_seq != dispatch_seq)
      return failed_precondition("{} got the handle of dispatch #{} but this CudaBuffer's latest is #{}; it keeps the "
                                 "routes of its latest dispatch only",
                                 op, handle.data().dispatch_seq, dispatch_seq);
    return Status::ok();
  }
  // Payload (and metadata when topk_idx is given) along the latest routes, into the peers' regions.
  Status move_rows(const TensorView& x, const TensorView* topk_idx, const TensorView* topk_weights) {
    std::vector<detail::RecvRegion> recv;
    for (const Region& g : regions) recv.push_back(g.recv);
    cuda::DispatchArgs a = detail::make_dispatch_args(x, row_bytes, rank, num_tokens, scratch.send_row, recv);
    if (topk_idx != nullptr)
      detail::add_dispatch_meta(&a, *topk_idx, topk_weights ? *topk_weights : TensorView(), scratch.expert_rank,
                                scratch.local_id);
    EPX_CUDA_CHECK(cudaSetDevice(device));
    EPX_CUDA_CHECK(cuda::launch_dispatch(a, stream));
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    return Status::ok();
  }
  // The cached dispatch and the combine, for a caller that may already have
  // failed (local_status): it still takes part, so its peers return Aborted.
  Status cached_rows(Status local_status, const TensorView& x, const Handle& handle, TensorView* recv_x);
  Status combine_rows(Status local_status, const TensorView& y, const Handle& handle, const TensorView& out,
                      const CombineOptions& options);
  // The weights of combine_expanded: `weights` when given, else the dispatched ones.
  Status expanded_weights(const TensorView& weights, const float** w) const {
    if (weights.defined()) {
      *w = weights.data_as<const float>();
    } else if (has_weights) {
      *w = regions[rank].recv.topk_weights;
    } else {
      return invalid_argument("combine_expanded needs weights: none were dispatched and none were passed");
    }
    return Status::ok();
  }
};

CudaBuffer::CudaBuffer(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)), ops_(std::make_unique<detail::OperationQueue>(impl_->config.timeout)) {}
CudaBuffer::~CudaBuffer() {
  // The queued operations run on the stream: they finish before it goes.
  ops_.reset();
  if (impl_->stream != nullptr && cudaSetDevice(impl_->device) == cudaSuccess) cudaStreamDestroy(impl_->stream);
}

Device CudaBuffer::device() const { return impl_->dev(); }
const BufferConfig& CudaBuffer::config() const { return impl_->config; }

Result<std::unique_ptr<CudaBuffer>> CudaBuffer::create(Transport& transport, BufferConfig config, int device) {
  const Topology& topo = transport.topology();
  const int R = topo.num_ranks();
  Status local_status = detail::validate_buffer_config(&config, R);
  if (local_status.is_ok() && config.dtype == DType::kFP8E4M3)
    local_status = unimplemented("fp8 payloads are not built on the CUDA backend yet; use bf16 or f32");
  const bool staged = topo.num_nodes() > 1;
  if (local_status.is_ok() && !staged && R > cuda::kMaxRanks)
    local_status = invalid_argument("num_ranks = {} is above the CUDA backend's limit {} for one node", R,
                                    cuda::kMaxRanks);
  if (local_status.is_ok()) {
    const std::string why = cuda_unavailable_reason();
    if (!why.empty()) local_status = failed_precondition("CudaBuffer needs a GPU: {}", why);
  }
  const Deadline deadline = Deadline::after(config.timeout.count() > 0 ? config.timeout : Milliseconds(30000));
  // Every rank must agree that it can go on before anyone maps memory.
  const int64_t mine = local_status.is_ok() ? 0 : 1;
  std::vector<int64_t> all(R);
  EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const int64_t>(&mine, 1), std::span<int64_t>(all), deadline));
  EPX_RETURN_IF_ERROR(local_status);
  for (int r = 0; r < R; ++r)
    if (all[r] != 0) return aborted("rank {} rejected its CudaBuffer config, so none was made", r);

  ExpertPlacement placement = *config.placement;
  auto impl = std::make_unique<Impl>(transport, config, std::move(placement), device);
  Impl& m = *impl;
  m.id = g_next_cuda_buffer_id.fetch_add(1);
  m.rank = transport.rank();
  m.num_ranks = R;
  if (staged) {
    EPX_ASSIGN_OR_RETURN(m.staged,
                         detail::StagedExchange::create(transport, std::move(config), std::make_unique<CudaCopier>(device)));
    return std::unique_ptr<CudaBuffer>(new CudaBuffer(std::move(impl)));
  }
  m.max_recv = detail::max_recv_rows(m.config, R);
  m.row_bytes = static_cast<std::size_t>(m.config.hidden) * dtype_size(m.config.dtype);
  m.combine_row_bytes = static_cast<std::size_t>(m.config.hidden) * dtype_size(m.config.max_combine_dtype);
  const std::size_t bytes =
      Region::carve(nullptr, m.max_recv, m.row_bytes, m.config.max_topk, m.combine_row_bytes, nullptr);
  EPX_ASSIGN_OR_RETURN(m.memory, map_cuda_peer_memory(transport, device, bytes, deadline));
  m.regions.resize(R);
  for (int r = 0; r < R; ++r)
    Region::carve(m.memory->peer(r), m.max_recv, m.row_bytes, m.config.max_topk, m.combine_row_bytes, &m.regions[r]);
  const auto carve_scratch = [&](std::byte* base) {
    Carver c(base);
    m.scratch.carve(c, m.config.max_tokens_per_rank, R, topo.num_nodes(), m.config.num_experts, m.config.max_topk);
    return c.bytes();
  };
  EPX_RETURN_IF_ERROR(m.scratch_memory.allocate(device, carve_scratch(nullptr)));
  carve_scratch(m.scratch_memory.get());
  EPX_CUDA_CHECK(cudaSetDevice(device));
  EPX_CUDA_CHECK(cudaStreamCreate(&m.stream));
  EPX_RETURN_IF_ERROR(m.scratch.upload_placement(m.placement));
  return std::unique_ptr<CudaBuffer>(new CudaBuffer(std::move(impl)));
}

Status CudaBuffer::dispatch_blocking(const DispatchInputs& in, DispatchResult* out) {
  Impl& m = *impl_;
  if (m.staged) return m.staged->dispatch(in, out);
  Stopwatch watch;
  const Deadline deadline = Deadline::after(m.config.timeout);
  const Topology& topo = m.transport.topology();
  const int R = m.num_ranks, N = topo.num_nodes(), E = m.config.num_experts;
  Status local_status = out ? detail::check_dispatch_inputs(m.config, in, m.dev()) : invalid_argument("dispatch needs an output");
  std::vector<int32_t> counts(R + N + E, 0);
  unsigned long long error = ~0ull;
  if (local_status.is_ok()) {
    // A CUDA failure here is this rank's error: it still takes part below, so the peers return Aborted.
    const cudaError_t err = cudaSetDevice(m.device);
    local_status = err == cudaSuccess ? detail::enqueue_layout(in.topk_idx, E, topo,
                                                               m.scratch.layout(m.scratch.topk_rank), counts.data(),
                                                               &error, m.stream)
                                      : internal_error("cudaSetDevice({}) failed: {}", m.device, cudaGetErrorString(err));
    if (local_status.is_ok()) {
      const cudaError_t err = cudaStreamSynchronize(m.stream);
      local_status = err == cudaSuccess ? detail::layout_error(in.topk_idx, error, E)
                                        : internal_error("the layout kernel failed: {}", cudaGetErrorString(err));
    }
  }
  // Header: tokens, topk, weights, then the counts per rank, node and expert.
  std::vector<int64_t> words(3 + R + N + E, 0);
  if (local_status.is_ok()) {
    words[0] = in.topk_idx.size(0);
    words[1] = in.topk_idx.size(1);
    words[2] = in.topk_weights.defined() ? 1 : 0;
    std::copy(counts.begin(), counts.end(), words.begin() + 3);
  }
  std::vector<int64_t> all;
  EPX_RETURN_IF_ERROR(m.gather(local_status, words, &all, "dispatch", deadline));
  const std::size_t stride = words.size() + 1;
  auto header = [&](int r, std::size_t i) { return all[r * stride + 1 + i]; };
  for (int r = 0; r < R; ++r) {
    if (header(r, 1) != header(0, 1))
      return invalid_argument("topk differs between ranks: rank 0 passes {} and rank {} passes {}", header(0, 1), r,
                              header(r, 1));
    if (header(r, 2) != header(0, 2))
      return invalid_argument("rank 0 {} topk_weights but rank {} {}; pass them on every rank or none",
                              header(0, 2) ? "passes" : "does not pass", r, header(r, 2) ? "does" : "does not");
  }
  std::vector<int32_t> matrix(static_cast<std::size_t>(R) * R), node_counts(static_cast<std::size_t>(R) * N);
  std::vector<int64_t> expert_counts(static_cast<std::size_t>(R) * E);
  for (int s = 0; s < R; ++s) {
    for (int d = 0; d < R; ++d) matrix[s * R + d] = static_cast<int32_t>(header(s, 3 + d));
    for (int n = 0; n < N; ++n) node_counts[s * N + n] = static_cast<int32_t>(header(s, 3 + R + n));
    for (int e = 0; e < E; ++e) expert_counts[static_cast<std::size_t>(s) * E + e] = header(s, 3 + R + N + e);
  }
  EPX_RETURN_IF_ERROR(detail::check_recv_capacity(matrix, R, m.max_recv));

  ++m.dispatch_seq;
  m.num_tokens = static_cast<int>(in.topk_idx.size(0));
  m.topk = static_cast<int>(in.topk_idx.size(1));
  m.has_weights = header(0, 2) != 0;
  m.expanded.ready = false;
  m.num_recv = detail::num_recv_rows(matrix, R, m.rank);
  const std::vector<int64_t> offsets = detail::block_offsets(matrix, R);
  cuda::SendRowArgs a;
  a.in_rank = m.scratch.in_rank;
  a.num_tokens = m.num_tokens;
  a.num_ranks = R;
  for (int d = 0; d < R; ++d) a.base[d] = offsets[static_cast<std::size_t>(m.rank) * R + d];
  a.send_row = m.scratch.send_row;
  EPX_CUDA_CHECK(cuda::launch_send_rows(a, m.stream));
  EPX_RETURN_IF_ERROR(m.move_rows(in.x, &in.topk_idx, in.topk_weights.defined() ? &in.topk_weights : nullptr));
  // Every rank's rows have landed once every rank has synchronised its stream.
  EPX_RETURN_IF_ERROR(m.transport.barrier(deadline));

  const detail::HandleIdentity id{m.id, m.dispatch_seq, m.rank, m.num_tokens, m.topk, header(0, 2) != 0};
  detail::fill_dispatch_result(id, m.dev(), m.config, m.placement, topo, matrix, node_counts, expert_counts,
                               m.regions[m.rank].recv, out);
  out->stats.seconds = watch.seconds();
  return Status::ok();
}

Status CudaBuffer::dispatch_cached_blocking(const TensorView& x, const Handle& handle, TensorView* recv_x) {
  Impl& m = *impl_;
  if (m.staged) return m.staged->dispatch_cached(x, handle, recv_x);
  return m.cached_rows(Status::ok(), x, handle, recv_x);
}

Status CudaBuffer::Impl::cached_rows(Status local_status, const TensorView& x, const Handle& handle,
                                     TensorView* recv_x) {
  Impl& m = *this;
  const Deadline deadline = Deadline::after(m.config.timeout);
  if (local_status.is_ok()) local_status = m.check_handle(handle, "dispatch_cached");
  if (local_status.is_ok())
    local_status = check_matrix(x, "x", m.config.dtype, m.num_tokens, m.config.hidden, m.dev());
  if (local_status.is_ok() && recv_x == nullptr) local_status = invalid_argument("dispatch_cached needs an output");
  std::vector<int64_t> all;
  EPX_RETURN_IF_ERROR(m.gather(local_status, {}, &all, "dispatch_cached", deadline));
  EPX_RETURN_IF_ERROR(m.move_rows(x, nullptr, nullptr));
  EPX_RETURN_IF_ERROR(m.transport.barrier(deadline));
  *recv_x = TensorView::contiguous(m.regions[m.rank].recv.recv_x, m.config.dtype, {m.num_recv, m.config.hidden}, m.dev());
  return Status::ok();
}

Result<TensorView> CudaBuffer::combine_input_blocking(const Handle& handle, DType dtype) {
  Impl& m = *impl_;
  if (m.staged) return m.staged->combine_input(handle, dtype);
  EPX_RETURN_IF_ERROR(m.check_handle(handle, "combine_input"));
  if ((dtype != DType::kF32 && dtype != DType::kBF16) || dtype_size(dtype) > dtype_size(m.config.max_combine_dtype))
    return invalid_argument("combine_input dtype {} must be bf16 or f32 and no wider than max_combine_dtype = {}",
                            dtype_name(dtype), dtype_name(m.config.max_combine_dtype));
  return TensorView::contiguous(m.regions[m.rank].combine, dtype, {m.num_recv, m.config.hidden}, m.dev());
}

Status CudaBuffer::combine_blocking(const TensorView& y, const Handle& handle, const TensorView& out,
                               const CombineOptions& options) {
  Impl& m = *impl_;
  if (m.staged) return m.staged->combine(y, handle, out, options);
  return m.combine_rows(Status::ok(), y, handle, out, options);
}

Status CudaBuffer::Impl::combine_rows(Status local_status, const TensorView& y, const Handle& handle,
                                      const TensorView& out, const CombineOptions& options) {
  Impl& m = *this;
  const Deadline deadline = Deadline::after(m.config.timeout);
  const int R = m.num_ranks, H = m.config.hidden;
  if (local_status.is_ok()) local_status = m.check_handle(handle, "combine");
  if (local_status.is_ok()) local_status = detail::check_combine_inputs(m.config, y, out, options, m.shape());
  const bool slots = local_status.is_ok() && options.grad_recv_topk_weights.defined();
  const DType ydtype = local_status.is_ok() ? y.dtype() : DType::kF32;
  const std::size_t yrow = static_cast<std::size_t>(H) * dtype_size(ydtype);
  const Region& mine = m.regions[m.rank];
  // y (and the weight gradients) into this rank's combine region, where
  // peers read them. A CUDA failure is this rank's error: it still takes
  // part below, so the peers return Aborted.
  if (local_status.is_ok()) local_status = [&]() -> Status {
    EPX_CUDA_CHECK(cudaSetDevice(m.device));
    if (y.data() != mine.combine)
      EPX_CUDA_CHECK(detail::copy_rows_async(mine.combine, yrow, y.data(), y.row_stride_bytes(), yrow, m.num_recv,
                                             m.stream));
    if (slots && m.num_recv > 0)
      EPX_CUDA_CHECK(cudaMemcpyAsync(mine.combine_slots, options.grad_recv_topk_weights.data(),
                                     sizeof(float) * m.num_recv * m.topk, cudaMemcpyDeviceToDevice, m.stream));
    EPX_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    return Status::ok();
  }();
  std::vector<int64_t> all;
  EPX_RETURN_IF_ERROR(m.gather(local_status, {static_cast<int64_t>(ydtype), slots ? 1 : 0}, &all, "combine", deadline));
  for (int r = 0; r < R; ++r)
    if (all[r * 3 + 1] != static_cast<int64_t>(ydtype) || all[r * 3 + 2] != (slots ? 1 : 0))
      return invalid_argument("combine inputs differ between ranks: rank {} has y {}{} and rank {} has y {}{}", m.rank,
                              dtype_name(ydtype), slots ? " with weight gradients" : "", r,
                              dtype_name(static_cast<DType>(all[r * 3 + 1])), all[r * 3 + 2] ? " with weight gradients" : "");
  cuda::CombineArgs a;
  for (int d = 0; d < R; ++d) {
    a.y[d] = m.regions[d].combine;
    a.y_stride_bytes[d] = yrow;
    a.grad_recv_weights[d] = m.regions[d].combine_slots;
  }
  a.y_bf16 = ydtype == DType::kBF16;
  a.num_tokens = m.num_tokens;
  a.hidden = H;
  a.num_ranks = R;
  a.ranks_per_node = R;
  a.hierarchical = false;
  a.send_row = m.scratch.send_row;
  if (options.bias.defined()) {
    a.bias = static_cast<const std::byte*>(options.bias.data());
    a.bias_stride_bytes = options.bias.row_stride_bytes();
    a.bias_bf16 = options.bias.dtype() == DType::kBF16;
  }
  a.out = static_cast<std::byte*>(out.data());
  a.out_stride_bytes = out.row_stride_bytes();
  a.out_bf16 = out.dtype() == DType::kBF16;
  a.topk_rank = m.scratch.topk_rank;
  a.topk = m.topk;
  if (slots) a.grad_topk_weights = options.grad_topk_weights.data_as<float>();
  EPX_CUDA_CHECK(cuda::launch_combine(a, m.stream));
  EPX_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  // No rank may overwrite its combine region while a peer still reads it.
  return m.transport.barrier(deadline);
}

Result<const ExpandedLayout*> CudaBuffer::expanded_layout_blocking(const Handle& handle) {
  Impl& m = *impl_;
  if (m.staged) return m.staged->expanded_layout(handle);
  EPX_RETURN_IF_ERROR(m.check_handle(handle, "expanded_layout"));
  EPX_RETURN_IF_ERROR(m.expanded.build(m.device, m.regions[m.rank].recv.topk_idx, m.num_recv, m.topk,
                                       m.placement.num_local_experts(m.rank), m.config.expert_alignment));
  return &m.expanded.host;
}

Status CudaBuffer::expand_blocking(const TensorView& recv_x, const Handle& handle, const TensorView& out) {
  Impl& m = *impl_;
  if (m.staged) return m.staged->expand(recv_x, handle, out);
  EPX_RETURN_IF_ERROR(expanded_layout_blocking(handle).status());
  return detail::expand_rows(m.expanded, recv_x, out, m.num_recv, m.config.hidden, m.dev(), m.stream);
}

Status CudaBuffer::combine_expanded_blocking(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                        const TensorView& weights, const CombineOptions& options) {
  Impl& m = *impl_;
  if (m.staged) return m.staged->combine_expanded(y_expanded, handle, out, weights, options);
  // The weighted sum of each received row's local slots goes into this
  // rank's combine region (f32, dense), where combine reads it.
  const Status local_status = [&]() -> Status {
    EPX_ASSIGN_OR_RETURN(const ExpandedLayout* layout, expanded_layout_blocking(handle));
    EPX_RETURN_IF_ERROR(
        detail::check_expanded_inputs(m.config, false, y_expanded, weights, {}, {}, layout->num_rows(), m.shape()));
    if (options.partial_dtype != DType::kF32)
      return invalid_argument("combine_expanded partial_dtype = {}: the CUDA backend sends f32 partials only",
                              dtype_name(options.partial_dtype));
    if (options.weights_at != CombineWeights::kHolder)
      return invalid_argument("combine_expanded weights_at = kReceiver: the CUDA backend's device path weighs by "
                              "the holder only (CombineWeights::kHolder)");
    EPX_RETURN_IF_ERROR(detail::check_outside_combine_region(
        y_expanded, m.regions[m.rank].combine, static_cast<std::size_t>(m.max_recv) * m.combine_row_bytes));
    const float* w = nullptr;
    EPX_RETURN_IF_ERROR(m.expanded_weights(weights, &w));
    EPX_CUDA_CHECK(cudaSetDevice(m.device));
    EPX_CUDA_CHECK(cuda::launch_expanded_partial(
        static_cast<const std::byte*>(y_expanded.data()), y_expanded.row_stride_bytes(),
        y_expanded.dtype() == DType::kBF16, m.expanded.row_of(), w, m.num_recv, m.topk, m.config.hidden,
        reinterpret_cast<float*>(m.regions[m.rank].combine), m.stream));
    EPX_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    return Status::ok();
  }();
  const TensorView partial =
      TensorView::contiguous(m.regions[m.rank].combine, DType::kF32, {m.num_recv, m.config.hidden}, m.dev());
  return m.combine_rows(local_status, partial, handle, out, options);
}

Status CudaBuffer::combine_expanded_backward_blocking(const TensorView& grad_out, const Handle& handle,
                                                 const TensorView& y_expanded, const TensorView& weights,
                                                 const TensorView& grad_y_expanded, const TensorView& grad_weights) {
  Impl& m = *impl_;
  if (m.staged)
    return m.staged->combine_expanded_backward(grad_out, handle, y_expanded, weights, grad_y_expanded, grad_weights);
  const float* w = nullptr;
  const Status local_status = [&]() -> Status {
    EPX_ASSIGN_OR_RETURN(const ExpandedLayout* layout, expanded_layout_blocking(handle));
    EPX_RETURN_IF_ERROR(detail::check_expanded_inputs(m.config, true, y_expanded, weights, grad_y_expanded,
                                                      grad_weights, layout->num_rows(), m.shape()));
    return m.expanded_weights(weights, &w);
  }();
  // The gradient of each partial row is grad_out of its token, along the dispatch routes.
  TensorView grad_partial;
  EPX_RETURN_IF_ERROR(m.cached_rows(local_status, grad_out, handle, &grad_partial));
  const cuda::ExpandedBackwardArgs a =
      detail::expanded_backward_args(m.expanded, grad_partial, y_expanded, w, m.num_recv, m.topk, m.config.hidden,
                                     grad_y_expanded, grad_weights);
  EPX_CUDA_CHECK(cudaSetDevice(m.device));
  EPX_CUDA_CHECK(cuda::launch_expanded_backward(a, m.stream));
  EPX_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  return Status::ok();
}

// The public forms, one line each on the shared OperationQueue
// (operation_queue.h), as Buffer's.

Status CudaBuffer::dispatch(const DispatchInputs& inputs, DispatchResult* out) {
  return ops_->run("dispatch", [&] { return dispatch_blocking(inputs, out); });
}

Status CudaBuffer::dispatch_cached(const TensorView& x, const Handle& handle, TensorView* recv_x) {
  return ops_->run("dispatch_cached", [&] { return dispatch_cached_blocking(x, handle, recv_x); });
}

// A queued combine may still use the region: run() waits for it first.
Result<TensorView> CudaBuffer::combine_input(const Handle& handle, DType dtype) {
  return ops_->run("combine_input", [&] { return combine_input_blocking(handle, dtype); });
}

Status CudaBuffer::combine(const TensorView& y, const Handle& handle, const TensorView& out,
                           const CombineOptions& options) {
  return ops_->run("combine", [&] { return combine_blocking(y, handle, out, options); });
}

// A queued dispatch would replace the layout: run() waits for it first.
Result<const ExpandedLayout*> CudaBuffer::expanded_layout(const Handle& handle) {
  return ops_->run("expanded_layout", [&] { return expanded_layout_blocking(handle); });
}

Status CudaBuffer::expand(const TensorView& recv_x, const Handle& handle, const TensorView& out) {
  return ops_->run("expand", [&] { return expand_blocking(recv_x, handle, out); });
}

Status CudaBuffer::combine_expanded(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                    const TensorView& weights, const CombineOptions& options) {
  return ops_->run("combine_expanded",
                   [&] { return combine_expanded_blocking(y_expanded, handle, out, weights, options); });
}

Status CudaBuffer::combine_expanded_backward(const TensorView& grad_out, const Handle& handle,
                                             const TensorView& y_expanded, const TensorView& weights,
                                             const TensorView& grad_y_expanded, const TensorView& grad_weights) {
  return ops_->run("combine_expanded_backward", [&] {
    return combine_expanded_backward_blocking(grad_out, handle, y_expanded, weights, grad_y_expanded, grad_weights);
  });
}

PendingOp CudaBuffer::dispatch_async(const DispatchInputs& inputs, DispatchResult* out) {
  return ops_->submit([=, this] { return dispatch_blocking(inputs, out); });
}

PendingOp CudaBuffer::dispatch_cached_async(const TensorView& x, const Handle& handle, TensorView* recv_x) {
  return ops_->submit([=, this] { return dispatch_cached_blocking(x, handle, recv_x); });
}

PendingOp CudaBuffer::combine_async(const TensorView& y, const Handle& handle, const TensorView& out,
                                    const CombineOptions& options) {
  return ops_->submit([=, this] { return combine_blocking(y, handle, out, options); });
}

PendingOp CudaBuffer::combine_expanded_async(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                             const TensorView& weights, const CombineOptions& options) {
  return ops_->submit([=, this] { return combine_expanded_blocking(y_expanded, handle, out, weights, options); });
}

PendingOp CudaBuffer::combine_expanded_backward_async(const TensorView& grad_out, const Handle& handle,
                                                      const TensorView& y_expanded, const TensorView& weights,
                                                      const TensorView& grad_y_expanded,
                                                      const TensorView& grad_weights) {
  return ops_->submit([=, this] {
    return combine_expanded_backward_blocking(grad_out, handle, y_expanded, weights, grad_y_expanded, grad_weights);
  });
}

}  // namespace epx
