#include "epx/layer/moe_layer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>

#include "epx/core/clock.h"
#include "epx/core/fp8.h"
#include "epx/core/random.h"
#include "epx/experts/ffn.h"
#include "epx/routing/aux_loss.h"
#include "core/guard.h"
#include "layer/dense.h"

namespace epx {
namespace {

// Streams of the counter-based initialisation, per layer.
enum InitStream : uint64_t { kRouterStream = 1, kSharedStream = 2, kExpertStream = 3 };

uint64_t stream_id(int layer_index, uint64_t kind, uint64_t sub) {
  return (static_cast<uint64_t>(layer_index) << 40) ^ (kind << 32) ^ sub;
}

void init_normal(std::span<float> out, uint64_t seed, uint64_t stream, float std) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(standard_normal(seed, stream, i)) * std;
}

// The f32 master weights as the expert GEMMs read them: the masters
// themselves for f32, a rounded copy for bf16, made again only when the
// parameter's version moved (Parameter::mark_written) since the last copy.
struct StorageCopy {
  std::vector<std::byte> bytes;
  std::optional<uint64_t> version;  // of the values `bytes` holds; none before the first copy

  // `copies` counts the copies made (MoELayer::weight_copies).
  Result<TensorView> refresh(const Parameter& p, DType dtype, int64_t& copies) {
    if (dtype == DType::kF32) return p.view();
    const std::size_t size = static_cast<std::size_t>(p.numel()) * dtype_size(dtype);
    if (version == p.version && bytes.size() == size) {
      EPX_RETURN_IF_ERROR(check_unchanged(p, dtype));
    } else {
      bytes.resize(size);
      detail::convert_from_f32(p.value.data(), p.numel(), dtype, bytes.data());
      version = p.version;
      ++copies;
    }
    return TensorView::contiguous(bytes.data(), dtype, {p.rows, p.cols});
  }

  // A tripwire for a writer that forgot mark_written(): 64 values spread over
  // the parameter must still round to the copy's bits.
  Status check_unchanged(const Parameter& p, DType dtype) const {
    const std::size_t width = dtype_size(dtype), n = p.value.size(), samples = std::min<std::size_t>(n, 64);
    std::byte rounded[8];
    for (std::size_t s = 0; s < samples; ++s) {
      const std::size_t i = s * n / samples;
      detail::convert_from_f32(&p.value[i], 1, dtype, rounded);
      if (std::memcmp(rounded, bytes.data() + i * width, width) != 0)
        return internal_error("parameter {} changed at [{}] since its {} copy at version {} without "
                              "Parameter::mark_written()",
                              p.name, i, dtype_name(dtype), p.version);
    }
    return Status::ok();
  }
};

std::vector<int32_t> copy_ints(const TensorView& v) {
  const auto* p = static_cast<const int32_t*>(v.data());
  return v.defined() ? std::vector<int32_t>(p, p + v.numel()) : std::vector<int32_t>();
}

template <typename T>
T* ensure(std::vector<T>& v, int64_t count) {
  v.resize(static_cast<std::size_t>(std::max<int64_t>(count, 1)));
  return v.data();
}

}  // namespace

std::string_view overlap_mode_name(OverlapMode mode) {
  switch (mode) {
    case OverlapMode::kNone: return "none";
    case OverlapMode::kSharedExperts: return "shared";
    case OverlapMode::kChunked: return "chunked";
    case OverlapMode::kTwoMicroBatches: return "two-micro-batches";
  }
  return "?";
}

Result<OverlapMode> parse_overlap_mode(std::string_view name) {
  for (OverlapMode m : {OverlapMode::kNone, OverlapMode::kSharedExperts, OverlapMode::kChunked,
                        OverlapMode::kTwoMicroBatches})
    if (name == overlap_mode_name(m)) return m;
  return invalid_argument("overlap mode '{}' is not one of none, shared, chunked, two-micro-batches", name);
}

LayerTimes& LayerTimes::operator+=(const LayerTimes& o) {
  router += o.router;
  dispatch += o.dispatch;
  experts += o.experts;
  combine += o.combine;
  stats += o.stats;
  experts_cpu += o.experts_cpu;
  return *this;
}

Status MoELayerConfig::validate() const {
  if (hidden <= 0) return invalid_argument("hidden = {} must be at least 1", hidden);
  if (ffn_hidden <= 0) return invalid_argument("ffn_hidden = {} must be at least 1", ffn_hidden);
  if (num_shared_experts < 0) return invalid_argument("num_shared_experts = {} is below 0", num_shared_experts);
  if (dtype != DType::kF32 && dtype != DType::kBF16)
    return invalid_argument("dtype {} is not supported by the layer; use f32 or bf16", dtype_name(dtype));
  if (dispatch_dtype && *dispatch_dtype != dtype && *dispatch_dtype != DType::kFP8E4M3)
    return invalid_argument("dispatch_dtype {} with dtype {}: the layer dispatches its dtype or fp8_e4m3",
                            dtype_name(*dispatch_dtype), dtype_name(dtype));
  if (dispatch_dtype == DType::kFP8E4M3 && hidden % kFp8BlockSize != 0)
    return invalid_argument("dispatch_dtype fp8_e4m3 needs hidden a multiple of {} (one scale per block), got {}",
                            kFp8BlockSize, hidden);
  if (compute_dtype && *compute_dtype != DType::kF32 && *compute_dtype != DType::kBF16)
    return invalid_argument("compute_dtype {} is not supported by the layer; use f32 or bf16",
                            dtype_name(*compute_dtype));
  if (pack_expert_weights && compute_dtype.value_or(dtype) != DType::kBF16)
    return invalid_argument("pack_expert_weights needs bf16 expert GEMMs; they are {} here",
                            dtype_name(compute_dtype.value_or(dtype)));
  if (combine_dtype != DType::kF32 && combine_dtype != DType::kBF16)
    return invalid_argument("combine_dtype {} is not supported by the layer; use f32 or bf16", dtype_name(combine_dtype));
  if (combine_weights != CombineWeights::kHolder && combine_weights != CombineWeights::kReceiver)
    return invalid_argument("combine_weights = {} is neither holder nor receiver", static_cast<int>(combine_weights));
  if (combine_weights == CombineWeights::kReceiver && combine_dtype != DType::kF32)
    return invalid_argument("combine_dtype {} names the holders' partials; combine_weights receiver sends unweighted "
                            "rows in dtype (use combine_dtype f32)", dtype_name(combine_dtype));
  if (combine_weights == CombineWeights::kReceiver && overlap != OverlapMode::kNone)
    return invalid_argument("combine_weights receiver keeps y in the Buffer's combine region, which overlap {} reuses "
                            "between chunks; use overlap none or combine_weights holder", overlap_mode_name(overlap));
  if (!(aux_loss_coeff >= 0) || !std::isfinite(aux_loss_coeff))
    return invalid_argument("aux_loss_coeff = {} must be finite and >= 0", aux_loss_coeff);
  if (!(z_loss_coeff >= 0) || !std::isfinite(z_loss_coeff))
    return invalid_argument("z_loss_coeff = {} must be finite and >= 0", z_loss_coeff);
  if (!(bias_rate >= 0) || !std::isfinite(bias_rate))
    return invalid_argument("bias_rate = {} must be finite and >= 0", bias_rate);
  if (!(norm_eps > 0)) return invalid_argument("norm_eps = {} must be above 0", norm_eps);
  if (!(init_std >= 0) || !std::isfinite(init_std)) return invalid_argument("init_std = {} must be >= 0", init_std);
  if (overlap_chunks < 1 || overlap_chunks > 64)
    return invalid_argument("overlap_chunks = {} is outside [1, 64]", overlap_chunks);
  if (overlap == OverlapMode::kTwoMicroBatches && router.capacity_factor > 0)
    return invalid_argument("overlap two-micro-batches routes each half on its own, but capacity_factor = {} makes "
                            "the drops depend on the whole batch; use overlap chunked",
                            router.capacity_factor);
  return router.validate();
}

