#include "epx/core/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "epx/core/memory.h"

namespace epx {
namespace {

Status open_error(int err, std::string_view what, const std::string& path) {
  const StatusCode code = (err == ENOENT || err == ENOTDIR) ? StatusCode::kNotFound : StatusCode::kInvalidArgument;
  return make_status(code, "cannot open {} '{}': {}", what, path, std::strerror(err));
}

Status not_regular(unsigned mode, std::string_view what, const std::string& path) {
  return invalid_argument("{} '{}' is {}, not a regular file; epx reads only regular files here", what, path,
                          file_type_name(mode));
}

// What open() refused: a socket (ENXIO) is named as one, the rest by errno.
Status explain_open_failure(int err, std::string_view what, const std::string& path) {
  struct stat st {};
  if (err != ENOENT && ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return not_regular(st.st_mode, what, path);
  return open_error(err, what, path);
}

Status check_size(int64_t size, std::string_view what, const std::string& path, int64_t max_bytes) {
  if (max_bytes >= 0 && size > max_bytes)
    return invalid_argument("{} '{}' is {} ({} bytes), above the limit of {} ({} bytes) for such a file", what, path,
                            format_bytes(size), size, format_bytes(max_bytes), max_bytes);
  return Status::ok();
}

// The room for a copy of `size` bytes, before it is allocated.
Status check_memory(int64_t size, std::string_view what, const std::string& path) {
  const MemoryAvailable available = available_memory();
  if (size <= available.bytes) return Status::ok();
  return resource_exhausted("{} '{}' is {} ({} bytes); reading it needs that much memory but {} is available ({})",
                            what, path, format_bytes(size), size, format_bytes(available.bytes), available.source);
}

template <typename Bytes>
Status read_into(const InputFile& file, std::string_view what, const std::string& path, Bytes* out) {
  EPX_RETURN_IF_ERROR(check_memory(file.size(), what, path));
  try {
    out->resize(static_cast<std::size_t>(file.size()));
  } catch (const std::bad_alloc&) {
    return resource_exhausted("out of memory while reading {} '{}' ({} bytes)", what, path, file.size());
  }
  std::size_t done = 0;
  while (done < out->size()) {
    const ssize_t n = ::pread(file.fd(), reinterpret_cast<char*>(out->data()) + done, out->size() - done,
                              static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return invalid_argument("cannot read {} '{}': {}", what, path, std::strerror(errno));
    if (n == 0) return invalid_argument("{} '{}' shrank while it was read ({} of {} bytes)", what, path, done, out->size());
    done += static_cast<std::size_t>(n);
  }
  return Status::ok();
}

}  // namespace

std::string_view file_type_name(unsigned mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a file";
}

Result<InputFile> InputFile::open(const std::string& path, std::string_view what, int64_t max_bytes) {
  if (path.empty()) return invalid_argument("{}: the path is empty", what);
  // O_NONBLOCK: opening a FIFO without a writer returns at once instead of
  // waiting for one; fstat then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return explain_open_failure(errno, what, path);
  InputFile file(fd, 0, 0, 0);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return invalid_argument("cannot stat {} '{}': {}", what, path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode, what, path);
  EPX_RETURN_IF_ERROR(check_size(st.st_size, what, path, max_bytes));
  // A regular file never blocks; the flag is cleared so reads behave as usual.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  file.size_ = st.st_size;
  file.device_ = st.st_dev;
  file.inode_ = st.st_ino;
  return file;
}

InputFile::InputFile(InputFile&& other) noexcept
    : fd_(other.fd_), size_(other.size_), device_(other.device_), inode_(other.inode_) {
  other.fd_ = -1;
}

InputFile& InputFile::operator=(InputFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    size_ = other.size_;
    device_ = other.device_;
    inode_ = other.inode_;
    other.fd_ = -1;
  }
  return *this;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

Status InputFile::read_all(std::string_view what, const std::string& path, std::string* out) const {
  return read_into(*this, what, path, out);
}

Status InputFile::read_all(std::string_view what, const std::string& path, std::vector<uint8_t>* out) const {
  return read_into(*this, what, path, out);
}

Result<std::string> read_input_file(const std::string& path, std::string_view what, int64_t max_bytes) {
  EPX_ASSIGN_OR_RETURN(InputFile file, InputFile::open(path, what, max_bytes));
  std::string text;
  EPX_RETURN_IF_ERROR(file.read_all(what, path, &text));
  return text;
}

Status read_input_file(const std::string& path, std::string_view what, int64_t max_bytes, std::vector<uint8_t>* out) {
  EPX_ASSIGN_OR_RETURN(InputFile file, InputFile::open(path, what, max_bytes));
  return file.read_all(what, path, out);
}

}  // namespace epx
