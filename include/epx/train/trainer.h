// Training: the MoE model on R in-process ranks, one step after another.
//
// `train` builds an InprocWorld of num_ranks ranks (num_nodes emulated
// nodes), gives every rank its model replica (dense parameters replicated,
// experts spread by the placement) and runs `steps` optimizer steps. Each
// step's global batch is samples [step * batch_tokens, (step + 1) *
// batch_tokens) of the task's deterministic stream, split into contiguous
// shares over the ranks, so R ranks and one rank see the same batch. After
// every step `on_step` gets a StepReport (on the calling thread's behalf
// from rank 0; keep it quick).
//
// Balancing strategies: none, the auxiliary load-balancing loss, the
// aux-loss-free expert bias (DeepSeek-V3), and a capacity factor with
// position or score drops; they combine (e.g. bias + capacity).
//
// Checkpoints (save_dir / resume_dir) hold every rank's parameters, AdamW
// moments, expert biases and the step; a resumed run continues with the same
// bits as an uninterrupted one.
//
//   epx::TrainConfig config;  // defaults: the tiny synthetic task
//   EPX_ASSIGN_OR_RETURN(epx::TrainSummary summary,
//                        epx::train(config, [](const epx::StepReport& r) { ... }));
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "epx/core/trace.h"
#include "epx/routing/load_stats.h"
#include "epx/train/data.h"
#include "epx/train/model.h"
#include "epx/train/optimizer.h"

namespace epx {

struct BalancingConfig {
  double aux_loss_coeff = 0.0;  // > 0: the auxiliary loss
  AuxLossKind aux_loss = AuxLossKind::kMicroBatch;
  bool expert_bias = false;     // aux-loss-free bias balancing
  float bias_rate = ExpertBias::kDefaultRate;
  double capacity_factor = 0.0;  // > 0: drop over capacity
  DropPolicy drop_policy = DropPolicy::kPosition;
  // A short name: "none", "aux", "bias", "capacity", combinations joined by '+'.
  [[nodiscard]] std::string name() const;
};

// "none", "aux", "aux-global", "bias", "capacity" (or "capacity-score"), and
// '+'-joined combinations such as "bias+capacity"; InvalidArgument otherwise.
Result<BalancingConfig> parse_balancing(std::string_view text, const BalancingConfig& defaults);

struct TrainConfig {
  ModelConfig model;  // max_tokens_per_rank is set from batch_tokens and num_ranks
  SyntheticTaskConfig synthetic;
  TextTaskConfig text;  // used when model.task == kNextByte
  BalancingConfig balancing;
  int num_ranks = 4;
  int num_nodes = 1;
  int64_t steps = 200;
  int64_t batch_tokens = 512;  // global tokens per step
  LearningRateSchedule schedule;
  AdamWConfig adamw;
  double clip_norm = 1.0;  // 0 = no clipping
  std::string save_dir;    // write a checkpoint at the end (and every save_every steps)
  int64_t save_every = 0;
  std::string resume_dir;  // start from this checkpoint
  Tracer* tracer = nullptr;  // records spans of steps [trace_first, trace_first + trace_steps)
  int64_t trace_first = 1;
  int64_t trace_steps = 0;

  // Applies balancing to the model's layer config and sizes the buffers.
  [[nodiscard]] Result<ModelConfig> resolved_model() const;
  [[nodiscard]] Status validate() const;
};

struct RankTimes {
  double router = 0, dispatch = 0, experts = 0, combine = 0, dense = 0;
  double wait = 0;  // in the barrier after forward/backward: waiting for the slowest rank
  double sync = 0;  // gradient all-reduce, clipping, stats
  double total = 0;
  [[nodiscard]] double communication() const { return dispatch + combine + sync; }
};

struct StepReport {
  int64_t step = 0;  // 0-based
  int64_t steps = 0;
  double loss = 0;       // main + auxiliary, summed over ranks
  double main_loss = 0;  // the task loss of the global batch
  double learning_rate = 0;
  double grad_norm = 0;
  double seconds = 0;
  double tokens_per_second = 0;
  std::vector<LoadStats> layers;  // global, per layer
  std::vector<RankTimes> ranks;
  [[nodiscard]] std::string to_json() const;
};

struct TrainSummary {
  int64_t steps = 0;
  double first_loss = 0;
  double final_loss = 0;      // mean main loss of the last min(10, steps) steps
  double tokens_per_second = 0;  // over the run, after the first step
  double max_vio = 0;         // mean over layers of the last step's MaxVio
  double mean_max_vio = 0;    // ... averaged over the last 10 steps
  int64_t dropped = 0;        // (token, slot) pairs dropped over the run
  double idle_fraction = 0;   // mean over the last 10 steps of the worst layer's idle fraction
  double communication_share = 0;  // dispatch + combine + sync over total time, all ranks
  // Every rank's parameters after the last step, dense ones once, expert ones
  // by "name#global_expert" (for comparisons); filled when keep_parameters.
  std::map<std::string, std::vector<float>> parameters;
};

// With a resume folder: its meta file matches this configuration (ranks,
// nodes, model shape), every rank's file is there and its step is at most
// config.steps. NotFound / InvalidArgument naming the folder otherwise.
[[nodiscard]] Status check_resume(const TrainConfig& config);

using StepCallback = std::function<void(const StepReport&)>;

Result<TrainSummary> train(const TrainConfig& config, const StepCallback& on_step = {}, bool keep_parameters = false);

}  // namespace epx
