#include "epx/exchange/cuda_group.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstring>

#include "epx/core/buffer.h"
#include "epx/core/clock.h"
#include "exchange/cuda/cuda_util.h"
#include "exchange/cuda/kernels.h"
#include "exchange/exchange_plan.h"
#include "exchange/group_checks.h"
#include "exchange/handle_data.h"

namespace epx {
namespace {

// Group handles carry ids with the top bit set, so no CPU Buffer's id matches.
std::atomic<uint64_t> g_next_group_id{(1ull << 63) + 1};

// One rank's device memory: receive rows and metadata (written by peers),
// then its own layout scratch and the placement tables.
struct Region {
  detail::RecvRegion recv;
  detail::RankScratch scratch;          // scratch.topk_rank: the latest dispatch's (combine's weight gradients)
  int32_t* layout_topk_rank = nullptr;  // what get_layouts computes, so it leaves the dispatch's alone

  static std::size_t carve(std::byte* base, int64_t max_recv, std::size_t row_bytes, int max_topk, int max_tokens,
                           int num_ranks, int num_nodes, int num_experts, Region* out) {
    Carver c(base);
    Region r;
    r.recv.carve(c, max_recv, row_bytes, max_topk);
    r.scratch.carve(c, max_tokens, num_ranks, num_nodes, num_experts, max_topk);
    r.layout_topk_rank = c.take<int32_t>(static_cast<std::size_t>(max_tokens) * max_topk);
    if (out) *out = r;
    return c.bytes();
  }
};

struct RankState {
  int device = 0;
  cudaStream_t stream = nullptr;
  detail::DeviceMemory memory;
  Region region;
  // The latest dispatch of this rank.
  int num_tokens = 0;
  int64_t num_recv = 0;
  std::vector<int32_t> host_counts;  // [R + N + E] from the layout kernel
  detail::DeviceExpandedLayout expanded;
  detail::DeviceMemory partial;        // f32 [max_recv, H] for combine_expanded
};

}  // namespace

struct CudaGroup::Impl {
  Impl(const Topology& t, BufferConfig c, ExpertPlacement p)
      : topology(t), config(std::move(c)), placement(std::move(p)) {}
  Topology topology;
  BufferConfig config;
  ExpertPlacement placement;
  uint64_t id = 0;
  int64_t dispatch_seq = 0;
  int topk = 0;
  bool has_weights = false;
  bool hierarchical = false;
  int64_t max_recv = 0;
  std::size_t row_bytes = 0;
  std::vector<RankState> ranks;
  std::vector<Device> devices;

