// Traffic: who sends how many tokens to whom in one MoE layer of one step,
// built by the library's own router (epx::route) and dispatch layout
// (epx::compute_layout), never a copy of them.
//
// For each GPU of an expert-parallel group, `route_group` draws router logits
// whose top-k follows the layer's expert popularity (log-popularity plus
// Gumbel noise: the top-k of those is a draw without replacement in
// proportion to popularity), runs `route` with the layer's expert bias,
// groups and capacity, maps experts to replica slots when the placement has
// them (`map_to_replicas`), and runs `compute_layout` to get the deduplicated
// (token, rank) and (token, node) counts and the per-slot rows. When a GPU has
// more tokens than `sample_tokens`, that many are routed and every count is
// scaled by tokens / sample_tokens (GroupTraffic::scale says by how much).
//
// Deterministic: a GPU's draws depend only on (seed, step, layer, group,
// GPU), not on threads or order.
//
//   epx::sim::GroupTraffic t;
//   EPX_RETURN_IF_ERROR(epx::sim::route_group(request, &t));
//   t.pair(s, d);   // tokens GPU s sends to GPU d (scaled)
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "epx/comm/topology.h"
#include "epx/core/status.h"
#include "epx/exchange/placement.h"
#include "epx/routing/router.h"
#include "epx/sim/scenario.h"

namespace epx::sim {

struct GroupTraffic {
  int num_ranks = 0;
  int num_nodes = 0;
  double scale = 1.0;                  // real tokens per routed token
  int64_t tokens_per_gpu = 0;          // real tokens on each GPU
  std::vector<double> pairs;           // [R, R]: (token, rank) pairs s -> d, deduplicated
  std::vector<double> node_pairs;      // [R, N]: (token, node) pairs s -> node n, deduplicated
  std::vector<double> slot_rows;       // [slots]: rows each expert slot receives
  std::vector<int64_t> expert_load;    // [logical experts]: kept (token, slot) pairs, unscaled
  int64_t num_dropped = 0;             // unscaled

  [[nodiscard]] double pair(int s, int d) const { return pairs[static_cast<std::size_t>(s) * num_ranks + d]; }
  [[nodiscard]] double node_pair(int s, int n) const {
    return node_pairs[static_cast<std::size_t>(s) * num_nodes + n];
  }
};

struct RouteRequest {
  const RouterConfig* router = nullptr;
  const ExpertPlacement* placement = nullptr;          // over slots when replicas is non-empty
  const Topology* topology = nullptr;                  // the EP group
  std::span<const std::vector<int32_t>> replicas;      // logical expert -> slots; empty = slot == expert
  std::span<const double> log_popularity;              // [experts]
  std::span<const float> expert_bias;                  // [experts] or empty
  int64_t tokens_per_gpu = 0;
  int sample_tokens = 0;
  uint64_t seed = 1;
  uint64_t stream = 0;  // (step, layer, group): distinct draws per call
  int threads = 1;
};

// The router a model uses: score function, top-k with normalized weights,
// groups, capacity factor.
RouterConfig make_router_config(const ModelConfig& model);

// Routes every GPU of the group and accumulates the traffic into *out.
Status route_group(const RouteRequest& request, GroupTraffic* out);

// The traffic of explicit routings: topk_idx[r] is GPU r's [T_r, topk]
// (expert or slot ids, -1 = none), run through compute_layout as they are
// (no sampling, scale 1). What the tests compare with the exchange.
Result<GroupTraffic> traffic_from_routing(std::span<const std::vector<int32_t>> topk_idx, int topk,
                                          const ExpertPlacement& placement, const Topology& topology);

}  // namespace epx::sim
