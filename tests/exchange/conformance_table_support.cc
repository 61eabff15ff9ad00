#include "exchange/conformance_table.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace epx::exchange_test {

const char* algorithm_name(DispatchAlgorithm a) {
  return a == DispatchAlgorithm::kFlat ? "flat" : a == DispatchAlgorithm::kHierarchical ? "hierarchical" : "auto";
}

std::string shape_name(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return fmt::format("{}ranks_{}nodes_{}_{}", s.num_ranks, s.num_nodes, algorithm_name(s.algorithm),
                     dtype_name(s.dtype));
}

std::vector<Shape> all_shapes() {
  std::vector<Shape> shapes;
  const struct {
    int ranks;
    int nodes;
    std::vector<DispatchAlgorithm> algorithms;
  } grid[] = {
      {1, 1, {DispatchAlgorithm::kAuto}},
      {2, 1, {DispatchAlgorithm::kAuto}},
      {2, 2, {DispatchAlgorithm::kFlat, DispatchAlgorithm::kHierarchical}},
      {3, 1, {DispatchAlgorithm::kAuto}},
      {4, 1, {DispatchAlgorithm::kAuto}},
      {4, 2, {DispatchAlgorithm::kFlat, DispatchAlgorithm::kAuto}},
      {8, 1, {DispatchAlgorithm::kAuto}},
      {8, 2, {DispatchAlgorithm::kFlat, DispatchAlgorithm::kHierarchical}},
      {8, 4, {DispatchAlgorithm::kFlat, DispatchAlgorithm::kAuto}},
  };
  for (const auto& g : grid)
    for (DispatchAlgorithm a : g.algorithms)
      for (DType dtype : {DType::kF32, DType::kBF16}) shapes.push_back({g.ranks, g.nodes, a, dtype});
  return shapes;
}

const char* form_name(Form f) { return f == Form::kBlocking ? "blocking" : f == Form::kAsync ? "async" : "split"; }

std::string Case::name() const {
  return fmt::format(
      "{} ranks as {} nodes, {}, {} payload; E={} K={} routing={} seed={} hidden={} alignment={} weights={} "
      "pass_layout={} bias={} combine_input={} expanded_y={} explicit_expand_weights={} form={}{}",
      shape.num_ranks, shape.num_nodes, algorithm_name(shape.algorithm), dtype_name(shape.dtype), num_experts, topk,
      routing_name(routing), seed, hidden, alignment, with_weights, pass_layout, with_bias,
      dtype_name(combine_input_dtype), dtype_name(expanded_dtype), explicit_expand_weights, form_name(form),
      expert_map.empty() ? "" : fmt::format(" expert_map={}", fmt::join(expert_map, ",")));
}

namespace {

// Sub-case `index` of `shape`: its seed and the knobs a hash of the index picks.
Case make_case(const Shape& shape, int num_experts, int topk, Routing routing, uint32_t index) {
  Case c;
  c.shape = shape;
  c.num_experts = num_experts;
  c.topk = topk;
  c.routing = routing;
  c.seed = 7919u * (static_cast<uint32_t>(shape.num_ranks) * 16 + shape.num_nodes) +
           131u * static_cast<uint32_t>(shape.dtype) + 17u * static_cast<uint32_t>(shape.algorithm) + index * 3u + 1u;
  const uint32_t bits = (index * 2654435761u) >> 7;
  // 36 columns of bf16 are 72 bytes: rows that a wide copy unit does not divide.
  c.hidden = (index % 3 == 0) ? 8 : (index % 3 == 1) ? 36 : 64;
  c.alignment = (bits & 1u) ? 4 : 1;
  c.with_weights = (bits & 6u) != 0;  // 3 in 4
  c.pass_layout = (bits & 8u) != 0;
  c.with_bias = (bits & 16u) != 0;
  c.combine_input_dtype = (bits & 32u) ? DType::kBF16 : DType::kF32;
  c.expanded_dtype = (bits & 64u) ? DType::kBF16 : DType::kF32;
  c.explicit_expand_weights = !c.with_weights || (bits & 128u) != 0;
  c.form = static_cast<Form>((index / 3) % 3);  // not index % 3: hidden follows that
  return c;
}

}  // namespace

std::vector<Case> make_cases(const Shape& shape) {
  const int r = shape.num_ranks;
  std::vector<int> experts = {r, 4 * r, 32 % r == 0 ? 32 : 48};
  if (experts[2] == experts[1]) experts[2] = 64;
  std::vector<Case> cases;
  uint32_t index = 0;
  for (int e : experts)
    for (int k : {1, 2, 8}) {
      if (k > e) continue;
      for (Routing routing : kAllRoutings) cases.push_back(make_case(shape, e, k, routing, index++));
    }
  return cases;
}

uint32_t sub_seed(const Case& c, int what, int rank) { return c.seed * 1009u + static_cast<uint32_t>(what * 97 + rank); }

BufferConfig make_config(const Case& c) {
  BufferConfig config;
  config.num_experts = c.num_experts;
  config.hidden = c.hidden;
  config.dtype = c.shape.dtype;
  config.max_topk = std::min(8, c.num_experts);
  config.max_tokens_per_rank = kConformanceMaxTokens;
  config.expert_alignment = c.alignment;
  config.algorithm = c.shape.algorithm;
  config.timeout = Milliseconds(20000);
  if (!c.expert_map.empty()) config.placement = *ExpertPlacement::from_map(c.expert_map, c.shape.num_ranks);
  return config;
}

}  // namespace epx::exchange_test