  int R() const { return topology.num_ranks(); }
  Status sync_all() {
    for (RankState& s : ranks) {
      EPX_CUDA_CHECK(cudaSetDevice(s.device));
      EPX_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    }
    return Status::ok();
  }
  Status check_handles(std::span<const Handle> handles, std::string_view op) const {
    EPX_RETURN_IF_ERROR(detail::check_per_rank(handles.size(), R(), fmt::format("{}'s handles", op)));
    for (int r = 0; r < R(); ++r) {
      const Handle& h = handles[r];
      if (!h.valid()) return invalid_argument("{}: rank {}'s handle is empty; pass the handles of a dispatch", op, r);
      if (h.data().buffer_id != id)
        return invalid_argument("{}: rank {}'s handle was made by another Buffer or group", op, r);
      if (h.data().rank != r) return invalid_argument("{}: handle {} is rank {}'s; pass them in rank order", op, r, h.data().rank);
      if (h.data().dispatch_seq != dispatch_seq)
        return failed_precondition("{}: rank {}'s handle is of dispatch #{} but the group's latest is #{}; a CudaGroup "
                                   "keeps the routes of its latest dispatch only",
                                   op, r, h.data().dispatch_seq, dispatch_seq);
    }
    return Status::ok();
  }
  // Payload (and metadata when inputs is set) of every rank along the latest routes.
  Status move_rows(std::span<const TensorView> x, std::span<const DispatchInputs> inputs) {
    std::vector<detail::RecvRegion> regions;
    for (const RankState& st : ranks) regions.push_back(st.region.recv);
    for (int s = 0; s < R(); ++s) {
      RankState& st = ranks[s];
      cuda::DispatchArgs a = detail::make_dispatch_args(x[s], row_bytes, s, st.num_tokens, st.region.scratch.send_row, regions);
      if (!inputs.empty())
        detail::add_dispatch_meta(&a, inputs[s].topk_idx, inputs[s].topk_weights, st.region.scratch.expert_rank,
                                  st.region.scratch.local_id);
      EPX_CUDA_CHECK(cudaSetDevice(st.device));
      EPX_CUDA_CHECK(cuda::launch_dispatch(a, st.stream));
    }
    return sync_all();
  }
  Status combine_rows(std::span<const TensorView> y, std::span<const TensorView> out,
                      std::span<const CombineOptions> options) {
    for (int s = 0; s < R(); ++s) {
      RankState& st = ranks[s];
      cuda::CombineArgs a;
      for (int d = 0; d < R(); ++d) {
        a.y[d] = static_cast<const std::byte*>(y[d].data());
        a.y_stride_bytes[d] = y[d].row_stride_bytes();
        if (!options.empty() && options[d].grad_recv_topk_weights.defined())
          a.grad_recv_weights[d] = options[d].grad_recv_topk_weights.data_as<const float>();
      }
      a.y_bf16 = y[0].dtype() == DType::kBF16;
      a.num_tokens = st.num_tokens;
      a.hidden = config.hidden;
      a.num_ranks = R();
      a.ranks_per_node = topology.ranks_per_node();
      a.hierarchical = hierarchical;
      a.send_row = st.region.scratch.send_row;
      if (!options.empty() && options[s].bias.defined()) {
        a.bias = static_cast<const std::byte*>(options[s].bias.data());
        a.bias_stride_bytes = options[s].bias.row_stride_bytes();
        a.bias_bf16 = options[s].bias.dtype() == DType::kBF16;
      }
      a.out = static_cast<std::byte*>(out[s].data());
      a.out_stride_bytes = out[s].row_stride_bytes();
      a.out_bf16 = out[s].dtype() == DType::kBF16;
      a.topk_rank = st.region.scratch.topk_rank;
      a.topk = topk;
      if (!options.empty() && options[s].grad_topk_weights.defined())
        a.grad_topk_weights = options[s].grad_topk_weights.data_as<float>();
      EPX_CUDA_CHECK(cudaSetDevice(st.device));
      EPX_CUDA_CHECK(cuda::launch_combine(a, st.stream));
    }
    return sync_all();
  }
  std::vector<detail::CombineShape> combine_shapes() const {
    std::vector<detail::CombineShape> shapes(R());
    for (int r = 0; r < R(); ++r) shapes[r] = {ranks[r].num_recv, ranks[r].num_tokens, topk, devices[r]};
    return shapes;
  }
  // The layout kernels of every rank, their counts in host_counts; `out`
  // (optional) gets the layouts. for_dispatch: the slots' ranks go where
  // combine reads them.
  Status run_layouts(std::span<const TensorView> topk_idx, bool for_dispatch, std::vector<DispatchLayout>* out);
  // The weights rank r's expanded combine uses (checked by check_expanded_inputs).
  Status weights_of(int r, std::span<const TensorView> weights, const float** w) const {
    if (!weights.empty() && weights[r].defined()) {
      *w = weights[r].data_as<const float>();
    } else if (has_weights) {
      *w = ranks[r].region.recv.topk_weights;
    } else {
      return invalid_argument("rank {}: combine_expanded needs weights: none were dispatched and none were passed", r);
    }
    return Status::ok();
  }
};

std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
    return fmt::format("no CUDA device: cudaGetDeviceCount says {} ({})", cudaGetErrorName(err), cudaGetErrorString(err));
  if (count == 0) return "no CUDA device: cudaGetDeviceCount found 0";
  return {};
}

bool cuda_built() { return true; }

std::vector<Handle> handles_of(const std::vector<DispatchResult>& results) {
  std::vector<Handle> handles;
  for (const DispatchResult& r : results) handles.push_back(r.handle);
  return handles;
}

CudaGroup::CudaGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaGroup::~CudaGroup() {
  for (RankState& s : impl_->ranks)
    if (s.stream != nullptr && cudaSetDevice(s.device) == cudaSuccess) cudaStreamDestroy(s.stream);
}

int CudaGroup::num_ranks() const { return impl_->R(); }
Device CudaGroup::device_of(int rank) const { return impl_->devices[rank]; }
const BufferConfig& CudaGroup::config() const { return impl_->config; }
const ExpertPlacement& CudaGroup::placement() const { return impl_->placement; }
bool CudaGroup::hierarchical() const { return impl_->hierarchical; }

