// The bound on one metrics line, shared by the readers of a metrics file
// (run_log_files.cc, run_log_resumes.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "epx/core/status.h"

namespace epx::detail {

// A metrics line is a few KiB (a few MiB with wait matrices of many ranks);
// bytes running longer than this without a newline are not a metrics file,
// and are refused rather than held in memory.
inline constexpr std::size_t kMaxLineBytes = std::size_t{64} << 20;

inline Status line_too_long(const std::string& path, int64_t line) {
  return invalid_argument("{}:{}: the line runs over {} bytes without a newline; a metrics line is far shorter (is "
                          "this a metrics file?)",
                          path, line, kMaxLineBytes);
}

}  // namespace epx::detail
