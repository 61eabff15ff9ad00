// read_metrics and MetricsFollower: the files under the line parser
// (run_log_parse.h). read_metrics reads blocks of whole lines and parses two
// at a time, one on a helper thread, delivering the records in file order.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <future>
#include <optional>

#include <simdjson.h>

#include "epx/observe/run_log.h"
#include "observe/file_error.h"
#include "observe/run_log_parse.h"

namespace epx {

using observe_detail::file_error;
using observe_detail::LineParser;
using observe_detail::ParsedLines;

namespace {

constexpr std::size_t kBlockBytes = std::size_t{8} << 20;  // per parse; two are in flight
constexpr std::size_t kPadding = simdjson::SIMDJSON_PADDING;

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

// Reads up to `n` bytes at `at` into `out` (read() or pread() repeated until n
// or the end of the file); the count read, or -errno.
ssize_t read_fully(int fd, char* out, std::size_t n, std::optional<off_t> at) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t got = at ? ::pread(fd, out + done, n - done, *at + static_cast<off_t>(done))
                           : ::read(fd, out + done, n - done);
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
    if (bytes.size() < size + n + kPadding) bytes.resize(size + n + kPadding);
  }
};

// The file as blocks of whole lines, about kBlockBytes each; a last line
// without its newline is never handed out.
class LineBlocks {
 public:
  LineBlocks(int fd, const std::string& path) : fd_(fd), path_(path) {}

  // Fills `block` with the next lines; false when none are left.
  Result<bool> next(Block& block) {
    block.size = 0;
    block.reserve_more(carry_.size());
    std::memcpy(block.bytes.data(), carry_.data(), carry_.size());
    block.size = carry_.size();
    std::size_t searched = 0;  // bytes of block known to hold no newline
    for (;;) {
      if (!eof_) {
        block.reserve_more(kBlockBytes);
        const ssize_t got = read_fully(fd_, block.bytes.data() + block.size, kBlockBytes, std::nullopt);
        if (got < 0) return file_error(static_cast<int>(-got), "read the metrics file", path_);
        block.size += static_cast<std::size_t>(got);
        eof_ = static_cast<std::size_t>(got) < kBlockBytes;
      }
      const void* nl = memrchr(block.bytes.data() + searched, '\n', block.size - searched);
      if (nl != nullptr) {
        const std::size_t end = static_cast<const char*>(nl) - block.bytes.data() + 1;
        carry_.assign(block.bytes.data() + end, block.size - end);
        block.size = end;
        return true;
      }
      if (eof_) return false;  // only a partial line (or nothing) is left
      searched = block.size;
    }
  }

 private:
  int fd_;
  const std::string& path_;
  std::string carry_;
  bool eof_ = false;
};

// Hands a block's records to the callback; its error (a malformed line) with
// the file's line number. `lines_before` counts the lines of earlier blocks.
Status deliver(ParsedLines& parsed, int64_t& lines_before, const std::string& path,
               const std::function<Status(StepRecord&&)>& on_record) {
  for (StepRecord& record : parsed.records) EPX_RETURN_IF_ERROR(on_record(std::move(record)));
  if (!parsed.error.is_ok())
    return invalid_argument("{}:{}: {}", path, lines_before + parsed.error_line, parsed.error.message());
  lines_before += parsed.num_lines;
  return Status::ok();
}

ParsedLines parse_block(LineParser& parser, const Block& block) {
  return observe_detail::parse_lines(parser, block.text(), block.bytes.size());
}

}  // namespace

