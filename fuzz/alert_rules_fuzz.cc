// `epx monitor --alerts FILE`: the TOML text of an alert rule file into rules.
// Any input is parsed or refused with InvalidArgument naming the file; the
// rules accepted are well formed (a name, each name once, thresholds and
// counts in range) and an evaluator runs them over a few steps.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <set>

#include "epx/observe/alerts.h"
#include "fuzz_check.h"

namespace {

// Three steps: a normal one, a spike with a hot layer and an idle rank, a NaN loss.
std::vector<epx::StepRecord> sample_steps() {
  std::vector<epx::StepRecord> steps(3);
  for (int i = 0; i < 3; ++i) {
    epx::StepRecord& s = steps[static_cast<std::size_t>(i)];
    s.step = i;
    s.loss = i == 2 ? std::nan("") : 1.0 + 9.0 * i;
    s.seconds = 0.1 * (i + 1);
    s.layers.resize(1);
    s.layers[0].max_vio = 0.5 * i;
    s.layers[0].idle_fraction = 0.3 * i;
    s.layers[0].dropped = 10 * i;
    s.ranks.resize(2);
    s.ranks[1].rank = 1;
    s.ranks[i % 2].exchange_wait = 0.05 * i;
  }
  return steps;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = "fuzz_rules.toml";
  epx::Result<std::vector<epx::AlertRule>> rules = epx::parse_alert_rules(epx::fuzz::as_text(data, size), path);
  if (!rules.is_ok()) {
    EPX_FUZZ_CHECK(rules.status().code() == epx::StatusCode::kInvalidArgument, rules.status());
    epx::fuzz::check_refusal(rules.status(), path);
    return 0;
  }
  std::set<std::string> names;
  for (const epx::AlertRule& r : *rules) {
    EPX_FUZZ_CHECK(names.insert(r.name).second);
    EPX_FUZZ_CHECK(std::isfinite(r.above));
    EPX_FUZZ_CHECK(r.for_steps >= 1);
    EPX_FUZZ_CHECK(r.window >= 0);
  }
  epx::AlertEvaluator alerts(std::move(*rules));
  for (const epx::StepRecord& s : sample_steps())
    for (const epx::Alert& a : alerts.add(s)) EPX_FUZZ_CHECK(!epx::format_alert(a).empty());
  EPX_FUZZ_CHECK(alerts.num_fired() >= 0);
  return 0;
}
