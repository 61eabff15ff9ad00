#include "sim/routing_trace.h"

#include <cmath>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace epx::sim {
namespace {

using nlohmann::json;

// One line's layers, appended to trace->log_popularity. Only const accessors
// that cannot throw: a value of another type is an error, not an exception.
Status read_line(const json& j, const std::string& where, int num_experts, RoutingTrace* trace) {
  const auto layers_it = j.is_object() ? j.find("layers") : j.end();
  if (!j.is_object() || layers_it == j.end() || !layers_it->is_array() || layers_it->empty())
    return invalid_argument("{}: no \"layers\" array (the format epx train --metrics writes)", where);
  const json& layers = *layers_it;
  if (layers.size() > static_cast<std::size_t>(1 << 20))
    return invalid_argument("{}: {} layers is above the limit {}", where, layers.size(), 1 << 20);
  const int num_layers = static_cast<int>(layers.size());
  if (trace->num_layers != 0 && num_layers != trace->num_layers)
    return invalid_argument("{}: {} layers, the first line had {}", where, num_layers, trace->num_layers);
  trace->num_layers = num_layers;
  for (int l = 0; l < num_layers; ++l) {
    const json& layer = layers[static_cast<std::size_t>(l)];
    const auto counts_it = layer.is_object() ? layer.find("tokens_per_expert") : layer.end();
    if (!layer.is_object() || counts_it == layer.end() || !counts_it->is_array() ||
        counts_it->size() != static_cast<std::size_t>(num_experts))
      return invalid_argument("{}: layers[{}].tokens_per_expert must list model.experts = {} counts", where, l,
                              num_experts);
    std::vector<double> pop(static_cast<std::size_t>(num_experts));
    for (int e = 0; e < num_experts; ++e) {
      const json& count = (*counts_it)[static_cast<std::size_t>(e)];
      const double v = count.is_number() ? count.get<double>() : -1.0;
      if (!(v >= 0) || !std::isfinite(v))
        return invalid_argument("{}: layers[{}].tokens_per_expert[{}] is not a finite count >= 0", where, l, e);
      pop[static_cast<std::size_t>(e)] = std::log(v + 1.0);
    }
    trace->log_popularity.push_back(std::move(pop));
  }
  return Status::ok();
}

}  // namespace

Result<RoutingTrace> read_routing_trace(std::istream& in, const std::string& path, int num_experts) {
  if (num_experts < 1) return invalid_argument("{}: model.experts = {} must be at least 1", path, num_experts);
  RoutingTrace trace;
  std::string line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", path, lineno);
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      return invalid_argument("{}: not JSON ({})", where, e.what());
    }
    EPX_RETURN_IF_ERROR(read_line(j, where, num_experts, &trace));
  }
  if (trace.log_popularity.empty()) return invalid_argument("routing.trace = '{}' holds no steps", path);
  return trace;
}

}  // namespace epx::sim
