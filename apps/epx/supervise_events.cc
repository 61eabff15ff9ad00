// Reading an `epx supervise --events` file.
#include "supervise_events.h"

#include <fmt/format.h>

#include "epx/core/input_file.h"

namespace epx::app {
namespace {

constexpr int64_t kMaxEventsBytes = int64_t{256} << 20;

void add_event(const nlohmann::json& e, RestartHistory* h) {
  const std::string kind = e.value("event", "");
  if (kind == "start") {
    if (h->runs++ > 0) ++h->restarts;
  } else if (kind == "exit") {
    h->lost_steps += e.value("lost_steps", int64_t{0});
  } else if (kind == "rank_failed") {
    h->failures.push_back(fmt::format("rank {} on {}: {} at step {}", e.value("rank", -1), e.value("host", "?"),
                                      e.value("cause", "?"), e.value("step", int64_t{-1})));
  } else if (kind == "excluded") {
    const std::string by = e.value("replaced_by", "");
    h->excluded.push_back(e.value("host", "?") + (by.empty() ? "" : " (replaced by " + by + ")"));
  } else if (kind == "resumed") {
    h->restart_seconds.push_back(e.value("restart_seconds", 0.0));
  } else if (kind == "gave_up") {
    h->gave_up = e.value("cause", fmt::format("{} restarts within {} s", e.value("restarts", 0),
                                              e.value("window_s", 0.0)));
  }
}

}  // namespace

Result<RestartHistory> read_restart_history(const std::string& path) {
  EPX_ASSIGN_OR_RETURN(std::string text, read_input_file(path, "the --events file", kMaxEventsBytes));
  RestartHistory h;
  std::size_t from = 0;
  while (from < text.size()) {
    std::size_t end = text.find('\n', from);
    if (end == std::string::npos) end = text.size();
    const nlohmann::json e = nlohmann::json::parse(text.substr(from, end - from), nullptr, false);
    if (e.is_object()) add_event(e, &h);
    from = end + 1;
  }
  return h;
}

std::string describe_restarts(const RestartHistory& h) {
  std::string s = fmt::format("{} restart{}, {} step{} lost", h.restarts, h.restarts == 1 ? "" : "s", h.lost_steps,
                              h.lost_steps == 1 ? "" : "s");
  for (const std::string& f : h.failures) s += "; " + f;
  for (const std::string& x : h.excluded) s += "; excluded " + x;
  if (!h.gave_up.empty()) s += "; gave up: " + h.gave_up;
  return s;
}

nlohmann::json restarts_json(const RestartHistory& h) {
  return {{"runs", h.runs},         {"restarts", h.restarts},
          {"lost_steps", h.lost_steps}, {"failures", h.failures},
          {"excluded", h.excluded}, {"restart_seconds", h.restart_seconds},
          {"gave_up", h.gave_up.empty() ? nlohmann::json(nullptr) : nlohmann::json(h.gave_up)}};
}

}  // namespace epx::app