struct MoELayer::Impl {
  MoELayerConfig config;
  Transport& transport;  // the EP group: the Buffer's and the replica sums'
  Transport& global;     // every rank of the run: aux losses, load statistics
  Buffer& buffer;
  int layer_index = 0;
  const char* phase_name = "";  // the phase entered last (router, dispatch, ...), for error messages
  int num_local = 0;

  // Logical experts -> physical slots (identity without redundant experts).
  bool identity = true;
  std::vector<int32_t> slot_expert;               // slot -> logical expert (-1 = empty)
  std::vector<std::vector<int32_t>> replicas;     // logical expert -> its slots, ascending
  std::vector<int32_t> replicated_pos;            // logical expert -> row in the replica all-reduce, -1 = single
  int num_replicated = 0;
  std::vector<int32_t> slot_idx;                  // the last forward's topk_idx over slots

  Parameter norm, router;
  Parameter shared_w1, shared_w3, shared_w2;
  Parameter w1, w3, w2;
  StorageCopy w1_copy, w3_copy, w2_copy, shared_w1_copy, shared_w3_copy, shared_w2_copy;
  int64_t weight_copies = 0;
  // config.pack_expert_weights: the routed weights packed, and the versions
  // of w1, w3, w2 they were packed at.
  PackedExpertWeights packed_weights;
  std::optional<std::array<uint64_t, 3>> packed_versions;
  ExpertWeights weights, shared_weights;
  ExpertBias bias;

  // What forward keeps for backward.
  int64_t num_tokens = 0;
  std::vector<float> x, n, rstd, logits, aux_grad_logits;
  std::vector<std::byte> n_payload;  // n in config.dtype (the dispatch payload)
  RouterOutput routed;
  Handle handle;
  std::vector<int64_t> offsets;
  std::vector<std::byte> x_expanded;
  std::vector<std::byte> recv_dequantised;  // fp8 dispatch: the received rows in config.dtype, before expand
  std::vector<float> y_expanded, moe_out, shared_out;
  // The experts' output rows as the last forward wrote them: y_expanded (f32),
  // or (combine_weights receiver) a view of the Buffer's combine region in dtype.
  TensorView y_view;
  // Backward's buffers, kept between calls.
  struct BackwardScratch {
    std::vector<float> grad_out, grad_n, grad_n_part, grad_y, grad_recv_weights, grad_x_expanded, grad_recv_x,
        grad_weights;
    std::vector<std::byte> grad_out_payload;
  } bwd;
  // An overlapped forward's chunks (one for kSharedExperts, two for
  // kTwoMicroBatches), kept for backward.
  struct Chunk {
    int64_t begin = 0, count = 0;  // this rank's tokens [begin, begin + count)
    RouterOutput routed;           // kTwoMicroBatches: this half's routing (merged into `routed` after)
    DispatchResult recv;
    std::vector<int32_t> src_rank;  // of each received row
    std::vector<int64_t> offsets;
    std::vector<std::byte> x_expanded;
    std::vector<float> y_expanded;
    ExpertFfnCache cache;
    std::vector<float> grad_y, grad_recv_weights, grad_recv_x, grad_x_expanded;
    ExpertFfnGradState grad_state;
    std::vector<int64_t> whole_row;  // expanded row -> row of the whole-batch layout (-1: padding)
    PendingOp op;
  };
  std::vector<Chunk> chunks;
  bool overlapped = false;  // the last forward took the overlapped path
  // The whole batch's expanded rows, assembled from the chunks for backward.
  struct Whole {
    std::vector<int64_t> offsets;
    std::vector<std::byte> x;
    std::vector<float> grad_y;
    ExpertFfnGradState grad_state;
  } whole;
  ExpertFfnCache cache, shared_cache;
  ExpertFfnGradState grad_state, shared_grad_state;  // the backward's data -> weight pass state
  double aux_loss = 0.0;
  LoadStats stats;
  LayerTimes times;
  WaitRecord waits;  // the last forward's and backward's exchanges
  Tracer* tracer = nullptr;

  // Times one phase into `slot` and, with a tracer, records it as a span.
  class Phase {
   public:
    Phase(Impl& impl, double& slot, const char* name)
        : slot_(slot),
          cpu_slot_(&slot == &impl.times.experts ? &impl.times.experts_cpu : nullptr),
          cpu_start_(cpu_slot_ ? thread_cpu_seconds() : 0.0),
          span_(impl.tracer, impl.global.world_rank(impl.global.rank()), name) {
      impl.phase_name = name;
    }
    ~Phase() {
      slot_ += watch_.seconds();
      if (cpu_slot_) *cpu_slot_ += thread_cpu_seconds() - cpu_start_;
    }
    Phase(const Phase&) = delete;
    Phase& operator=(const Phase&) = delete;

   private:
    double& slot_;
    double* cpu_slot_;  // times.experts_cpu for the experts phases
    double cpu_start_;
    Stopwatch watch_;
    ScopedSpan span_;
  };

  Impl(const MoELayerConfig& c, Transport& t, Transport& g, Buffer& b, int index)
      : config(c), transport(t), global(g), buffer(b), layer_index(index), bias(c.router.num_experts, c.bias_rate) {}

  [[nodiscard]] int hidden() const { return config.hidden; }
  [[nodiscard]] CombineOptions combine_options() const {
    CombineOptions options;
    options.partial_dtype = config.combine_dtype;
    options.weights_at = config.combine_weights;
    return options;
  }
  [[nodiscard]] int shared_width() const { return config.num_shared_experts * config.ffn_hidden; }
  [[nodiscard]] Deadline deadline() const { return Deadline::after(buffer.config().timeout); }

  ExpertFfnConfig expert_config() const {
    return {.num_experts = num_local, .hidden = config.hidden, .ffn_hidden = config.ffn_hidden,
            .dtype = config.dtype, .num_threads = 1, .compute_dtype = config.compute_dtype};
  }
  ExpertFfnConfig shared_config() const {
    return {.num_experts = 1, .hidden = config.hidden, .ffn_hidden = shared_width(), .dtype = config.dtype,
            .num_threads = 1, .compute_dtype = config.compute_dtype};
  }
  DType compute_dtype() const { return config.compute_dtype.value_or(config.dtype); }
  TensorView payload_view(const std::vector<std::byte>& bytes, int64_t rows) const {
    return TensorView::contiguous(bytes.data(), config.dtype, {rows, config.hidden});
  }

  // The received rows laid out per local expert in config.dtype (`rows`
  // expanded rows, padding zero): Buffer::expand, after dequantising fp8
  // rows with their scales (into recv_dequantised).
  Status expand_received(const DispatchResult& recv, int64_t rows, std::vector<std::byte>* into) {
    const std::size_t row_bytes = static_cast<std::size_t>(hidden()) * dtype_size(config.dtype);
    into->resize(static_cast<std::size_t>(std::max<int64_t>(rows, 1)) * row_bytes);
    if (!recv.recv_scales.defined()) return buffer.expand(recv.recv_x, recv.handle, payload_view(*into, rows));
    const int64_t received = recv.recv_x.size(0);
    recv_dequantised.resize(static_cast<std::size_t>(std::max<int64_t>(received, 1)) * row_bytes);
    EPX_RETURN_IF_ERROR(dequantize_fp8(recv.recv_x, recv.recv_scales, payload_view(recv_dequantised, received)));
    return buffer.expand(payload_view(recv_dequantised, received), recv.handle, payload_view(*into, rows));
  }

