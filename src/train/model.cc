#include "epx/train/model.h"

#include <cmath>
#include <cstring>

#include "epx/core/clock.h"
#include "epx/core/random.h"
#include "layer/dense.h"
#include "train/model_buffer.h"

namespace epx {
namespace {

// Init streams of the model's own parameters (the layers use theirs).
constexpr uint64_t kEmbedStream = 0xE0000001ULL;
constexpr uint64_t kHeadStream = 0xE0000002ULL;

void init_normal(std::vector<float>& out, uint64_t seed, uint64_t stream, float std) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(standard_normal(seed, stream, i)) * std;
}

TensorView matrix(const std::vector<float>& v, int64_t rows, int64_t cols) {
  return TensorView::contiguous(v.data(), DType::kF32, {rows, cols});
}

}  // namespace

namespace detail {

Result<BufferConfig> model_buffer_config(const ModelConfig& m, int num_experts, int num_ranks, bool rank_major) {
  const MoELayerConfig& lc = m.layer;
  std::optional<ExpertPlacement> placement = m.placement;
  if (rank_major) {
    if (num_experts % num_ranks != 0)
      return invalid_argument("eplb slots = {} must be a multiple of ranks = {}", num_experts, num_ranks);
    EPX_ASSIGN_OR_RETURN(placement, ExpertPlacement::contiguous(num_experts, num_ranks));
  }
  if (placement && placement->num_ranks() != num_ranks)
    return invalid_argument("the placement is over {} ranks; the EP group has {}", placement->num_ranks(), num_ranks);
  const DType payload = lc.dispatch_dtype.value_or(lc.dtype);
  BufferConfig bc{.num_experts = num_experts,
                  .hidden = lc.hidden,
                  .dtype = payload,
                  .gradient_dtype = payload == DType::kFP8E4M3 ? std::optional<DType>(lc.dtype) : std::nullopt,
                  .max_topk = lc.router.topk,
                  .max_tokens_per_rank = m.max_tokens_per_rank,
                  .placement = placement,
                  .timeout = m.timeout,
                  .record_waits = m.record_waits};
  // Receiver weights: room for the expanded rows of y in dtype.
  if (lc.combine_weights == CombineWeights::kReceiver)
    bc.max_expanded_rows = Buffer::expanded_rows_bound(bc, num_ranks, lc.dtype);
  return bc;
}

}  // namespace detail

Status ModelConfig::validate() const {
  if (num_layers < 1) return invalid_argument("num_layers = {} must be at least 1", num_layers);
  if (!layer_slots.empty() && static_cast<int>(layer_slots.size()) != num_layers)
    return invalid_argument("layer_slots has {} layers' maps; the model has {} layers", layer_slots.size(), num_layers);
  if (max_tokens_per_rank < 1) return invalid_argument("max_tokens_per_rank = {} must be at least 1", max_tokens_per_rank);
  if (task == TaskKind::kRegression) {
    if (input_dim < 1) return invalid_argument("input_dim = {} must be at least 1", input_dim);
    if (output_dim < 1) return invalid_argument("output_dim = {} must be at least 1", output_dim);
  } else if (window < 1) {
    return invalid_argument("window = {} must be at least 1", window);
  }
  return layer.validate();
}

struct MoEModel::Impl {
  ModelConfig config;
  Transport& transport;  // the EP group: Buffers and exchanges
  Transport& global;     // every rank: the layers' aux losses and load statistics
  std::vector<std::unique_ptr<Buffer>> buffers;  // one shared, or one per layer (layer_slots)
  std::vector<std::unique_ptr<MoELayer>> layers;
  Parameter embed, final_norm, head;
  StepTimes times;
  GradReadyHook grad_ready;
  void sum_layer_times();
  Status gradients_ready(int layer) const { return grad_ready ? grad_ready(layer) : Status::ok(); }
  // Activations of the last forward: hidden[l] is the input of layer l.
  std::vector<std::vector<float>> hidden;
  std::vector<float> normed, rstd, outputs;

  Impl(const ModelConfig& c, Transport& t, Transport& g) : config(c), transport(t), global(g) {}

  [[nodiscard]] int H() const { return config.layer.hidden; }

  // A Buffer over `num_experts` experts (slots), rank-major when `rank_major`.
  Result<std::unique_ptr<Buffer>> make_buffer(int num_experts, bool rank_major) {
    EPX_ASSIGN_OR_RETURN(BufferConfig bc,
                         detail::model_buffer_config(config, num_experts, transport.num_ranks(), rank_major));
    return Buffer::create(transport, bc);
  }

