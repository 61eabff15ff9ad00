// Pipeline-parallel activation transfers in the simulator: what 1F1B adds to
// each unit's critical path between stages.
//
// Layout: stage s holds the GPUs s x G .. (s+1) x G - 1 of the cluster (G =
// GPUs per stage, nodes filled in order, as the simulator's stages are laid
// out); GPU g of stage s sends to GPU g of stage s + 1. Per micro-batch, each
// GPU sends its activations forward (tokens_per_gpu rows of `hidden` in
// model.activation_dtype) and, when training, receives their gradients back
// (the same bytes). One transfer across a stage boundary costs
//   max(bytes / (nvlink.bandwidth x efficiency)            [a pair inside a node],
//       bytes / (nic.bandwidth x efficiency x nic.per_gpu)  [a pair across nodes;
//           x the node's senders when hardware.nic.shared_per_node],
//       the boundary's bytes x copies / host.copy_bandwidth [emulated hosts])
//   + the link's latency + message_overhead,
// and the slowest boundary sets it. A unit (one micro-batch, two for
// two_micro_batch) pays one transfer per micro-batch each way:
//   per_unit_s = micro-batches per unit x (2 if training else 1) x transfer,
// on the 1F1B critical path: step = (units + pp - 1) x (stage + per_unit_s) + ...
// Nothing with one stage or parallelism.pp_transfers = false.
#pragma once

#include <string>

#include "epx/core/status.h"
#include "epx/sim/scenario.h"

namespace epx::sim {

struct PipelineTransfer {
  double bytes = 0;        // one micro-batch's activations (or their gradients) per GPU
  std::string link = "none";  // of the slowest boundary: "nvlink", "nic" or "none" (no transfers)
  double seconds = 0;      // one transfer across the slowest boundary
  double per_unit_s = 0;   // added to each unit on the critical path
};

Result<PipelineTransfer> pipeline_transfer(const Scenario& scenario);

}  // namespace epx::sim
