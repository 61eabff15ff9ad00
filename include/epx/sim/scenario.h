// Scenario: everything the cluster simulator needs to know, as plain data.
//
// A scenario is a hardware profile (per-GPU compute, memory and link figures),
// a cluster shape, a model, a parallel layout, a routing distribution, a
// balancing strategy, an overlap schedule and how long to simulate. It is read
// from TOML (configs/sim/*.toml; the hardware profile from
// configs/hardware/*.toml, named by `hardware.profile` relative to the
// scenario file) and every value can be overridden by its dotted key
// ("model.topk", "hardware.nic.bandwidth"), which is how `--set` and `--sweep`
// work.
//
//   EPX_ASSIGN_OR_RETURN(epx::sim::Scenario s, epx::sim::load_scenario("configs/sim/deepseek-v3.toml"));
//   EPX_RETURN_IF_ERROR(epx::sim::set_value(s, "model.topk", "4"));
//   EPX_RETURN_IF_ERROR(s.validate());
//
// Errors name the file, the key and the problem: "x.toml: model.topk = 0 is
// below 1", "x.toml: unknown key 'model.topkk'".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "epx/core/status.h"

namespace epx::sim {

// One GPU and its links. Bandwidths in bytes/s per direction, FLOP/s, seconds.
struct HardwareProfile {
  std::string name;
  double bf16_flops = 0;           // dense peak
  double fp8_flops = 0;            // dense peak
  int sms = 1;                     // cores (streaming multiprocessors)
  double gemm_efficiency = 0.66;   // grouped GEMM share of peak with many rows per expert
  double gemm_half_rows = 64;      // rows per expert at which the share is half of that
  int gemm_tile = 128;             // rows of one expert are padded to a multiple of this
  double hbm_bandwidth = 0;        // read + write traffic
  // Memory traffic per second the optimizer step reaches on one GPU; 0 =
  // hbm_bandwidth (a fused AdamW is memory-bound). Emulated hosts: the rate
  // epx train's AdamW reaches on one core (it is compute-bound there).
  double optimizer_bandwidth = 0;
  double nvlink_bandwidth = 0;     // effective, per direction
  double nvlink_efficiency = 1.0;  // share of nvlink_bandwidth an all-to-all reaches (calibrated)
  double nvlink_latency = 0;       // once per all-to-all that uses NVLink
  int nics_per_gpu = 1;
  double nic_bandwidth = 0;        // per NIC, per direction
  double nic_efficiency = 1.0;     // share an all-to-all reaches (calibrated)
  double nic_latency = 0;          // once per all-to-all that crosses nodes
  // Two-hop: bytes per second one forwarding SM copies (comm_sms / 2 of them
  // forward on each GPU; DeepEP internode.cu). 0 = no such limit.
  double forward_sm_bandwidth = 0;
  double message_overhead = 0;     // per (source, destination) message a GPU issues
  int comm_sms = 0;                // cores the communication kernels take while they run
  // Emulated clusters (the in-process backend): every link is a CPU copy on
  // cores that all ranks share. 0 = no such limit (real GPUs).
  double host_copy_bandwidth = 0;  // bytes copied per second by the whole host
  int host_nic_copies = 1;         // copies per byte that crosses an emulated node boundary
  // The ranks of a node share one NIC of nic.bandwidth (emulated hosts joined
  // by one link), instead of nic.per_gpu NICs each.
  bool nic_shared_per_node = false;
  // Cores that run every rank's compute (emulated clusters: more ranks than
  // cores run slower by ranks / cores). 0 = a GPU per rank.
  int host_cores = 0;
};

struct ClusterConfig {
  int nodes = 1;
  int gpus_per_node = 8;
  bool rail_aligned = true;  // NIC i of every node on one rail (two-hop needs it)
};

struct ModelConfig {
  int layers = 1;
  int dense_layers = 0;           // the first layers are dense (no experts)
  int hidden = 7168;
  int expert_hidden = 2048;       // width of one expert's FFN (SwiGLU: 3 matrices)
  int dense_hidden = 18432;       // FFN width of the dense layers
  int experts = 256;
  int shared_experts = 0;
  int topk = 8;
  int groups = 1;                 // expert groups (node-limited routing: nodes)
  int topk_groups = 1;            // groups a token may use (ignored when groups = 1)
  double capacity_factor = 0;     // 0 = dropless
  std::string score = "sigmoid";  // sigmoid or softmax
  std::string dispatch_dtype = "bf16";   // fp8 rows carry hidden/128 f32 scales
  std::string combine_dtype = "bf16";
  std::string combine_remote_dtype;      // between nodes; empty = combine_dtype
  std::string compute_dtype = "bf16";    // bf16 or fp8: which peak the GEMMs use
  double attention_flops_per_token = 0;  // forward, per layer; 0 = 8 * hidden^2 (Q, K, V, O)
  bool attention = true;                 // false: MoE blocks without attention (epx train's model)
  std::string grad_dtype = "f32";        // gradients as all-reduced: f32 or bf16
  int64_t embedding_params = 0;          // input embedding (dense, all ranks; first stage)
  int64_t head_params = 0;               // output head (dense, all ranks; last stage), final norm added
  std::string activation_dtype = "bf16"; // hidden states sent between pipeline stages: fp8, bf16 or f32
};

struct ParallelismConfig {
  int ep = 8;                      // expert-parallel group size (GPUs)
  int pp_stages = 1;
  int micro_batches = 1;           // per step, per pipeline
  int64_t tokens_per_gpu = 4096;   // per micro-batch
  // two_hop, flat, low_latency (DeepEP's GPU kernels) or low_latency_epx
  // (epx's CPU LowLatencyBuffer; cost.h "kLowLatencyEpx")
  std::string dispatch = "two_hop";
  // low_latency_epx: LowLatencyConfig::combine_per_rank (one combine row per
  // (token, rank) instead of per (token, expert)).
  bool combine_per_rank = false;
  std::string mode = "train";        // train (forward + backward) or forward
  // Gradient all-reduces (grad_sync.h): routed experts over the EDP group
  // (GPUs per stage / ep), dense parameters over all GPUs of the stage.
  bool grad_overlap = true;               // buckets start as the backward makes them ready
  int64_t grad_bucket_bytes = 25 << 20;   // at most, whole layers (a larger layer alone); 0 = one bucket per group
  // ring, hierarchical, auto (the faster of the two), allgather (epx's
  // in-process transport: every contribution gathered, summed in rank order)
  // or chunked (epx's MPI transport: all-to-all of chunks, rank-order sums,
  // all-gather).
  std::string allreduce = "auto";
  // Pipeline stages send each micro-batch's activations forward and their
  // gradients back (pipeline.h); false leaves the transfers out.
  bool pp_transfers = true;
};

// The optimizer step after the gradient all-reduce (optimizer.h): AdamW's
// memory traffic over the parameters a GPU holds.
struct OptimizerConfig {
  std::string kind = "adamw";             // adamw, or none (no optimizer step in the step time)
  std::string master_dtype = "f32";       // the weights it updates: f32 or bf16
  std::string moment_dtype = "f32";       // AdamW's two moments: f32 or bf16 (DeepSeek-V3: bf16)
  std::string weight_copy_dtype = "none"; // a compute copy written after the update: none, bf16 or fp8
  // ZeRO-1: the optimizer state sharded over each data-parallel group (EDP for
  // routed experts, the stage for dense parameters); gradients are then
  // reduce-scattered instead of all-reduced and the updated weights all-gathered.
  bool zero = false;
};

struct RoutingConfig {
  std::string distribution = "uniform";  // uniform, zipf, lognormal or trace
  double zipf_s = 1.0;
  double lognormal_sigma = 1.0;
  double drift = 0.0;       // per step: log-popularity random walk step (std)
  std::string trace;        // per-expert token counts (docs/simulator.md "Routing traces")
  std::string trace_format = "auto";  // auto (by content), jsonl (epx train --metrics) or counts
  uint64_t seed = 1;
  int sample_tokens = 128;  // tokens per GPU routed one by one; counts are scaled to tokens_per_gpu
};

struct BalancingConfig {
  std::string strategy = "none";   // none, aux, bias, capacity or eplb
  double aux_skew_reduction = 0.5; // aux: log-popularity multiplied by (1 - this)
  double bias_rate = 1e-3;         // bias: ExpertBias update speed
  int eplb_redundant = 1;          // eplb: extra slots per GPU
  int eplb_every = 10;             // eplb: steps between re-placements
};

struct ScheduleConfig {
  std::string overlap = "none";  // none, shared, chunked or two_micro_batch
  int chunks = 4;                // chunked: pieces of the dispatch/compute/combine pipeline
};

struct RunConfig {
  int steps = 10;
  int ep_groups = 0;      // EP groups simulated per stage; 0 = all
  int trace_step = 0;     // the step whose timelines the Chrome trace shows
  int threads = 0;        // simulator threads (units of a step, or a group's routing); 0 = hardware concurrency
};

struct Scenario {
  std::string path;  // where it was read from ("" = built in code)
  HardwareProfile hardware;
  ClusterConfig cluster;
  ModelConfig model;
  ParallelismConfig parallelism;
  OptimizerConfig optimizer;
  RoutingConfig routing;
  BalancingConfig balancing;
  ScheduleConfig schedule;
  RunConfig run;

