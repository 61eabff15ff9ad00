// Opening a file the user named: the one way epx reads a config, a scenario,
// a loads file, a trace, training text, metrics, alert rules or a checkpoint.
//
//   EPX_ASSIGN_OR_RETURN(std::string text, epx::read_input_file(path, "the --config file", epx::kMaxTomlBytes));
//
// Only a regular file is read. A FIFO, a device (/dev/zero), a directory or a
// socket is refused before a byte is read, and nothing blocks on it: the file
// is opened with O_NONBLOCK and checked with fstat, so a FIFO without a writer
// cannot hold the caller. A file above `max_bytes` is refused before it is
// read, naming its size and the limit; so is one larger than the memory this
// process can have (available_memory()). A file that grows while it is read
// is read up to the size it had when opened.
//
// Messages name `what` (a noun phrase: "the --loads file", "text file") and
// the path: NotFound when the file or its folder does not exist,
// InvalidArgument for a file that is not regular, too large, or cannot be
// opened or read (no permission), ResourceExhausted when the memory for its
// bytes cannot be had.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "epx/core/status.h"

namespace epx {

// Limits by kind of file; each message names the one it applied.
inline constexpr int64_t kMaxTomlBytes = int64_t{16} << 20;   // configs, scenarios, profiles, alert rules
inline constexpr int64_t kMaxTableBytes = int64_t{64} << 20;   // eplb loads and placements
inline constexpr int64_t kMaxTraceBytes = int64_t{4} << 30;    // sim routing traces (held in memory as lines)
inline constexpr int64_t kMaxTextBytes = int64_t{16} << 30;    // --data text: (held in memory whole)

// An open regular file: its descriptor (closed by the destructor) and its
// size when it was opened.
class InputFile {
 public:
  // Opens `path` and checks that it is a regular file of at most `max_bytes`
  // (no limit when max_bytes < 0: for readers that stream, e.g. metrics).
  [[nodiscard]] static Result<InputFile> open(const std::string& path, std::string_view what, int64_t max_bytes);

  InputFile(InputFile&& other) noexcept;
  InputFile& operator=(InputFile&& other) noexcept;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile();

  [[nodiscard]] int fd() const { return fd_; }
  [[nodiscard]] int64_t size() const { return size_; }
  [[nodiscard]] uint64_t device() const { return device_; }
  [[nodiscard]] uint64_t inode() const { return inode_; }

  // All of its `size()` bytes into `out` (resized). Fails if the file shrank.
  [[nodiscard]] Status read_all(std::string_view what, const std::string& path, std::string* out) const;
  [[nodiscard]] Status read_all(std::string_view what, const std::string& path, std::vector<uint8_t>* out) const;

 private:
  InputFile(int fd, int64_t size, uint64_t device, uint64_t inode)
      : fd_(fd), size_(size), device_(device), inode_(inode) {}
  int fd_ = -1;
  int64_t size_ = 0;
  uint64_t device_ = 0;
  uint64_t inode_ = 0;
};

// The whole of a regular file of at most `max_bytes`, as text or bytes.
[[nodiscard]] Result<std::string> read_input_file(const std::string& path, std::string_view what, int64_t max_bytes);
[[nodiscard]] Status read_input_file(const std::string& path, std::string_view what, int64_t max_bytes,
                                     std::vector<uint8_t>* out);

// "a directory", "a FIFO (named pipe)", "a character device", ... for a
// st_mode; "a regular file" for one.
[[nodiscard]] std::string_view file_type_name(unsigned mode);

}  // namespace epx
