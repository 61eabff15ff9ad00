// on_step may stop a run: a failed Status stops every rank after that step.
#include <gtest/gtest.h>

#include "epx/train/trainer.h"

namespace epx {
namespace {

TrainConfig tiny(int num_ranks) {
  TrainConfig c;
  c.num_ranks = num_ranks;
  c.steps = 20;
  c.batch_tokens = 48;
  c.model.input_dim = c.synthetic.input_dim = 8;
  c.model.output_dim = c.synthetic.output_dim = 4;
  c.synthetic.num_clusters = 4;
  c.model.num_layers = 1;
  c.model.layer.hidden = 16;
  c.model.layer.ffn_hidden = 16;
  c.model.layer.router = {.num_experts = 4, .topk = 2, .normalize_weights = true};
  c.schedule = {.peak = 3e-3, .warmup_steps = 2, .total_steps = c.steps};
  return c;
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
