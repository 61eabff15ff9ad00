// detail::OperationQueue, the seam every backend's public forms go through:
// a blocking form runs after the queued asynchronous ones, on the caller's
// thread; asynchronous ones run in the order issued; an exception becomes a
// Status naming the operation; the destructor lets queued operations finish.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <new>
#include <stdexcept>
#include <thread>
#include <vector>

#include "exchange/operation_queue.h"

namespace epx::detail {
namespace {

constexpr Milliseconds kTimeout{5000};

TEST(OperationQueue, BlockingFormRunsAfterTheQueuedOnesOnTheCallersThread) {
  OperationQueue queue(kTimeout);
  std::vector<int> order;  // written by one operation at a time
  const PendingOp slow = queue.submit([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    order.push_back(1);
    return Status::ok();
  });
  const PendingOp fast = queue.submit([&] {
    order.push_back(2);
    return Status::ok();
  });
  std::thread::id ran_on;
  const Status status = queue.run("blocking", [&] {
    ran_on = std::this_thread::get_id();
    order.push_back(3);
    return Status::ok();
  });
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  EXPECT_TRUE(slow.done());
  EXPECT_TRUE(fast.done());
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

TEST(OperationQueue, ResultsAndErrorsReachTheCaller) {
  OperationQueue queue(kTimeout);
  const Result<int> value = queue.run("value", []() -> Result<int> { return 7; });
  ASSERT_TRUE(value.is_ok());
  EXPECT_EQ(*value, 7);
  const PendingOp failed = queue.submit([] { return invalid_argument("bad input 3"); });
  const Status status = failed.wait();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("bad input 3"), std::string::npos) << status.message();
}

TEST(OperationQueue, AnExceptionBecomesAStatusNamingTheOperation) {
  OperationQueue queue(kTimeout);
  const Status oom = queue.run("combine_expanded", []() -> Status { throw std::bad_alloc(); });
  EXPECT_EQ(oom.code(), StatusCode::kResourceExhausted) << oom.to_string();
  EXPECT_NE(oom.message().find("combine_expanded"), std::string::npos) << oom.message();
  const Status other = queue.run("dispatch", []() -> Status { throw std::runtime_error("boom"); });
  EXPECT_EQ(other.code(), StatusCode::kInternal) << other.to_string();
  EXPECT_NE(other.message().find("dispatch"), std::string::npos) << other.message();
}

TEST(OperationQueue, DestructionLetsTheQueuedOperationsFinish) {
  auto finished = std::make_shared<std::atomic<int>>(0);
  PendingOp last;
  {
    OperationQueue queue(kTimeout);
    for (int i = 0; i < 3; ++i)
      last = queue.submit([finished] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        finished->fetch_add(1);
        return Status::ok();
      });
  }
  EXPECT_EQ(finished->load(), 3);
  EXPECT_TRUE(last.done());
  EXPECT_TRUE(last.wait().is_ok());
}

}  // namespace
}  // namespace epx::detail
