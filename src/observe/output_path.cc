#include "epx/observe/output_path.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace epx {
namespace {

Status path_error(int err, std::string_view what, const std::string& path, std::string_view doing,
                  const std::string& where) {
  StatusCode code = StatusCode::kInternal;
  switch (err) {
    case ENOENT:
    case ENOTDIR: code = StatusCode::kNotFound; break;
    case ENOSPC:
    case EDQUOT: code = StatusCode::kResourceExhausted; break;
    case EACCES:
    case EPERM:
    case EROFS:
    case EISDIR: code = StatusCode::kInvalidArgument; break;
    default: break;
  }
  return make_status(code, "{} {}: cannot {} '{}': {}", what, path, doing, where, std::strerror(err));
}

std::string folder_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Creates and removes a probe file in `folder`.
Status probe_folder(const std::string& folder, std::string_view what, const std::string& path) {
  std::string probe = (folder == "/" ? "" : folder) + "/.epx-probe-XXXXXX";
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) return path_error(errno, what, path, "create a file in", folder);
  // One byte proves there is room for at least a little.
  const bool wrote = ::write(fd, "x", 1) == 1;
  const int err = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  if (!wrote) return path_error(err, what, path, "write a file in", folder);
  return Status::ok();
}

}  // namespace

Status check_output_writable(const std::string& path, std::string_view what, bool renamed_into_place) {
  if (path == "-") return Status::ok();
  if (path.empty()) return invalid_argument("{}: the path is empty", what);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return path_error(EISDIR, what, path, "write", path);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return path_error(errno, what, path, "open for writing", path);
    ::close(fd);
    // A file replaced by a rename needs its folder to take a new file too.
    if (renamed_into_place && S_ISREG(st.st_mode)) return probe_folder(folder_of(path), what, path);
    return Status::ok();
  }
  if (errno != ENOENT) return path_error(errno, what, path, "reach", path);
  return probe_folder(folder_of(path), what, path);
}

}  // namespace epx
