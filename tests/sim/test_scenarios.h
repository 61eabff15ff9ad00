// Small scenarios with round hardware numbers, shared by the simulator tests.
#pragma once

#include "epx/sim/scenario.h"

namespace epx::sim::testing {

// `nodes` x 4 GPUs, 16 experts (one shared) top-2, 4 layers, EP `ep`, 512
// tokens per GPU (64 routed one by one), buckets of 1 MiB, 2 steps.
inline Scenario four_gpu_nodes(int nodes, int ep) {
  Scenario s;
  s.hardware.name = "test";
  s.hardware.bf16_flops = 1e14;
  s.hardware.sms = 100;
  s.hardware.hbm_bandwidth = 3e12;
  s.hardware.nvlink_bandwidth = 1e11;
  s.hardware.nic_bandwidth = 1e10;
  s.hardware.nvlink_latency = 2e-6;
  s.hardware.nic_latency = 5e-6;
  s.cluster.nodes = nodes;
  s.cluster.gpus_per_node = 4;
  s.model.layers = 4;
  s.model.hidden = 512;
  s.model.expert_hidden = 256;
  s.model.experts = 16;
  s.model.topk = 2;
  s.model.shared_experts = 1;
  s.parallelism.ep = ep;
  s.parallelism.tokens_per_gpu = 512;
  s.parallelism.grad_bucket_bytes = 1 << 20;
  s.routing.sample_tokens = 64;
  s.run.steps = 2;
  s.run.threads = 1;
  return s;
}

}  // namespace epx::sim::testing
