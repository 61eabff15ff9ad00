// `epx sim` with routing.distribution = "trace": a routing trace in either
// format (JSON Lines or counts, told apart by content). The last byte of the
// input picks model.experts (1..64) and top-k (1, 3, 5 or 7, at most the
// experts) so that traces of every width are reached; the rest is the file.
// Any input gives a trace of whole steps of finite log-popularities, or
// InvalidArgument naming it.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>

#include "fuzz_check.h"
#include "sim/routing_trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int num_experts = 1 + data[size - 1] % 64;
  const int topk = std::min(num_experts, 1 + (data[size - 1] >> 6) * 2);
  const std::string path = "fuzz-trace.jsonl";
  std::istringstream in{std::string(epx::fuzz::as_text(data, size - 1))};
  auto trace = epx::sim::read_routing_trace(in, path, num_experts, topk);
  if (!trace.is_ok()) {
    EPX_FUZZ_CHECK(trace.status().code() == epx::StatusCode::kInvalidArgument, trace.status());
    epx::fuzz::check_refusal(trace.status(), path);
    return 0;
  }
  const auto& rows = trace->log_popularity;
  EPX_FUZZ_CHECK(trace->num_layers >= 1 && !rows.empty() && rows.size() % trace->num_layers == 0);
  for (const auto& row : rows) {
    EPX_FUZZ_CHECK(row.size() == static_cast<size_t>(num_experts));
    for (double v : row) EPX_FUZZ_CHECK(std::isfinite(v));
  }
  return 0;
}
