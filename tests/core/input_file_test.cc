// read_input_file / InputFile: only regular files are read, none blocks, and
// the size limit and the memory at hand are checked before a byte is read.
#include "epx/core/input_file.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "observe/temp_dir.h"

namespace epx {
namespace {

using epx::testing::TempDir;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

TEST(InputFile, ReadsARegularFileWhole) {
  TempDir dir;
  write_text(dir.file("a.toml"), "x = 1\n");
  Result<std::string> text = read_input_file(dir.file("a.toml"), "the --config file", kMaxTomlBytes);
  ASSERT_TRUE(text.is_ok()) << text.status().to_string();
  EXPECT_EQ(*text, "x = 1\n");
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(read_input_file(dir.file("a.toml"), "text file", 6, &bytes).is_ok());
  EXPECT_EQ(std::string(bytes.begin(), bytes.end()), "x = 1\n");
  Result<std::string> empty_limit = read_input_file(dir.file("a.toml"), "x", -1);  // no limit
  ASSERT_TRUE(empty_limit.is_ok());
  EXPECT_EQ(empty_limit->size(), 6u);
}

TEST(InputFile, AMissingFileIsNotFoundNamingIt) {
  TempDir dir;
  Result<std::string> r = read_input_file(dir.file("none.toml"), "the --config file", kMaxTomlBytes);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(),
            "cannot open the --config file '" + dir.file("none.toml") + "': No such file or directory");
}

TEST(InputFile, ADirectoryIsRefused) {
  TempDir dir;
  Result<std::string> r = read_input_file(dir.path().string(), "the --loads file", kMaxTableBytes);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "the --loads file '" + dir.path().string() +
                                      "' is a directory, not a regular file; epx reads only regular files here");
}

TEST(InputFile, ADeviceIsRefusedBeforeAByteIsRead) {
  Result<std::string> r = read_input_file("/dev/zero", "text file", kMaxTextBytes);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "text file '/dev/zero' is a character device, not a regular file; epx reads only regular files here");
}

// Without O_NONBLOCK, opening a FIFO that has no writer would wait forever.
TEST(InputFile, AFifoWithoutAWriterIsRefusedWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.file("pipe");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  Result<InputFile> r = InputFile::open(fifo, "routing.trace", kMaxTraceBytes);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "routing.trace '" + fifo +
                                      "' is a FIFO (named pipe), not a regular file; epx reads only regular files here");
}

TEST(InputFile, ASocketIsNamedAsOne) {
  TempDir dir;
  const std::string path = dir.file("s");
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  Result<std::string> r = read_input_file(path, "the alert rule file", kMaxTomlBytes);
  ::close(fd);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("' is a socket, not a regular file"), std::string::npos) << r.status().message();
}

// A sparse file: its size is checked from fstat, nothing is read.
TEST(InputFile, AFileAboveTheLimitIsRefusedNamingSizeAndLimit) {
  TempDir dir;
  const std::string path = dir.file("big.toml");
  write_text(path, "");
  ASSERT_EQ(::truncate(path.c_str(), (int64_t{20} << 20) + 1), 0);
  Result<std::string> r = read_input_file(path, "the scenario file", kMaxTomlBytes);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "the scenario file '" + path +
                                      "' is 20 MiB (20971521 bytes), above the limit of 16 MiB (16777216 bytes) for such a file");
  // Exactly at the limit is read.
  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  Result<std::string> at = read_input_file(path, "the scenario file", 4096);
  ASSERT_TRUE(at.is_ok()) << at.status().to_string();
  EXPECT_EQ(at->size(), 4096u);
  EXPECT_FALSE(read_input_file(path, "the scenario file", 4095).is_ok());
}

TEST(InputFile, AnOpenFileKeepsItsIdentityAndSize) {
  TempDir dir;
  write_text(dir.file("m.jsonl"), "{}\n");
  Result<InputFile> f = InputFile::open(dir.file("m.jsonl"), "the metrics file", -1);
  ASSERT_TRUE(f.is_ok());
  struct stat st {};
  ASSERT_EQ(::stat(dir.file("m.jsonl").c_str(), &st), 0);
  EXPECT_EQ(f->size(), 3);
  EXPECT_EQ(f->inode(), st.st_ino);
  EXPECT_EQ(f->device(), st.st_dev);
  InputFile moved = std::move(*f);
  EXPECT_GE(moved.fd(), 0);
  EXPECT_EQ(f->fd(), -1);
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // their runtimes reserve terabytes of address space
#else
constexpr bool kSanitized = false;
#endif

// Under a 512 MiB address-space limit a 1 GiB file (sparse) within its size
// limit is refused as too large for the memory, not read into a bad_alloc.
TEST(InputFile, AFileLargerThanTheMemoryAtHandIsRefused) {
  if (kSanitized) GTEST_SKIP() << "RLIMIT_AS and a sanitizer runtime do not mix";
  TempDir dir;
  const std::string path = dir.file("big.txt");
  write_text(path, "");
  ASSERT_EQ(::truncate(path.c_str(), int64_t{1} << 30), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    const rlimit limit{512 << 20, 512 << 20};
    if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(10);
    std::vector<uint8_t> bytes;
    const Status s = read_input_file(path, "text file", kMaxTextBytes, &bytes);
    if (s.code() != StatusCode::kResourceExhausted) _exit(11);
    // The least of the limits is named; RLIMIT_AS's 512 MiB or a smaller one.
    const std::string want = "text file '" + path + "' is 1.0 GiB (1073741824 bytes); reading it needs that much "
                             "memory but ";
    if (s.message().rfind(want, 0) != 0) _exit(12);
    _exit(s.message().find(" is available (") != std::string::npos ? 0 : 13);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's check number " << WEXITSTATUS(status) << " failed";
}

}  // namespace
}  // namespace epx
