#include "epx/observe/straggler.h"

#include <gtest/gtest.h>

#include <cmath>

namespace epx {
namespace {

// `num_steps` steps of 50 ms on `num_ranks` ranks; every rank causes
// `base` seconds of others' arrival wait per step (and half that of data
// wait), and `rank` in addition `late` and `slow_data`. What a rank causes is
// waited by the others evenly (their exchange_wait).
std::vector<StepRecord> window_of(int num_steps, int num_ranks, int rank, double late, double slow_data,
                                  double base = 2e-4) {
  std::vector<StepRecord> steps(static_cast<std::size_t>(num_steps));
  for (int s = 0; s < num_steps; ++s) {
    StepRecord& step = steps[static_cast<std::size_t>(s)];
    step.step = s;
    step.seconds = 0.05;
    step.num_nodes = 2;
    for (int r = 0; r < num_ranks; ++r) {
      RankRecord& rr = step.ranks.emplace_back();
      rr.rank = r;
      rr.late = base + (r == rank ? late : 0);
      rr.slow_data = base / 2 + (r == rank ? slow_data : 0);
    }
    for (int r = 0; r < num_ranks; ++r)
      for (int p = 0; p < num_ranks; ++p)
        if (p != r) step.ranks[r].exchange_wait += (step.ranks[p].late + step.ranks[p].slow_data) / (num_ranks - 1);
  }
  return steps;
}

void set_rows(std::vector<StepRecord>& steps, const std::vector<int64_t>& tokens_per_rank) {
  for (StepRecord& step : steps) {
    for (int l = 0; l < 2; ++l) {
      LayerRecord& layer = step.layers.emplace_back();
      layer.layer = l;
      layer.tokens_per_rank = tokens_per_rank;
    }
  }
}

TEST(Straggler, APausedRankIsCompute) {
  std::vector<StepRecord> steps = window_of(20, 4, 2, 0.030, 0.001);
  set_rows(steps, {100, 100, 110, 100});
  const std::vector<Straggler> found = diagnose_stragglers(steps);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 2);
  EXPECT_EQ(found[0].cause, StragglerCause::kCompute);
  EXPECT_EQ(cause_name(found[0].cause), "compute");
  // 31.3 ms/step of 31.3 + 4 x 0.3 ms of everybody's base.
  EXPECT_NEAR(found[0].seconds_per_step, 0.0313, 1e-9);
  EXPECT_NEAR(found[0].share, 0.0313 / (0.0313 + 3 * 0.0003), 1e-9);
  EXPECT_NE(found[0].explanation.find("31.3 ms/step"), std::string::npos) << found[0].explanation;
  EXPECT_NE(found[0].explanation.find("30.2 ms for it to arrive, 1.1 ms for its data"), std::string::npos)
      << found[0].explanation;
  EXPECT_NE(found[0].explanation.find("1.07x the mean rows"), std::string::npos) << found[0].explanation;
}

TEST(Straggler, SlowDataIsTheLink) {
  const std::vector<Straggler> found = diagnose_stragglers(window_of(10, 4, 1, 0.002, 0.020));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 1);
  EXPECT_EQ(found[0].cause, StragglerCause::kLink);
  EXPECT_EQ(cause_name(found[0].cause), "link");
}

// On one node data moves through memory: a rank slow with its data there is
// slow itself (a paused process caught inside an exchange), not its link.
TEST(Straggler, SlowDataOnOneNodeIsCompute) {
  std::vector<StepRecord> steps = window_of(10, 4, 1, 0.002, 0.020);
  for (StepRecord& step : steps) step.num_nodes = 1;
  std::vector<Straggler> found = diagnose_stragglers(steps);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 1);
  EXPECT_EQ(found[0].cause, StragglerCause::kCompute);
  EXPECT_NE(found[0].explanation.find("one node"), std::string::npos) << found[0].explanation;
  steps[3].num_nodes = 2;  // not every step on one node: a link is possible
  found = diagnose_stragglers(steps);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].cause, StragglerCause::kLink);
}

TEST(Straggler, LateWithManyRowsIsAHotExpert) {
  std::vector<StepRecord> steps = window_of(10, 4, 3, 0.020, 0.0);
  set_rows(steps, {100, 100, 100, 400});
  std::vector<Straggler> found = diagnose_stragglers(steps);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 3);
  EXPECT_EQ(found[0].cause, StragglerCause::kHotExpert);
  EXPECT_EQ(cause_name(found[0].cause), "hot expert");
  EXPECT_NE(found[0].explanation.find("2.29x the mean rows"), std::string::npos) << found[0].explanation;

  // EP 2 on 4 ranks: tokens_per_rank has an entry per EP rank; world rank 3
  // is EP rank 1, which receives 1.5x the mean: still hot. Rank 2 (EP rank 0)
  // would not be.
  steps = window_of(10, 4, 3, 0.020, 0.0);
  set_rows(steps, {100, 300});
  found = diagnose_stragglers(steps);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].cause, StragglerCause::kHotExpert);
  steps = window_of(10, 4, 2, 0.020, 0.0);
  set_rows(steps, {100, 300});
  found = diagnose_stragglers(steps);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 2);
  EXPECT_EQ(found[0].cause, StragglerCause::kCompute);
}

