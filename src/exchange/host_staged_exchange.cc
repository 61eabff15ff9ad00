#include "exchange/host_staged_exchange.h"

#include <array>
#include <vector>

#include "epx/core/clock.h"
#include "exchange/config_check.h"
#include "exchange/exchange_plan.h"
#include "exchange/group_checks.h"
#include "exchange/handle_data.h"

namespace epx::detail {
namespace {

// The host arrays a call stages its views in, one per role.
enum Slot : std::size_t { kX, kIdx, kWeights, kBias, kGradRecvWeights, kGradWeights, kOut, kYExpanded, kGradOut, kSlots };

}  // namespace

struct StagedExchange::Impl {
  BufferConfig config;
  std::unique_ptr<DeviceCopier> copier;
  std::unique_ptr<Buffer> buffer;
  Device dev;
  uint64_t buffer_id = 0;  // the host Buffer's, learned from its first handle
  // Device copies of the latest dispatch's results, and the combine input.
  std::byte* recv_x = nullptr;
  std::byte* recv_topk_idx = nullptr;
  std::byte* recv_topk_weights = nullptr;
  std::byte* recv_src_rank = nullptr;
  std::byte* recv_src_idx = nullptr;
  std::byte* combine = nullptr;
  std::array<std::vector<std::byte>, kSlots> host;

