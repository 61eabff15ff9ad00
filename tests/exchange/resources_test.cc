// Memory or threads that are not there: ResourceExhausted statuses on every
// rank, never an exception (failures injected through core/guard.h's hooks).
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "core/failure_hooks.h"
#include "core/guard.h"
#include "epx/comm/inproc.h"
#include "epx/comm/topology.h"
#include "epx/exchange/buffer.h"
#include "epx/exchange/low_latency.h"

namespace epx {
namespace {

BufferConfig small_config() {
  BufferConfig config;
  config.num_experts = 4;
  config.hidden = 16;
  config.dtype = DType::kBF16;
  config.max_topk = 2;
  config.max_tokens_per_rank = 8;
  config.timeout = Milliseconds(20000);
  return config;
}

TEST(Resources, PeerMemoryThatCannotBeAllocatedFailsBufferCreateOnEveryRank) {
  testing::DisarmFailureHooks disarm;
  detail::fail_allocations(0, 1);  // one rank's receive region
  std::vector<std::string> messages(2);
  std::vector<Status> statuses = run_ranks(*Topology::create(2, 1), [&](Transport& transport) -> Status {
    Result<std::unique_ptr<Buffer>> buffer = Buffer::create(transport, small_config());
    if (buffer.is_ok()) return internal_error("Buffer::create succeeded");
    messages[transport.rank()] = buffer.status().to_string();
    return Status::ok();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
    EXPECT_NE(messages[r].find("ResourceExhausted: map_peer_memory"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("could not allocate"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("bytes of peer memory"), std::string::npos) << messages[r];
  }
}

TEST(Resources, LowLatencyStagingThatCannotBeAllocatedFailsCreateOnEveryRank) {
  testing::DisarmFailureHooks disarm;
  // Two nodes of one rank: the two receive regions (mapped together) come
  // first; the third allocation is the first rank's send staging.
  detail::fail_allocations(2, 1);
  std::vector<Status> results(2);
  std::vector<Status> statuses = run_ranks(*Topology::create(2, 2), [&](Transport& transport) -> Status {
    LowLatencyConfig config;
    config.num_experts = 4;
    config.hidden = 16;
    config.max_tokens_per_rank = 8;
    config.max_topk = 2;
    config.timeout = Milliseconds(20000);
    Result<std::unique_ptr<LowLatencyBuffer>> buffer = LowLatencyBuffer::create(transport, config);
    results[transport.rank()] = buffer.is_ok() ? Status::ok() : buffer.status();
    return Status::ok();
  });
  int exhausted = 0, aborted = 0;
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
    const Status& s = results[r];
    if (s.code() == StatusCode::kResourceExhausted) {
      ++exhausted;
      EXPECT_NE(s.message().find("bytes for the low-latency send staging: out of memory"), std::string::npos)
          << s.to_string();
    } else {
      ++aborted;
      EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
      EXPECT_EQ(s.message(), "rank " + std::to_string(1 - r) +
                                 " rejected its staging memory, so no LowLatencyBuffer was made");
    }
  }
  EXPECT_EQ(exhausted, 1);
  EXPECT_EQ(aborted, 1);
}

TEST(Resources, AProgressThreadThatCannotStartFailsTheOperationNotTheProcess) {
  testing::DisarmFailureHooks disarm;
  std::vector<Status> statuses = run_ranks(*Topology::create(1, 1), [&](Transport& transport) -> Status {
    EPX_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> buffer, Buffer::create(transport, small_config()));
    DispatchResult out;
    detail::fail_thread_starts(0, 1);
    Status first = buffer->dispatch_async(DispatchInputs{}, &out).wait();
    EXPECT_EQ(first.code(), StatusCode::kResourceExhausted) << first.to_string();
    EXPECT_EQ(first.message(),
              "could not start the progress thread of an exchange buffer: Resource temporarily unavailable");
    // The next operation starts the thread and runs (its empty input is rejected).
    Status second = buffer->dispatch_async(DispatchInputs{}, &out).wait();
    EXPECT_EQ(second.code(), StatusCode::kInvalidArgument) << second.to_string();
    return Status::ok();
  });
  ASSERT_TRUE(statuses[0].is_ok()) << statuses[0].to_string();
}

TEST(Resources, ARankThreadThatCannotStartFailsTheRunNamingIt) {
  testing::DisarmFailureHooks disarm;
  detail::fail_thread_starts(1, 1);  // the thread of rank 1
  std::vector<Status> statuses = run_ranks(*Topology::create(3, 1), [&](Transport& transport) -> Status {
    return transport.barrier(Deadline::after(Milliseconds(20000)));
  });
  EXPECT_EQ(statuses[1].code(), StatusCode::kResourceExhausted) << statuses[1].to_string();
  EXPECT_EQ(statuses[1].message(), "could not start the thread of rank 1: Resource temporarily unavailable");
  for (int r : {0, 2}) EXPECT_EQ(statuses[r].code(), StatusCode::kAborted) << statuses[r].to_string();
}

// For real: a child process allowed no more threads (RLIMIT_NPROC = 1, as
// user nobody when root, whom the limit does not bind) runs a world of ranks.
TEST(Resources, UnderRlimitNprocTheRanksFailAsStatuses) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (getuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(20);
    const rlimit limit{1, 1};
    if (setrlimit(RLIMIT_NPROC, &limit) != 0) _exit(21);
    std::vector<Status> statuses =
        run_ranks(*Topology::create(2, 1), [](Transport& t) { return t.barrier(Deadline::after(Milliseconds(5000))); });
    if (statuses[0].code() != StatusCode::kResourceExhausted) _exit(22);
    if (statuses[0].message() != "could not start the thread of rank 0: Resource temporarily unavailable") _exit(23);
    if (statuses[1].is_ok()) _exit(24);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's check number " << WEXITSTATUS(status) << " failed";
}

}  // namespace
}  // namespace epx