  // Sets the slot map (empty: identity over the Buffer's slots) and derives
  // the replica lists.
  Status set_slot_map(std::vector<int32_t> map) {
    const int E = config.router.num_experts, S = buffer.config().num_experts;
    if (map.empty()) {
      if (S != E) return invalid_argument("the Buffer has {} experts, the router {}", S, E);
      map.resize(static_cast<std::size_t>(E));
      for (int e = 0; e < E; ++e) map[e] = e;
    }
    if (static_cast<int>(map.size()) != S)
      return invalid_argument("slot_expert has {} entries; the Buffer has {} slots", map.size(), S);
    replicas.assign(static_cast<std::size_t>(E), {});
    identity = S == E;
    for (int s = 0; s < S; ++s) {
      const int e = map[s];
      if (e < -1 || e >= E) return invalid_argument("slot_expert[{}] = {} is outside [-1, {})", s, e, E);
      if (e >= 0) replicas[e].push_back(s);
      identity = identity && e == s;
    }
    replicated_pos.assign(static_cast<std::size_t>(E), -1);
    num_replicated = 0;
    for (int e = 0; e < E; ++e) {
      if (replicas[e].empty()) return invalid_argument("logical expert {} has no slot in slot_expert", e);
      if (replicas[e].size() > 1) replicated_pos[e] = num_replicated++;
    }
    slot_expert = std::move(map);
    return Status::ok();
  }

  [[nodiscard]] int local_logical(int local) const {
    return slot_expert[buffer.placement().global_id(transport.rank(), local)];
  }
  // The routed experts' ids as the Buffer sees them: logical ids, or slots.
  [[nodiscard]] TensorView dispatch_idx(int64_t T) const {
    const int32_t* idx = identity ? routed.topk_idx.data() : slot_idx.data();
    return TensorView::contiguous(idx, DType::kI32, {T, config.router.topk});
  }

  Status init_parameters() {
    const int H = config.hidden, F = config.ffn_hidden, E = config.router.num_experts;
    const std::string prefix = "layer" + std::to_string(layer_index) + ".";
    auto std_for = [&](int fan_in) {
      return config.init_std > 0 ? config.init_std : static_cast<float>(1.0 / std::sqrt(fan_in));
    };
    EPX_ASSIGN_OR_RETURN(norm, Parameter::make(prefix + "norm", ParamKind::kDense, 1, H));
    std::fill(norm.value.begin(), norm.value.end(), 1.0f);
    EPX_ASSIGN_OR_RETURN(router, Parameter::make(prefix + "router", ParamKind::kDense, H, E));
    init_normal(router.value, config.seed, stream_id(layer_index, kRouterStream, 0), std_for(H));
    if (config.num_shared_experts > 0) {
      const int S = shared_width();
      EPX_ASSIGN_OR_RETURN(shared_w1, Parameter::make(prefix + "shared.w1", ParamKind::kDense, H, S));
      EPX_ASSIGN_OR_RETURN(shared_w3, Parameter::make(prefix + "shared.w3", ParamKind::kDense, H, S));
      EPX_ASSIGN_OR_RETURN(shared_w2, Parameter::make(prefix + "shared.w2", ParamKind::kDense, S, H));
      init_normal(shared_w1.value, config.seed, stream_id(layer_index, kSharedStream, 1), std_for(H));
      init_normal(shared_w3.value, config.seed, stream_id(layer_index, kSharedStream, 3), std_for(H));
      init_normal(shared_w2.value, config.seed, stream_id(layer_index, kSharedStream, 2), std_for(S));
    }
    EPX_ASSIGN_OR_RETURN(w1, Parameter::make(prefix + "experts.w1", ParamKind::kExpert, int64_t{num_local} * H, F));
    EPX_ASSIGN_OR_RETURN(w3, Parameter::make(prefix + "experts.w3", ParamKind::kExpert, int64_t{num_local} * H, F));
    EPX_ASSIGN_OR_RETURN(w2, Parameter::make(prefix + "experts.w2", ParamKind::kExpert, int64_t{num_local} * F, H));
    // Each logical expert draws from its own streams, wherever (and however
    // often) it lives; an empty slot stays zero.
    for (int l = 0; l < num_local; ++l) {
      if (local_logical(l) < 0) continue;
      const auto g = static_cast<uint64_t>(local_logical(l));
      const auto hf = static_cast<std::size_t>(H) * F;
      init_normal(std::span(w1.value).subspan(l * hf, hf), config.seed, stream_id(layer_index, kExpertStream, 4 * g + 1),
                  std_for(H));
      init_normal(std::span(w3.value).subspan(l * hf, hf), config.seed, stream_id(layer_index, kExpertStream, 4 * g + 3),
                  std_for(H));
      init_normal(std::span(w2.value).subspan(l * hf, hf), config.seed, stream_id(layer_index, kExpertStream, 4 * g + 2),
                  std_for(F));
    }
    return Status::ok();
  }

  Status refresh_weights() {
    const DType dtype = compute_dtype();
    if (num_local > 0) {
      EPX_ASSIGN_OR_RETURN(weights.w1, w1_copy.refresh(w1, dtype, weight_copies));
      EPX_ASSIGN_OR_RETURN(weights.w3, w3_copy.refresh(w3, dtype, weight_copies));
      EPX_ASSIGN_OR_RETURN(weights.w2, w2_copy.refresh(w2, dtype, weight_copies));
      EPX_RETURN_IF_ERROR(refresh_packed_weights());
    }
    if (config.num_shared_experts > 0) {
      EPX_ASSIGN_OR_RETURN(shared_weights.w1, shared_w1_copy.refresh(shared_w1, dtype, weight_copies));
      EPX_ASSIGN_OR_RETURN(shared_weights.w3, shared_w3_copy.refresh(shared_w3, dtype, weight_copies));
      EPX_ASSIGN_OR_RETURN(shared_weights.w2, shared_w2_copy.refresh(shared_w2, dtype, weight_copies));
    }
    return Status::ok();
  }

  // Packs the routed weights again when they moved since the last packing.
  Status refresh_packed_weights() {
    weights.packed = nullptr;
    if (!config.pack_expert_weights) return Status::ok();
    const std::array<uint64_t, 3> versions{w1.version, w3.version, w2.version};
    if (packed_versions != versions || packed_weights.source != weights.w1.data()) {
      EPX_RETURN_IF_ERROR(pack_expert_weights(expert_config(), weights, &packed_weights));
      packed_versions = versions;
    }
    weights.packed = &packed_weights;
    return Status::ok();
  }

  Status forward(const TensorView& x_in, const TensorView& out) {
    const int H = hidden(), K = config.router.topk;
    if (x_in.ndim() != 2)
      return invalid_argument("x must be [tokens, {}] f32, got {}", H, x_in.defined() ? x_in.describe() : "undefined");
    const int64_t T = x_in.size(0);
    EPX_RETURN_IF_ERROR(check_matrix(x_in, "x", DType::kF32, T, H));
    EPX_RETURN_IF_ERROR(check_matrix(out, "out", DType::kF32, T, H));
    times = {};
    num_tokens = 0;
    handle = {};
    overlapped = false;

    std::optional<Phase> phase;
    phase.emplace(*this, times.router, "router");
    float* xs = ensure(x, T * H);
    for (int64_t t = 0; t < T; ++t) std::memcpy(xs + t * H, x_in.row<const float>(t), sizeof(float) * H);
    detail::rms_norm_forward(xs, norm.value.data(), config.norm_eps, T, H, ensure(n, T * H), ensure(rstd, T));
    phase.reset();
    if (config.overlap != OverlapMode::kNone) {
      EPX_RETURN_IF_ERROR(forward_overlapped(T, out));
      return finish_forward(T);
    }

    phase.emplace(*this, times.router, "router");
    EPX_RETURN_IF_ERROR(route_batch(T));
    phase.reset();

    // Dispatch the normed tokens, then lay them out per local expert.
    phase.emplace(*this, times.dispatch, "dispatch");
    to_payload(n.data(), T, n_payload);
    DispatchResult recv;
    EPX_RETURN_IF_ERROR(buffer.dispatch(
        {.x = payload_view(n_payload, T),
         .topk_idx = dispatch_idx(T),
         .topk_weights = TensorView::contiguous(routed.topk_weights.data(), DType::kF32, {T, K})},
        &recv));
    handle = recv.handle;
    const ExpandedLayout& expanded = buffer.expanded_layout(handle);
    offsets = expanded.expert_offsets;
    const int64_t rows = expanded.num_rows();
    EPX_RETURN_IF_ERROR(expand_received(recv, rows, &x_expanded));
    phase.reset();

    phase.emplace(*this, times.experts, "experts");
    EPX_RETURN_IF_ERROR(refresh_weights());
    EPX_ASSIGN_OR_RETURN(y_view, routed_output(rows));
    if (num_local > 0)
      EPX_RETURN_IF_ERROR(
          expert_ffn_forward(expert_config(), weights, payload_view(x_expanded, rows), offsets, y_view, &cache));
    EPX_RETURN_IF_ERROR(shared_forward(T));
    phase.reset();

    phase.emplace(*this, times.combine, "combine");
    float* combined = ensure(moe_out, T * H);
    EPX_RETURN_IF_ERROR(buffer.combine_expanded(y_view, handle, TensorView::contiguous(combined, DType::kF32, {T, H}),
                                                {}, combine_options()));
    phase.reset();
    add_residual(T, out);
    return finish_forward(T);
  }

