// The flags that size a synthetic exchange (ranks, nodes, hidden, experts,
// top-k, seed), declared once with one wording and one range for every
// command that has them (demo and the benchmarks). A command names the fields
// it has; the others stay null and their flags are not added:
//   add_shape_options(cmd, {.ranks = &o.num_ranks, .hidden = &o.hidden, .seed = &o.seed});
#pragma once

#include <cstdint>

#include <CLI/CLI.hpp>

namespace epx::app {

struct ShapeFields {
  int* ranks = nullptr;    // --ranks: ranks (threads of this process)
  int* nodes = nullptr;    // --nodes: emulated nodes; must divide --ranks
  int* hidden = nullptr;   // --hidden: elements per token row
  int* experts = nullptr;  // --experts
  int* topk = nullptr;     // --topk: experts per token
  double* skew = nullptr;  // --skew: routing skew
  uint64_t* seed = nullptr;  // --seed: the routing's seed
  int min_hidden = 1;      // the smallest --hidden the command takes
};

void add_shape_options(CLI::App* cmd, const ShapeFields& fields);

}  // namespace epx::app
