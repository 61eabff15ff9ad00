// `epx report` / `epx monitor`: the metrics (run log) reader, read_metrics and
// MetricsFollower, over the input as a file (an in-memory file, so nothing is
// written to disk). Any input is read or refused with InvalidArgument naming
// the file and a line; where read_metrics accepts the file, a follower that
// reads it in pieces (ending inside lines) delivers the same records.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "epx/observe/run_log.h"
#include "fuzz_check.h"

namespace {

// An in-memory regular file holding `text`; -1 if it cannot be made.
int memory_file(std::string_view text) {
  const int fd = ::memfd_create("epx_fuzz_metrics", MFD_CLOEXEC);
  if (fd < 0) return -1;
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) {
      ::close(fd);
      return -1;
    }
    done += static_cast<std::size_t>(n);
  }
  return fd;
}

// The steps a follower delivers, polling `piece` bytes at a time until the
// file is read; false at the first error.
bool follow(const std::string& path, std::size_t size, std::size_t piece, std::vector<int64_t>* steps) {
  epx::Result<epx::MetricsFollower> follower = epx::MetricsFollower::open(path);
  EPX_FUZZ_CHECK(follower.is_ok(), follower.status());
  for (std::size_t polls = 0; polls <= size / piece + 1; ++polls) {
    epx::Result<std::vector<epx::StepRecord>> got = follower->poll(piece);
    if (!got.is_ok()) {
      epx::fuzz::check_refusal(got.status(), path);
      return false;
    }
    for (const epx::StepRecord& r : *got) steps->push_back(r.step);
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = epx::fuzz::as_text(data, size);
  const int fd = memory_file(text);
  if (fd < 0) return 0;
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  std::vector<int64_t> steps;
  const epx::Status read = epx::read_metrics(path, [&](epx::StepRecord&& r) {
    steps.push_back(r.step);
    return epx::Status::ok();
  });
  if (!read.is_ok()) {
    EPX_FUZZ_CHECK(read.code() == epx::StatusCode::kInvalidArgument, read);
    epx::fuzz::check_refusal(read, path + ":");
  } else {
    std::vector<int64_t> whole, pieces;
    EPX_FUZZ_CHECK(follow(path, size, size + 1, &whole));
    EPX_FUZZ_CHECK(whole == steps);
    // About eight polls, each ending inside a line most of the time.
    const std::size_t piece = 1 + size / 8 + (size > 0 ? data[0] % 64 : 0);
    EPX_FUZZ_CHECK(follow(path, size, piece, &pieces));
    EPX_FUZZ_CHECK(pieces == steps);
  }
  ::close(fd);
  return 0;
}