Result<std::unique_ptr<CudaGroup>> CudaGroup::create(const Topology& topology, BufferConfig config,
                                                     std::vector<int> devices) {
  const int R = topology.num_ranks();
  if (R > cuda::kMaxRanks) return invalid_argument("num_ranks = {} is above the CUDA backend's limit {}", R, cuda::kMaxRanks);
  EPX_RETURN_IF_ERROR(detail::validate_buffer_config(&config, R));
  if (config.dtype == DType::kFP8E4M3)
    return unimplemented("fp8 payloads are not built on the CUDA backend yet; use bf16 or f32");
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) return failed_precondition("CudaGroup needs a GPU: {}", why);
  int count = 0;
  EPX_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (devices.empty()) devices.assign(R, 0);
  EPX_RETURN_IF_ERROR(detail::check_per_rank(devices.size(), R, "devices"));
  for (int r = 0; r < R; ++r)
    if (devices[r] < 0 || devices[r] >= count)
      return invalid_argument("devices[{}] = {} is outside [0, {}) (the CUDA devices here)", r, devices[r], count);
  // Peer access between every pair of distinct devices.
  for (int a : devices)
    for (int b : devices) {
      if (a == b) continue;
      int can = 0;
      EPX_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, a, b));
      if (!can) return failed_precondition("device {} cannot access device {} (no peer access)", a, b);
      EPX_CUDA_CHECK(cudaSetDevice(a));
      const cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clears it
      } else {
        EPX_CUDA_CHECK(err);
      }
    }

  ExpertPlacement placement = *config.placement;
  auto impl = std::make_unique<Impl>(topology, std::move(config), std::move(placement));
  Impl& m = *impl;
  m.id = g_next_group_id.fetch_add(1);
  m.hierarchical = topology.num_nodes() > 1 && m.config.algorithm != DispatchAlgorithm::kFlat;
  m.max_recv = detail::max_recv_rows(m.config, R);
  m.row_bytes = static_cast<std::size_t>(m.config.hidden) * dtype_size(m.config.dtype);
  m.ranks = std::vector<RankState>(R);
  const int N = topology.num_nodes(), E = m.config.num_experts;
  const std::size_t bytes = Region::carve(nullptr, m.max_recv, m.row_bytes, m.config.max_topk,
                                          m.config.max_tokens_per_rank, R, N, E, nullptr);
  for (int r = 0; r < R; ++r) {
    RankState& s = m.ranks[r];
    s.device = devices[r];
    m.devices.push_back(Device{DeviceKind::kCuda, devices[r]});
    EPX_RETURN_IF_ERROR(s.memory.allocate(s.device, bytes));
    Region::carve(s.memory.get(), m.max_recv, m.row_bytes, m.config.max_topk, m.config.max_tokens_per_rank, R, N, E,
                  &s.region);
    // Blocking streams: work on the legacy default stream (a caller's events) orders with them.
    EPX_CUDA_CHECK(cudaStreamCreate(&s.stream));
    EPX_RETURN_IF_ERROR(s.region.scratch.upload_placement(m.placement));
  }
  return std::unique_ptr<CudaGroup>(new CudaGroup(std::move(impl)));
}

Status CudaGroup::get_layouts(std::span<const TensorView> topk_idx, std::vector<DispatchLayout>* out) {
  if (out == nullptr) return invalid_argument("get_layouts needs an output");
  return impl_->run_layouts(topk_idx, false, out);
}