  // Where the experts write y: the Buffer's combine region in dtype (receiver
  // weights: the combine reads it there); with holder weights and f32
  // partials, the region in f32 when it has room for the rows
  // (BufferConfig::max_expanded_rows; the combine then weighs them where they
  // lie, docs/design.md); else y_expanded in f32.
  Result<TensorView> routed_output(int64_t rows) {
    if (config.combine_weights == CombineWeights::kReceiver)
      return buffer.combine_expanded_input(handle, config.dtype);
    if (config.combine_dtype == DType::kF32) {
      // Refused only for want of room (the handle and dtype are valid), before anything is written.
      Result<TensorView> in_region = buffer.combine_expanded_input(handle, DType::kF32);
      if (in_region.is_ok()) return in_region;
    }
    return TensorView::contiguous(ensure(y_expanded, rows * hidden()), DType::kF32, {rows, hidden()});
  }

  Status shared_forward(int64_t T) {
    if (config.num_shared_experts == 0) return Status::ok();
    const int H = hidden();
    const int64_t shared_offsets[2] = {0, T};
    return expert_ffn_forward(shared_config(), shared_weights, payload_view(n_payload, T), shared_offsets,
                              TensorView::contiguous(ensure(shared_out, T * H), DType::kF32, {T, H}), &shared_cache);
  }

  // out = x + the routed experts' combined output (+ the shared experts').
  void add_residual(int64_t T, const TensorView& out) const {
    const int H = hidden();
    for (int64_t t = 0; t < T; ++t) {
      float* o = out.row<float>(t);
      const float* xt = x.data() + t * H;
      const float* m = moe_out.data() + t * H;
      if (config.num_shared_experts > 0) {
        const float* s = shared_out.data() + t * H;
        for (int h = 0; h < H; ++h) o[h] = xt[h] + m[h] + s[h];
      } else {
        for (int h = 0; h < H; ++h) o[h] = xt[h] + m[h];
      }
    }
  }

  // The load statistics of the forward just done (one all-reduce).
  Status finish_forward(int64_t T) {
    const int E = config.router.num_experts;
    num_tokens = T;
    std::optional<Phase> phase;
    phase.emplace(*this, times.stats, "stats");
    // Work per rank follows the slots; tokens_per_expert is per logical expert.
    EPX_ASSIGN_OR_RETURN(stats, compute_load_stats(dispatch_idx(T), buffer.placement().expert_rank()));
    if (!identity) {
      std::vector<int64_t> logical(static_cast<std::size_t>(E), 0);
      for (std::size_t s = 0; s < slot_expert.size(); ++s)
        if (slot_expert[s] >= 0) logical[slot_expert[s]] += stats.tokens_per_expert[s];
      stats.tokens_per_expert = std::move(logical);
      stats.summarize();
    }
    EPX_RETURN_IF_ERROR(sum_load_stats_over_ranks(global, &stats, deadline()));
    phase.reset();
    return Status::ok();
  }

  [[nodiscard]] int num_chunks() const {
    switch (config.overlap) {
      case OverlapMode::kChunked: return config.overlap_chunks;
      case OverlapMode::kTwoMicroBatches: return 2;
      default: return 1;
    }
  }

  // Waits for every chunk's queued operation (they use this layer's memory),
  // whatever happened; the first error, if any.
  Status wait_chunks() {
    Status first;
    for (Chunk& c : chunks) {
      // wait() gives up at the operation's bound; an operation that somehow
      // runs past it still uses this layer's memory: wait until it ends.
      Status s = c.op.wait();
      while (!c.op.done()) s = c.op.wait();
      c.op = PendingOp();
      if (first.is_ok() && !s.is_ok()) first = std::move(s);
    }
    return first;
  }
  // On every way out of an overlapped forward or backward, nothing of ours
  // may still be in flight.
  struct WaitOnExit {
    Impl& impl;
    ~WaitOnExit() { impl.wait_chunks().ignore(); }
  };

  // The whole batch's routing into `routed`, its auxiliary losses and its
  // replicas (both forwards, unless the two micro-batches route apart).
  Status route_batch(int64_t T) {
    ensure(logits, T * config.router.num_experts);
    EPX_RETURN_IF_ERROR(route_rows(0, T, &routed));
    EPX_RETURN_IF_ERROR(auxiliary_losses(T));
    return choose_replicas();
  }

  // The slot of each routed (token, k) in slot_idx, among its expert's
  // replicas (token modulo: deterministic, no communication); nothing to do
  // without redundant experts.
  Status choose_replicas() {
    if (identity) return Status::ok();
    EPX_ASSIGN_OR_RETURN(slot_idx,
                         map_to_replicas(replicas, routed.topk_idx, config.router.topk, ReplicaChoice::kTokenModulo));
    if (slot_idx.empty()) slot_idx.push_back(-1);
    return Status::ok();
  }

  // `T` f32 rows of `rows` in the exchange's payload dtype (config.dtype),
  // into `into` (never empty: at least one row's room).
  void to_payload(const float* rows, int64_t T, std::vector<std::byte>& into) const {
    const int H = hidden();
    into.resize(static_cast<std::size_t>(std::max<int64_t>(T, 1) * H) * dtype_size(config.dtype));
    detail::convert_from_f32(rows, T * H, config.dtype, into.data());
  }

  // Router GEMM and routing of rows [begin, begin + count) into `out`.
  Status route_rows(int64_t begin, int64_t count, RouterOutput* out) {
    const int H = hidden(), E = config.router.num_experts;
    EPX_RETURN_IF_ERROR(detail::dense_gemm(false, false, count, E, H, n.data() + begin * H, router.value.data(), false,
                                           logits.data() + begin * E));
    const TensorView view = TensorView::contiguous(logits.data() + begin * E, DType::kF32, {count, E});
    EPX_ASSIGN_OR_RETURN(*out, route(config.router, view, config.expert_bias ? bias.view() : TensorView{}));
    return Status::ok();
  }

  // The two halves' routing as if routed together (tokens are independent
  // without capacity, which kTwoMicroBatches refuses).
  void merge_routing() {
    RouterOutput merged;
    merged.num_experts = config.router.num_experts;
    merged.topk = config.router.topk;
    merged.tokens_per_expert.assign(static_cast<std::size_t>(merged.num_experts), 0);
    merged.rows_per_expert.assign(static_cast<std::size_t>(merged.num_experts), 0);
    auto append = [](auto& into, const auto& part) { into.insert(into.end(), part.begin(), part.end()); };
    for (const Chunk& c : chunks) {
      const RouterOutput& r = c.routed;
      merged.num_tokens += r.num_tokens;
      append(merged.topk_idx, r.topk_idx);
      append(merged.topk_weights, r.topk_weights);
      append(merged.scores, r.scores);
      append(merged.selected_idx, r.selected_idx);
      append(merged.selected_probs, r.selected_probs);
      merged.num_dropped += r.num_dropped;
      for (std::size_t e = 0; e < r.tokens_per_expert.size(); ++e) merged.tokens_per_expert[e] += r.tokens_per_expert[e];
      for (std::size_t e = 0; e < r.rows_per_expert.size(); ++e) merged.rows_per_expert[e] += r.rows_per_expert[e];
    }
    routed = std::move(merged);
  }