  [[nodiscard]] bool ours(const Handle& h) const { return h.valid() && buffer_id != 0 && h.data().buffer_id == buffer_id; }
  std::byte* host_bytes(Slot slot, std::size_t bytes) {
    std::vector<std::byte>& v = host[slot];
    if (v.size() < bytes + 64) v.resize(bytes + 64);
    return v.data();
  }
  // A host copy, in `slot`, of device view `v`, checked to be [rows, cols]
  // on the device (its dtype is the host Buffer's to check). Undefined stays undefined.
  Status stage_in(Slot slot, const TensorView& v, std::string_view name, int64_t rows, int64_t cols, TensorView* h) {
    EPX_RETURN_IF_ERROR(stage_out(slot, v, name, rows, cols, h));
    if (!v.defined()) return Status::ok();
    const std::size_t row = static_cast<std::size_t>(cols) * v.element_size();
    return copier->copy_rows(h->data(), row, v.data(), v.row_stride_bytes(), row, rows);
  }
  // Host room, in `slot`, for device output `v` (checked like stage_in's).
  Status stage_out(Slot slot, const TensorView& v, std::string_view name, int64_t rows, int64_t cols, TensorView* h) {
    *h = TensorView();
    if (!v.defined()) return Status::ok();
    EPX_RETURN_IF_ERROR(check_matrix(v, name, v.dtype(), rows, cols, dev));
    const std::size_t row = static_cast<std::size_t>(cols) * v.element_size();
    *h = TensorView::contiguous(host_bytes(slot, row * static_cast<std::size_t>(rows)), v.dtype(), {rows, cols});
    return Status::ok();
  }
  // Host result `h` into device output `v` (both [rows, cols] when defined).
  Status copy_back(const TensorView& h, const TensorView& v) {
    if (!v.defined() || !h.defined()) return Status::ok();
    const std::size_t row = static_cast<std::size_t>(h.size(1)) * h.element_size();
    return copier->copy_rows(v.data(), v.row_stride_bytes(), h.data(), row, row, h.size(0));
  }
  // Host view `h` (1-D or 2-D) into the device array at `dst`, densely: a device view of it.
  Result<TensorView> to_device(const TensorView& h, std::byte* dst) {
    if (!h.defined()) return TensorView();
    const int64_t rows = h.size(0), cols = h.ndim() == 2 ? h.size(1) : 1;
    const std::size_t row = static_cast<std::size_t>(cols) * h.element_size();
    EPX_RETURN_IF_ERROR(copier->copy_rows(dst, row, h.data(), h.row_stride_bytes(), row, rows));
    return h.ndim() == 2 ? TensorView::contiguous(dst, h.dtype(), {rows, cols}, dev)
                         : TensorView::contiguous(dst, h.dtype(), {rows}, dev);
  }
  // The combine options and the output of a combine-like call: inputs
  // staged, host room for the outputs (finish_combine copies them back).
  Status stage_combine(const CombineOptions& o, const TensorView& out, int64_t n, int64_t T, int64_t K,
                       CombineOptions* ho, TensorView* hout) {
    const int64_t H = config.hidden;
    EPX_RETURN_IF_ERROR(stage_in(kBias, o.bias, "bias", T, H, &ho->bias));
    EPX_RETURN_IF_ERROR(stage_in(kGradRecvWeights, o.grad_recv_topk_weights, "grad_recv_topk_weights", n, K,
                                 &ho->grad_recv_topk_weights));
    EPX_RETURN_IF_ERROR(stage_out(kGradWeights, o.grad_topk_weights, "grad_topk_weights", T, K, &ho->grad_topk_weights));
    return stage_out(kOut, out, "out", T, H, hout);
  }
  Status finish_combine(const CombineOptions& o, const TensorView& out, const CombineOptions& ho,
                        const TensorView& hout) {
    return stage([&] { return copy_back(hout, out); },
                 [&] { return copy_back(ho.grad_topk_weights, o.grad_topk_weights); });
  }
  // Runs the copy steps in order until one fails, then waits for the copies
  // already started (also after a failure: none is left in flight).
  template <typename... Steps>
  Status stage(Steps&&... steps) {
    Status status = Status::ok();
    ((status = status.is_ok() ? steps() : status), ...);
    const Status synced = copier->sync();
    return status.is_ok() ? synced : status;
  }
  // A step that copies host view `h` to `dst` and points `*view` at it.
  auto to_device_step(const TensorView& h, std::byte* dst, TensorView* view) {
    return [this, &h, dst, view]() -> Status {
      EPX_ASSIGN_OR_RETURN(*view, to_device(h, dst));
      return Status::ok();
    };
  }
};

StagedExchange::StagedExchange(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StagedExchange::~StagedExchange() = default;

Result<std::unique_ptr<StagedExchange>> StagedExchange::create(Transport& transport, BufferConfig config,
                                                               std::unique_ptr<DeviceCopier> copier) {
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.dev = copier->device();
  m.copier = std::move(copier);
  Status local_status = validate_buffer_config(&config, transport.num_ranks());
  if (local_status.is_ok() && config.dtype == DType::kFP8E4M3)
    local_status = unimplemented("host staging does not carry fp8 payloads yet; use bf16 or f32");
  const auto rows = static_cast<std::size_t>(max_recv_rows(config, transport.num_ranks()));
  const auto K = static_cast<std::size_t>(config.max_topk), H = static_cast<std::size_t>(config.hidden);
  const auto allocate = [&](std::size_t bytes, std::byte** out) -> Status {
    if (!local_status.is_ok()) return local_status;
    Result<std::byte*> p = m.copier->allocate(bytes + 64);
    if (!p.is_ok()) return p.status();
    *out = *p;
    return Status::ok();
  };
  local_status = allocate(rows * H * dtype_size(config.dtype), &m.recv_x);
  local_status = allocate(rows * K * sizeof(int32_t), &m.recv_topk_idx);
  local_status = allocate(rows * K * sizeof(float), &m.recv_topk_weights);
  local_status = allocate(rows * sizeof(int32_t), &m.recv_src_rank);
  local_status = allocate(rows * sizeof(int32_t), &m.recv_src_idx);
  local_status = allocate(rows * H * dtype_size(config.max_combine_dtype), &m.combine);
  const Deadline deadline = Deadline::after(config.timeout.count() > 0 ? config.timeout : Milliseconds(30000));
  EPX_RETURN_IF_ERROR(agree_on_config(transport, local_status, {}, {}, "device staging memory", "staged exchange",
                                      deadline));
  m.config = config;
  EPX_ASSIGN_OR_RETURN(m.buffer, Buffer::create(transport, std::move(config)));
  return std::unique_ptr<StagedExchange>(new StagedExchange(std::move(impl)));
}

Status StagedExchange::dispatch(const DispatchInputs& in, DispatchResult* out) {
  Impl& m = *impl_;
  Stopwatch watch;
  Status local_status = out ? check_dispatch_inputs(m.config, in, m.dev) : invalid_argument("dispatch needs an output");
  DispatchInputs host;
  if (local_status.is_ok()) {
    const int64_t T = in.topk_idx.size(0), K = in.topk_idx.size(1);
    local_status = m.stage([&] { return m.stage_in(kX, in.x, "x", T, m.config.hidden, &host.x); },
                           [&] { return m.stage_in(kIdx, in.topk_idx, "topk_idx", T, K, &host.topk_idx); },
                           [&] { return m.stage_in(kWeights, in.topk_weights, "topk_weights", T, K, &host.topk_weights); });
  }
  // A rank that failed still takes part, with no inputs, so its peers return Aborted.
  DispatchResult r;
  const Status status = m.buffer->dispatch(local_status.is_ok() ? host : DispatchInputs{}, &r);
  EPX_RETURN_IF_ERROR(local_status);
  EPX_RETURN_IF_ERROR(status);
  m.buffer_id = r.handle.data().buffer_id;
  *out = r;
  EPX_RETURN_IF_ERROR(m.stage(m.to_device_step(r.recv_x, m.recv_x, &out->recv_x),
                              m.to_device_step(r.recv_topk_idx, m.recv_topk_idx, &out->recv_topk_idx),
                              m.to_device_step(r.recv_topk_weights, m.recv_topk_weights, &out->recv_topk_weights),
                              m.to_device_step(r.recv_src_rank, m.recv_src_rank, &out->recv_src_rank),
                              m.to_device_step(r.recv_src_idx, m.recv_src_idx, &out->recv_src_idx)));
  out->stats.seconds = watch.seconds();
  return Status::ok();
}

Status StagedExchange::dispatch_cached(const TensorView& x, const Handle& handle, TensorView* recv_x) {
  Impl& m = *impl_;
  Status local_status = recv_x ? Status::ok() : invalid_argument("dispatch_cached needs an output");
  TensorView hx, hr;
  if (local_status.is_ok() && m.ours(handle))
    local_status = m.stage([&] { return m.stage_in(kX, x, "x", handle.num_tokens(), m.config.hidden, &hx); });
  const bool go = local_status.is_ok();
  const Status status = m.buffer->dispatch_cached(go ? hx : TensorView(), handle, go ? &hr : nullptr);
  EPX_RETURN_IF_ERROR(local_status);
  EPX_RETURN_IF_ERROR(status);
  return m.stage(m.to_device_step(hr, m.recv_x, recv_x));
}

Result<TensorView> StagedExchange::combine_input(const Handle& handle, DType dtype) {
  Impl& m = *impl_;
  EPX_ASSIGN_OR_RETURN(const TensorView host, m.buffer->combine_input(handle, dtype));  // checks handle and dtype
  return TensorView::contiguous(m.combine, dtype, {host.size(0), m.config.hidden}, m.dev);
}

Status StagedExchange::combine(const TensorView& y, const Handle& handle, const TensorView& out,
                               const CombineOptions& options) {
  Impl& m = *impl_;
  const int64_t H = m.config.hidden;
  Status local_status = Status::ok();
  TensorView hy, hout;
  CombineOptions ho;
  const bool ours = m.ours(handle);
  if (ours) {
    const int64_t n = handle.num_recv_tokens(), T = handle.num_tokens(), K = handle.topk();
    local_status = check_combine_inputs(m.config, y, out, options, {n, static_cast<int>(T), static_cast<int>(K), m.dev});
    // y goes straight into the host Buffer's combine region.
    if (local_status.is_ok())
      local_status = m.stage(
        [&]() -> Status {
          EPX_ASSIGN_OR_RETURN(hy, m.buffer->combine_input(handle, y.dtype()));
          const std::size_t row = static_cast<std::size_t>(H) * y.element_size();
          return m.copier->copy_rows(hy.data(), hy.row_stride_bytes(), y.data(), y.row_stride_bytes(), row, n);
        },
        [&] { return m.stage_combine(options, out, n, T, K, &ho, &hout); });
  }
  // Not our handle: the host Buffer names what is wrong with it, to every rank.
  const bool go = local_status.is_ok() && ours;
  const Status status = m.buffer->combine(go ? hy : TensorView(), handle, go ? hout : TensorView(), go ? ho : CombineOptions{});
  EPX_RETURN_IF_ERROR(local_status);
  EPX_RETURN_IF_ERROR(status);
  return m.finish_combine(options, out, ho, hout);
}

Result<const ExpandedLayout*> StagedExchange::expanded_layout(const Handle& handle) {
  Impl& m = *impl_;
  if (!m.ours(handle)) return invalid_argument("expanded_layout needs the handle of a dispatch of this buffer");
  return &m.buffer->expanded_layout(handle);
}

Status StagedExchange::expand(const TensorView& recv_x, const Handle& handle, const TensorView& out) {
  Impl& m = *impl_;
  EPX_ASSIGN_OR_RETURN(const ExpandedLayout* layout, expanded_layout(handle));
  const int64_t H = m.config.hidden;
  TensorView hx, hout;
  EPX_RETURN_IF_ERROR(m.stage([&] { return m.stage_in(kX, recv_x, "recv_x", handle.num_recv_tokens(), H, &hx); },
                              [&] { return m.stage_out(kOut, out, "out", layout->num_rows(), H, &hout); }));
  EPX_RETURN_IF_ERROR(m.buffer->expand(hx, handle, hout));
  return m.stage([&] { return m.copy_back(hout, out); });
}

Status StagedExchange::combine_expanded(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                        const TensorView& weights, const CombineOptions& options) {
  Impl& m = *impl_;
  const int64_t H = m.config.hidden;
  Status local_status = Status::ok();
  TensorView hy, hw, hout;
  CombineOptions ho;
  const bool ours = m.ours(handle);
  if (ours) {
    const int64_t rows = m.buffer->expanded_layout(handle).num_rows();
    const int64_t n = handle.num_recv_tokens(), T = handle.num_tokens(), K = handle.topk();
    local_status = m.stage(
        [&] { return m.stage_in(kYExpanded, y_expanded, "y_expanded", rows, H, &hy); },
        [&] { return m.stage_in(kWeights, weights, "weights", n, K, &hw); },
        [&] { return m.stage_combine(options, out, n, T, K, &ho, &hout); });
  }
  const bool go = local_status.is_ok() && ours;
  const Status status = m.buffer->combine_expanded(go ? hy : TensorView(), handle, go ? hout : TensorView(),
                                                   go ? hw : TensorView(), go ? ho : CombineOptions{});
  EPX_RETURN_IF_ERROR(local_status);
  EPX_RETURN_IF_ERROR(status);
  return m.finish_combine(options, out, ho, hout);
}

Status StagedExchange::combine_expanded_backward(const TensorView& grad_out, const Handle& handle,
                                                 const TensorView& y_expanded, const TensorView& weights,
                                                 const TensorView& grad_y_expanded, const TensorView& grad_weights) {
  Impl& m = *impl_;
  const int64_t H = m.config.hidden;
  Status local_status = Status::ok();
  TensorView hg, hy, hw, hgy, hgw;
  const bool ours = m.ours(handle);
  if (ours) {
    const int64_t rows = m.buffer->expanded_layout(handle).num_rows();
    const int64_t n = handle.num_recv_tokens(), T = handle.num_tokens(), K = handle.topk();
    local_status = m.stage([&] { return m.stage_in(kGradOut, grad_out, "grad_out", T, H, &hg); },
                           [&] { return m.stage_in(kYExpanded, y_expanded, "y_expanded", rows, H, &hy); },
                           [&] { return m.stage_in(kWeights, weights, "weights", n, K, &hw); },
                           [&] { return m.stage_out(kOut, grad_y_expanded, "grad_y_expanded", rows, H, &hgy); },
                           [&] { return m.stage_out(kGradWeights, grad_weights, "grad_weights", n, K, &hgw); });
  }
  const bool go = local_status.is_ok() && ours;
  const Status status = m.buffer->combine_expanded_backward(go ? hg : TensorView(), handle, go ? hy : TensorView(),
                                                            go ? hw : TensorView(), go ? hgy : TensorView(),
                                                            go ? hgw : TensorView());
  EPX_RETURN_IF_ERROR(local_status);
  EPX_RETURN_IF_ERROR(status);
  return m.stage([&] { return m.copy_back(hgy, grad_y_expanded); }, [&] { return m.copy_back(hgw, grad_weights); });
}

}  // namespace epx::detail
