#include "epx/observe/run_snapshot.h"

#include <gtest/gtest.h>

#include "observe/monitor_records.h"

namespace epx {
namespace {

using epx::testing::healthy_step;
using epx::testing::make_straggler;

TEST(RunSnapshot, LastStepTotalsHotExpertsAndTheStraggler) {
  RunTracker tracker({.window = 3, .hot_experts = 2});
  EXPECT_EQ(tracker.snapshot().records, 0);
  for (int i = 0; i < 5; ++i) {
    StepRecord s = healthy_step(i);
    s.layers[0].dropped = 2;
    s.layers[1].tokens_per_expert = {10, 40, 10, 10, 10, 10, 50, 10};  // 150 tokens
    s.ranks[1].wait = 0.25;
    if (i >= 2) make_straggler(s, 3, 0.2);
    tracker.add(s);
  }
  const RunSnapshot s = tracker.snapshot();
  EXPECT_EQ(s.records, 5);
  EXPECT_EQ(s.step, 4);
  ASSERT_EQ(s.layers.size(), 2u);
  EXPECT_EQ(s.layers[0].dropped, 2);
  EXPECT_EQ(s.layers[0].dropped_total, 10);
  EXPECT_EQ(s.dropped_total, 10);
  ASSERT_EQ(s.layers[1].hot.size(), 2u);
  EXPECT_EQ(s.layers[1].hot[0].expert, 6);
  EXPECT_DOUBLE_EQ(s.layers[1].hot[0].share, 50.0 / 150);
  EXPECT_EQ(s.layers[1].hot[1].expert, 1);
  ASSERT_EQ(s.ranks.size(), 4u);
  EXPECT_DOUBLE_EQ(s.ranks[1].idle_fraction, 0.25 + 0.2);  // barrier wait + exchange wait
  EXPECT_DOUBLE_EQ(s.ranks[3].idle_fraction, 0.0);
  EXPECT_EQ(s.window_steps, 3);
  ASSERT_FALSE(s.stragglers.empty());
  EXPECT_EQ(s.stragglers.front().rank, 3);
}

TEST(RunSnapshot, IdleFractionIsClampedAndZeroWithoutTime) {
  RankRecord r;
  EXPECT_EQ(rank_idle_fraction(r), 0.0);
  r.total = 1.0;
  r.wait = 0.7;
  r.exchange_wait = 0.6;
  EXPECT_EQ(rank_idle_fraction(r), 1.0);
}

}  // namespace
}  // namespace epx
