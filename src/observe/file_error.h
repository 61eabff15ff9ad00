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

}  // namespace epx::observe_detail
