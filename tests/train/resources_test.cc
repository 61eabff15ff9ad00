// train() when memory or threads are short: a ResourceExhausted status, never
// an exception (failures injected through core/guard.h's hooks).
#include <gtest/gtest.h>

#include <string>

#include "core/guard.h"
#include "epx/train/trainer.h"
#include "train/tiny_config.h"

namespace epx {
namespace {

TrainConfig small(int num_ranks) {
  return testing::tiny_config({.num_ranks = num_ranks, .steps = 2, .batch_tokens = 32, .input_dim = 8,
                               .output_dim = 4, .clusters = 4, .layers = 1, .hidden = 16, .ffn_hidden = 16,
                               .experts = 4, .warmup = 1});
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
