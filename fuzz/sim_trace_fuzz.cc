// `epx sim` with routing.distribution = "trace": the JSON Lines of a routing
// trace. The last byte of the input picks model.experts (1..64) so that
// traces of every width are reached; the rest is the file. Any input gives a
// trace of whole lines of finite popularities, or InvalidArgument naming it.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>

#include "fuzz_check.h"
#include "sim/routing_trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int num_experts = 1 + data[size - 1] % 64;
  const std::string path = "fuzz-trace.jsonl";
  std::istringstream in{std::string(epx::fuzz::as_text(data, size - 1))};
  auto trace = epx::sim::read_routing_trace(in, path, num_experts);
  if (!trace.is_ok()) {
    EPX_FUZZ_CHECK(trace.status().code() == epx::StatusCode::kInvalidArgument, trace.status());
    epx::fuzz::check_refusal(trace.status(), path);
    return 0;
  }
  const auto& rows = trace->log_popularity;
  EPX_FUZZ_CHECK(trace->num_layers >= 1 && !rows.empty() && rows.size() % trace->num_layers == 0);
  for (const auto& row : rows) {
    EPX_FUZZ_CHECK(row.size() == static_cast<size_t>(num_experts));
    for (double v : row) EPX_FUZZ_CHECK(std::isfinite(v) && v >= 0);
  }
  return 0;
}
