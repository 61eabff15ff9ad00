// The optimizer step of a training step in the simulator: AdamW over the
// parameters one GPU holds, after the gradient all-reduce.
//
// AdamW reads each parameter's master weight, gradient and two moments and
// writes the weight and the moments back (and, with a separate compute copy,
// that copy): memory traffic, per GPU,
//   bytes_per_param = 2 master + grad + 4 moment [+ weight copy]   (dtype sizes)
//   update_s        = params updated x bytes_per_param / hbm_bandwidth
//                     (hardware.memory.optimizer_bandwidth when set),
// where params updated = the routed experts held (EPLB slots included) + the
// dense parameters of its stage. Emulated clusters (hardware.host.cores > 0)
// run every rank's update on the host's cores: x max(1, GPUs / cores), and at
// least every rank's traffic over twice the host's copy rate (a copy reads and
// writes). With optimizer.zero (ZeRO-1, as DeepSeek-V3 trains) each GPU
// updates only its 1/n share (n = the EDP group for experts, the stage for
// dense parameters) and the updated weights are then all-gathered in the
// weight copy's dtype (else the master's) over the same groups, one after the
// other, after the update.
#pragma once

#include "epx/sim/grad_sync.h"
#include "epx/sim/scenario.h"

namespace epx::sim {

struct OptimizerCost {
  double params = 0;           // parameters this GPU updates (ZeRO-1: its shard)
  double bytes_per_param = 0;  // memory traffic per parameter updated
  double update_s = 0;         // the update itself
  AllReduceCost gather_expert, gather_dense;  // ZeRO-1 weight all-gathers ("none" without)
  double gather_s = 0;         // both all-gathers
  [[nodiscard]] double seconds() const { return update_s + gather_s; }
};

// The optimizer step of one GPU of a stage holding `params` (parameters_held),
// in groups `edp` and `world`; zero cost with optimizer.kind = "none" or in
// forward mode.
OptimizerCost optimizer_cost(const Scenario& scenario, const GradientBytes& params, const GroupShape& edp,
                             const GroupShape& world);

}  // namespace epx::sim
