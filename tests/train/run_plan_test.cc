// The run plan: a training run's settings checked once into what every later
// stage takes. A bad field is refused naming it and its limit; the plan holds
// the resolved model, the layout, the resume and the save folder's probe; and
// train(plan) neither probes the save folder nor reads the checkpoint's
// meta.json again.
#include <gtest/gtest.h>

#include <filesystem>
#include <type_traits>

#include "epx/train/run_plan.h"
#include "observe/temp_dir.h"
#include "train/checkpoint.h"
#include "train/tiny_config.h"

namespace epx {
namespace {

using epx::testing::TempDir;

TrainConfig tiny(int num_ranks, int64_t steps) {
  return testing::tiny_config({.num_ranks = num_ranks, .steps = steps, .batch_tokens = 65, .hidden = 16,
                               .ffn_hidden = 16, .warmup = 1});
}

// The accessors give const views only: no stage can change what was decided.
static_assert(std::is_const_v<std::remove_reference_t<decltype(std::declval<const RunPlan&>().config())>>);
static_assert(std::is_const_v<std::remove_reference_t<decltype(std::declval<RunPlan&>().model())>>);
static_assert(!std::is_default_constructible_v<RunPlan>, "a plan comes from plan_run only");

TEST(RunPlan, ABadFieldIsRefusedNamingItAndItsLimit) {
  TrainConfig c = tiny(4, 2);
  c.balancing = {.eplb = true, .eplb_slots = 40};
  auto plan = plan_run(c);
  ASSERT_FALSE(plan.is_ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("eplb_slots = 40 is above experts = 8 x ranks = 4 = 32"), std::string::npos)
      << plan.status().to_string();
  // The same message as validate() gives: one set of rules.
  EXPECT_EQ(plan.status().message(), c.validate().message());
  c = tiny(4, 2);
  c.ep = 3;
  plan = plan_run(c);
  ASSERT_FALSE(plan.is_ok());
  EXPECT_NE(plan.status().message().find("ep = 3 must divide ranks = 4"), std::string::npos)
      << plan.status().to_string();
  c = tiny(4, 2);
  c.keep_checkpoints = 0;
  EXPECT_NE(plan_run(c).status().message().find("keep = 0 must be at least 1"), std::string::npos);
}

TEST(RunPlan, HoldsTheResolvedModelAndTheLayout) {
  TrainConfig c = tiny(4, 2);
  c.ep = 2;
  c.balancing = {.expert_bias = true, .capacity_factor = 1.5};
  auto plan = plan_run(c);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  // 65 tokens over 4 ranks: at most 17 per rank; the balancing is in the layer.
  EXPECT_EQ(plan->model().max_tokens_per_rank, 17);
  EXPECT_TRUE(plan->model().layer.expert_bias);
  EXPECT_EQ(plan->model().layer.router.capacity_factor, 1.5);
  EXPECT_EQ(plan->layout().ep(), 2);
  EXPECT_EQ(plan->layout().edp(), 2);
  EXPECT_EQ(plan->topology().num_ranks(), 4);
  // A run id is chosen once (16 hex digits) when none is given; no resume, no save folder.
  EXPECT_EQ(plan->config().run_id.size(), 16u);
  EXPECT_FALSE(plan->resume().has_value());
  EXPECT_TRUE(plan->save().folder.empty());
  // A copy is the same plan, not a new one.
  const RunPlan copy = *plan;
  EXPECT_EQ(&copy.model(), &plan->model());
}

TEST(RunPlan, TrainOnAPlanDoesNotProbeOrReadAgain) {
  TempDir tmp;
  const std::string first = (tmp.path() / "first").string(), second = (tmp.path() / "second").string();
  TrainConfig c = tiny(2, 2);
  c.save_dir = first;
  ASSERT_TRUE(train(c).is_ok());

  TrainConfig next = tiny(2, 3);
  next.resume_dir = first;
  next.save_dir = second;
  const detail::CheckpointProbes before = detail::checkpoint_probes();
  auto plan = plan_run(next);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  const detail::CheckpointProbes planned = detail::checkpoint_probes();
  EXPECT_EQ(planned.save_dir - before.save_dir, 1);  // the save folder, probed once
  EXPECT_EQ(planned.meta - before.meta, 1);          // the checkpoint, verified once
  ASSERT_TRUE(plan->resume().has_value());
  EXPECT_EQ(plan->resume()->step, 2);
  EXPECT_EQ(plan->save().folder, second);
  EXPECT_GT(plan->save().checkpoint_bytes, 0);

  auto summary = train(*plan);
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  const detail::CheckpointProbes trained = detail::checkpoint_probes();
  EXPECT_EQ(trained.save_dir, planned.save_dir);
  EXPECT_EQ(trained.meta, planned.meta);
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(second) / "step-000003"));
}

}  // namespace
}  // namespace epx
