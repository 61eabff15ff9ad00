#include "epx/observe/metrics.h"

#include <cerrno>

#include <nlohmann/json.hpp>

#include "observe/file_error.h"

namespace epx {

using observe_detail::file_error;

Result<MetricsWriter> MetricsWriter::open(const std::string& path, bool append) {
  if (path.empty()) return invalid_argument("the metrics path is empty; pass a file name or \"-\" for stdout");
  if (path == "-") return MetricsWriter(stdout, /*owned=*/false, path);
  std::FILE* file = std::fopen(path.c_str(), append ? "a" : "w");
  if (file == nullptr) return file_error(errno, "open the metrics file", path);
  return MetricsWriter(file, /*owned=*/true, path);
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept
    : file_(std::exchange(other.file_, nullptr)),
      owned_(std::exchange(other.owned_, false)),
      path_(std::move(other.path_)),
      lines_written_(other.lines_written_) {}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& other) noexcept {
  if (this != &other) {
    close().ignore();
    file_ = std::exchange(other.file_, nullptr);
    owned_ = std::exchange(other.owned_, false);
    path_ = std::move(other.path_);
    lines_written_ = other.lines_written_;
  }
  return *this;
}

MetricsWriter::~MetricsWriter() { close().ignore(); }

Status MetricsWriter::write(std::string_view json_object_line) {
  if (file_ == nullptr) return failed_precondition("the metrics writer for '{}' is closed", path_);
  if (json_object_line.find('\n') != std::string_view::npos)
    return invalid_argument("a metrics line must be one line; got a newline at offset {} of '{}'",
                            json_object_line.find('\n'), json_object_line);
  const std::size_t first = json_object_line.find_first_not_of(" \t\r");
  if (first == std::string_view::npos || json_object_line[first] != '{' ||
      !nlohmann::json::accept(json_object_line))
    return invalid_argument("a metrics line must be one JSON object; got '{}'", json_object_line);
  if (std::fwrite(json_object_line.data(), 1, json_object_line.size(), file_) != json_object_line.size() ||
      std::fputc('\n', file_) == EOF || std::fflush(file_) != 0)
    return file_error(errno, "write the metrics file", path_);
  ++lines_written_;
  return Status::ok();
}

Status MetricsWriter::close() {
  if (file_ == nullptr) return Status::ok();
  std::FILE* file = std::exchange(file_, nullptr);
  if (!owned_) {
    if (std::fflush(file) != 0) return file_error(errno, "flush", path_);
    return Status::ok();
  }
  if (std::fclose(file) != 0) return file_error(errno, "close the metrics file", path_);
  return Status::ok();
}

}  // namespace epx