Status read_metrics(const std::string& path, const std::function<Status(StepRecord&&)>& on_record) {
  const Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return file_error(errno, "open the metrics file", path);
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  LineBlocks blocks(fd.get(), path);
  LineParser parsers[2];
  Block first, second;
  int64_t lines_before = 0;
  for (;;) {
    EPX_ASSIGN_OR_RETURN(const bool have_first, blocks.next(first));
    if (!have_first) return Status::ok();
    Result<bool> have_second = blocks.next(second);
    std::future<ParsedLines> parsing_second;
    if (have_second.is_ok() && *have_second)
      parsing_second = std::async(std::launch::async, [&] { return parse_block(parsers[1], second); });
    ParsedLines parsed = parse_block(parsers[0], first);
    Status status = deliver(parsed, lines_before, path, on_record);
    if (parsing_second.valid()) {
      ParsedLines parsed_second = parsing_second.get();
      if (status.is_ok()) status = deliver(parsed_second, lines_before, path, on_record);
    }
    EPX_RETURN_IF_ERROR(status);
    if (!have_second.is_ok()) return have_second.status();
    if (!*have_second) return Status::ok();
  }
}

// ---- MetricsFollower ------------------------------------------------------

struct MetricsFollower::State {
  std::string path;
  LineParser parser;
  Block pending;        // read but not yet parsed: a partial line, or lines after a bad one
  int64_t offset = 0;   // bytes of the file read into pending or parsed
  int64_t lines = 0;    // whole lines read from the file
  bool seen = false;    // the file existed at the last poll
  dev_t dev = 0;
  ino_t ino = 0;

  void start_over() {
    pending.size = 0;
    offset = 0;
    lines = 0;
  }
  // A new file at the path, or this one rewritten (shorter, or its last
  // byte read is no longer the newline it was).
  bool replaced(int fd, const struct stat& st) const;
  Result<std::vector<StepRecord>> parse_pending();
};

bool MetricsFollower::State::replaced(int fd, const struct stat& st) const {
  if (!seen) return false;
  if (st.st_dev != dev || st.st_ino != ino || st.st_size < offset) return true;
  const int64_t consumed = offset - static_cast<int64_t>(pending.size);
  if (consumed == 0) return false;
  char last = 0;
  return read_fully(fd, &last, 1, static_cast<off_t>(consumed - 1)) != 1 || last != '\n';
}

// Parses the whole lines of `pending`. A malformed line is reported once: the
// records before it come first (the bad line stays for the next poll), then
// its error alone, after which the follower goes on past it.
Result<std::vector<StepRecord>> MetricsFollower::State::parse_pending() {
  ParsedLines parsed = observe_detail::parse_lines(parser, pending.text(), pending.bytes.size());
  std::size_t consumed = parsed.consumed;
  int64_t lines_done = parsed.num_lines;
  Status error;
  if (!parsed.error.is_ok()) {
    if (!parsed.records.empty()) {
      --lines_done;  // the bad line is read again next time
    } else {
      const void* nl = std::memchr(pending.bytes.data() + consumed, '\n', pending.size - consumed);
      consumed = static_cast<const char*>(nl) - pending.bytes.data() + 1;
      error = invalid_argument("{}:{}: {}", path, lines + parsed.error_line, parsed.error.message());
    }
  }
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
  const Fd fd(::open(s.path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return std::vector<StepRecord>{};  // not there yet (or removed): nothing new
    return file_error(errno, "open the metrics file", s.path);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return file_error(errno, "stat the metrics file", s.path);
  if (s.replaced(fd.get(), st)) s.start_over();
  s.seen = true;
  s.dev = st.st_dev;
  s.ino = st.st_ino;
  const std::size_t fresh = static_cast<std::size_t>(std::min<int64_t>(
      st.st_size - s.offset, static_cast<int64_t>(std::min<std::size_t>(max_bytes, INT64_MAX))));
  if (fresh > 0) {
    s.pending.reserve_more(fresh);
    const ssize_t got = read_fully(fd.get(), s.pending.bytes.data() + s.pending.size, fresh, s.offset);
    if (got < 0) return file_error(static_cast<int>(-got), "read the metrics file", s.path);
    s.pending.size += static_cast<std::size_t>(got);
    s.offset += got;
  }
  return s.parse_pending();
}

}  // namespace epx