  // Starts chunk c's dispatch. Its routing is in `routed` (rows [begin,
  // begin + count)) or, for two micro-batches, in the chunk's own.
  void start_dispatch(Chunk& c, bool own_routing) {
    const int H = hidden(), K = config.router.topk;
    const std::size_t row_bytes = static_cast<std::size_t>(H) * dtype_size(config.dtype);
    const int32_t* idx = own_routing ? c.routed.topk_idx.data()
                                     : (identity ? routed.topk_idx.data() : slot_idx.data()) + c.begin * K;
    const float* w = own_routing ? c.routed.topk_weights.data() : routed.topk_weights.data() + c.begin * K;
    c.op = buffer.dispatch_async({.x = TensorView::contiguous(n_payload.data() + c.begin * row_bytes, config.dtype,
                                                             {c.count, H}),
                                  .topk_idx = TensorView::contiguous(idx, DType::kI32, {c.count, K}),
                                  .topk_weights = TensorView::contiguous(w, DType::kF32, {c.count, K})},
                                 &c.recv);
  }

  // Chunk i of an overlapped forward: waits for its dispatch and lays its
  // rows out, starts the next chunk's dispatch, runs the experts, and queues
  // its combine into `combined` (behind the next chunk's dispatch).
  Status chunk_forward(int i, bool per_half_routing, float* combined) {
    const int H = hidden();
    Chunk& c = chunks[i];
    std::optional<Phase> phase;
    phase.emplace(*this, times.dispatch, "dispatch");
    EPX_RETURN_IF_ERROR(c.op.wait());
    c.op = PendingOp();
    const ExpandedLayout& expanded = buffer.expanded_layout(c.recv.handle);
    c.offsets = expanded.expert_offsets;
    c.src_rank = copy_ints(c.recv.recv_src_rank);
    const int64_t rows = expanded.num_rows();
    EPX_RETURN_IF_ERROR(expand_received(c.recv, rows, &c.x_expanded));
    phase.reset();
    // The region is free again: the next chunk's rows may come.
    if (i + 1 < static_cast<int>(chunks.size())) start_dispatch(chunks[i + 1], per_half_routing);

    phase.emplace(*this, times.experts, "experts");
    float* y = ensure(c.y_expanded, rows * H);
    if (num_local > 0)
      EPX_RETURN_IF_ERROR(expert_ffn_forward(expert_config(), weights, payload_view(c.x_expanded, rows), c.offsets,
                                             TensorView::contiguous(y, DType::kF32, {rows, H}), &c.cache));
    phase.reset();
    c.op = buffer.combine_expanded_async(TensorView::contiguous(y, DType::kF32, {rows, H}), c.recv.handle,
                                         TensorView::contiguous(combined + c.begin * H, DType::kF32, {c.count, H}),
                                         {}, combine_options());
    return Status::ok();
  }

  // Forward with the exchange in flight under compute (config.overlap).
  Status forward_overlapped(int64_t T, const TensorView& out) {
    const int H = hidden();
    const int C = num_chunks();
    const bool per_half_routing = config.overlap == OverlapMode::kTwoMicroBatches;
    chunks.resize(static_cast<std::size_t>(C));
    for (int c = 0; c < C; ++c) {
      chunks[c].begin = T * c / C;
      chunks[c].count = T * (c + 1) / C - chunks[c].begin;
    }
    WaitOnExit wait_on_exit{*this};

    std::optional<Phase> phase;
    phase.emplace(*this, times.router, "router");
    if (per_half_routing) {
      ensure(logits, T * config.router.num_experts);
      EPX_RETURN_IF_ERROR(route_rows(0, chunks[0].count, &chunks[0].routed));
    } else {
      EPX_RETURN_IF_ERROR(route_batch(T));
    }
    to_payload(n.data(), T, n_payload);
    phase.reset();

    start_dispatch(chunks[0], per_half_routing);
    // Under the first dispatch: the other half's routing, the shared experts.
    if (per_half_routing) {
      phase.emplace(*this, times.router, "router");
      EPX_RETURN_IF_ERROR(route_rows(chunks[1].begin, chunks[1].count, &chunks[1].routed));
      phase.reset();
    }
    phase.emplace(*this, times.experts, "experts");
    EPX_RETURN_IF_ERROR(refresh_weights());
    EPX_RETURN_IF_ERROR(shared_forward(T));
    phase.reset();

    float* combined = ensure(moe_out, T * H);
    for (int i = 0; i < C; ++i) EPX_RETURN_IF_ERROR(chunk_forward(i, per_half_routing, combined));
    phase.emplace(*this, times.combine, "combine");
    EPX_RETURN_IF_ERROR(wait_chunks());
    phase.reset();

    if (per_half_routing) {
      phase.emplace(*this, times.router, "router");
      merge_routing();
      EPX_RETURN_IF_ERROR(auxiliary_losses(T));
      phase.reset();
    }
    add_residual(T, out);
    overlapped = true;
    return Status::ok();
  }

  // Where each chunk's expanded rows sit in the layout one dispatch of the
  // whole batch would have made: per local expert, rows by source rank, and
  // for one source rank by chunk (its tokens in order), each group padded
  // to the Buffer's expert alignment as the Buffer pads it.
  void build_whole_layout() {
    const int64_t align = buffer.config().expert_alignment;
    const int R = transport.num_ranks();
    whole.offsets.assign(static_cast<std::size_t>(num_local) + 1, 0);
    for (Chunk& c : chunks) c.whole_row.assign(static_cast<std::size_t>(c.offsets.back()), -1);
    int64_t next = 0;
    for (int e = 0; e < num_local; ++e) {
      std::vector<int64_t> pos(chunks.size());
      for (std::size_t ci = 0; ci < chunks.size(); ++ci) pos[ci] = chunks[ci].offsets[e];
      for (int s = 0; s < R; ++s)
        for (std::size_t ci = 0; ci < chunks.size(); ++ci) {
          Chunk& c = chunks[ci];
          const std::vector<int64_t>& recv_row = buffer.expanded_layout(c.recv.handle).recv_row;
          for (; pos[ci] < c.offsets[e + 1]; ++pos[ci]) {
            const int64_t r = recv_row[pos[ci]];
            if (r < 0 || c.src_rank[r] != s) break;  // padding ends a group; rows come by source
            c.whole_row[pos[ci]] = next++;
          }
        }
      const int64_t n = next - whole.offsets[e];
      next = whole.offsets[e] + (n + align - 1) / align * align;
      whole.offsets[e + 1] = next;
    }
  }

  // Copies each chunk's expanded rows (elements of `bytes_per_row`) into the
  // whole-batch rows, padding rows zero.
  template <typename T>
  void gather_whole(std::vector<T>& into, std::size_t per_row, const std::function<const T*(const Chunk&)>& from) {
    into.assign(static_cast<std::size_t>(std::max<int64_t>(whole.offsets.back(), 1)) * per_row, T{});
    for (const Chunk& c : chunks) {
      const T* src = from(c);
      for (std::size_t j = 0; j < c.whole_row.size(); ++j)
        if (c.whole_row[j] >= 0)
          std::copy(src + j * per_row, src + (j + 1) * per_row, into.data() + c.whole_row[j] * per_row);
    }
  }

  // The routed experts' backward, in its two passes (ffn.h).
  Status routed_backward_data(const std::vector<std::byte>& x_rows, const std::vector<int64_t>& offs,
                              const ExpertFfnCache& c, const float* grad_y, float* grad_x, ExpertFfnGradState* state) {
    const int64_t rows = offs.back();
    const int H = hidden();
    return expert_ffn_backward_data(expert_config(), weights, payload_view(x_rows, rows), offs, c,
                                    TensorView::contiguous(grad_y, DType::kF32, {rows, H}),
                                    TensorView::contiguous(grad_x, DType::kF32, {rows, H}), state);
  }
  Status routed_backward_weights(const std::vector<std::byte>& x_rows, const std::vector<int64_t>& offs,
                                 const float* grad_y, const ExpertFfnGradState& state) {
    const int64_t rows = offs.back();
    return expert_ffn_backward_weights(expert_config(), weights, payload_view(x_rows, rows), offs,
                                       TensorView::contiguous(grad_y, DType::kF32, {rows, hidden()}), state,
                                       {w1.grad_view(), w3.grad_view(), w2.grad_view()});
  }

