// Routing from Python: RouterConfig, route, route_backward, ExpertBias, the
// load statistics (docs/python.md, "Routing").
//
// route's results are copies made on first access (the C++ RouterOutput stays
// inside the result object for route_backward, which reads its selected ids:
// no Python write can reach them). Every call copies what another Python
// thread could change (the config, an ExpertBias's values) before the GIL is
// released.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "arrays.h"
#include "epx/comm/transport.h"
#include "epx/routing/expert_bias.h"
#include "epx/routing/load_stats.h"
#include "epx/routing/router.h"
#include "errors.h"
#include "gil.h"
#include "transport.h"
#include "args.h"

namespace epx::py {
namespace {

namespace pb = pybind11;
using namespace pybind11::literals;

ScoreFunction parse_score_function(std::string_view name) {
  return parse_choice<ScoreFunction>(name, "score_function",
                                     {{"softmax", ScoreFunction::kSoftmax}, {"sigmoid", ScoreFunction::kSigmoid}});
}
std::string score_function_name(ScoreFunction fn) { return fn == ScoreFunction::kSoftmax ? "softmax" : "sigmoid"; }

DropPolicy parse_drop_policy(std::string_view name) {
  return parse_choice<DropPolicy>(name, "drop_policy", {{"position", DropPolicy::kPosition}, {"score", DropPolicy::kScore}});
}
std::string drop_policy_name(DropPolicy policy) { return policy == DropPolicy::kPosition ? "position" : "score"; }

RouterConfig make_router_config(int num_experts, int topk, std::string_view score_function,
                                bool softmax_after_topk, bool normalize_weights, float scaling_factor,
                                int num_groups, int topk_groups, const pb::object& expert_group,
                                double capacity_factor, std::string_view drop_policy, int capacity_alignment,
                                bool pad_to_capacity) {
  RouterConfig config{.num_experts = num_experts,
                      .topk = topk,
                      .score_function = parse_score_function(score_function),
                      .softmax_after_topk = softmax_after_topk,
                      .normalize_weights = normalize_weights,
                      .scaling_factor = scaling_factor,
                      .num_groups = num_groups,
                      .topk_groups = topk_groups,
                      .capacity_factor = capacity_factor,
                      .drop_policy = parse_drop_policy(drop_policy),
                      .capacity_alignment = capacity_alignment,
                      .pad_to_capacity = pad_to_capacity};
  if (!expert_group.is_none()) config.expert_group = int_vector<int32_t>(expert_group, "expert_group");
  check(config.validate());
  return config;
}

std::string describe_config(const RouterConfig& c) {
  return fmt::format(
      "RouterConfig(num_experts={}, topk={}, score_function='{}', softmax_after_topk={}, normalize_weights={}, "
      "scaling_factor={}, num_groups={}, topk_groups={}, expert_group=[{}], capacity_factor={}, "
      "drop_policy='{}', capacity_alignment={}, pad_to_capacity={})",
      c.num_experts, c.topk, score_function_name(c.score_function), c.softmax_after_topk ? "True" : "False",
      c.normalize_weights ? "True" : "False", c.scaling_factor, c.num_groups, c.topk_groups,
      fmt::join(c.expert_group, ", "), c.capacity_factor, drop_policy_name(c.drop_policy), c.capacity_alignment,
      c.pad_to_capacity ? "True" : "False");
}

void bind_router_config(pb::module_& m) {
  pb::class_<RouterConfig>(m, "RouterConfig", "The router's configuration (epx/routing/router.h); validated when made.")
      .def(pb::init(&make_router_config), "num_experts"_a, "topk"_a, pb::kw_only(), "score_function"_a = "softmax",
           "softmax_after_topk"_a = false, "normalize_weights"_a = false, "scaling_factor"_a = 1.0f,
           "num_groups"_a = 1, "topk_groups"_a = 1, "expert_group"_a = pb::none(), "capacity_factor"_a = 0.0,
           "drop_policy"_a = "position", "capacity_alignment"_a = 1, "pad_to_capacity"_a = false)
      .def_readwrite("num_experts", &RouterConfig::num_experts)
      .def_readwrite("topk", &RouterConfig::topk)
      .def_property(
          "score_function", [](const RouterConfig& c) { return score_function_name(c.score_function); },
          [](RouterConfig& c, std::string_view name) { c.score_function = parse_score_function(name); })
      .def_readwrite("softmax_after_topk", &RouterConfig::softmax_after_topk)
      .def_readwrite("normalize_weights", &RouterConfig::normalize_weights)
      .def_readwrite("scaling_factor", &RouterConfig::scaling_factor)
      .def_readwrite("num_groups", &RouterConfig::num_groups)
      .def_readwrite("topk_groups", &RouterConfig::topk_groups)
      .def_property(
          "expert_group", [](const RouterConfig& c) { return c.expert_group; },
          [](RouterConfig& c, const pb::object& group) {
            c.expert_group = group.is_none() ? std::vector<int32_t>{} : int_vector<int32_t>(group, "expert_group");
          })
      .def_readwrite("capacity_factor", &RouterConfig::capacity_factor)
      .def_property(
          "drop_policy", [](const RouterConfig& c) { return drop_policy_name(c.drop_policy); },
          [](RouterConfig& c, std::string_view name) { c.drop_policy = parse_drop_policy(name); })
      .def_readwrite("capacity_alignment", &RouterConfig::capacity_alignment)
      .def_readwrite("pad_to_capacity", &RouterConfig::pad_to_capacity)
      .def("validate", [](const RouterConfig& c) { check(c.validate()); },
           "Raises InvalidArgumentError naming the first bad field.")
      .def("capacity", [](const RouterConfig& c, Int64 num_tokens) { return expert_capacity(c, num_tokens); },
           "num_tokens"_a, "Rows each expert keeps for num_tokens tokens (0 when dropless).")
      .def("__repr__", &describe_config);
}

// route's output and the library its arrays are of. Arrays are copies, made
// once on first access.
class RouteResult {
 public:
  enum Field { kTopkIdx, kTopkWeights, kScores, kSelectedIdx, kSelectedProbs, kTokensPerExpert, kRowsPerExpert, kCount };

