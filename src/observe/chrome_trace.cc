#include "epx/observe/chrome_trace.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "observe/file_error.h"

namespace epx {
using observe_detail::write_file_atomically;

Status write_chrome_trace(std::span<const TraceSpan> spans, const std::string& path) {
  for (std::size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].end_ns < spans[i].begin_ns)
      return invalid_argument("spans[{}] '{}' on rank {} ends before it begins (begin_ns = {}, end_ns = {})", i,
                              spans[i].name, spans[i].rank, spans[i].begin_ns, spans[i].end_ns);
  }
  int64_t origin_ns = 0;
  if (!spans.empty()) {
    origin_ns = std::min_element(spans.begin(), spans.end(), [](const TraceSpan& a, const TraceSpan& b) {
                  return a.begin_ns < b.begin_ns;
                })->begin_ns;
  }

  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", "epx"}}}});
  std::set<int> ranks;
  for (const TraceSpan& s : spans) ranks.insert(s.rank);
  for (int rank : ranks) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", rank},
                      {"args", {{"name", fmt::format("rank {}", rank)}}}});
    events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 0}, {"tid", rank},
                      {"args", {{"sort_index", rank}}}});
  }
  for (const TraceSpan& s : spans) {
    // Microseconds as doubles keep nanosecond resolution for about 100 days after the origin.
    events.push_back({{"name", s.name},
                      {"ph", "X"},
                      {"ts", static_cast<double>(s.begin_ns - origin_ns) / 1e3},
                      {"dur", static_cast<double>(s.end_ns - s.begin_ns) / 1e3},
                      {"pid", 0},
                      {"tid", s.rank}});
  }
  nlohmann::json trace = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  // Invalid UTF-8 in a span name is replaced rather than thrown on.
  std::string text = trace.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  text += '\n';
  return write_file_atomically(path, text);
}

}  // namespace epx
