// `epx train`: options, the TOML config file and the run.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include "epx/core/status.h"

namespace epx::app {

// Every setting of `epx train`, flat. Precedence: defaults < --config file <
// command-line flags.
struct TrainOptions {
  std::string config_path;
  // [run]
  int num_ranks = 4;
  int num_nodes = 1;
  std::string backend = "auto";  // inproc | mpi | auto (command line only)
  int64_t steps = 300;
  int64_t batch_tokens = 512;
  uint64_t seed = 1;
  double timeout_s = 60;  // bound on every wait for the other ranks (ModelConfig::timeout)
  // [parallelism]
  int ep = 0;  // ranks per EP group (0 = all ranks); the rest is expert-data-parallel
  // [data]
  std::string data = "synthetic";  // or text:FILE
  int input_dim = 32;
  int output_dim = 16;
  int clusters = 16;
  double zipf = 1.2;
  double cluster_spread = 0.3;
  int window = 16;
  // [model]
  int layers = 2;
  int hidden = 64;
  int ffn_hidden = 128;
  int experts = 16;
  int topk = 2;
  int shared_experts = 0;
  std::string dtype = "f32";
  std::string compute_dtype = "auto";  // MoELayerConfig::compute_dtype; auto: faster_compute_dtype
  std::string overlap = "none";  // MoELayerConfig::overlap
  int overlap_chunks = 4;
  std::string dispatch_dtype;  // MoELayerConfig::dispatch_dtype: fp8, bf16, f32; empty = dtype
  std::string combine_dtype = "f32";  // MoELayerConfig::combine_dtype: the combine's partial rows, f32 or bf16
  std::string combine_weights = "holder";  // MoELayerConfig::combine_weights: holder or receiver
  std::string score = "softmax";
  bool normalize = true;
  int groups = 1;
  int topk_groups = 1;
  // [balance]
  std::string balance = "bias";
  double aux_coeff = 1e-2;
  double z_coeff = 0.0;
  double bias_rate = 3e-3;
  double capacity_factor = 1.25;
  int64_t eplb_every = 50;  // eplb: steps between re-placements
  int eplb_slots = 0;       // eplb: physical slots per layer and EP group (0 = experts + one per EP rank)
  // [optim]
  double lr = 3e-3;
  int64_t warmup = 20;
  double min_lr_ratio = 0.1;
  double weight_decay = 0.01;
  double clip = 1.0;
  std::string grad_overlap = "on";  // TrainConfig::grad_overlap: on or off
  // [output]
  std::string metrics_path;
  std::string trace_path;
  int64_t trace_steps = 3;
  int64_t wait_matrix_every = 100;  // TrainConfig::wait_matrix_every (0 = never)
  std::string record_waits = "on";  // ModelConfig::record_waits: on or off (off only to measure its cost)
  std::string save_dir;
  int64_t save_every = 0;
  bool async_save = false;  // --async-save: checkpoints every save_every steps written while training goes on
  int keep = 2;
  std::string resume_dir;
  bool overwrite_checkpoints = false;  // --overwrite-checkpoints: --save may hold another run's checkpoints
  bool allow_data_change = false;      // --allow-data-change: --resume with other data settings
  std::string compare;  // --compare-balancing LIST
  bool compare_given = false;
  bool quiet = false;
  bool dry_run = false;  // --dry-run: check everything, print the sizes, write nothing
};

// Adds the `train` subcommand bound to `options`.
CLI::App* add_train_command(CLI::App& app, TrainOptions& options);
// Reads --config FILE from argv (before CLI parsing, so that flags override
// it) into options. Returns 0, or kExitUsage after printing the error.
int preload_train_config(int argc, char** argv, TrainOptions& options);
int run_train(const TrainOptions& options);
// The TOML text of a --config file into options (`path` names it in errors);
// what --config FILE does after reading the file. InvalidArgument on a
// syntax error, a key it does not know, or a value of the wrong type or range.
Status parse_train_config(std::string_view text, const std::string& path, TrainOptions& options);

}  // namespace epx::app
