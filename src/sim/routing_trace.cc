#include "sim/routing_trace.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <string_view>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace epx::sim {
namespace {

using nlohmann::json;

constexpr int kMaxLayers = 1 << 20;

bool is_blank(std::string_view s) { return s.find_first_not_of(" \t\r") == std::string_view::npos; }

std::string_view trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t\r");
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(" \t\r") - first + 1);
}

// ---- jsonl ----------------------------------------------------------------

// One layer's "tokens_per_expert" array, checked.
Status read_layer_counts(const json& layer, const std::string& where, int l, int num_experts,
                         std::vector<double>* counts) {
  const auto counts_it = layer.is_object() ? layer.find("tokens_per_expert") : layer.end();
  if (!layer.is_object() || counts_it == layer.end() || !counts_it->is_array() ||
      counts_it->size() != static_cast<std::size_t>(num_experts))
    return invalid_argument("{}: layers[{}].tokens_per_expert must list model.experts = {} counts", where, l,
                            num_experts);
  counts->assign(static_cast<std::size_t>(num_experts), 0.0);
  for (int e = 0; e < num_experts; ++e) {
    const json& count = (*counts_it)[static_cast<std::size_t>(e)];
    const double v = count.is_number() ? count.get<double>() : -1.0;
    if (!(v >= 0) || !std::isfinite(v))
      return invalid_argument("{}: layers[{}].tokens_per_expert[{}] = {} is not a finite count >= 0", where, l, e,
                              count.dump());
    (*counts)[static_cast<std::size_t>(e)] = v;
  }
  return Status::ok();
}

// One line's layers, appended to out->tokens. Only const accessors that cannot
// throw: a value of another type is an error, not an exception.
Status read_json_line(const json& j, const std::string& where, int num_experts, TraceCounts* out) {
  const auto layers_it = j.is_object() ? j.find("layers") : j.end();
  if (!j.is_object() || layers_it == j.end() || !layers_it->is_array() || layers_it->empty())
    return invalid_argument("{}: no \"layers\" array (the format epx train --metrics writes)", where);
  const json& layers = *layers_it;
  if (layers.size() > static_cast<std::size_t>(kMaxLayers))
    return invalid_argument("{}: {} layers is above the limit {}", where, layers.size(), kMaxLayers);
  const int num_layers = static_cast<int>(layers.size());
  if (out->num_layers != 0 && num_layers != out->num_layers)
    return invalid_argument("{}: {} layers, the first line had {}", where, num_layers, out->num_layers);
  out->num_layers = num_layers;
  for (int l = 0; l < num_layers; ++l) {
    std::vector<double> counts;
    EPX_RETURN_IF_ERROR(read_layer_counts(layers[static_cast<std::size_t>(l)], where, l, num_experts, &counts));
    out->tokens.push_back(std::move(counts));
  }
  return Status::ok();
}

// ---- counts ---------------------------------------------------------------

// A line's fields: split at commas when it has any, else at runs of spaces
// and tabs; a '#' starts a comment.
std::vector<std::string_view> split_fields(std::string_view line) {
  line = trim(line.substr(0, line.find('#')));
  std::vector<std::string_view> fields;
  if (line.empty()) return fields;
  if (line.find(',') != std::string_view::npos) {
    for (std::size_t start = 0;;) {
      const std::size_t comma = line.find(',', start);
      fields.push_back(trim(line.substr(start, comma == std::string_view::npos ? comma : comma - start)));
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    return fields;
  }
  for (std::size_t pos = 0; pos < line.size();) {
    const std::size_t start = line.find_first_not_of(" \t", pos);
    if (start == std::string_view::npos) break;
    const std::size_t end = std::min(line.find_first_of(" \t", start), line.size());
    fields.push_back(line.substr(start, end - start));
    pos = end;
  }
  return fields;
}

bool parse_index(std::string_view f, int64_t* v) {
  const auto [ptr, ec] = std::from_chars(f.data(), f.data() + f.size(), *v);
  return !f.empty() && ec == std::errc() && ptr == f.data() + f.size() && *v >= 0;
}

// "" when `f` is a finite count >= 0 (stored in *v), else what is wrong.
const char* parse_count(std::string_view f, double* v) {
  const auto [ptr, ec] = std::from_chars(f.data(), f.data() + f.size(), *v);
  if (f.empty() || ec != std::errc() || ptr != f.data() + f.size()) return "is not a number";
  if (!std::isfinite(*v)) return "is not finite";
  if (*v < 0) return "is negative";
  return "";
}

struct CountsLine {
  std::vector<double> tokens;
  int line = 0;
};
using CountsByStep = std::map<int64_t, std::map<int, CountsLine>>;

// One data line into *by_step.
Status read_counts_line(std::span<const std::string_view> fields, const std::string& where, int lineno,
                        int num_experts, CountsByStep* by_step) {
  const int num_counts = static_cast<int>(fields.size()) - 2;
  if (num_counts != num_experts)
    return invalid_argument("{}: {} counts after step and layer; model.experts = {} needs {} (a line is "
                            "step,layer,count_0,...,count_{})",
                            where, std::max(num_counts, 0), num_experts, num_experts, num_experts - 1);
  int64_t step = 0, layer = 0;
  if (!parse_index(fields[0], &step))
    return invalid_argument("{}: step '{}' is not an integer >= 0", where, fields[0]);
  if (!parse_index(fields[1], &layer) || layer >= kMaxLayers)
    return invalid_argument("{}: layer '{}' is not an integer in [0, {})", where, fields[1], kMaxLayers);
  CountsLine entry{std::vector<double>(static_cast<std::size_t>(num_experts)), lineno};
  for (int e = 0; e < num_experts; ++e) {
    const std::string_view f = fields[static_cast<std::size_t>(e) + 2];
    const char* wrong = parse_count(f, &entry.tokens[static_cast<std::size_t>(e)]);
    if (*wrong != '\0') return invalid_argument("{}: count of expert {} = '{}' {}", where, e, f, wrong);
  }
  auto [it, fresh] = (*by_step)[step].emplace(static_cast<int>(layer), std::move(entry));
  if (!fresh)
    return invalid_argument("{}: step {} layer {} again (first given on line {})", where, step, layer,
                            it->second.line);
  return Status::ok();
}

// Steps in order; a layer a step leaves out repeats its last counts.
Result<TraceCounts> assemble_counts(const CountsByStep& by_step, const std::string& path) {
  TraceCounts out;
  for (const auto& [step, layers] : by_step) out.num_layers = std::max(out.num_layers, layers.rbegin()->first + 1);
  const auto& [first_step, first_layers] = *by_step.begin();
  for (int l = 0; l < out.num_layers; ++l)
    if (!first_layers.contains(l))
      return invalid_argument("{}:{}: the first step ({}) has no layer {}; it must list every layer 0..{} (layers "
                              "count the MoE layers from 0; a later step may leave one out to repeat it)",
                              path, first_layers.begin()->second.line, first_step, l, out.num_layers - 1);
  std::vector<const std::vector<double>*> last(static_cast<std::size_t>(out.num_layers), nullptr);
  for (const auto& [step, layers] : by_step) {
    for (const auto& [l, entry] : layers) last[static_cast<std::size_t>(l)] = &entry.tokens;
    for (const std::vector<double>* counts : last) out.tokens.push_back(*counts);
  }
  return out;
}

// Spreads what lies above 1 over the shares below 1, in proportion to them
// (evenly where they are all 0), until none is above 1.
void cap_shares_at_one(std::vector<double>& pi) {
  for (std::size_t round = 0; round < pi.size(); ++round) {
    double excess = 0, below = 0;
    int num_below = 0;
    for (double& p : pi) {
      if (p > 1) excess += p - 1, p = 1;
      if (p < 1) below += p, ++num_below;
    }
    if (excess <= 1e-12 || num_below == 0) return;
    for (double& p : pi)
      if (p < 1) p += below > 0 ? excess * p / below : excess / num_below;
  }
}

}  // namespace

