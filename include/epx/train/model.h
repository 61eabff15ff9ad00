// MoEModel: an input projection, a stack of MoE layers and an output head,
// trained data-parallel over ranks with expert parallelism inside each layer.
//
//   input -> W_in -> [MoELayer] x num_layers -> RMSNorm -> W_out -> loss
//
// Two tasks: regression (dense inputs, mean squared error) and next-byte
// prediction (a window of bytes, one embedding row per (position, byte),
// softmax cross-entropy over 256 classes). Each rank passes its share of
// the global batch; the loss is the mean over the global batch, so the sum
// over ranks of forward_backward's return value is the batch loss and the
// dense gradients summed over ranks are its gradient.
//
// EP x EDP (several EP groups, data-parallel to each other): create(config,
// world, ep) puts the Buffers and the exchange on the EP group's transport and
// everything global (aux losses, load statistics, so the expert bias) on the
// world's; each EP group then holds every expert once, and a routed expert's
// gradient covers its EP group's tokens (sum it over the EDP group).
//
//   EPX_ASSIGN_OR_RETURN(auto model, epx::MoEModel::create(config, transport));
//   EPX_ASSIGN_OR_RETURN(double loss, model->forward_backward(batch, global_tokens));
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/exchange/buffer.h"
#include "epx/layer/moe_layer.h"

namespace epx {

enum class TaskKind : uint8_t { kRegression, kNextByte };

struct ModelConfig {
  TaskKind task = TaskKind::kRegression;
  int input_dim = 32;    // regression: features per token
  int output_dim = 16;   // regression: targets per token (next-byte: 256)
  int window = 16;       // next-byte: context bytes per token
  int num_layers = 2;
  int max_tokens_per_rank = 0;  // the largest local batch
  MoELayerConfig layer;  // every layer's shape (seed and index differ per layer)
  std::optional<ExpertPlacement> placement;  // default: contiguous
  // Redundant experts (EPLB): slot -> logical expert (-1 = empty) per layer,
  // S slots rank-major (rank r holds [r S/R, (r+1) S/R)); each layer then has
  // its own Buffer over the S slots. Empty: all layers share one Buffer over
  // `placement`.
  std::vector<std::vector<int32_t>> layer_slots;
  Milliseconds timeout{60000};
  bool record_waits = true;  // BufferConfig::record_waits of the layers' Buffers (off: to measure its cost)

  [[nodiscard]] int num_inputs() const { return task == TaskKind::kRegression ? input_dim : window * 256; }
  [[nodiscard]] int num_outputs() const { return task == TaskKind::kRegression ? output_dim : 256; }
  [[nodiscard]] Status validate() const;
};

// One rank's share of a batch. Regression: x [T, input_dim], target
// [T, output_dim]; next-byte: context [T, window], label [T].
struct Batch {
  int64_t num_tokens = 0;
  std::vector<float> x, target;
  std::vector<uint8_t> context;
  std::vector<int32_t> label;
};

// Per-step times of one rank, in seconds.
struct StepTimes {
  LayerTimes layers;  // summed over layers
  double dense = 0;   // input projection, head, loss
  double total = 0;   // forward_backward as a whole
};

class MoEModel {
 public:
  // One EP group of every rank.
  static Result<std::unique_ptr<MoEModel>> create(const ModelConfig& config, Transport& transport);
  // `ep`: this rank's EP group (its ranks are ranks of `world`); the placement
  // and layer_slots are over the EP group's ranks.
  static Result<std::unique_ptr<MoEModel>> create(const ModelConfig& config, Transport& world, Transport& ep);
  ~MoEModel();

  [[nodiscard]] const ModelConfig& config() const;
  // Zeroes the gradients, runs forward and backward and returns this rank's
  // share of the loss (main loss over global_tokens plus its share of the
  // auxiliary losses). Collective.
  [[nodiscard]] Result<double> forward_backward(const Batch& batch, int64_t global_tokens);
  // Forward only: this rank's share of the main loss (no auxiliary terms).
  [[nodiscard]] Result<double> evaluate(const Batch& batch, int64_t global_tokens);

  [[nodiscard]] std::vector<Parameter*> parameters();
  [[nodiscard]] std::vector<MoELayer*> layers();
  [[nodiscard]] const StepTimes& times() const;
  [[nodiscard]] Buffer& buffer(int layer = 0);

  // Called by forward_backward on the calling thread as gradients become
  // final, in this order: num_layers (the head and the final norm), then each
  // layer from the last to the first (its router, norm, shared and expert
  // gradients), then -1 (the input projection). A non-OK status stops the
  // backward and is returned. Empty (the default): no calls. Lets a gradient
  // all-reduce start while the backward goes on (train/grad_sync.h).
  using GradReadyHook = std::function<Status(int layer)>;
  void set_grad_ready_hook(GradReadyHook hook);

  // Re-places layer `layer`'s experts: builds a new Buffer over `slot_expert`
  // (same slot count) and a new MoELayer that keeps the old one's dense
  // parameters and expert bias; its expert weights are the initial ones of
  // their logical experts (the caller copies the trained ones in). Needs
  // layer_slots. Invalidates the layer's Parameter pointers. Collective.
  [[nodiscard]] Status replace_layer(int layer, std::vector<int32_t> slot_expert);

 private:
  struct Impl;
  explicit MoEModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epx
