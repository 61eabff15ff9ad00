#include "epx/sim/goodput.h"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

namespace epx::sim {
namespace {

// The model's semantics played out: exponential failures that may strike
// during work, a save or a restart; a failure loses the interval in progress.
// Returns kept work over wall time.
double monte_carlo_goodput(const FailureModel& m, double interval, int intervals, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> failure(1 / job_mtbf_s(m));
  double wall = 0;
  for (int i = 0; i < intervals; ++i) {
    for (;;) {
      const double x = failure(rng);
      if (x >= interval + m.save_blocking_s) {
        wall += interval + m.save_blocking_s;
        break;
      }
      wall += x;
      for (double y = failure(rng); y < m.restart_s; y = failure(rng)) wall += y;  // the restart fails too
      wall += m.restart_s;
    }
  }
  return intervals * interval / wall;
}

TEST(Goodput, WithoutFailuresOnlyTheSavesCost) {
  const FailureModel m{.gpus = 1, .failures_per_gpu_hour = 1e-12, .save_blocking_s = 10, .restart_s = 600};
  auto g = expected_goodput(m, 990);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  EXPECT_NEAR(g->goodput, 0.99, 1e-6);
}

TEST(Goodput, AgreesWithAMonteCarloRunOfTheSameFailures) {
  // A job MTBF of an hour: 1000 GPUs at 1e-3 failures per GPU-hour.
  const FailureModel m{.gpus = 1000, .failures_per_gpu_hour = 1e-3, .save_blocking_s = 60, .restart_s = 300};
  for (double interval : {300.0, 1200.0, 3600.0}) {
    auto g = expected_goodput(m, interval);
    ASSERT_TRUE(g.is_ok());
    const double simulated = monte_carlo_goodput(m, interval, 200000, 7);
    EXPECT_NEAR(g->goodput, simulated, 0.01 * simulated) << "interval " << interval;
    EXPECT_GT(g->goodput, 0.1);
    EXPECT_LT(g->goodput, 1.0);
  }
}

TEST(Goodput, TheBestIntervalBeatsItsNeighboursAndIsNearYoungsWhenSavesAreCheap) {
  const FailureModel m{.gpus = 1024, .failures_per_gpu_hour = 2e-5, .save_blocking_s = 30, .restart_s = 600};
  auto best = best_checkpoint_interval(m);
  ASSERT_TRUE(best.is_ok());
  for (double factor : {0.8, 0.95, 1.05, 1.25})
    EXPECT_GT(best->goodput, expected_goodput(m, best->interval_s * factor)->goodput) << factor;
  // Young's sqrt(2 delta M) is the first-order optimum for delta << M (here M is about 49 hours).
  EXPECT_NEAR(best->interval_s, young_interval_s(m), 0.05 * young_interval_s(m));
}

TEST(Goodput, MoreGpusMeanLessGoodputAtTheSameInterval) {
  FailureModel m{.gpus = 1024, .failures_per_gpu_hour = 2e-5, .save_blocking_s = 30, .restart_s = 600};
  const double small = expected_goodput(m, 3600)->goodput;
  m.gpus = 16384;
  EXPECT_LT(expected_goodput(m, 3600)->goodput, small);
}

TEST(Goodput, BadValuesAreRefusedNamingThem) {
  const FailureModel good{.gpus = 8, .failures_per_gpu_hour = 1e-4, .save_blocking_s = 1, .restart_s = 1};
  FailureModel m = good;
  m.gpus = 0;
  EXPECT_NE(expected_goodput(m, 60).status().message().find("gpus = 0"), std::string::npos);
  m = good;
  m.failures_per_gpu_hour = std::nan("");
  EXPECT_NE(best_checkpoint_interval(m).status().message().find("failures per GPU-hour = nan"), std::string::npos);
  m = good;
  m.restart_s = -1;
  EXPECT_EQ(expected_goodput(m, 60).status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(expected_goodput(good, 0).status().message().find("checkpoint interval = 0"), std::string::npos);
}

}  // namespace
}  // namespace epx::sim