  RouteResult(RouterOutput output, ArrayKind kind) : output_(std::move(output)), kind_(kind) {}
  [[nodiscard]] const RouterOutput& output() const { return output_; }

  pb::object array(Field field) {
    pb::object& cached = arrays_[field];
    if (!cached) cached = copy_of(kind_, view(field));
    return cached;
  }

 private:
  [[nodiscard]] TensorView view(Field field) const {
    const RouterOutput& o = output_;
    const int64_t t = o.num_tokens, k = o.topk, e = o.num_experts;
    switch (field) {
      case kTopkIdx: return TensorView::contiguous(o.topk_idx.data(), DType::kI32, {t, k});
      case kTopkWeights: return TensorView::contiguous(o.topk_weights.data(), DType::kF32, {t, k});
      case kScores: return TensorView::contiguous(o.scores.data(), DType::kF32, {t, e});
      case kSelectedIdx: return TensorView::contiguous(o.selected_idx.data(), DType::kI32, {t, k});
      case kSelectedProbs: return TensorView::contiguous(o.selected_probs.data(), DType::kF32, {t, k});
      case kTokensPerExpert: return TensorView::contiguous(o.tokens_per_expert.data(), DType::kI64, {e});
      case kRowsPerExpert:
      case kCount: break;
    }
    return TensorView::contiguous(o.rows_per_expert.data(), DType::kI64, {e});
  }