Status CudaGroup::Impl::run_layouts(std::span<const TensorView> topk_idx, bool for_dispatch,
                                    std::vector<DispatchLayout>* out) {
  Impl& m = *this;
  const int R = m.R(), N = m.topology.num_nodes(), E = m.config.num_experts;
  EPX_RETURN_IF_ERROR(detail::check_per_rank(topk_idx.size(), R, "topk_idx"));
  std::vector<unsigned long long> errors(R);
  for (int r = 0; r < R; ++r) {
    const TensorView& idx = topk_idx[r];
    if (idx.ndim() != 2) return invalid_argument("rank {}: topk_idx must be 2-D [num_tokens, topk], got {}", r, idx.describe());
    if (idx.size(0) > m.config.max_tokens_per_rank)
      return invalid_argument("rank {}: num_tokens = {} is above max_tokens_per_rank = {}", r, idx.size(0),
                              m.config.max_tokens_per_rank);
    if (idx.size(1) < 1 || idx.size(1) > m.config.max_topk)
      return invalid_argument("rank {}: topk = {} is outside [1, max_topk = {}]", r, idx.size(1), m.config.max_topk);
    EPX_RETURN_IF_ERROR(check_matrix(idx, "topk_idx", DType::kI32, idx.size(0), idx.size(1), m.devices[r]));
    RankState& s = m.ranks[r];
    s.host_counts.resize(R + N + E);
    EPX_CUDA_CHECK(cudaSetDevice(s.device));
    const detail::LayoutScratch scratch =
        s.region.scratch.layout(for_dispatch ? s.region.scratch.topk_rank : s.region.layout_topk_rank);
    EPX_RETURN_IF_ERROR(
        detail::enqueue_layout(idx, E, m.topology, scratch, s.host_counts.data(), &errors[r], s.stream));
  }
  EPX_RETURN_IF_ERROR(m.sync_all());
  for (int r = 0; r < R; ++r) {
    const Status bad = detail::layout_error(topk_idx[r], errors[r], E);
    if (!bad.is_ok()) return make_status(bad.code(), "rank {}: {}", r, bad.message());
  }
  if (out != nullptr) {
    out->assign(R, DispatchLayout{});
    for (int r = 0; r < R; ++r) {
      DispatchLayout& l = (*out)[r];
      const RankState& s = m.ranks[r];
      l.num_tokens = static_cast<int>(topk_idx[r].size(0));
      l.num_ranks = R;
      l.num_tokens_per_rank.assign(s.host_counts.begin(), s.host_counts.begin() + R);
      l.num_tokens_per_node.assign(s.host_counts.begin() + R, s.host_counts.begin() + R + N);
      l.num_tokens_per_expert.assign(s.host_counts.begin() + R + N, s.host_counts.end());
      l.is_token_in_rank.resize(static_cast<std::size_t>(l.num_tokens) * R);
      EPX_CUDA_CHECK(cudaMemcpy(l.is_token_in_rank.data(), s.region.scratch.in_rank, l.is_token_in_rank.size(),
                                cudaMemcpyDeviceToHost));
    }
  }
  return Status::ok();
}

Status CudaGroup::dispatch(std::span<const DispatchInputs> inputs, std::vector<DispatchResult>* out) {
  Impl& m = *impl_;
  Stopwatch watch;
  const int R = m.R(), N = m.topology.num_nodes(), E = m.config.num_experts;
  if (out == nullptr) return invalid_argument("dispatch needs an output");
  EPX_RETURN_IF_ERROR(detail::validate_group_dispatch(m.config, inputs, m.devices));
  std::vector<TensorView> idx(R), x(R);
  for (int r = 0; r < R; ++r) {
    idx[r] = inputs[r].topk_idx;
    x[r] = inputs[r].x;
  }
  // Layout and counts on every rank; nothing moves before all of them pass.
  EPX_RETURN_IF_ERROR(m.run_layouts(idx, true, nullptr));
  std::vector<int32_t> counts(static_cast<std::size_t>(R) * R), node_counts(static_cast<std::size_t>(R) * N);
  std::vector<int64_t> expert_counts(static_cast<std::size_t>(R) * E);
  for (int s = 0; s < R; ++s) {
    const std::vector<int32_t>& c = m.ranks[s].host_counts;
    std::copy(c.begin(), c.begin() + R, counts.begin() + static_cast<std::size_t>(s) * R);
    std::copy(c.begin() + R, c.begin() + R + N, node_counts.begin() + static_cast<std::size_t>(s) * N);
    std::copy(c.begin() + R + N, c.end(), expert_counts.begin() + static_cast<std::size_t>(s) * E);
  }
  EPX_RETURN_IF_ERROR(detail::check_recv_capacity(counts, R, m.max_recv));

  ++m.dispatch_seq;
  m.topk = static_cast<int>(inputs[0].topk_idx.size(1));
  m.has_weights = inputs[0].topk_weights.defined();
  const std::vector<int64_t> offsets = detail::block_offsets(counts, R);
  for (int s = 0; s < R; ++s) {
    RankState& st = m.ranks[s];
    st.num_tokens = static_cast<int>(inputs[s].topk_idx.size(0));
    st.num_recv = detail::num_recv_rows(counts, R, s);
    st.expanded.ready = false;
    cuda::SendRowArgs a;
    a.in_rank = st.region.scratch.in_rank;
    a.num_tokens = st.num_tokens;
    a.num_ranks = R;
    for (int d = 0; d < R; ++d) a.base[d] = offsets[static_cast<std::size_t>(s) * R + d];
    a.send_row = st.region.scratch.send_row;
    EPX_CUDA_CHECK(cudaSetDevice(st.device));
    EPX_CUDA_CHECK(cuda::launch_send_rows(a, st.stream));
  }
  EPX_RETURN_IF_ERROR(m.sync_all());
  EPX_RETURN_IF_ERROR(m.move_rows(x, inputs));

  out->assign(R, DispatchResult{});
  for (int r = 0; r < R; ++r) {
    const detail::HandleIdentity id{m.id, m.dispatch_seq, r, m.ranks[r].num_tokens, m.topk, m.has_weights};
    detail::fill_dispatch_result(id, m.devices[r], m.config, m.placement, m.topology, counts, node_counts, expert_counts,
                                 m.ranks[r].region.recv, &(*out)[r]);
    (*out)[r].stats.seconds = watch.seconds();
  }
  return Status::ok();
}

