// The routing trace of `epx sim` (routing.distribution = "trace"): the JSON
// Lines that `epx train --metrics` writes, one step a line, each with a
// "layers" array whose entries hold "tokens_per_expert".
#pragma once

#include <istream>
#include <string>
#include <vector>

#include "epx/core/status.h"

namespace epx::sim {

struct RoutingTrace {
  int num_layers = 0;  // MoE layers of every line
  // log(1 + tokens) per expert: [line * num_layers + layer][expert].
  std::vector<std::vector<double>> log_popularity;
};

// Reads every non-blank line of `in`. InvalidArgument naming `path`, the line
// and the place inside it for a line that is not JSON or not of that shape, a
// count that is not a finite number >= 0, a line whose number of layers
// differs from the first's, or no line at all. Each line must list
// `num_experts` counts per layer. Throws nothing.
Result<RoutingTrace> read_routing_trace(std::istream& in, const std::string& path, int num_experts);

}  // namespace epx::sim
