// Training with a rank that stalls or fails mid-run (TrainConfig::before_step,
// the fault-injection hook): the run fails, the message says which rank never
// arrived and where the others waited (step, layer, operation), and the
// stalled rank stops when it resumes instead of training on.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "epx/core/clock.h"
#include "epx/train/trainer.h"
#include "train/tiny_config.h"

namespace epx {
namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TrainConfig tiny_with_timeout(std::chrono::milliseconds timeout) {
  TrainConfig c = testing::tiny_config({});
  c.model.timeout = timeout;
  return c;
}

TEST(TrainStall, AStalledRankIsNamedWithStepLayerAndOperation) {
  TrainConfig c = tiny_with_timeout(std::chrono::milliseconds(500));
  const auto stall = std::chrono::milliseconds(1500);
  c.before_step = [&](int rank, int64_t step) -> Status {
    if (rank == 2 && step == 2) std::this_thread::sleep_for(stall);
    return Status::ok();
  };
  int64_t reported = 0;
  Stopwatch watch;
  auto summary = train(c, [&](const StepReport&) { ++reported; });
  const double seconds = watch.seconds();
  ASSERT_FALSE(summary.is_ok());
  const Status& s = summary.status();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "step 2, forward/backward: layer 0, dispatch:")) << s.message();
  EXPECT_TRUE(contains(s.message(), "rank 2 did not arrive (ranks 0, 1, 3 waited)")) << s.message();
  EXPECT_EQ(reported, 2) << "steps 0 and 1 finished; no rank trained on after the stall";
  // The run ends when the stalled rank resumes and fails at once (no second timeout, no hang).
  EXPECT_LT(seconds, 1.5 + 2.0) << s.to_string();
}

TEST(TrainStall, AFailedRankIsNamedByTheOthers) {
  TrainConfig c = tiny_with_timeout(std::chrono::milliseconds(30000));
  c.before_step = [](int rank, int64_t step) -> Status {
    if (rank == 1 && step == 1) return internal_error("injected failure of rank 1");
    return Status::ok();
  };
  Stopwatch watch;
  auto summary = train(c, {});
  ASSERT_FALSE(summary.is_ok());
  const Status& s = summary.status();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "step 1, forward/backward: layer 0, dispatch:")) << s.message();
  EXPECT_TRUE(contains(s.message(), "rank 1 failed: Internal: step 1, before the step: injected failure of rank 1")) << s.message();
  EXPECT_LT(watch.seconds(), 10.0) << "the others waited for their 30 s timeout instead of hearing of the failure";
}

}  // namespace
}  // namespace epx
