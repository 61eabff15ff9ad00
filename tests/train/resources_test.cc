// train() when memory or threads are short: a ResourceExhausted status, never
// an exception (failures injected through core/guard.h's hooks).
#include <gtest/gtest.h>

#include <string>

#include "core/guard.h"
#include "epx/train/trainer.h"

namespace epx {
namespace {

TrainConfig small(int num_ranks) {
  TrainConfig c;
  c.num_ranks = num_ranks;
  c.steps = 2;
  c.batch_tokens = 32;
  c.model.input_dim = c.synthetic.input_dim = 8;
  c.model.output_dim = c.synthetic.output_dim = 4;
  c.synthetic.num_clusters = 4;
  c.model.num_layers = 1;
  c.model.layer.hidden = 16;
  c.model.layer.ffn_hidden = 16;
  c.model.layer.router = {.num_experts = 4, .topk = 2, .normalize_weights = true};
  c.schedule = {.peak = 3e-3, .warmup_steps = 1, .total_steps = 2};
  return c;
}

TEST(TrainResources, MemoryThatIsNotThereIsResourceExhausted) {
  detail::fail_allocations(0, 1);
  Result<TrainSummary> r = train(small(1));
  detail::fail_allocations(0, 0);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().to_string();
  EXPECT_NE(r.status().message().find("could not allocate"), std::string::npos) << r.status().to_string();
  EXPECT_TRUE(train(small(1)).is_ok());
}

TEST(TrainResources, ARankThreadThatCannotStartIsResourceExhausted) {
  detail::fail_thread_starts(1, 1);  // the thread of rank 1
  Result<TrainSummary> r = train(small(2));
  detail::fail_thread_starts(0, 0);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("could not start the thread of rank 1: Resource temporarily unavailable"),
            std::string::npos)
      << r.status().to_string();
}

}  // namespace
}  // namespace epx
