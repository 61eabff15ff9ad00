// read_metrics and MetricsFollower: the files under the line parser
// (run_log_parse.h). read_metrics reads and parses two regions of the file
// at a time, one on a helper thread, delivering the records in file order.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <future>

#include <simdjson.h>

#include "epx/core/input_file.h"
#include "epx/observe/run_log.h"
#include "observe/file_error.h"
#include "observe/metrics_line.h"
#include "observe/run_log_parse.h"

namespace epx {

using observe_detail::file_error;
using observe_detail::LineParser;
using observe_detail::ParsedLines;

namespace {

constexpr std::size_t kRegionBytes = std::size_t{8} << 20;  // per parse; two are in flight
constexpr std::size_t kTailBytes = std::size_t{256} << 10;   // read at a time past a region for its last line
constexpr std::size_t kPadding = simdjson::SIMDJSON_PADDING;
using detail::kMaxLineBytes;
using detail::line_too_long;

// Reads up to `n` bytes at `at` into `out` (pread() repeated until n or the
// end of the file); the count read, or -errno.
ssize_t read_fully(int fd, char* out, std::size_t n, off_t at) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, out + done, n - done, at + static_cast<off_t>(done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  return static_cast<ssize_t>(done);
}

// Bytes with room for simdjson's padding after `size`.
struct Block {
  std::vector<char> bytes;
  std::size_t size = 0;
  [[nodiscard]] std::string_view text() const { return {bytes.data(), size}; }
  void reserve_more(std::size_t n) {
    // With slack, so that a block of kBlockBytes after a carried line does not grow it each time.
    if (bytes.size() < size + n + kPadding) bytes.resize(size + n + kPadding + n / 8);
  }
};

// One lane of the reader: the lines that start in one region of the file,
// read with pread and parsed by one thread; its buffer, parser and records
// are reused region after region.
struct Lane {
  Block block;
  LineParser parser;
  ParsedLines parsed;
  Status read_error;
  bool too_long = false;  // the region's last line runs on without end (after its records)

  // Reads [from, to) of the file into the block (to <= file_size); the count read.
  Result<std::size_t> read(int fd, int64_t from, int64_t to, const std::string& path) {
    const std::size_t n = static_cast<std::size_t>(to - from);
    block.reserve_more(n);
    const ssize_t got = read_fully(fd, block.bytes.data() + block.size, n, static_cast<off_t>(from));
    if (got < 0) return file_error(static_cast<int>(-got), "read the metrics file", path);
    block.size += static_cast<std::size_t>(got);
    return static_cast<std::size_t>(got);
  }

  // The lines that start in [begin, end) of a file of `file_size` bytes: a
  // line starts at 0 or after a newline. The last one is read to its newline
  // past `end`; one without a newline before file_size (a run still writing)
  // is left out.
  void load_and_parse(int fd, int64_t begin, int64_t end, int64_t file_size, const std::string& path) {
    block.size = 0;
    first = 0;
    parsed.num_records = 0;
    parsed.num_lines = 0;
    parsed.error = Status::ok();
    too_long = false;
    read_error = load(fd, begin, end, file_size, path);
    if (read_error.is_ok() && block.size > first)
      observe_detail::parse_lines(parser, std::string_view(block.bytes.data() + first, block.size - first),
                                  block.bytes.size() - first, parsed);
  }