  Status check_batch(const Batch& b) const {
    const int64_t T = b.num_tokens;
    if (T < 0 || T > config.max_tokens_per_rank)
      return invalid_argument("the batch has {} tokens; this rank takes [0, {}]", T, config.max_tokens_per_rank);
    if (config.task == TaskKind::kRegression) {
      if (b.x.size() != static_cast<std::size_t>(T * config.input_dim) ||
          b.target.size() != static_cast<std::size_t>(T * config.output_dim))
        return invalid_argument("regression batch of {} tokens needs x of {} and target of {} values, got {} and {}", T,
                                T * config.input_dim, T * config.output_dim, b.x.size(), b.target.size());
    } else {
      if (b.context.size() != static_cast<std::size_t>(T * config.window) || b.label.size() != static_cast<std::size_t>(T))
        return invalid_argument("next-byte batch of {} tokens needs {} context bytes and {} labels, got {} and {}", T,
                                T * config.window, T, b.context.size(), b.label.size());
      for (int64_t t = 0; t < T; ++t)
        if (b.label[t] < 0 || b.label[t] > 255) return invalid_argument("label[{}] = {} is outside [0, 256)", t, b.label[t]);
    }
    return Status::ok();
  }

  // Forward through the head; outputs = logits or predictions [T, outputs].
  Status forward(const Batch& b) {
    const int64_t T = b.num_tokens;
    const int h = H();
    Stopwatch watch;
    hidden.resize(config.num_layers + 1);
    for (auto& v : hidden) v.assign(static_cast<std::size_t>(std::max<int64_t>(T, 1) * h), 0.0f);
    if (config.task == TaskKind::kRegression) {
      EPX_RETURN_IF_ERROR(detail::dense_gemm(false, false, T, h, config.input_dim, b.x.data(), embed.value.data(), false, hidden[0].data()));
    } else {
      for (int64_t t = 0; t < T; ++t) {
        float* dst = hidden[0].data() + t * h;
        for (int w = 0; w < config.window; ++w) {
          const float* row = embed.value.data() + (static_cast<int64_t>(w) * 256 + b.context[t * config.window + w]) * h;
          for (int i = 0; i < h; ++i) dst[i] += row[i];
        }
      }
    }
    times.dense += watch.seconds();
    for (int l = 0; l < config.num_layers; ++l) {
      EPX_RETURN_IF_ERROR(layers[l]->forward(matrix(hidden[l], T, h), matrix(hidden[l + 1], T, h)));
    }
    watch.reset();
    const int D = config.num_outputs();
    normed.assign(hidden.back().size(), 0.0f);
    rstd.assign(static_cast<std::size_t>(std::max<int64_t>(T, 1)), 0.0f);
    detail::rms_norm_forward(hidden.back().data(), final_norm.value.data(), config.layer.norm_eps, T, h, normed.data(),
                             rstd.data());
    outputs.assign(static_cast<std::size_t>(std::max<int64_t>(T, 1) * D), 0.0f);
    EPX_RETURN_IF_ERROR(detail::dense_gemm(false, false, T, D, h, normed.data(), head.value.data(), false, outputs.data()));
    times.dense += watch.seconds();
    return Status::ok();
  }

  // Main loss over global_tokens; fills grad (same shape as outputs) when given.
  double loss(const Batch& b, int64_t global_tokens, std::vector<float>* grad) const {
    const int64_t T = b.num_tokens;
    const int D = config.num_outputs();
    const double scale = 1.0 / static_cast<double>(std::max<int64_t>(global_tokens, 1));
    double total = 0.0;
    if (grad) grad->assign(outputs.size(), 0.0f);
    for (int64_t t = 0; t < T; ++t) {
      const float* o = outputs.data() + t * D;
      if (config.task == TaskKind::kRegression) {
        const float* y = b.target.data() + t * D;
        for (int d = 0; d < D; ++d) {
          const double diff = static_cast<double>(o[d]) - y[d];
          total += diff * diff / D;
          if (grad) (*grad)[t * D + d] = static_cast<float>(2.0 * diff / D * scale);
        }
      } else {
        double max = o[0];
        for (int d = 1; d < D; ++d) max = std::max(max, static_cast<double>(o[d]));
        double sum = 0.0;
        for (int d = 0; d < D; ++d) sum += std::exp(o[d] - max);
        const double lse = max + std::log(sum);
        total += lse - o[b.label[t]];
        if (grad) {
          for (int d = 0; d < D; ++d) (*grad)[t * D + d] = static_cast<float>(std::exp(o[d] - lse) * scale);
          (*grad)[t * D + b.label[t]] -= static_cast<float>(scale);
        }
      }
    }
    return total * scale;
  }

