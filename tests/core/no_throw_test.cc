// No exception crosses the API: allocations and thread starts that fail
// become ResourceExhausted statuses, by injection (core/guard.h's hooks) and
// for real in a child process under RLIMIT_AS / RLIMIT_NPROC.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/failure_hooks.h"
#include "core/guard.h"
#include "epx/core/buffer.h"

namespace epx {
namespace {

TEST(NoThrow, AnAllocationThatFailsNamesTheBytesAndWhatFor) {
  testing::DisarmFailureHooks disarm;
  detail::fail_allocations(1, 1);
  Result<AlignedBuffer> first = AlignedBuffer::allocate(4096, "the first");
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  Result<AlignedBuffer> second = AlignedBuffer::allocate(123456, "the receive region of rank 3");
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(second.status().message(), "could not allocate 123456 bytes for the receive region of rank 3: out of memory");
  EXPECT_TRUE(AlignedBuffer::allocate(64, "the third").is_ok());  // only one was to fail
}

TEST(NoThrow, ASizeNoMachineHasIsResourceExhausted) {
  const std::size_t huge = std::numeric_limits<std::size_t>::max() - 10;
  Result<AlignedBuffer> r = AlignedBuffer::allocate(huge, "a test");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(r.status().message(), "could not allocate " + std::to_string(huge) + " bytes for a test: out of memory");
}

TEST(NoThrow, AReserveThatFailsLeavesTheBufferAsItWas) {
  testing::DisarmFailureHooks disarm;
  AlignedBuffer buf(100);
  std::byte* before = buf.data();
  detail::fail_allocations(0, 1);
  Status s = buf.reserve(1000, "the fp8 rows to send");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "could not allocate 1000 bytes for the fp8 rows to send: out of memory");
  EXPECT_EQ(buf.data(), before);
  EXPECT_EQ(buf.size(), 100u);
  // The throwing constructor (tests, benchmarks) still throws, as operator new does.
  detail::fail_allocations(0, 1);
  EXPECT_THROW(AlignedBuffer(64), std::bad_alloc);
}

TEST(NoThrow, GuardTurnsWhatEscapesIntoAStatus) {
  auto code_and_message = [](auto&& fn) {
    Status s = detail::guard("dispatch", fn);
    return std::string(status_code_name(s.code())) + ": " + s.message();
  };
  EXPECT_EQ(code_and_message([]() -> Status { throw std::bad_alloc(); }),
            "ResourceExhausted: dispatch: out of memory (an allocation failed)");
  EXPECT_EQ(code_and_message([]() -> Status {
              throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
            }),
            "ResourceExhausted: dispatch: Resource temporarily unavailable");
  EXPECT_EQ(code_and_message([]() -> Status {
              std::vector<int> v;
              v.reserve(v.max_size() + 1);  // std::length_error
              return Status::ok();
            }).rfind("ResourceExhausted: dispatch: a size is above what can be allocated", 0),
            0u);
  EXPECT_EQ(code_and_message([]() -> Status { throw std::runtime_error("boom"); }),
            "Internal: dispatch threw an exception: boom");
  EXPECT_EQ(code_and_message([]() -> Status { throw 7; }),
            "Internal: dispatch threw an exception that is not a std::exception");
  EXPECT_EQ(code_and_message([]() -> Status { return invalid_argument("x"); }), "InvalidArgument: x");
  Result<int> r = detail::guard("get", []() -> Result<int> { throw std::bad_alloc(); });
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
}

TEST(NoThrow, AThreadThatCannotStartIsResourceExhausted) {
  testing::DisarmFailureHooks disarm;
  detail::fail_thread_starts(0, 1);
  std::atomic<bool> ran{false};
  Result<std::thread> t = detail::start_thread("a router worker thread", [&] { ran = true; });
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(t.status().message(), "could not start a router worker thread: Resource temporarily unavailable");
  Result<std::thread> again = detail::start_thread("a router worker thread", [&] { ran = true; });
  ASSERT_TRUE(again.is_ok());
  again->join();
  EXPECT_TRUE(ran);
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // their runtimes reserve terabytes of address space
#else
constexpr bool kSanitized = false;
#endif

// Runs `child` in a forked process and returns its exit code (the child
// reports through it: 0 = as expected, other = which check failed).
template <typename F>
int in_child(F&& child) {
  const pid_t pid = fork();
  if (pid == 0) _exit(child());
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(NoThrow, UnderRlimitAsAllocationsFailAsStatuses) {
  if (kSanitized) GTEST_SKIP() << "RLIMIT_AS and a sanitizer runtime do not mix";
  const int code = in_child([] {
    const rlimit limit{512 << 20, 512 << 20};
    if (setrlimit(RLIMIT_AS, &limit) != 0) return 10;
    Result<AlignedBuffer> r = AlignedBuffer::allocate(std::size_t{1} << 31, "the receive region");
    if (r.is_ok()) return 11;
    if (r.status().code() != StatusCode::kResourceExhausted) return 12;
    if (r.status().message() != "could not allocate 2147483648 bytes for the receive region: out of memory") return 13;
    Status s = detail::guard("train", []() -> Status {
      std::vector<char> v(std::size_t{1} << 31);  // std::bad_alloc
      static_cast<volatile char*>(v.data())[0] = 1;
      return Status::ok();
    });
    if (s.code() != StatusCode::kResourceExhausted || s.message() != "train: out of memory (an allocation failed)")
      return 14;
    return 0;
  });
  EXPECT_EQ(code, 0) << "the child's check number " << code << " failed";
}

TEST(NoThrow, UnderRlimitNprocThreadStartsFailAsStatuses) {
  const int code = in_child([] {
    // Root is not bound by RLIMIT_NPROC: become nobody first (the limit
    // counts that user's processes; this one is already one).
    if (getuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) return 20;
    const rlimit limit{1, 1};
    if (setrlimit(RLIMIT_NPROC, &limit) != 0) return 21;
    Result<std::thread> t = detail::start_thread("the progress thread of an exchange buffer", [] {});
    if (t.is_ok()) {
      t->join();
      return 22;
    }
    if (t.status().code() != StatusCode::kResourceExhausted) return 23;
    if (t.status().message() !=
        "could not start the progress thread of an exchange buffer: Resource temporarily unavailable")
      return 24;
    return 0;
  });
  EXPECT_EQ(code, 0) << "the child's check number " << code << " failed";
}

}  // namespace
}  // namespace epx
