// The routing trace of `epx sim` (routing.distribution = "trace"): per step
// and MoE layer, how many tokens each expert received, read from one of two
// formats (docs/simulator.md "Routing traces"):
//   jsonl   the JSON Lines that `epx train --metrics` writes, one step a line,
//           each with a "layers" array whose entries hold "tokens_per_expert";
//   counts  text for counts exported from elsewhere (Megatron, DeepSpeed):
//           one line per (step, layer), `step,layer,count_0,...,count_{E-1}`,
//           '#' comments, an optional `step,layer,...` header.
// Both are parsed into TraceCounts, then turned into router log-popularities
// by one function (routing_trace_from_counts).
#pragma once

#include <istream>
#include <span>
#include <string>
#include <vector>

#include "epx/core/status.h"

namespace epx::sim {

// Token counts per expert of every replayed step, in replay order.
struct TraceCounts {
  int num_layers = 0;  // MoE layers of every step
  // [step * num_layers + layer][expert], counts >= 0.
  std::vector<std::vector<double>> tokens;
};

struct RoutingTrace {
  int num_layers = 0;  // MoE layers of every replayed step
  // Router log-popularity per expert: [step * num_layers + layer][expert].
  std::vector<std::vector<double>> log_popularity;
};

// "jsonl" when the first line that is neither blank nor a '#' comment starts
// with '{' or '[' (JSON), else "counts".
std::string detect_trace_format(std::span<const std::string> lines);

// `epx train --metrics` lines. InvalidArgument naming `path`, the line and the
// place inside it for a line that is not JSON or not of that shape, a count
// that is not a finite number >= 0, a line whose number of layers differs
// from the first's, or no line at all. Each layer lists `num_experts` counts.
Result<TraceCounts> parse_jsonl_trace(std::span<const std::string> lines, const std::string& path, int num_experts);

// The counts format. Steps are replayed in increasing step number (gaps in
// the numbering are skipped, not filled); layers are 0-based MoE layers; the
// first step must list every layer up to the largest one in the file, and a
// later step that leaves a layer out repeats that layer's last counts.
// InvalidArgument naming `path:line` and the offending value for a field that
// is not a number, a count < 0 or not finite, a step or layer that is not an
// integer >= 0, a line without 2 + `num_experts` fields, a (step, layer)
// given twice, a layer missing from the first step, or no line at all.
Result<TraceCounts> parse_counts_trace(std::span<const std::string> lines, const std::string& path, int num_experts);

// One (step, layer)'s log-popularity for a top-`topk` router: expert e gets
// weight w_e = -log(1 - pi_e), pi_e = topk x tokens_e / sum(tokens) (capped
// at 1, the excess spread over the others in proportion), so that the
// router's Gumbel top-k (order sampling) includes e in about pi_e of the
// tokens (Rosen's approximation): the replayed loads keep the trace's shares.
// All zeros give a uniform popularity; a zero count a tiny one.
std::vector<double> log_popularity_from_counts(std::span<const double> tokens, int topk);

RoutingTrace routing_trace_from_counts(const TraceCounts& counts, int topk);

// Reads `in` in `format` ("auto", "jsonl" or "counts") and converts it.
Result<RoutingTrace> read_routing_trace(std::istream& in, const std::string& path, int num_experts, int topk,
                                        const std::string& format = "auto");

}  // namespace epx::sim