  Status backward(const Batch& b, const std::vector<float>& grad_outputs) {
    const int64_t T = b.num_tokens;
    const int h = H(), D = config.num_outputs();
    Stopwatch watch;
    std::vector<float> grad_normed(normed.size(), 0.0f);
    if (T > 0) {
      EPX_RETURN_IF_ERROR(detail::dense_gemm(true, false, h, D, T, normed.data(), grad_outputs.data(), true, head.grad.data()));
      EPX_RETURN_IF_ERROR(detail::dense_gemm(false, true, T, h, D, grad_outputs.data(), head.value.data(), false, grad_normed.data()));
    }
    std::vector<float> grad(normed.size(), 0.0f), grad_in(normed.size());
    detail::rms_norm_backward(hidden.back().data(), final_norm.value.data(), rstd.data(), grad_normed.data(), T, h,
                              grad.data(), final_norm.grad.data());
    times.dense += watch.seconds();
    EPX_RETURN_IF_ERROR(gradients_ready(config.num_layers));
    for (int l = config.num_layers - 1; l >= 0; --l) {
      EPX_RETURN_IF_ERROR(layers[l]->backward(matrix(grad, T, h), matrix(grad_in, T, h)));
      EPX_RETURN_IF_ERROR(gradients_ready(l));
      grad.swap(grad_in);
    }
    watch.reset();
    if (config.task == TaskKind::kRegression) {
      if (T > 0)
        EPX_RETURN_IF_ERROR(detail::dense_gemm(true, false, config.input_dim, h, T, b.x.data(), grad.data(), true, embed.grad.data()));
    } else {
      for (int64_t t = 0; t < T; ++t) {
        const float* g = grad.data() + t * h;
        for (int w = 0; w < config.window; ++w) {
          float* row = embed.grad.data() + (static_cast<int64_t>(w) * 256 + b.context[t * config.window + w]) * h;
          for (int i = 0; i < h; ++i) row[i] += g[i];
        }
      }
    }
    times.dense += watch.seconds();
    return gradients_ready(-1);
  }
};

Result<std::unique_ptr<MoEModel>> MoEModel::create(const ModelConfig& config, Transport& transport) {
  return create(config, transport, transport);
}

Result<std::unique_ptr<MoEModel>> MoEModel::create(const ModelConfig& config, Transport& world, Transport& ep) {
  EPX_RETURN_IF_ERROR(config.validate());
  if (world.num_ranks() % ep.num_ranks() != 0)
    return invalid_argument("the world's {} ranks are not a multiple of the EP group's {} ranks", world.num_ranks(),
                            ep.num_ranks());
  auto impl = std::make_unique<Impl>(config, ep, world);
  const MoELayerConfig& lc = config.layer;
  for (int l = 0; l < config.num_layers; ++l) {
    if (config.layer_slots.empty()) {
      if (l == 0) {
        EPX_ASSIGN_OR_RETURN(auto buffer, impl->make_buffer(lc.router.num_experts, false));
        impl->buffers.push_back(std::move(buffer));
      }
      EPX_ASSIGN_OR_RETURN(auto layer, MoELayer::create(lc, ep, *impl->buffers[0], l, {}, &world));
      impl->layers.push_back(std::move(layer));
    } else {
      const auto& slots = config.layer_slots[l];
      EPX_ASSIGN_OR_RETURN(auto buffer, impl->make_buffer(static_cast<int>(slots.size()), true));
      EPX_ASSIGN_OR_RETURN(auto layer, MoELayer::create(lc, ep, *buffer, l, slots, &world));
      impl->buffers.push_back(std::move(buffer));
      impl->layers.push_back(std::move(layer));
    }
  }
  const int h = lc.hidden, D = config.num_outputs();
  EPX_ASSIGN_OR_RETURN(impl->embed, Parameter::make("embed", ParamKind::kDense, config.num_inputs(), h));
  const double embed_fan_in = config.task == TaskKind::kRegression ? config.input_dim : config.window;
  init_normal(impl->embed.value, lc.seed, kEmbedStream, static_cast<float>(1.0 / std::sqrt(embed_fan_in)));
  EPX_ASSIGN_OR_RETURN(impl->final_norm, Parameter::make("final_norm", ParamKind::kDense, 1, h));
  std::fill(impl->final_norm.value.begin(), impl->final_norm.value.end(), 1.0f);
  EPX_ASSIGN_OR_RETURN(impl->head, Parameter::make("head", ParamKind::kDense, h, D));
  init_normal(impl->head.value, lc.seed, kHeadStream, static_cast<float>(1.0 / std::sqrt(h)));
  return std::unique_ptr<MoEModel>(new MoEModel(std::move(impl)));
}

