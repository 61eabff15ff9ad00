// Monotonic time: now, stopwatches and deadlines.
//
// Every blocking epx call takes a Deadline, so nothing waits forever:
//
//   auto deadline = epx::Deadline::after(std::chrono::seconds(30));
//   EPX_RETURN_IF_ERROR(transport.barrier(deadline));
#pragma once

#include <time.h>

#include <chrono>
#include <cstdint>

namespace epx {

using Clock = std::chrono::steady_clock;
using Milliseconds = std::chrono::milliseconds;

// Nanoseconds on the monotonic clock (arbitrary origin).
[[nodiscard]] inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// CPU time of the calling thread, in seconds (CLOCK_THREAD_CPUTIME_ID).
[[nodiscard]] inline double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

class Stopwatch {
 public:
  Stopwatch() : start_(Clock::now()) {}
  void reset() { start_ = Clock::now(); }
  [[nodiscard]] double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  Clock::time_point start_;
};

class Deadline {
 public:
  static Deadline after(Clock::duration timeout) { return Deadline(Clock::now() + timeout); }
  static Deadline at(Clock::time_point when) { return Deadline(when); }
  [[nodiscard]] Clock::time_point when() const { return when_; }
  [[nodiscard]] bool expired() const { return Clock::now() >= when_; }
  [[nodiscard]] Clock::duration remaining() const {
    const auto left = when_ - Clock::now();
    return left.count() > 0 ? left : Clock::duration::zero();
  }

 private:
  explicit Deadline(Clock::time_point when) : when_(when) {}
  Clock::time_point when_;
};

}  // namespace epx
