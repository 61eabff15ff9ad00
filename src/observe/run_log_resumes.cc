// Resumed runs' metrics files: the steps of every line (a quick scan), the
// history read with each step once, and the cut before a resume appends.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <limits>
#include <string_view>

#include "epx/core/input_file.h"
#include "epx/observe/run_log.h"
#include "observe/file_error.h"
#include "observe/metrics_line.h"

namespace epx {

using observe_detail::file_error;

namespace {

constexpr std::size_t kChunkBytes = std::size_t{1} << 20;
constexpr std::string_view kStepPrefix = "{\"step\":";

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  [[nodiscard]] int get() const { return fd_; }

 private:
  int fd_;
};

bool is_blank(std::string_view line) { return line.find_first_not_of(" \t\r") == std::string_view::npos; }

// The step of one line: read from the front of a line epx wrote, else from
// the whole line parsed.
Result<int64_t> line_step(std::string_view line) {
  if (line.starts_with(kStepPrefix)) {
    int64_t step = 0;
    const char* begin = line.data() + kStepPrefix.size();
    const char* end = line.data() + line.size();
    const auto [p, ec] = std::from_chars(begin, end, step);
    if (ec == std::errc() && p < end && (*p == ',' || *p == '}')) return step;
  }
  EPX_ASSIGN_OR_RETURN(StepRecord record, parse_step_record(line));
  return record.step;
}

// The steps of a file's whole lines, in order, with the offset just past each
// line's newline; blank lines are skipped. `tail` receives what follows the
// last newline (a line still being written, or torn).
struct LineSteps {
  std::vector<std::pair<int64_t, int64_t>> lines;  // (step, end offset)
  std::string tail;
};

Result<LineSteps> scan_steps(int fd, const std::string& path) {
  LineSteps out;
  std::string line;
  std::vector<char> chunk(kChunkBytes);
  int64_t offset = 0, line_number = 0;
  for (;;) {
    const ssize_t got = ::read(fd, chunk.data(), chunk.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return file_error(errno, "read the metrics file", path);
    if (got == 0) break;
    std::string_view rest(chunk.data(), static_cast<std::size_t>(got));
    while (!rest.empty()) {
      const std::size_t nl = rest.find('\n');
      line.append(rest.substr(0, nl));
      if (line.size() > detail::kMaxLineBytes) return detail::line_too_long(path, line_number + 1);
      if (nl == std::string_view::npos) {
        offset += static_cast<int64_t>(rest.size());
        break;
      }
      offset += static_cast<int64_t>(nl + 1);
      rest.remove_prefix(nl + 1);
      ++line_number;
      if (!is_blank(line)) {
        Result<int64_t> step = line_step(line);
        if (!step.is_ok()) return invalid_argument("{}:{}: {}", path, line_number, step.status().message());
        out.lines.emplace_back(*step, offset);
      }
      line.clear();
    }
  }
  out.tail = std::move(line);
  return out;
}

// Through InputFile: a FIFO, a device or a directory is refused unread.
Result<LineSteps> scan_file(const std::string& path) {
  EPX_ASSIGN_OR_RETURN(InputFile file, InputFile::open(path, "the metrics file", -1));
  return scan_steps(file.fd(), path);
}

// The histories of a file: a new one starts where the step goes back. Each
// history's records are kept below `cut` (the least first step of the
// histories after it); `owner` is the history whose start that is.
struct History {
  int64_t first_step = 0, cut = std::numeric_limits<int64_t>::max();
  std::size_t owner = 0;
};

std::vector<History> histories_of(const LineSteps& scan) {
  std::vector<History> out;
  for (std::size_t i = 0; i < scan.lines.size(); ++i)
    if (i == 0 || scan.lines[i].first <= scan.lines[i - 1].first) out.push_back({.first_step = scan.lines[i].first});
  for (std::size_t h = out.size(); h-- > 1;) {
    const History& next = out[h];
    const bool next_starts_lower = next.first_step <= next.cut;
    out[h - 1].cut = next_starts_lower ? next.first_step : next.cut;
    out[h - 1].owner = next_starts_lower ? h : next.owner;
  }
  return out;
}

}  // namespace

Status read_run_metrics(const std::string& path, const std::function<Status(StepRecord&&)>& on_record,
                        std::vector<MetricsResume>* resumes) {
  EPX_ASSIGN_OR_RETURN(LineSteps scan, scan_file(path));
  const std::vector<History> histories = histories_of(scan);
  if (histories.size() <= 1) return read_metrics(path, on_record);
  std::vector<MetricsResume> found(histories.size());
  for (std::size_t h = 0; h < histories.size(); ++h) found[h].step = histories[h].first_step;
  std::size_t current = 0;
  int64_t previous = 0;
  bool first = true;
  EPX_RETURN_IF_ERROR(read_metrics(path, [&](StepRecord&& r) -> Status {
    // The same lines as the scan, so the same places where the step goes back.
    if (!first && r.step <= previous && current + 1 < histories.size()) ++current;
    first = false;
    previous = r.step;
    const History& h = histories[current];
    if (r.step >= h.cut) {
      ++found[h.owner].replaced;
      return Status::ok();
    }
    return on_record(std::move(r));
  }));
  if (resumes != nullptr) resumes->assign(found.begin() + 1, found.end());
  return Status::ok();
}

Result<MetricsCut> cut_metrics_before_step(const std::string& path, int64_t step) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return MetricsCut{};
    return file_error(errno, "stat the metrics file", path);
  }
  if (!S_ISREG(st.st_mode)) return MetricsCut{};  // a pipe or a terminal: nothing to cut
  const Fd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (fd.get() < 0) return file_error(errno, "open the metrics file", path);
  Result<LineSteps> scanned = scan_steps(fd.get(), path);
  if (!scanned.is_ok())
    return invalid_argument("{}; the metrics file of a resumed run is cut back to the checkpoint's step, and this one "
                            "is not a file epx wrote: name another --metrics",
                            scanned.status().message());
  const LineSteps& scan = *scanned;
  if (!scan.tail.empty() && !scan.tail.starts_with(kStepPrefix))
    return invalid_argument("{}: its last line is not a metrics record and has no newline; the metrics file of a "
                            "resumed run is cut back to the checkpoint's step, and this one is not a file epx wrote: "
                            "name another --metrics",
                            path);
  // The end of the last record of a step below `step`: what follows is cut.
  MetricsCut cut;
  int64_t keep_end = 0;
  for (std::size_t i = 0; i < scan.lines.size(); ++i)
    if (scan.lines[i].first < step) keep_end = scan.lines[i].second;
  for (const auto& [line_step, end] : scan.lines) {
    if (end <= keep_end) {
      ++cut.kept;
      continue;
    }
    ++cut.removed;
    cut.first_removed_step = cut.first_removed_step < 0 ? line_step : std::min(cut.first_removed_step, line_step);
    cut.last_removed_step = std::max(cut.last_removed_step, line_step);
  }
  if (::fstat(fd.get(), &st) != 0) return file_error(errno, "stat the metrics file", path);
  const int64_t size = static_cast<int64_t>(st.st_size);
  cut.bytes_removed = std::max<int64_t>(size - keep_end, 0);
  if (cut.bytes_removed == 0) return cut;
  if (::ftruncate(fd.get(), static_cast<off_t>(keep_end)) != 0) return file_error(errno, "cut back the metrics file", path);
  if (::fsync(fd.get()) != 0) return file_error(errno, "sync the metrics file", path);
  return cut;
}

}  // namespace epx
