#include "epx/observe/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "observe/file_error.h"

namespace epx {

using observe_detail::file_error;
using observe_detail::write_all;

Result<MetricsWriter> MetricsWriter::open(const std::string& path, bool append) {
  if (path.empty()) return invalid_argument("the metrics path is empty; pass a file name or \"-\" for stdout");
  if (path == "-") return MetricsWriter(STDOUT_FILENO, /*owned=*/false, path, /*end=*/-1);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC), 0644);
  if (fd < 0) return file_error(errno, "open the metrics file", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return file_error(err, "open the metrics file", path);
  }
  // A regular file can be cut back to its last whole line after a failed
  // write; a pipe or a terminal cannot.
  const int64_t end = S_ISREG(st.st_mode) ? static_cast<int64_t>(st.st_size) : -1;
  return MetricsWriter(fd, /*owned=*/true, path, end);
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      owned_(std::exchange(other.owned_, false)),
      path_(std::move(other.path_)),
      end_(other.end_),
      lines_written_(other.lines_written_) {}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& other) noexcept {
  if (this != &other) {
    close().ignore();
    fd_ = std::exchange(other.fd_, -1);
    owned_ = std::exchange(other.owned_, false);
    path_ = std::move(other.path_);
    end_ = other.end_;
    lines_written_ = other.lines_written_;
  }
  return *this;
}

MetricsWriter::~MetricsWriter() { close().ignore(); }

Status MetricsWriter::write(std::string_view json_object_line) {
  if (fd_ < 0) return failed_precondition("the metrics writer for '{}' is closed", path_);
  if (json_object_line.find('\n') != std::string_view::npos)
    return invalid_argument("a metrics line must be one line; got a newline at offset {} of '{}'",
                            json_object_line.find('\n'), json_object_line);
  const std::size_t first = json_object_line.find_first_not_of(" \t\r");
  if (first == std::string_view::npos || json_object_line[first] != '{' ||
      !nlohmann::json::accept(json_object_line))
    return invalid_argument("a metrics line must be one JSON object; got '{}'", json_object_line);
  std::string line;
  line.reserve(json_object_line.size() + 1);
  line.append(json_object_line).push_back('\n');
  if (!owned_) std::fflush(stdout);  // keep the order of what else went to stdout
  if (const int err = write_all(fd_, line); err != 0) return fail_write(err);
  if (end_ >= 0) end_ += static_cast<int64_t>(line.size());
  ++lines_written_;
  return Status::ok();
}

Status MetricsWriter::fail_write(int err) {
  // Cut off whatever part of the line reached the file, so it stays JSON
  // Lines; then refuse further writes.
  std::string undo;
  if (end_ >= 0 && ::ftruncate(fd_, static_cast<off_t>(end_)) != 0)
    undo = fmt::format(" (and it could not be cut back to its last whole line: {})", std::strerror(errno));
  close().ignore();
  Status s = file_error(err, "write the metrics file", path_);
  return undo.empty() ? s : Status(s.code(), s.message() + undo);
}

Status MetricsWriter::close() {
  if (fd_ < 0) return Status::ok();
  const int fd = std::exchange(fd_, -1);
  if (!owned_) return Status::ok();
  if (::close(fd) != 0) return file_error(errno, "close the metrics file", path_);
  return Status::ok();
}

}  // namespace epx
