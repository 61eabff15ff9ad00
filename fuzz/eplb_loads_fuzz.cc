// `epx eplb --loads FILE`: per-expert loads. Any input gives at least one
// finite load >= 0, or InvalidArgument naming the file.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>

#include "eplb.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = "fuzz-loads.txt";
  std::istringstream in{std::string(epx::fuzz::as_text(data, size))};
  auto loads = epx::app::parse_loads(in, path);
  if (!loads.is_ok()) {
    EPX_FUZZ_CHECK(loads.status().code() == epx::StatusCode::kInvalidArgument, loads.status());
    epx::fuzz::check_refusal(loads.status(), path);
    return 0;
  }
  EPX_FUZZ_CHECK(!loads->empty());
  for (double v : *loads) EPX_FUZZ_CHECK(std::isfinite(v) && v >= 0);
  return 0;
}