 private:
  Status load(int fd, int64_t begin, int64_t end, int64_t file_size, const std::string& path) {
    const int64_t from = begin == 0 ? 0 : begin - 1;  // the byte before: is a line starting at `begin`?
    EPX_ASSIGN_OR_RETURN(std::size_t got, read(fd, from, std::min(end, file_size), path));
    if (begin > 0) {
      const void* nl = std::memchr(block.bytes.data(), '\n', got);
      if (nl == nullptr) return drop_all();  // inside a line that started earlier
      first = static_cast<const char*>(nl) - block.bytes.data() + 1;
      if (first >= got) return drop_all();  // the next line starts at `end`: the next region's
    }
    // Read on until the newline that ends the line holding byte end - 1.
    int64_t at = from + static_cast<int64_t>(got);
    std::size_t searched = std::max(first, block.size > 0 ? block.size - 1 : 0);
    const void* nl = std::memchr(block.bytes.data() + searched, '\n', block.size - searched);
    const std::size_t line_start = nl != nullptr ? 0 : last_line_start();
    while (nl == nullptr && at < file_size) {
      if (block.size - line_start > kMaxLineBytes) {  // the lines before it are still delivered
        too_long = true;
        block.size = line_start;
        return Status::ok();
      }
      searched = block.size;
      EPX_ASSIGN_OR_RETURN(got, read(fd, at, std::min(at + static_cast<int64_t>(kTailBytes), file_size), path));
      at += static_cast<int64_t>(got);
      nl = std::memchr(block.bytes.data() + searched, '\n', block.size - searched);
    }
    // Without it the region's last line is unfinished: end at the last newline.
    if (nl == nullptr) nl = first < block.size ? memrchr(block.bytes.data() + first, '\n', block.size - first) : nullptr;
    if (nl == nullptr) return drop_all();
    block.size = static_cast<const char*>(nl) - block.bytes.data() + 1;
    return Status::ok();
  }
  // Where the block's last line starts: after its last newline, or at `first`.
  [[nodiscard]] std::size_t last_line_start() const {
    if (block.size <= first) return first;
    const void* nl = memrchr(block.bytes.data() + first, '\n', block.size - first);
    return nl == nullptr ? first : static_cast<std::size_t>(static_cast<const char*>(nl) - block.bytes.data()) + 1;
  }
  Status drop_all() {
    block.size = first = 0;
    return Status::ok();
  }
  std::size_t first = 0;  // where the region's first line starts in block
};

// Hands a lane's records to the callback; its error (a malformed line) with
// the file's line number. `lines_before` counts the lines of earlier regions.
Status deliver(Lane& lane, int64_t& lines_before, const std::string& path,
               const std::function<Status(StepRecord&&)>& on_record) {
  EPX_RETURN_IF_ERROR(lane.read_error);
  ParsedLines& parsed = lane.parsed;
  for (std::size_t i = 0; i < parsed.num_records; ++i) EPX_RETURN_IF_ERROR(on_record(std::move(parsed.records[i])));
  if (!parsed.error.is_ok())
    return invalid_argument("{}:{}: {}", path, lines_before + parsed.error_line, parsed.error.message());
  lines_before += parsed.num_lines;
  if (lane.too_long) return line_too_long(path, lines_before + 1);
  return Status::ok();
}

}  // namespace

// Regions of kRegionBytes go to two lanes in turn: this thread parses one
// while a helper parses the next, then this thread delivers both in order.
Status read_metrics(const std::string& path, const std::function<Status(StepRecord&&)>& on_record) {
  // Streamed region by region, so no limit on the size; a FIFO or a device is refused.
  EPX_ASSIGN_OR_RETURN(const InputFile file, InputFile::open(path, "the metrics file", -1));
  const int64_t file_size = file.size();  // what a run appends later is not read
  ::posix_fadvise(file.fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
  Lane lanes[2];
  int64_t lines_before = 0;
  const auto region = static_cast<int64_t>(kRegionBytes);
  for (int64_t begin = 0; begin < file_size; begin += 2 * region) {
    std::future<void> second;
    if (begin + region < file_size)
      second = std::async(std::launch::async, [&, begin] {
        lanes[1].load_and_parse(file.fd(), begin + region, begin + 2 * region, file_size, path);
      });
    lanes[0].load_and_parse(file.fd(), begin, begin + region, file_size, path);
    Status status = deliver(lanes[0], lines_before, path, on_record);
    if (second.valid()) {
      second.get();
      if (status.is_ok()) status = deliver(lanes[1], lines_before, path, on_record);
    }
    EPX_RETURN_IF_ERROR(status);
  }
  return Status::ok();
}

// ---- MetricsFollower ------------------------------------------------------

struct MetricsFollower::State {
  std::string path;
  LineParser parser;
  Block pending;        // read but not yet parsed: a partial line, or lines after a bad one
  int64_t offset = 0;   // bytes of the file read into pending or parsed
  int64_t lines = 0;    // whole lines read from the file
  bool seen = false;    // the file existed at the last poll
  uint64_t dev = 0;
  uint64_t ino = 0;

  void start_over() {
    pending.size = 0;
    offset = 0;
    lines = 0;
  }
  // A new file at the path, or this one rewritten (shorter, or its last
  // byte read is no longer the newline it was).
  bool replaced(const InputFile& file) const;
  Result<std::vector<StepRecord>> parse_pending();
};

bool MetricsFollower::State::replaced(const InputFile& file) const {
  if (!seen) return false;
  if (file.device() != dev || file.inode() != ino || file.size() < offset) return true;
  const int64_t consumed = offset - static_cast<int64_t>(pending.size);
  if (consumed == 0) return false;
  char last = 0;
  return read_fully(file.fd(), &last, 1, static_cast<off_t>(consumed - 1)) != 1 || last != '\n';
}

// Parses the whole lines of `pending`. A malformed line is reported once: the
// records before it come first (the bad line stays for the next poll), then
// its error alone, after which the follower goes on past it.
Result<std::vector<StepRecord>> MetricsFollower::State::parse_pending() {
  ParsedLines parsed;
  observe_detail::parse_lines(parser, pending.text(), pending.bytes.size(), parsed);
  std::size_t consumed = parsed.consumed;
  int64_t lines_done = parsed.num_lines;
  Status error;
  parsed.records.resize(parsed.num_records);
  if (!parsed.error.is_ok()) {
    if (!parsed.records.empty()) {
      --lines_done;  // the bad line is read again next time
    } else {
      const void* nl = std::memchr(pending.bytes.data() + consumed, '\n', pending.size - consumed);
      consumed = static_cast<const char*>(nl) - pending.bytes.data() + 1;
      error = invalid_argument("{}:{}: {}", path, lines + parsed.error_line, parsed.error.message());
    }
  }
  if (pending.size > consumed)  // an empty buffer's data() may be null, which memmove must not get
    std::memmove(pending.bytes.data(), pending.bytes.data() + consumed, pending.size - consumed);
  pending.size -= consumed;
  lines += lines_done;
  if (!error.is_ok()) return error;
  return std::move(parsed.records);
}

Result<MetricsFollower> MetricsFollower::open(const std::string& path) {
  auto state = std::make_unique<State>();
  state->path = path;
  return MetricsFollower(std::move(state));
}

MetricsFollower::MetricsFollower(std::unique_ptr<State> state) : state_(std::move(state)) {}
MetricsFollower::MetricsFollower(MetricsFollower&&) noexcept = default;
MetricsFollower& MetricsFollower::operator=(MetricsFollower&&) noexcept = default;
MetricsFollower::~MetricsFollower() = default;

int64_t MetricsFollower::lines_read() const { return state_->lines; }

Result<std::vector<StepRecord>> MetricsFollower::poll() { return poll(std::numeric_limits<std::size_t>::max()); }

Result<std::vector<StepRecord>> MetricsFollower::poll(std::size_t max_bytes) {
  State& s = *state_;
  Result<InputFile> opened = InputFile::open(s.path, "the metrics file", -1);
  if (!opened.is_ok()) {
    // Not there yet (or removed): nothing new.
    if (opened.status().code() == StatusCode::kNotFound) return std::vector<StepRecord>{};
    return opened.status();
  }
  const InputFile& file = *opened;
  if (s.pending.size > kMaxLineBytes) {  // an unfinished line this long is skipped, once reported
    s.pending.size = 0;
    return line_too_long(s.path, s.lines + 1);
  }
  if (s.replaced(file)) s.start_over();
  s.seen = true;
  s.dev = file.device();
  s.ino = file.inode();
  const std::size_t fresh = static_cast<std::size_t>(std::min<int64_t>(
      file.size() - s.offset, static_cast<int64_t>(std::min<std::size_t>(max_bytes, INT64_MAX))));
  if (fresh > 0) {
    s.pending.reserve_more(fresh);
    const ssize_t got = read_fully(file.fd(), s.pending.bytes.data() + s.pending.size, fresh, static_cast<off_t>(s.offset));
    if (got < 0) return file_error(static_cast<int>(-got), "read the metrics file", s.path);
    s.pending.size += static_cast<std::size_t>(got);
    s.offset += got;
  }
  return s.parse_pending();
}

}  // namespace epx
