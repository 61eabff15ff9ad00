// A small TrainConfig for the trainer's tests: synthetic clustered data,
// MoE layers of top-2 experts, a short warm-up. Each test names only what it
// changes: tiny_config({.num_ranks = 2, .steps = 8}).
#pragma once

#include <cstdint>

#include "epx/train/trainer.h"

namespace epx::testing {

struct TinyShape {
  int num_ranks = 4;
  int64_t steps = 6;
  int64_t batch_tokens = 96;
  int input_dim = 16, output_dim = 8, clusters = 8;
  int layers = 2, hidden = 32, ffn_hidden = 32, experts = 8;
  int64_t warmup = 3;
};

inline TrainConfig tiny_config(const TinyShape& s) {
  TrainConfig c;
  c.num_ranks = s.num_ranks;
  c.steps = s.steps;
  c.batch_tokens = s.batch_tokens;
  c.model.input_dim = c.synthetic.input_dim = s.input_dim;
  c.model.output_dim = c.synthetic.output_dim = s.output_dim;
  c.synthetic.num_clusters = s.clusters;
  c.model.num_layers = s.layers;
  c.model.layer.hidden = s.hidden;
  c.model.layer.ffn_hidden = s.ffn_hidden;
  c.model.layer.router = {.num_experts = s.experts, .topk = 2, .normalize_weights = true};
  c.schedule = {.peak = 3e-3, .warmup_steps = s.warmup, .total_steps = s.steps};
  return c;
}

}  // namespace epx::testing
