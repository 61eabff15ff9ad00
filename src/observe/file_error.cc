#include "observe/file_error.h"

#include <cerrno>
#include <cstring>

namespace epx::observe_detail {

Status file_error(int err, std::string_view what, const std::string& path) {
  StatusCode code = StatusCode::kInternal;
  switch (err) {
    case ENOENT:
    case ENOTDIR: code = StatusCode::kNotFound; break;
    case ENOSPC:
    case EDQUOT:
    case EFBIG: code = StatusCode::kResourceExhausted; break;
    case EACCES:
    case EPERM:
    case EROFS:
    case EISDIR: code = StatusCode::kInvalidArgument; break;
    default: break;
  }
  return make_status(code, "cannot {} '{}': {}", what, path, std::strerror(err));
}

}  // namespace epx::observe_detail
