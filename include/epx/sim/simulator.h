// The cluster simulator: steps of an MoE model on thousands of GPUs, per GPU.
//
// For every simulated step, pipeline stage, EP group and MoE layer, traffic
// comes from the real router and dispatch layout (traffic.h), costs from the
// link and GEMM models (cost.h), and each GPU runs the layer as an explicit
// schedule of tasks on two streams, compute and communication:
//   none             attention, router, dispatch, experts (+ shared), combine, one after another;
//   shared           the shared experts run while dispatch is in flight;
//   chunked          dispatch, experts and combine in `chunks` pieces, pipelined;
//   two_micro_batch  two micro-batches interleaved (DualPipe-style): one's
//                    all-to-all runs while the other computes.
// An all-to-all starts when every GPU of the group has issued it and ends on
// each GPU after its own cost; compute that runs while communication is in
// flight is slowed by sms / (sms - comm_sms). Backward (mode = train) runs the
// same schedule in reverse order with twice the FLOPs. A step is
// (units + pp_stages - 1) x (the slowest stage's time + the activation
// transfers between stages) (1F1B bubble), where a unit is one micro-batch
// (two for two_micro_batch), then the gradient all-reduce the backward left
// exposed and the optimizer step (pipeline.h, grad_sync.h, optimizer.h).
//
// Deterministic for a scenario; independent of run.threads.
//
//   EPX_ASSIGN_OR_RETURN(epx::sim::SimResult r, epx::sim::simulate(scenario));
//   r.summary.step_s.p50;
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "epx/core/status.h"
#include "epx/core/trace.h"
#include "epx/sim/grad_sync.h"
#include "epx/sim/optimizer.h"
#include "epx/sim/pipeline.h"
#include "epx/sim/scenario.h"

namespace epx::sim {

struct StepStats {
  double step_s = 0;               // one training step (or forward pass), bubbles included
  double stage_s = 0;              // the slowest stage, one unit of micro-batches
  double worst_idle = 0;           // max over simulated GPUs: 1 - compute busy / stage time
  double mean_idle = 0;
  double exposed_comm = 0;         // mean over GPUs: communication time with no compute running / stage time
  double comm_share = 0;           // mean over GPUs: communication time / stage time
  double tokens_per_s_per_gpu = 0;
  double mfu = 0;                  // model FLOPs / (step time x peak), per GPU
  double max_vio = 0;              // max over layers: max expert load / mean - 1 (logical experts)
  int64_t dropped = 0;             // (token, slot) pairs dropped by capacity, in the sample
  // Gradient all-reduces (EDP experts + all-ranks dense), the stage that
  // exposes most: their busy time, what the backward leaves exposed (in
  // step_s), and the share hidden (1 - exposed / busy).
  double grad_sync_s = 0;
  double grad_exposed_s = 0;
  double grad_hidden = 1;
  // The rest of the whole step (docs/simulator.md "The whole step"):
  // step_s = (units + pp - 1) x stage_s + pp_transfer_s + grad_exposed_s + optimizer_s + param_gather_s.
  double pp_transfer_s = 0;   // activation transfers between stages on the 1F1B critical path
  double optimizer_s = 0;     // the optimizer's update after the all-reduce (the stage that ends last)
  double param_gather_s = 0;  // ZeRO-1: the updated weights' all-gathers
};

struct Percentiles {
  double p50 = 0, p99 = 0, mean = 0;
};

struct Summary {
  Percentiles step_s, worst_idle, exposed_comm, comm_share, tokens_per_s_per_gpu, mfu, max_vio;
  Percentiles grad_sync_s, grad_exposed_s, grad_hidden;
  Percentiles pp_transfer_s, optimizer_s, param_gather_s;
  // Mean seconds per GPU per step in each task kind ("attention", "router",
  // "dispatch", "shared", "experts", "combine", "dense"), forward + backward.
  std::vector<std::pair<std::string, double>> phase_s;
};

struct SimResult {
  std::vector<StepStats> steps;
  Summary summary;
  // One step (run.trace_step) of the first stage with an MoE layer, EP group
  // 0: rank 2g is GPU g's
  // compute stream (with "idle" gaps), rank 2g + 1 its communication.
  std::vector<TraceSpan> trace;
  int sampled_tokens = 0;           // tokens per GPU routed one by one
  double sample_scale = 1.0;        // counts multiplied by this
  int simulated_groups = 0;         // EP groups per stage that were simulated
  int64_t routed_gpu_layers = 0;    // route + layout calls
  double model_flops_per_token = 0; // forward (x3 for training in MFU)
  double wall_s = 0;                // how long simulate() took
  // Training: the first stage's gradient all-reduce (bytes per GPU, the
  // group sizes, each group's whole-gradient cost and step 0's buckets).
  int edp_ranks = 0, dp_ranks = 0;
  double expert_grad_bytes = 0, dense_grad_bytes = 0;
  GradSyncResult grad_sync;
  PipelineTransfer pipeline;   // one transfer between stages (pp > 1)
  OptimizerCost optimizer;     // the first stage's optimizer step (training)
};

struct SimOptions {
  bool keep_trace = false;
  // Called after each simulated step with (steps done, steps), on the
  // calling thread (epx sim's progress line).
  std::function<void(int, int)> on_step = nullptr;
};

Result<SimResult> simulate(const Scenario& scenario, const SimOptions& options = {});

// p50 / p99 / mean of values (nearest rank); zeros for an empty span.
Percentiles percentiles(std::vector<double> values);

}  // namespace epx::sim
