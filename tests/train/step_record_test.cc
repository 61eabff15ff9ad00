// `epx train` hands each step's report to its summary windows as a record in
// memory (step_record) and writes JSON only to the metrics file: the record
// must be the one the metrics reader makes of that line.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "epx/observe/run_log.h"
#include "train_record.h"

namespace epx {
namespace {

// Equal, NaN equal to NaN (the line's null).
bool same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

StepReport full_report() {
  StepReport r;
  r.step = 7;
  r.steps = 20;
  r.num_nodes = 2;
  r.loss = std::numeric_limits<double>::quiet_NaN();
  r.main_loss = 1.0 / 3.0;
  r.learning_rate = 3e-3;
  r.grad_norm = std::numeric_limits<double>::infinity();
  r.seconds = 0.125;
  r.tokens_per_second = 4096.5;
  r.resumed_from = 6;
  for (int l = 0; l < 2; ++l) {
    LoadStats s;
    s.tokens_per_expert = {3, 5 + l, 0, 9};
    s.tokens_per_rank = {8, 9 + l};
    s.num_dropped = l;
    s.max_vio = 0.1 + l;
    s.cv = 2.0 / 7.0;
    s.worst_rank = 1;
    s.worst_rank_share = 0.6;
    s.idle_fraction = 0.25;
    r.layers.push_back(s);
  }
  for (int k = 0; k < 2; ++k)
    r.ranks.push_back(RankTimes{.router = 0.01 * k, .dispatch = 0.02, .experts = 0.03, .combine = 0.04, .dense = 0.05,
                                .wait = 0.06, .sync = 0.07, .total = 0.3 + k, .grad_reduce = 0.08, .grad_wait = 0.09,
                                .grad_bytes = 1024, .exchange_wait = 0.011, .waited_for = 1 - k, .late = 0.012,
                                .slow_data = 0.013});
  r.wait_matrix = WaitMatrixReport{.num_ranks = 2, .arrival = {0, 0.5, 0.25, 0}, .data = {0, 0.125, 0.0625, 0}};
  r.eplb = EplbReport{.balance_before = {1.5, 1.25}, .balance_after = {1.0, 1.125}, .num_moved_slots = 3,
                      .moved_bytes = 4096};
  return r;
}

TEST(StepRecord, TheReportInMemoryIsTheRecordOfItsMetricsLine) {
  const StepReport report = full_report();
  const StepRecord mine = app::step_record(report);
  auto parsed = parse_step_record(report.to_json());
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  const StepRecord& line = *parsed;
  EXPECT_EQ(mine.step, line.step);
  for (auto [a, b] : {std::pair{mine.loss, line.loss}, {mine.main_loss, line.main_loss}, {mine.lr, line.lr},
                      {mine.grad_norm, line.grad_norm}, {mine.seconds, line.seconds},
                      {mine.tokens_per_s, line.tokens_per_s}})
    EXPECT_TRUE(same(a, b)) << a << " vs " << b;
  EXPECT_TRUE(std::isnan(mine.grad_norm));  // infinite: null in the line
  EXPECT_EQ(mine.num_nodes, line.num_nodes);
  EXPECT_EQ(mine.resumed_from, line.resumed_from);
  EXPECT_EQ(mine.val_loss.has_value(), line.val_loss.has_value());
  ASSERT_EQ(mine.layers.size(), line.layers.size());
  for (std::size_t l = 0; l < mine.layers.size(); ++l) {
    const LayerRecord &a = mine.layers[l], &b = line.layers[l];
    EXPECT_EQ(a.layer, b.layer);
    EXPECT_EQ(a.dropped, b.dropped);
    EXPECT_EQ(a.worst_rank, b.worst_rank);
    EXPECT_EQ(a.tokens_per_expert, b.tokens_per_expert);
    EXPECT_EQ(a.tokens_per_rank, b.tokens_per_rank);
    EXPECT_TRUE(same(a.max_vio, b.max_vio) && same(a.cv, b.cv) && same(a.worst_rank_share, b.worst_rank_share) &&
                same(a.idle_fraction, b.idle_fraction));
  }
  ASSERT_EQ(mine.ranks.size(), line.ranks.size());
  for (std::size_t k = 0; k < mine.ranks.size(); ++k) {
    const RankRecord &a = mine.ranks[k], &b = line.ranks[k];
    EXPECT_EQ(a.rank, b.rank);
    EXPECT_EQ(a.waited_for, b.waited_for);
    for (auto [x, y] : {std::pair{a.router, b.router}, {a.dispatch, b.dispatch}, {a.experts, b.experts},
                        {a.combine, b.combine}, {a.dense, b.dense}, {a.wait, b.wait}, {a.sync, b.sync},
                        {a.total, b.total}, {a.grad_reduce, b.grad_reduce}, {a.grad_wait, b.grad_wait},
                        {a.grad_bytes, b.grad_bytes}, {a.exchange_wait, b.exchange_wait}, {a.late, b.late},
                        {a.slow_data, b.slow_data}})
      EXPECT_EQ(x, y) << "rank " << k;
  }
  ASSERT_TRUE(mine.wait_matrix && line.wait_matrix);
  EXPECT_EQ(mine.wait_matrix->num_ranks, line.wait_matrix->num_ranks);
  EXPECT_EQ(mine.wait_matrix->arrival, line.wait_matrix->arrival);
  EXPECT_EQ(mine.wait_matrix->data, line.wait_matrix->data);
  ASSERT_TRUE(mine.eplb && line.eplb);
  EXPECT_EQ(mine.eplb->balance_before, line.eplb->balance_before);
  EXPECT_EQ(mine.eplb->balance_after, line.eplb->balance_after);
  EXPECT_EQ(mine.eplb->moved_slots, line.eplb->moved_slots);
  EXPECT_EQ(mine.eplb->moved_bytes, line.eplb->moved_bytes);
}

TEST(StepRecord, AReportWithoutOptionalPartsHasNone) {
  StepReport report;
  report.step = 1;
  const StepRecord mine = app::step_record(report);
  EXPECT_FALSE(mine.wait_matrix.has_value());
  EXPECT_FALSE(mine.eplb.has_value());
  EXPECT_EQ(mine.resumed_from, -1);
  EXPECT_EQ(mine.num_nodes, 1);
}

}  // namespace
}  // namespace epx
