#include "epx/core/status.h"

#include <cstdio>

namespace epx {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kDeadlineExceeded: return "DeadlineExceeded";
    case StatusCode::kAborted: return "Aborted";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kNotFound: return "NotFound";
  }
  return "Unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "OK";
  return fmt::format("{}: {}", status_code_name(code_), message_);
}

namespace detail {

void die_on_bad_result(const Status& status) {
  std::fprintf(stderr, "epx: value() on a failed Result: %s\n", status.to_string().c_str());
  std::abort();
}

void check_failed(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "epx: %s:%d: %s failed\n", file, line, what.c_str());
  std::abort();
}

}  // namespace detail
}  // namespace epx
