// The host memory a simulation needs, estimated from its scenario before the
// simulator allocates anything: the per-expert state of every layer
// (popularity, bias, EPLB and step loads), the routing samples (one group's
// sampled logits and dispatch layouts), the per-pair byte matrices of an EP
// group, and the per-rank timelines. It guards `epx sim` the way
// estimate_train_memory guards `epx train`:
//
//   EPX_ASSIGN_OR_RETURN(epx::MemoryEstimate e, epx::sim::estimate_memory(scenario));
//   EPX_RETURN_IF_ERROR(epx::check_memory_fits(e, epx::available_memory()));
//
// The simulator runs in one process, so the estimate has one copy.
#pragma once

#include "epx/core/memory.h"
#include "epx/sim/scenario.h"

namespace epx::sim {

[[nodiscard]] MemoryEstimate estimate_memory(const Scenario& scenario);

}  // namespace epx::sim