MoEModel::MoEModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoEModel::~MoEModel() = default;

const ModelConfig& MoEModel::config() const { return impl_->config; }
const StepTimes& MoEModel::times() const { return impl_->times; }
Buffer& MoEModel::buffer(int layer) { return impl_->layers[layer]->buffer(); }
void MoEModel::set_grad_ready_hook(GradReadyHook hook) { impl_->grad_ready = std::move(hook); }

Status MoEModel::replace_layer(int layer, std::vector<int32_t> slot_expert) {
  Impl& m = *impl_;
  if (m.config.layer_slots.empty())
    return failed_precondition("replace_layer needs a model built with layer_slots (redundant experts)");
  if (layer < 0 || layer >= m.config.num_layers)
    return invalid_argument("layer = {} is outside [0, {})", layer, m.config.num_layers);
  if (slot_expert.size() != m.config.layer_slots[layer].size())
    return invalid_argument("the new map has {} slots; layer {} has {}", slot_expert.size(), layer,
                            m.config.layer_slots[layer].size());
  EPX_ASSIGN_OR_RETURN(auto buffer, m.make_buffer(static_cast<int>(slot_expert.size()), true));
  EPX_ASSIGN_OR_RETURN(auto fresh, MoELayer::create(m.config.layer, m.transport, *buffer, layer, slot_expert, &m.global));
  MoELayer& old = *m.layers[layer];
  const std::vector<Parameter*> from = old.parameters(), to = fresh->parameters();
  for (std::size_t i = 0; i < from.size(); ++i)
    if (from[i]->kind == ParamKind::kDense) {
      to[i]->value = from[i]->value;
      to[i]->mark_written();
    }
  fresh->bias().set_values(old.bias().values());
  fresh->bias().set_frozen(old.bias().frozen());
  fresh->bias().set_rate(old.bias().rate());
  m.layers[layer] = std::move(fresh);
  m.buffers[layer] = std::move(buffer);
  m.config.layer_slots[layer] = std::move(slot_expert);
  return Status::ok();
}

// Each layer's times cover its last forward and the backward after it.
void MoEModel::Impl::sum_layer_times() {
  times.layers = {};
  for (auto& layer : layers) times.layers += layer->times();
}

Result<double> MoEModel::forward_backward(const Batch& batch, int64_t global_tokens) {
  Impl& m = *impl_;
  EPX_RETURN_IF_ERROR(m.check_batch(batch));
  Stopwatch total;
  m.times = {};
  for (Parameter* p : parameters()) p->zero_grad();
  EPX_RETURN_IF_ERROR(m.forward(batch));
  std::vector<float> grad;
  double loss = m.loss(batch, global_tokens, &grad);
  for (auto& layer : m.layers) loss += layer->aux_loss();
  EPX_RETURN_IF_ERROR(m.backward(batch, grad));
  m.sum_layer_times();
  m.times.total = total.seconds();
  return loss;
}

Result<double> MoEModel::evaluate(const Batch& batch, int64_t global_tokens) {
  Impl& m = *impl_;
  EPX_RETURN_IF_ERROR(m.check_batch(batch));
  m.times = {};
  EPX_RETURN_IF_ERROR(m.forward(batch));
  m.sum_layer_times();
  return m.loss(batch, global_tokens, nullptr);
}

std::vector<Parameter*> MoEModel::parameters() {
  Impl& m = *impl_;
  std::vector<Parameter*> out = {&m.embed};
  for (auto& layer : m.layers) {
    auto p = layer->parameters();
    out.insert(out.end(), p.begin(), p.end());
  }
  out.insert(out.end(), {&m.final_norm, &m.head});
  return out;
}

std::vector<MoELayer*> MoEModel::layers() {
  std::vector<MoELayer*> out;
  for (auto& layer : impl_->layers) out.push_back(layer.get());
  return out;
}

}  // namespace epx