  // Backward of an overlapped forward: every chunk's combine backward goes
  // out at once; each chunk's data pass runs as soon as its gradients have
  // arrived and its dispatch backward goes out right after, under the next
  // chunk's data pass; the weight pass runs once over the whole batch,
  // assembled in the plain layer's row order, so the weight gradients keep
  // the plain layer's bits.
  Status backward_overlapped(int64_t T, float* go, float* grad_n, const TensorView& grad_x) {
    const int H = hidden(), K = config.router.topk, F = config.ffn_hidden;
    const std::size_t row_bytes = static_cast<std::size_t>(H) * dtype_size(config.dtype);
    BackwardScratch& b = bwd;
    WaitOnExit wait_on_exit{*this};
    std::optional<Phase> phase;

    phase.emplace(*this, times.combine, "combine_backward");
    to_payload(go, T, b.grad_out_payload);
    for (Chunk& c : chunks) {
      const int64_t rows = c.offsets.back(), num_recv = c.recv.handle.num_recv_tokens();
      float* grad_y = ensure(c.grad_y, rows * H);
      float* grad_w = ensure(c.grad_recv_weights, num_recv * K);
      c.op = buffer.combine_expanded_backward_async(
          TensorView::contiguous(b.grad_out_payload.data() + c.begin * row_bytes, config.dtype, {c.count, H}),
          c.recv.handle, TensorView::contiguous(c.y_expanded.data(), DType::kF32, {rows, H}), {},
          TensorView::contiguous(grad_y, DType::kF32, {rows, H}),
          TensorView::contiguous(grad_w, DType::kF32, {num_recv, K}));
    }
    phase.reset();
    phase.emplace(*this, times.experts, "experts_backward");
    EPX_RETURN_IF_ERROR(shared_backward(T, go, grad_n));
    phase.reset();

    float* grad_n_moe = ensure(b.grad_n_part, T * H);
    float* grad_weights = ensure(b.grad_weights, T * K);
    for (Chunk& c : chunks) {
      phase.emplace(*this, times.combine, "combine_backward");
      EPX_RETURN_IF_ERROR(c.op.wait());  // queued in order: the earlier chunks' are done
      phase.reset();
      phase.emplace(*this, times.experts, "experts_backward");
      const int64_t rows = c.offsets.back(), num_recv = c.recv.handle.num_recv_tokens();
      float* grad_x_expanded = ensure(c.grad_x_expanded, rows * H);
      if (num_local > 0)
        EPX_RETURN_IF_ERROR(routed_backward_data(c.x_expanded, c.offsets, c.cache, c.grad_y.data(), grad_x_expanded,
                                                 &c.grad_state));
      float* grad_recv_x = ensure(c.grad_recv_x, num_recv * H);
      fold_expanded(buffer.expanded_layout(c.recv.handle), num_recv,
                    [&](int64_t e) { return grad_x_expanded + e * H; }, grad_recv_x);
      phase.reset();
      c.op = buffer.dispatch_backward_async(
          TensorView::contiguous(grad_recv_x, DType::kF32, {num_recv, H}), c.recv.handle,
          TensorView::contiguous(grad_n_moe + c.begin * H, DType::kF32, {c.count, H}),
          {.bias = {},
           .grad_recv_topk_weights = TensorView::contiguous(c.grad_recv_weights.data(), DType::kF32, {num_recv, K}),
           .grad_topk_weights = TensorView::contiguous(grad_weights + c.begin * K, DType::kF32, {c.count, K})});
    }

    // The weight pass, under the last dispatch backwards.
    phase.emplace(*this, times.experts, "experts_backward");
    if (num_local > 0) {
      if (chunks.size() == 1) {
        const Chunk& c = chunks[0];
        EPX_RETURN_IF_ERROR(routed_backward_weights(c.x_expanded, c.offsets, c.grad_y.data(), c.grad_state));
      } else {
        build_whole_layout();
        const std::size_t state_row = static_cast<std::size_t>(F) * dtype_size(compute_dtype());
        gather_whole<std::byte>(whole.x, row_bytes, [](const Chunk& c) { return c.x_expanded.data(); });
        gather_whole<float>(whole.grad_y, H, [](const Chunk& c) { return c.grad_y.data(); });
        gather_whole<std::byte>(whole.grad_state.a, state_row, [](const Chunk& c) { return c.grad_state.a.data(); });
        gather_whole<std::byte>(whole.grad_state.grad_h1, state_row,
                                [](const Chunk& c) { return c.grad_state.grad_h1.data(); });
        gather_whole<std::byte>(whole.grad_state.grad_h3, state_row,
                                [](const Chunk& c) { return c.grad_state.grad_h3.data(); });
        // Exactly rows x F each (gather_whole keeps one row for an empty batch).
        const std::size_t state_bytes = static_cast<std::size_t>(whole.offsets.back()) * state_row;
        for (auto* v : {&whole.grad_state.a, &whole.grad_state.grad_h1, &whole.grad_state.grad_h3}) v->resize(state_bytes);
        whole.grad_state.rows = whole.offsets.back();
        EPX_RETURN_IF_ERROR(routed_backward_weights(whole.x, whole.offsets, whole.grad_y.data(), whole.grad_state));
      }
    }
    phase.reset();
    phase.emplace(*this, times.dispatch, "dispatch_backward");
    EPX_RETURN_IF_ERROR(wait_chunks());
    for (int64_t i = 0; i < T * H; ++i) grad_n[i] += grad_n_moe[i];
    phase.reset();
    return router_backward(T, go, grad_n, grad_weights, grad_x);
  }

  // Weighted aux and z losses of `routed`; keeps their gradient w.r.t. the logits.
  Status auxiliary_losses(int64_t T) {
    const int E = config.router.num_experts, K = config.router.topk;
    const TensorView logits_view = TensorView::contiguous(logits.data(), DType::kF32, {T, E});
    aux_loss = 0.0;
    aux_grad_logits.assign(static_cast<std::size_t>(T * E), 0.0f);
    const double R = global.num_ranks();
    auto add = [&](const LossAndGrad& term, double loss_scale, double grad_scale) {
      aux_loss += term.loss * loss_scale;
      for (std::size_t i = 0; i < term.grad_logits.size(); ++i)
        aux_grad_logits[i] += static_cast<float>(term.grad_logits[i] * grad_scale);
    };
    const TensorView idx = TensorView::contiguous(routed.topk_idx.data(), DType::kI32, {T, K});
    if (config.aux_loss_coeff > 0) {
      const double c = config.aux_loss_coeff;
      if (config.aux_loss == AuxLossKind::kGlobalBatch) {
        EPX_ASSIGN_OR_RETURN(LossAndGrad term, global_load_balancing_loss(config.router.score_function, logits_view,
                                                                          idx, global, deadline()));
        add(term, c / R, c);  // one loss for all ranks; each holds the gradient of its own logits
      } else if (T > 0) {
        EPX_ASSIGN_OR_RETURN(LossAndGrad term, load_balancing_loss(config.router.score_function, logits_view, idx));
        add(term, c / R, c / R);  // the mean over ranks of the per-rank losses
      }
    }
    if (config.z_loss_coeff > 0 && T > 0) {
      EPX_ASSIGN_OR_RETURN(LossAndGrad term, router_z_loss(logits_view));
      add(term, config.z_loss_coeff / R, config.z_loss_coeff / R);
    }
    return Status::ok();
  }

  // Each expert parameter holds num_local blocks of `per_expert` values.
  static std::span<float> block(std::vector<float>& v, int local, std::size_t per_expert) {
    return std::span(v).subspan(static_cast<std::size_t>(local) * per_expert, per_expert);
  }

