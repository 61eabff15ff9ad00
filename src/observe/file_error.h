// The Status for a failed file-system call: the path, what was being done and
// the errno text. ENOENT/ENOTDIR give NotFound, ENOSPC/EDQUOT/EFBIG
// ResourceExhausted, EACCES/EPERM/EROFS/EISDIR InvalidArgument (the caller
// named a place that cannot be written), anything else Internal.
#pragma once

#include <string>
#include <string_view>

#include "epx/core/status.h"

namespace epx::observe_detail {

Status file_error(int err, std::string_view what, const std::string& path);

// Writes all of `data` to `fd`: one write() call, repeated only for what a
// short write left (and EINTR). Returns 0 or the errno of the failure.
int write_all(int fd, std::string_view data);

// Writes `data` to a temporary file next to `path` (`path`.tmp.XXXXXX, mode
// 0644), then renames it over `path`, so a reader sees the old file or the
// new one, never a part; on failure the temporary file is removed and `path`
// is untouched.
Status write_file_atomically(const std::string& path, const std::string& data);

}  // namespace epx::observe_detail
