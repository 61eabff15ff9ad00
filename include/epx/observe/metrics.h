// MetricsWriter: one JSON object per line (JSON Lines), each line handed to
// the system whole (one write of the line and its newline, no user-space
// buffer), so a crashed or running job's metrics can be read (`tail -f`, jq,
// pandas).
//
//   EPX_ASSIGN_OR_RETURN(auto metrics, epx::MetricsWriter::open("metrics.jsonl"));
//   EPX_RETURN_IF_ERROR(metrics.write(R"({"step": 10, "loss": 0.123})"));
//
// `open("-")` writes to stdout. A file is truncated unless `append` is true (a
// resumed run). `write` takes one complete JSON object without a newline and
// checks it (InvalidArgument otherwise, nothing written), so every line of the
// file parses. Errors of the file system name the path and the errno text.
// A write that fails (disk full, file too large, I/O error) cuts a regular
// file back to the end of its last whole line, so every line still parses,
// and closes the writer (later writes: FailedPrecondition).
// A writer is movable, not copyable, and not safe to share between threads
// without a lock.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "epx/core/status.h"

namespace epx {

class MetricsWriter {
 public:
  [[nodiscard]] static Result<MetricsWriter> open(const std::string& path, bool append = false);

  MetricsWriter(MetricsWriter&& other) noexcept;
  MetricsWriter& operator=(MetricsWriter&& other) noexcept;
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  ~MetricsWriter();

  // Appends `json_object_line` and a newline in one write.
  [[nodiscard]] Status write(std::string_view json_object_line);
  // Closes (stdout is left open); later writes fail with
  // FailedPrecondition. The destructor closes too, dropping any error.
  [[nodiscard]] Status close();

  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] int64_t lines_written() const { return lines_written_; }

 private:
  MetricsWriter(int fd, bool owned, std::string path, int64_t end)
      : fd_(fd), owned_(owned), path_(std::move(path)), end_(end) {}
  // Cuts the file back to end_, closes, and returns the error of `err`.
  Status fail_write(int err);

  int fd_ = -1;
  bool owned_ = false;
  std::string path_;
  int64_t end_ = -1;  // the file's size after the last whole line; -1: not a regular file
  int64_t lines_written_ = 0;
};

}  // namespace epx