  Status sum_replica_gradients(Transport& group, const Deadline& until) {
    if (num_replicated == 0) return Status::ok();
    if (group.num_ranks() != transport.num_ranks() || group.rank() != transport.rank())
      return invalid_argument("sum_replica_gradients on rank {} of {} ranks; the layer's experts live on rank {} of {}",
                              group.rank(), group.num_ranks(), transport.rank(), transport.num_ranks());
    const std::size_t hf = static_cast<std::size_t>(config.hidden) * config.ffn_hidden;
    Parameter* params[3] = {&w1, &w3, &w2};
    std::vector<float> packed(static_cast<std::size_t>(num_replicated) * 3 * hf, 0.0f);
    for (int l = 0; l < num_local; ++l) {
      const int e = local_logical(l);
      if (e < 0 || replicated_pos[e] < 0) continue;
      float* dst = packed.data() + static_cast<std::size_t>(replicated_pos[e]) * 3 * hf;
      for (Parameter* p : params) {
        const std::span<float> g = block(p->grad, l, hf);
        for (std::size_t i = 0; i < hf; ++i) dst[i] += g[i];
        dst += hf;
      }
    }
    EPX_RETURN_IF_ERROR(group.all_reduce(std::span<float>(packed), ReduceOp::kSum, until));
    for (int l = 0; l < num_local; ++l) {
      const int e = local_logical(l);
      if (e < 0 || replicated_pos[e] < 0) continue;
      const float* src = packed.data() + static_cast<std::size_t>(replicated_pos[e]) * 3 * hf;
      for (Parameter* p : params) {
        const std::span<float> g = block(p->grad, l, hf);
        for (std::size_t i = 0; i < hf; ++i) g[i] = src[i];
        src += hf;
      }
    }
    return Status::ok();
  }

  double duplicate_grad_sq() {
    if (num_replicated == 0) return 0.0;
    const std::size_t hf = static_cast<std::size_t>(config.hidden) * config.ffn_hidden;
    double sum = 0.0;
    for (int l = 0; l < num_local; ++l) {
      const int e = local_logical(l);
      if (e < 0 || replicated_pos[e] < 0 || buffer.placement().global_id(transport.rank(), l) == replicas[e][0])
        continue;
      for (Parameter* p : {&w1, &w3, &w2})
        for (float g : block(p->grad, l, hf)) sum += static_cast<double>(g) * g;
    }
    return sum;
  }

  Status backward(const TensorView& grad_out, const TensorView& grad_x) {
    if (!handle.valid() && !overlapped)
      return failed_precondition("MoELayer::backward needs a successful forward first");
    const int H = hidden(), K = config.router.topk;
    const int64_t T = num_tokens;
    EPX_RETURN_IF_ERROR(check_matrix(grad_out, "grad_out", DType::kF32, T, H));
    EPX_RETURN_IF_ERROR(check_matrix(grad_x, "grad_x", DType::kF32, T, H));
    BackwardScratch& b = bwd;
    float* go = ensure(b.grad_out, T * H);
    for (int64_t t = 0; t < T; ++t) std::memcpy(go + t * H, grad_out.row<const float>(t), sizeof(float) * H);
    float* grad_n = ensure(b.grad_n, T * H);
    std::fill(grad_n, grad_n + T * H, 0.0f);
    if (overlapped) return backward_overlapped(T, go, grad_n, grad_x);

    const ExpandedLayout& expanded = buffer.expanded_layout(handle);
    const int64_t rows = expanded.num_rows();
    const int64_t num_recv = handle.num_recv_tokens();

    std::optional<Phase> phase;
    phase.emplace(*this, times.experts, "experts_backward");
    EPX_RETURN_IF_ERROR(shared_backward(T, go, grad_n));
    phase.reset();

    // Combine backward: grad_out travels to the experts' ranks.
    phase.emplace(*this, times.combine, "combine_backward");
    to_payload(go, T, b.grad_out_payload);
    float* grad_y = ensure(b.grad_y, rows * H);
    float* grad_recv_weights = ensure(b.grad_recv_weights, num_recv * K);
    EPX_RETURN_IF_ERROR(buffer.combine_expanded_backward(
        payload_view(b.grad_out_payload, T), handle, y_view, {}, TensorView::contiguous(grad_y, DType::kF32, {rows, H}),
        TensorView::contiguous(grad_recv_weights, DType::kF32, {num_recv, K})));
    phase.reset();

    phase.emplace(*this, times.experts, "experts_backward");
    float* grad_x_expanded = ensure(b.grad_x_expanded, rows * H);
    if (num_local > 0) {
      EPX_RETURN_IF_ERROR(routed_backward_data(x_expanded, offsets, cache, grad_y, grad_x_expanded, &grad_state));
      EPX_RETURN_IF_ERROR(routed_backward_weights(x_expanded, offsets, grad_y, grad_state));
    }
    phase.reset();

    // Dispatch backward: fold the expanded rows back onto the received rows
    // (slot order), then combine them home with the weights' gradient.
    phase.emplace(*this, times.dispatch, "dispatch_backward");
    float* grad_recv_x = ensure(b.grad_recv_x, num_recv * H);
    fold_expanded(expanded, num_recv, [&](int64_t e) { return grad_x_expanded + e * H; }, grad_recv_x);
    float* grad_n_moe = ensure(b.grad_n_part, T * H);
    float* grad_weights = ensure(b.grad_weights, T * K);
    EPX_RETURN_IF_ERROR(buffer.dispatch_backward(
        TensorView::contiguous(grad_recv_x, DType::kF32, {num_recv, H}), handle,
        TensorView::contiguous(grad_n_moe, DType::kF32, {T, H}),
        {.bias = {},
         .grad_recv_topk_weights = TensorView::contiguous(grad_recv_weights, DType::kF32, {num_recv, K}),
         .grad_topk_weights = TensorView::contiguous(grad_weights, DType::kF32, {T, K})}));
    for (int64_t i = 0; i < T * H; ++i) grad_n[i] += grad_n_moe[i];
    phase.reset();
    return router_backward(T, go, grad_n, grad_weights, grad_x);
  }

  // grad_n += the shared experts' backward of go (and their weight gradients).
  Status shared_backward(int64_t T, const float* go, float* grad_n) {
    if (config.num_shared_experts == 0) return Status::ok();
    const int H = hidden();
    const int64_t shared_offsets[2] = {0, T};
    float* grad_n_shared = ensure(bwd.grad_n_part, T * H);
    const TensorView n_view = payload_view(n_payload, T), go_view = TensorView::contiguous(go, DType::kF32, {T, H});
    EPX_RETURN_IF_ERROR(expert_ffn_backward_data(shared_config(), shared_weights, n_view, shared_offsets, shared_cache,
                                                 go_view, TensorView::contiguous(grad_n_shared, DType::kF32, {T, H}),
                                                 &shared_grad_state));
    EPX_RETURN_IF_ERROR(expert_ffn_backward_weights(shared_config(), shared_weights, n_view, shared_offsets, go_view,
                                                    shared_grad_state,
                                                    {shared_w1.grad_view(), shared_w3.grad_view(),
                                                     shared_w2.grad_view()}));
    for (int64_t i = 0; i < T * H; ++i) grad_n[i] += grad_n_shared[i];
    return Status::ok();
  }

  // Folds the expanded rows' gradients back onto the received rows, in slot
  // order: dst[r] = sum over k of row(row_of[r][k]).
  void fold_expanded(const ExpandedLayout& expanded, int64_t num_recv, const std::function<const float*(int64_t)>& row,
                     float* dst_rows) const {
    const int H = hidden(), K = config.router.topk;
    std::fill(dst_rows, dst_rows + num_recv * H, 0.0f);
    for (int64_t r = 0; r < num_recv; ++r) {
      float* dst = dst_rows + r * H;
      for (int k = 0; k < K; ++k) {
        const int64_t e = expanded.row_of[static_cast<std::size_t>(r * K + k)];
        if (e < 0) continue;
        const float* src = row(e);
        for (int h = 0; h < H; ++h) dst[h] += src[h];
      }
    }
  }