  RouterOutput output_;
  ArrayKind kind_;
  std::array<pb::object, kCount> arrays_;
};

// The bias to select with: an ExpertBias (its values copied: another thread
// may update it while route runs), an f32 array, or None.
struct BiasArg {
  std::vector<float> values;
  ArrayArg array;
  [[nodiscard]] TensorView view() const {
    if (array.defined()) return array.view;
    if (values.empty()) return {};
    return TensorView::contiguous(values.data(), DType::kF32, {static_cast<int64_t>(values.size())});
  }
};

BiasArg bias_arg(const pb::object& bias) {
  BiasArg arg;
  if (pb::isinstance<ExpertBias>(bias)) {
    arg.values = bias.cast<const ExpertBias&>().values();
    if (arg.values.empty()) throw_error("InvalidArgumentError", "expert_bias is an ExpertBias of 0 experts");
  } else {
    arg.array = view_optional(bias, "expert_bias");
  }
  return arg;
}

RouteResult route_py(const RouterConfig& config, const pb::object& logits, const pb::object& expert_bias) {
  const RouterConfig config_copy = config;
  const ArrayArg logits_arg = view_array(logits, "logits");
  const BiasArg bias = bias_arg(expert_bias);
  return RouteResult(call([&] { return route(config_copy, logits_arg.view, bias.view()); }), logits_arg.kind);
}

pb::object route_backward_py(const RouterConfig& config, const RouteResult& routed, const pb::object& grad) {
  const RouterConfig config_copy = config;
  const ArrayArg grad_arg = view_array(grad, "grad_topk_weights");
  const std::vector<float> values = call([&] { return route_backward(config_copy, routed.output(), grad_arg.view); });
  const RouterOutput& o = routed.output();
  return copy_of(grad_arg.kind, TensorView::contiguous(values.data(), DType::kF32, {o.num_tokens, o.num_experts}));
}

void bind_route(pb::module_& m) {
  using F = RouteResult::Field;
  auto field = [](F f) { return [f](RouteResult& r) { return r.array(f); }; };
  pb::class_<RouteResult>(m, "RouteResult", "route's output; its arrays are copies of the logits' library.")
      .def_property_readonly("topk_idx", field(F::kTopkIdx), "int32 [num_tokens, topk], -1 where dropped")
      .def_property_readonly("topk_weights", field(F::kTopkWeights), "float32 [num_tokens, topk], 0 where dropped")
      .def_property_readonly("scores", field(F::kScores), "float32 [num_tokens, num_experts], no bias")
      .def_property_readonly("selected_idx", field(F::kSelectedIdx), "int32 [num_tokens, topk], before dropping")
      .def_property_readonly("selected_probs", field(F::kSelectedProbs), "float32 [num_tokens, topk]")
      .def_property_readonly("tokens_per_expert", field(F::kTokensPerExpert), "int64 [num_experts]")
      .def_property_readonly("rows_per_expert", field(F::kRowsPerExpert), "int64 [num_experts]")
      .def_property_readonly("capacity", [](const RouteResult& r) { return r.output().capacity; })
      .def_property_readonly("num_dropped", [](const RouteResult& r) { return r.output().num_dropped; })
      .def_property_readonly("num_tokens", [](const RouteResult& r) { return r.output().num_tokens; })
      .def_property_readonly("num_experts", [](const RouteResult& r) { return r.output().num_experts; })
      .def_property_readonly("topk", [](const RouteResult& r) { return r.output().topk; });
  m.def("route", &route_py, "config"_a, "logits"_a, "expert_bias"_a = pb::none(),
        "Top-k routing of logits [num_tokens, num_experts] (float32); expert_bias: an ExpertBias, a float32 "
        "[num_experts] array or None, added for selection only.");
  m.def("route_backward", &route_backward_py, "config"_a, "routed"_a, "grad_topk_weights"_a,
        "The gradient of the routing weights taken back to the logits: [num_tokens, num_experts] float32.");
}

void set_bias_values(ExpertBias& bias, const pb::object& values) {
  const ArrayArg arg = view_array(values, "values");
  const TensorView& v = arg.view;
  if (v.ndim() != 1 || v.dtype() != DType::kF32 || v.size(0) != bias.num_experts() || v.stride(0) != 1)
    throw_error("InvalidArgumentError", fmt::format("values must be a contiguous float32 [{}] array, got {}",
                                                    bias.num_experts(), v.describe()));
  const auto* data = v.data_as<const float>();
  bias.set_values(std::span<const float>(data, static_cast<std::size_t>(bias.num_experts())));
}

void bind_expert_bias(pb::module_& m) {
  pb::class_<ExpertBias>(m, "ExpertBias", "Aux-loss-free balancing: a per-expert bias for selection only.")
      .def(pb::init([](int num_experts, float rate) {
             if (num_experts < 1)
               throw_error("InvalidArgumentError", fmt::format("num_experts = {} must be at least 1", num_experts));
             return ExpertBias(num_experts, rate);
           }),
           "num_experts"_a, "rate"_a = ExpertBias::kDefaultRate)
      .def_property_readonly("num_experts", &ExpertBias::num_experts)
      .def_property("rate", &ExpertBias::rate, &ExpertBias::set_rate)
      .def_property("frozen", &ExpertBias::frozen, &ExpertBias::set_frozen)
      .def(
          "update",
          [](ExpertBias& bias, const pb::object& load) { check(bias.update(int_vector<int64_t>(load, "load"))); },
          "load"_a, "Moves each bias by rate towards balance (load: tokens per expert, summed over ranks).")
      .def_property_readonly(
          "values",
          [](const ExpertBias& bias) {
            const std::vector<float>& v = bias.values();
            return copy_of(ArrayKind::kNumpy,
                           TensorView::contiguous(v.data(), DType::kF32, {static_cast<int64_t>(v.size())}));
          },
          "A float32 numpy copy of the biases.")
      .def("set_values", &set_bias_values, "values"_a, "Restores saved biases (float32 [num_experts]).");
}

// The load of `obj` (an int array or a list), summed over the ranks of
// `transport`; an array of obj's library (numpy for a list).
pb::object sum_load_over_ranks_py(const PyTransport& py_transport, const pb::object& load, pb::handle timeout) {
  Transport& transport = py_transport.get();
  ArrayKind kind = ArrayKind::kNumpy;
  std::vector<int64_t> values = int_vector<int64_t>(load, "load", &kind);
  const Deadline deadline = deadline_after(timeout, 30.0);
  call([&] { return sum_load_over_ranks(transport, values, deadline); });
  return copy_of(kind, TensorView::contiguous(values.data(), DType::kI64, {static_cast<int64_t>(values.size())}));
}

LoadStats compute_load_stats_py(const pb::object& topk_idx, const pb::object& expert_rank) {
  const ArrayArg idx = view_ids(topk_idx, "topk_idx");
  const std::vector<int32_t> ranks = int_vector<int32_t>(expert_rank, "expert_rank");
  return unwrap(compute_load_stats(idx.view, ranks));
}

LoadStats sum_load_stats_over_ranks_py(const PyTransport& py_transport, LoadStats stats, pb::handle timeout) {
  Transport& transport = py_transport.get();
  const Deadline deadline = deadline_after(timeout, 30.0);
  call([&] { return sum_load_stats_over_ranks(transport, &stats, deadline); });
  return stats;
}

void bind_load_stats(pb::module_& m) {
  pb::class_<LoadStats>(m, "LoadStats", "How evenly one step's routing spreads the work (epx/routing/load_stats.h).")
      .def(pb::init<>())
      .def_readwrite("tokens_per_expert", &LoadStats::tokens_per_expert)
      .def_readwrite("tokens_per_rank", &LoadStats::tokens_per_rank)
      .def_readwrite("work_per_rank", &LoadStats::work_per_rank)
      .def_readwrite("num_dropped", &LoadStats::num_dropped)
      .def_readwrite("max_load", &LoadStats::max_load)
      .def_readwrite("mean_load", &LoadStats::mean_load)
      .def_readwrite("max_vio", &LoadStats::max_vio)
      .def_readwrite("cv", &LoadStats::cv)
      .def_readwrite("worst_rank", &LoadStats::worst_rank)
      .def_readwrite("worst_rank_share", &LoadStats::worst_rank_share)
      .def_readwrite("idle_fraction", &LoadStats::idle_fraction)
      .def("summarize", &LoadStats::summarize, "Recomputes max_load .. idle_fraction from the counts.")
      .def("to_json", &LoadStats::to_json)
      .def("__repr__", [](const LoadStats& s) { return "LoadStats(" + s.to_json() + ")"; });
  pb::class_<LoadTracker>(m, "LoadTracker", "Exponential moving averages of LoadStats across steps.")
      .def(pb::init<double>(), "decay"_a = 0.9)
      .def("add", &LoadTracker::add, "stats"_a)
      .def_property_readonly("num_steps", &LoadTracker::num_steps)
      .def_property_readonly("ema_max_vio", &LoadTracker::ema_max_vio)
      .def_property_readonly("ema_cv", &LoadTracker::ema_cv)
      .def_property_readonly("ema_idle_fraction", &LoadTracker::ema_idle_fraction)
      .def_property_readonly("ema_dropped", &LoadTracker::ema_dropped)
      .def("to_json", &LoadTracker::to_json);
  m.def("compute_load_stats", &compute_load_stats_py, "topk_idx"_a, "expert_rank"_a,
        "Load statistics of topk_idx [num_tokens, topk] (-1 = dropped); expert_rank[e]: the rank of expert e.");
  m.def("sum_load_over_ranks", &sum_load_over_ranks_py, "transport"_a, "load"_a, "timeout"_a = 30.0,
        "Collective: the per-expert load summed over every rank (a new int64 array).");
  m.def("sum_load_stats_over_ranks", &sum_load_stats_over_ranks_py, "transport"_a, "stats"_a, "timeout"_a = 30.0,
        "Collective: every rank's counts summed and the summary recomputed (a new LoadStats).");
}

}  // namespace

void register_routing(pybind11::module_& m) {
  bind_router_config(m);
  bind_route(m);
  bind_expert_bias(m);
  bind_load_stats(m);
}

}  // namespace epx::py