std::string detect_trace_format(std::span<const std::string> lines) {
  for (const std::string& line : lines) {
    const std::string_view t = trim(line);
    if (t.empty() || t.front() == '#') continue;
    return t.front() == '{' || t.front() == '[' ? "jsonl" : "counts";
  }
  return "counts";
}

Result<TraceCounts> parse_jsonl_trace(std::span<const std::string> lines, const std::string& path, int num_experts) {
  TraceCounts out;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (is_blank(lines[i])) continue;
    const std::string where = fmt::format("{}:{}", path, i + 1);
    json j;
    try {
      j = json::parse(lines[i]);
    } catch (const json::exception& e) {
      return invalid_argument("{}: not JSON ({})", where, e.what());
    }
    EPX_RETURN_IF_ERROR(read_json_line(j, where, num_experts, &out));
  }
  if (out.tokens.empty()) return invalid_argument("routing.trace = '{}' holds no steps", path);
  return out;
}

Result<TraceCounts> parse_counts_trace(std::span<const std::string> lines, const std::string& path, int num_experts) {
  CountsByStep by_step;
  bool first = true;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const std::vector<std::string_view> fields = split_fields(lines[i]);
    if (fields.empty()) continue;
    const bool header = first && fields[0] == "step";
    first = false;
    if (header) continue;
    const std::string where = fmt::format("{}:{}", path, i + 1);
    EPX_RETURN_IF_ERROR(read_counts_line(fields, where, static_cast<int>(i + 1), num_experts, &by_step));
  }
  if (by_step.empty()) return invalid_argument("routing.trace = '{}' holds no steps", path);
  return assemble_counts(by_step, path);
}

std::vector<double> log_popularity_from_counts(std::span<const double> tokens, int topk) {
  const double total = std::accumulate(tokens.begin(), tokens.end(), 0.0);
  std::vector<double> pop(tokens.size(), 0.0);
  if (!(total > 0)) return pop;
  for (std::size_t e = 0; e < tokens.size(); ++e) pop[e] = topk * tokens[e] / total;
  cap_shares_at_one(pop);
  for (double& p : pop) p = std::log(-std::log1p(-std::clamp(p, 1e-9, 1 - 1e-9)));
  return pop;
}

RoutingTrace routing_trace_from_counts(const TraceCounts& counts, int topk) {
  RoutingTrace trace;
  trace.num_layers = counts.num_layers;
  trace.log_popularity.reserve(counts.tokens.size());
  for (const std::vector<double>& t : counts.tokens) trace.log_popularity.push_back(log_popularity_from_counts(t, topk));
  return trace;
}

Result<RoutingTrace> read_routing_trace(std::istream& in, const std::string& path, int num_experts, int topk,
                                        const std::string& format) {
  if (num_experts < 1) return invalid_argument("{}: model.experts = {} must be at least 1", path, num_experts);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  const std::string used = format == "auto" ? detect_trace_format(lines) : format;
  Result<TraceCounts> counts = invalid_argument("routing.trace_format = '{}' is not one of auto, jsonl, counts", format);
  if (used == "jsonl") counts = parse_jsonl_trace(lines, path, num_experts);
  if (used == "counts") counts = parse_counts_trace(lines, path, num_experts);
  if (!counts.is_ok()) return counts.status();
  return routing_trace_from_counts(*counts, topk);
}

}  // namespace epx::sim