Status CudaGroup::dispatch_cached(std::span<const TensorView> x, std::span<const Handle> handles,
                                  std::vector<TensorView>* recv_x) {
  Impl& m = *impl_;
  EPX_RETURN_IF_ERROR(m.check_handles(handles, "dispatch_cached"));
  EPX_RETURN_IF_ERROR(detail::check_per_rank(x.size(), m.R(), "x"));
  if (recv_x == nullptr) return invalid_argument("dispatch_cached needs an output");
  for (int r = 0; r < m.R(); ++r) {
    const Status s = check_matrix(x[r], "x", m.config.dtype, m.ranks[r].num_tokens, m.config.hidden, m.devices[r]);
    if (!s.is_ok()) return make_status(s.code(), "rank {}: {}", r, s.message());
  }
  EPX_RETURN_IF_ERROR(m.move_rows(x, {}));
  recv_x->assign(m.R(), TensorView{});
  for (int r = 0; r < m.R(); ++r)
    (*recv_x)[r] = TensorView::contiguous(m.ranks[r].region.recv.recv_x, m.config.dtype, {m.ranks[r].num_recv, m.config.hidden},
                                          m.devices[r]);
  return Status::ok();
}

Status CudaGroup::combine(std::span<const TensorView> y, std::span<const Handle> handles,
                          std::span<const TensorView> out, std::span<const CombineOptions> options) {
  Impl& m = *impl_;
  EPX_RETURN_IF_ERROR(m.check_handles(handles, "combine"));
  EPX_RETURN_IF_ERROR(detail::validate_group_combine(m.config, y, out, options, m.combine_shapes()));
  return m.combine_rows(y, out, options);
}

Result<const ExpandedLayout*> CudaGroup::expanded_layout(int rank, const Handle& handle) {
  Impl& m = *impl_;
  if (rank < 0 || rank >= m.R()) return invalid_argument("rank = {} is outside [0, {})", rank, m.R());
  if (!handle.valid() || handle.data().rank != rank)
    return invalid_argument("expanded_layout needs rank {}'s handle", rank);
  if (handle.data().buffer_id != m.id || handle.data().dispatch_seq != m.dispatch_seq)
    return failed_precondition("expanded_layout: the handle is not of this group's latest dispatch");
  RankState& s = m.ranks[rank];
  EPX_RETURN_IF_ERROR(s.expanded.build(s.device, s.region.recv.topk_idx, s.num_recv, m.topk,
                                       m.placement.num_local_experts(rank), m.config.expert_alignment));
  return &s.expanded.host;
}

Status CudaGroup::expand(int rank, const TensorView& recv_x, const Handle& handle, const TensorView& out) {
  Impl& m = *impl_;
  EPX_RETURN_IF_ERROR(expanded_layout(rank, handle).status());
  const RankState& s = m.ranks[rank];
  return detail::expand_rows(s.expanded, recv_x, out, s.num_recv, m.config.hidden, m.devices[rank], s.stream);
}