  // The router's and the norm's backward; grad_x = go + the norm's backward of grad_n.
  Status router_backward(int64_t T, float* go, float* grad_n, const float* grad_weights, const TensorView& grad_x) {
    const int H = hidden(), E = config.router.num_experts, K = config.router.topk;
    std::optional<Phase> phase;
    phase.emplace(*this, times.router, "router_backward");
    EPX_ASSIGN_OR_RETURN(std::vector<float> grad_logits,
                         route_backward(config.router, routed,
                                        TensorView::contiguous(grad_weights, DType::kF32, {T, K})));
    for (std::size_t i = 0; i < grad_logits.size(); ++i) grad_logits[i] += aux_grad_logits[i];
    if (T > 0) {
      EPX_RETURN_IF_ERROR(detail::dense_gemm(true, false, H, E, T, n.data(), grad_logits.data(), true, router.grad.data()));
      EPX_RETURN_IF_ERROR(detail::dense_gemm(false, true, T, H, E, grad_logits.data(), router.value.data(), true, grad_n));
    }
    // grad_x = grad_out (the residual) + the norm's backward of grad_n.
    detail::rms_norm_backward(x.data(), norm.value.data(), rstd.data(), grad_n, T, H, go, norm.grad.data());
    for (int64_t t = 0; t < T; ++t) std::memcpy(grad_x.row<float>(t), go + t * H, sizeof(float) * H);
    phase.reset();
    return Status::ok();
  }
};

Result<std::unique_ptr<MoELayer>> MoELayer::create(const MoELayerConfig& config, Transport& transport, Buffer& buffer,
                                                   int layer_index, std::vector<int32_t> slot_expert,
                                                   Transport* global) {
  return detail::guard("MoELayer::create", [&] {
    return create_unguarded(config, transport, buffer, layer_index, std::move(slot_expert), global ? *global : transport);
  });
}

Result<std::unique_ptr<MoELayer>> MoELayer::create_unguarded(const MoELayerConfig& config, Transport& transport,
                                                       Buffer& buffer, int layer_index,
                                                       std::vector<int32_t> slot_expert, Transport& global) {
  EPX_RETURN_IF_ERROR(config.validate());
  const BufferConfig& bc = buffer.config();
  if (bc.hidden != config.hidden)
    return invalid_argument("the Buffer's hidden = {} differs from the layer's hidden = {}", bc.hidden, config.hidden);
  const DType dispatch_dtype = config.dispatch_dtype.value_or(config.dtype);
  if (bc.dtype != dispatch_dtype)
    return invalid_argument("the Buffer's dtype {} differs from the layer's dispatch dtype {}", dtype_name(bc.dtype),
                            dtype_name(dispatch_dtype));
  if (dispatch_dtype == DType::kFP8E4M3 && bc.gradient_dtype != config.dtype)
    return invalid_argument("the Buffer's gradient_dtype {} differs from the layer's dtype {} (its backward sends "
                            "gradients in dtype)",
                            bc.gradient_dtype ? dtype_name(*bc.gradient_dtype) : "(unset)", dtype_name(config.dtype));
  if (bc.max_topk < config.router.topk)
    return invalid_argument("the Buffer's max_topk = {} is below the router's topk = {}", bc.max_topk,
                            config.router.topk);
  if (bc.max_combine_dtype != DType::kF32)
    return invalid_argument("the Buffer's max_combine_dtype must be f32 (the weighted combine sums f32 rows)");
  if (config.combine_weights == CombineWeights::kReceiver && buffer.hierarchical())
    return invalid_argument("combine_weights receiver takes the flat path, but the Buffer is two-hop; use "
                            "combine_weights holder or BufferConfig::algorithm = kFlat");
  if (layer_index < 0) return invalid_argument("layer_index = {} is below 0", layer_index);
  if (global.num_ranks() % transport.num_ranks() != 0)
    return invalid_argument("the global transport's {} ranks are not a multiple of the layer's {} ranks",
                            global.num_ranks(), transport.num_ranks());
  auto impl = std::make_unique<Impl>(config, transport, global, buffer, layer_index);
  EPX_RETURN_IF_ERROR(impl->set_slot_map(std::move(slot_expert)));
  if (config.overlap == OverlapMode::kTwoMicroBatches && !impl->identity)
    return invalid_argument("overlap two-micro-batches routes each half on its own, but redundant experts choose "
                            "replicas by token index over the whole batch; use overlap chunked");
  impl->num_local = buffer.num_local_experts();
  EPX_RETURN_IF_ERROR(impl->init_parameters());
  if (impl->num_local > 0) EPX_RETURN_IF_ERROR(impl->expert_config().validate());
  if (config.num_shared_experts > 0) EPX_RETURN_IF_ERROR(impl->shared_config().validate());
  return std::unique_ptr<MoELayer>(new MoELayer(std::move(impl)));
}

MoELayer::MoELayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoELayer::~MoELayer() = default;

const MoELayerConfig& MoELayer::config() const { return impl_->config; }
int MoELayer::num_local_experts() const { return impl_->num_local; }
Buffer& MoELayer::buffer() { return impl_->buffer; }
const std::vector<int32_t>& MoELayer::slot_expert() const { return impl_->slot_expert; }
int MoELayer::local_logical_expert(int local) const { return impl_->local_logical(local); }
Status MoELayer::sum_replica_gradients() {
  return detail::guard("MoELayer::sum_replica_gradients",
                       [&] { return impl_->sum_replica_gradients(impl_->transport, impl_->deadline()); });
}
Status MoELayer::sum_replica_gradients(Transport& transport, const Deadline& deadline) {
  return detail::guard("MoELayer::sum_replica_gradients",
                       [&] { return impl_->sum_replica_gradients(transport, deadline); });
}
double MoELayer::duplicate_grad_sq() const { return impl_->duplicate_grad_sq(); }
namespace {

// "layer 1, dispatch: <status>": where a failure (e.g. a peer that never
// arrived) happened, for the trainer's message.
Status in_phase(Status status, int layer_index, std::string_view phase) {
  if (status.is_ok()) return status;
  return Status(status.code(), fmt::format("layer {}, {}: {}", layer_index, phase, status.message()));
}

}  // namespace

Status MoELayer::forward(const TensorView& x, const TensorView& out) {
  impl_->phase_name = "forward";
  impl_->waits.clear(impl_->transport.num_ranks());
  Status status = detail::guard("MoELayer::forward", [&] { return impl_->forward(x, out); });
  impl_->buffer.take_waits(&impl_->waits);
  return in_phase(std::move(status), impl_->layer_index, impl_->phase_name);
}
Status MoELayer::backward(const TensorView& grad_out, const TensorView& grad_x) {
  impl_->phase_name = "backward";
  Status status = detail::guard("MoELayer::backward", [&] { return impl_->backward(grad_out, grad_x); });
  impl_->buffer.take_waits(&impl_->waits);
  return in_phase(std::move(status), impl_->layer_index, impl_->phase_name);
}
double MoELayer::aux_loss() const { return impl_->aux_loss; }
const LoadStats& MoELayer::load_stats() const { return impl_->stats; }
const LayerTimes& MoELayer::times() const { return impl_->times; }
int64_t MoELayer::weight_copies() const { return impl_->weight_copies; }
const WaitRecord& MoELayer::waits() const { return impl_->waits; }
ExpertBias& MoELayer::bias() { return impl_->bias; }
void MoELayer::set_tracer(Tracer* tracer) { impl_->tracer = tracer; }

Status MoELayer::update_bias() {
  if (!impl_->config.expert_bias) return Status::ok();
  return impl_->bias.update(impl_->stats.tokens_per_expert);
}

std::vector<Parameter*> MoELayer::parameters() {
  Impl& m = *impl_;
  std::vector<Parameter*> out = {&m.norm, &m.router};
  if (m.config.num_shared_experts > 0) out.insert(out.end(), {&m.shared_w1, &m.shared_w3, &m.shared_w2});
  out.insert(out.end(), {&m.w1, &m.w3, &m.w2});
  return out;
}

std::vector<Parameter*> MoELayer::expert_parameters() { return {&impl_->w1, &impl_->w3, &impl_->w2}; }

}  // namespace epx
