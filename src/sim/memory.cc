#include "epx/sim/memory.h"

#include <algorithm>

#include <fmt/format.h>

namespace epx::sim {

MemoryEstimate estimate_memory(const Scenario& s) {
  const int64_t L = std::max(s.model.layers, 1), E = std::max(s.model.experts, 1), K = std::max(s.model.topk, 1);
  const int64_t R = std::max(s.parallelism.ep, 1), N = std::max(s.cluster.nodes, 1);
  const int64_t slots = saturating_sum(E, saturating_product({R, std::max(s.balancing.eplb_redundant, 0)}));
  const int64_t sampled = std::min<int64_t>(s.parallelism.tokens_per_gpu, std::max(s.routing.sample_tokens, 1));
  const int64_t micro = std::max(s.parallelism.micro_batches, 1);
  MemoryEstimate e;
  e.scope = "";  // one simulator process
  // log-popularity, EPLB window loads, step loads (8 bytes each), the expert
  // bias (about 16 bytes an expert) and a redundant placement (slot maps).
  e.add("per-expert state of every layer", saturating_product({L, saturating_sum(saturating_product({E, 40}), saturating_product({slots, 8}))}),
        fmt::format("model.experts = {}", E));
  // One rank's sampled logits [tokens, E] and top-k; every rank's layout
  // counts (per rank, node and slot) and token-in-rank flags.
  int64_t routing = saturating_product({sampled, E, 4});
  routing = saturating_sum(routing, saturating_product({sampled, K, 8}));
  routing = saturating_sum(routing, saturating_product({R, saturating_sum(saturating_product({slots, 16}), saturating_product({R + N, 16}))}));
  routing = saturating_sum(routing, saturating_product({R, sampled, R}));
  e.add("routing samples and layouts", routing,
        E >= R ? fmt::format("model.experts = {}", E) : fmt::format("parallelism.ep = {}", R));
  e.add("per-pair byte matrices", saturating_product({R, R + N, 8, 2}), fmt::format("parallelism.ep = {}", R));
  e.add("per-rank timelines", saturating_product({micro + 8, R, 8, 4}), fmt::format("parallelism.ep = {}", R));
  return e;
}

}  // namespace epx::sim