Status CudaGroup::combine_expanded(std::span<const TensorView> y_expanded, std::span<const Handle> handles,
                                   std::span<const TensorView> out, std::span<const TensorView> weights) {
  Impl& m = *impl_;
  const int R = m.R(), H = m.config.hidden;
  EPX_RETURN_IF_ERROR(m.check_handles(handles, "combine_expanded"));
  EPX_RETURN_IF_ERROR(detail::check_per_rank(y_expanded.size(), R, "y_expanded"));
  if (!weights.empty()) EPX_RETURN_IF_ERROR(detail::check_per_rank(weights.size(), R, "weights"));
  const std::vector<detail::CombineShape> shapes = m.combine_shapes();
  std::vector<TensorView> partial(R);
  std::vector<const float*> w(R);
  for (int r = 0; r < R; ++r) {
    EPX_ASSIGN_OR_RETURN(const ExpandedLayout* layout, expanded_layout(r, handles[r]));
    EPX_RETURN_IF_ERROR(detail::on_rank(
        r, detail::check_expanded_inputs(m.config, false, y_expanded[r], weights.empty() ? TensorView() : weights[r],
                                         {}, {}, layout->num_rows(), shapes[r])));
    EPX_RETURN_IF_ERROR(m.weights_of(r, weights, &w[r]));
    RankState& s = m.ranks[r];
    EPX_RETURN_IF_ERROR(s.partial.allocate(s.device, sizeof(float) * static_cast<std::size_t>(m.max_recv) * H + 16));
    partial[r] = TensorView::contiguous(s.partial.get(), DType::kF32, {s.num_recv, H}, m.devices[r]);
  }
  EPX_RETURN_IF_ERROR(detail::validate_group_combine(m.config, partial, out, {}, shapes));
  for (int r = 0; r < R; ++r) {
    RankState& s = m.ranks[r];
    EPX_CUDA_CHECK(cudaSetDevice(s.device));
    EPX_CUDA_CHECK(cuda::launch_expanded_partial(static_cast<const std::byte*>(y_expanded[r].data()),
                                                 y_expanded[r].row_stride_bytes(), y_expanded[r].dtype() == DType::kBF16,
                                                 s.expanded.row_of(), w[r], s.num_recv, m.topk, H,
                                                 s.partial.get<float>(), s.stream));
  }
  EPX_RETURN_IF_ERROR(m.sync_all());
  return m.combine_rows(partial, out, {});
}

Status CudaGroup::combine_expanded_backward(std::span<const TensorView> grad_out, std::span<const Handle> handles,
                                            std::span<const TensorView> y_expanded, std::span<const TensorView> weights,
                                            std::span<const TensorView> grad_y_expanded,
                                            std::span<const TensorView> grad_weights) {
  Impl& m = *impl_;
  const int R = m.R(), H = m.config.hidden;
  constexpr std::string_view kOp = "combine_expanded_backward";
  EPX_RETURN_IF_ERROR(m.check_handles(handles, kOp));
  EPX_RETURN_IF_ERROR(detail::check_per_rank(y_expanded.size(), R, "y_expanded"));
  EPX_RETURN_IF_ERROR(detail::check_per_rank(grad_y_expanded.size(), R, "grad_y_expanded"));
  if (!weights.empty()) EPX_RETURN_IF_ERROR(detail::check_per_rank(weights.size(), R, "weights"));
  if (!grad_weights.empty()) EPX_RETURN_IF_ERROR(detail::check_per_rank(grad_weights.size(), R, "grad_weights"));
  const std::vector<detail::CombineShape> shapes = m.combine_shapes();
  std::vector<const float*> w(R);
  for (int r = 0; r < R; ++r) {
    EPX_ASSIGN_OR_RETURN(const ExpandedLayout* layout, expanded_layout(r, handles[r]));
    EPX_RETURN_IF_ERROR(detail::on_rank(
        r, detail::check_expanded_inputs(m.config, true, y_expanded[r], weights.empty() ? TensorView() : weights[r],
                                         grad_y_expanded[r], grad_weights.empty() ? TensorView() : grad_weights[r],
                                         layout->num_rows(), shapes[r])));
    EPX_RETURN_IF_ERROR(m.weights_of(r, weights, &w[r]));
  }
  // grad of each partial row = grad_out of its token, along the dispatch routes.
  std::vector<TensorView> grad_partial;
  EPX_RETURN_IF_ERROR(dispatch_cached(grad_out, handles, &grad_partial));
  for (int r = 0; r < R; ++r) {
    RankState& s = m.ranks[r];
    const cuda::ExpandedBackwardArgs a =
        detail::expanded_backward_args(s.expanded, grad_partial[r], y_expanded[r], w[r], s.num_recv, m.topk, H,
                                       grad_y_expanded[r], grad_weights.empty() ? TensorView() : grad_weights[r]);
    EPX_CUDA_CHECK(cudaSetDevice(s.device));
    EPX_CUDA_CHECK(cuda::launch_expanded_backward(a, s.stream));
  }
  return m.sync_all();
}

}  // namespace epx
