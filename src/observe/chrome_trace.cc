#include "epx/observe/chrome_trace.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "observe/file_error.h"

namespace epx {
namespace {

using observe_detail::file_error;

// Writes all of `data` to `fd`, retrying short writes and EINTR.
bool write_all(int fd, const std::string& data) {
  std::size_t written = 0;
  while (written < data.size()) {
    const ssize_t n = ::write(fd, data.data() + written, data.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    written += static_cast<std::size_t>(n);
  }
  return true;
}

// Writes `data` to a temporary file next to `path`, then renames it over
// `path`; on failure the temporary file is removed and `path` is untouched.
Status write_file_atomically(const std::string& path, const std::string& data) {
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) return file_error(errno, "create a temporary file for", path);
  ::fchmod(fd, 0644);  // mkstemp makes the file 0600; a trace is for reading.
  const auto fail = [&](std::string_view what) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return file_error(err, what, path);
  };
  if (!write_all(fd, data)) {
    ::close(fd);
    return fail("write");
  }
  if (::close(fd) != 0) return fail("write");
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail("rename a temporary file to");
  return Status::ok();
}

}  // namespace

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
