// on_step may stop a run: a failed Status stops every rank after that step.
#include <gtest/gtest.h>

#include "epx/train/trainer.h"
#include "train/tiny_config.h"

namespace epx {
namespace {

TrainConfig tiny(int num_ranks) {
  return testing::tiny_config({.num_ranks = num_ranks, .steps = 20, .batch_tokens = 48, .input_dim = 8,
                               .output_dim = 4, .clusters = 4, .layers = 1, .hidden = 16, .ffn_hidden = 16,
                               .experts = 4, .warmup = 2});
}

TEST(OnStep, AFailedStatusStopsEveryRankAfterThatStep) {
  for (int ranks : {1, 2, 4}) {
    int calls = 0;
    auto summary = train(tiny(ranks), [&](const StepReport& r) -> Status {
      ++calls;
      if (r.step == 2) return resource_exhausted("cannot write the metrics file 'm.jsonl': No space left on device");
      return Status::ok();
    });
    ASSERT_FALSE(summary.is_ok()) << ranks << " ranks";
    EXPECT_EQ(calls, 3) << ranks << " ranks";  // steps 1, 2 and 3; no step after the failed one
    EXPECT_EQ(summary.status().code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(summary.status().message(),
              "rank 0: after step 3: cannot write the metrics file 'm.jsonl': No space left on device");
  }
}

TEST(OnStep, VoidCallbacksStillWork) {
  int calls = 0;
  auto summary = train(tiny(2), [&](const StepReport&) { ++calls; });
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  EXPECT_EQ(calls, 20);
}

}  // namespace
}  // namespace epx
