// The two readers of `epx eplb`, from a stream; `path` names it in errors.
// Both return InvalidArgument naming the file, the line and the value.
#pragma once

#include <istream>
#include <string>
#include <vector>

#include "epx/balance/placement.h"
#include "epx/core/status.h"

namespace epx::app {

// --loads: one number per line, or several separated by whitespace or commas;
// each finite and >= 0, at least one.
Result<std::vector<double>> parse_loads(std::istream& in, const std::string& path);

// --current: the slot -> expert map of a placement file (what --save writes):
// ids in slot order, -1 for an empty slot, '#' to the end of a line a
// comment; exactly `num_slots` ids, each in [-1, num_experts), at most one
// replica of an expert per rank, and a placement RedundantPlacement accepts.
// Needs num_ranks >= 1 (the command's options ensure it).
Result<RedundantPlacement> parse_placement(std::istream& in, const std::string& path, int num_experts, int num_slots,
                                           int num_ranks, PlacementPolicy policy);

}  // namespace epx::app
