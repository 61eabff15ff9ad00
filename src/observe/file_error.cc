#include "observe/file_error.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

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

int write_all(int fd, std::string_view data) {
  std::size_t written = 0;
  while (written < data.size()) {
    const ssize_t n = ::write(fd, data.data() + written, data.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    written += static_cast<std::size_t>(n);
  }
  return 0;
}

Status write_file_atomically(const std::string& path, const std::string& data) {
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) return file_error(errno, "create a temporary file for", path);
  ::fchmod(fd, 0644);  // mkstemp makes the file 0600; these files are for reading.
  const auto fail = [&](std::string_view what) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return file_error(err, what, path);
  };
  if (const int err = write_all(fd, data); err != 0) {
    ::close(fd);
    errno = err;
    return fail("write");
  }
  if (::close(fd) != 0) return fail("write");
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail("rename a temporary file to");
  return Status::ok();
}

}  // namespace epx::observe_detail