TEST(Straggler, NobodyWhenTheWaitIsEvenOrBelowTheNoiseFloor) {
  EXPECT_TRUE(diagnose_stragglers(window_of(10, 4, 0, 0.0, 0.0)).empty());  // every rank the same
  EXPECT_TRUE(diagnose_stragglers(window_of(10, 4, 0, 0.0004, 0.0, 1e-5)).empty());  // clear share, 0.4 ms/step
  EXPECT_TRUE(diagnose_stragglers(window_of(10, 4, 0, 0.0, 0.0, 0.0)).empty());      // nobody waited at all
  EXPECT_TRUE(diagnose_stragglers(std::span<const StepRecord>()).empty());
  // Two ranks: rank 0 makes rank 1 wait 16 ms/step, rank 1 rank 0 15 ms:
  // 1 ms/step net is jitter (below 5% of the 50 ms step); 4 ms more is not.
  std::vector<StepRecord> two = window_of(10, 2, 0, 0.001, 0.0, 0.01);
  EXPECT_TRUE(diagnose_stragglers(two).empty());
  two = window_of(10, 2, 0, 0.005, 0.0, 0.01);
  ASSERT_EQ(diagnose_stragglers(two).size(), 1u);
  // Everybody waits a lot, evenly: nobody (net blame about 0 for all).
  EXPECT_TRUE(diagnose_stragglers(window_of(10, 4, 0, 0.0, 0.0, 0.02)).empty());
}

TEST(Straggler, TwoStragglersWorstFirstAndNaNIgnored) {
  std::vector<StepRecord> steps = window_of(10, 8, 5, 0.010, 0.0);
  for (StepRecord& step : steps) {
    step.ranks[1].slow_data += 0.020;
    step.ranks[4].late = std::nan("");
  }
  const std::vector<Straggler> found = diagnose_stragglers(steps);
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].rank, 1);
  EXPECT_EQ(found[0].cause, StragglerCause::kLink);
  EXPECT_EQ(found[1].rank, 5);
  EXPECT_EQ(found[1].cause, StragglerCause::kCompute);
  EXPECT_GT(found[0].share, found[1].share);
}

TEST(Straggler, TheWaitMatrixNamesWhoWaited) {
  std::vector<StepRecord> steps = window_of(4, 3, 1, 0.010, 0.0, 0.0);
  for (StepRecord& step : steps) {
    WaitMatrix& m = step.wait_matrix.emplace();
    m.num_ranks = 3;
    m.arrival.assign(9, 0.0);
    m.data.assign(9, 0.0);
    m.arrival[2 * 3 + 1] = 0.007;  // rank 2 waited for rank 1 the most
    m.arrival[0 * 3 + 1] = 0.003;
  }
  const std::vector<Straggler> found = diagnose_stragglers(steps);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 1);
  EXPECT_NE(found[0].explanation.find("waited for by ranks 2, 0"), std::string::npos) << found[0].explanation;
}

// 3 nodes x 2 ranks; node_data[x][y]: what node x's ranks waited for node y's
// data per step, put on the same-local-rank pairs.
void set_node_waits(std::vector<StepRecord>& steps, const double (&node_data)[3][3]) {
  for (StepRecord& step : steps) {
    step.num_nodes = 3;
    WaitMatrix& m = step.wait_matrix.emplace();
    m.num_ranks = 6;
    m.arrival.assign(36, 0.0);
    m.data.assign(36, 0.0);
    for (int r = 0; r < 6; ++r)
      for (int s = 0; s < 6; ++s)
        if (r / 2 != s / 2 && r % 2 == s % 2) m.data[static_cast<std::size_t>(r * 6 + s)] = node_data[r / 2][s / 2] / 2;
  }
}

TEST(Straggler, ASlowHostLinkIsTheOneEveryOtherHostWaitsFor) {
  // By blame, rank 5 (node 2) is a link straggler: the shadow of node 1's slow
  // link, whose far ends wait for it and then make the others wait.
  std::vector<StepRecord> steps = window_of(10, 6, 5, 0.0, 0.040);
  set_node_waits(steps, {{0, 0.040, 0.012}, {0.040, 0, 0.040}, {0.004, 0.038, 0}});
  std::vector<Straggler> found = diagnose_stragglers(steps);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_TRUE(found[0].rank == 2 || found[0].rank == 3) << describe(found[0]);
  EXPECT_EQ(found[0].cause, StragglerCause::kLink);
  EXPECT_NE(found[0].explanation.find("every other node waited for the data of node 1"), std::string::npos)
      << found[0].explanation;

  // No node clearly the one every other waits for (node 0 and 2 too): the
  // blame's answer stands.
  set_node_waits(steps, {{0, 0.040, 0.030}, {0.040, 0, 0.040}, {0.030, 0.038, 0}});
  found = diagnose_stragglers(steps);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 5);
}

}  // namespace
}  // namespace epx