  [[nodiscard]] int num_gpus() const { return cluster.nodes * cluster.gpus_per_node; }
  // GPUs per pipeline stage / ep.
  [[nodiscard]] int ep_groups_per_stage() const { return num_gpus() / parallelism.pp_stages / parallelism.ep; }
  // InvalidArgument naming the first bad key, its value and the limit.
  [[nodiscard]] Status validate() const;
};

// Bytes of one row of `hidden` elements of dtype "fp8" (with f32 scales per
// 128 channels), "bf16" or "f32".
Result<int64_t> row_bytes(const std::string& dtype, int hidden);
// Bytes of one element of "f32", "bf16", "fp8" ("none": 0): gradients and
// optimizer state.
double dtype_bytes(const std::string& dtype);

// Forward FLOPs per token of one layer's attention: attention_flops_per_token,
// or 8 x hidden^2 (Q, K, V, O) when that is 0; 0 without attention.
double attention_flops(const ModelConfig& model);

// Reads a scenario (and the hardware profile it names), then validates it.
Result<Scenario> load_scenario(const std::string& path);
// The same from the file's text; `path` names it in errors and is where a
// relative hardware.profile or routing.trace is taken from.
Result<Scenario> parse_scenario(std::string_view text, const std::string& path);
// Reads a hardware profile file into scenario->hardware.
Status load_hardware(const std::string& path, Scenario* scenario);

// Where hardware profiles given by name are looked for, in order: the
// folders of $EPX_HARDWARE_PATH (':'-separated), the source tree's
// configs/hardware (a build tree's program), share/epx/hardware beside the
// program's bin/, and the installed share/epx/hardware.
std::vector<std::string> hardware_profile_dirs();

// The file of a hardware profile: a bare name ("h800") is <folder>/h800.toml
// in the first of hardware_profile_dirs() that has it; anything with a '/' or
// ending in ".toml" is a path, relative to the folder `relative_to` (when
// not empty). An unknown name is NotFound, naming the known profiles and
// the folders looked in.
Result<std::string> find_hardware_profile(const std::string& name_or_path, const std::string& relative_to);
// Sets one value by dotted key from text ("model.topk", "4"); InvalidArgument
// for an unknown key or a value of the wrong type. Does not validate.
Status set_value(Scenario& scenario, const std::string& key, const std::string& value);
// Every key set_value accepts, sorted.
std::vector<std::string> scenario_keys();

}  // namespace epx::sim
