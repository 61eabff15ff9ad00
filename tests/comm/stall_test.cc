// A rank that stalls (sleeps) in the middle of a run: every other rank fails
// within its own timeout, measured from when it started waiting (1.1x the
// timeout plus a scheduling allowance), names the stalled rank, and the
// stalled rank fails when it resumes instead of carrying on.
//
// Elapsed-time bounds here check the deadline's correctness, not speed: the
// 200 ms allowance covers waking a thread on a loaded 2-core machine.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/core/clock.h"

namespace epx {
namespace {

constexpr auto kTimeout = std::chrono::milliseconds(1000);
constexpr double kAllowance = 0.2;  // seconds

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

struct RankOutcome {
  Status status;
  double waited = 0;  // seconds from the call to its return
};

// Rank `stalled` sleeps `stall` before the collective; the others call it at once.
std::vector<RankOutcome> run_with_stall(int num_ranks, int stalled, std::chrono::milliseconds stall,
                                        const std::function<Status(Transport&, const Deadline&)>& collective) {
  std::vector<RankOutcome> outcomes(static_cast<std::size_t>(num_ranks));
  run_ranks(Topology::create(num_ranks, 1).value(), [&](Transport& t) -> Status {
    EPX_RETURN_IF_ERROR(t.barrier(Deadline::after(std::chrono::seconds(30))));  // every rank is up
    if (t.rank() == stalled) std::this_thread::sleep_for(stall);
    Stopwatch watch;
    outcomes[t.rank()].status = collective(t, Deadline::after(kTimeout));
    outcomes[t.rank()].waited = watch.seconds();
    return outcomes[t.rank()].status;
  });
  return outcomes;
}

void expect_named_within_timeout(const std::vector<RankOutcome>& outcomes, int stalled, const std::string& op) {
  const double bound = 1.1 * std::chrono::duration<double>(kTimeout).count() + kAllowance;
  for (int r = 0; r < static_cast<int>(outcomes.size()); ++r) {
    const RankOutcome& o = outcomes[r];
    if (r == stalled) {
      // It resumes after the others gave up: its call fails at once.
      EXPECT_EQ(o.status.code(), StatusCode::kAborted) << o.status.to_string();
      EXPECT_LT(o.waited, kAllowance) << o.status.to_string();
      continue;
    }
    EXPECT_EQ(o.status.code(), StatusCode::kDeadlineExceeded) << "rank " << r << ": " << o.status.to_string();
    EXPECT_TRUE(contains(o.status.message(), fmt::format("rank {} did not arrive", stalled))) << o.status.message();
    EXPECT_TRUE(contains(o.status.message(), op)) << o.status.message();
    EXPECT_LE(o.waited, bound) << "rank " << r << " waited " << o.waited << " s for a " << kTimeout.count()
                               << " ms timeout: " << o.status.to_string();
  }
}

TEST(Stall, BarrierNamesTheStalledRankWithinTheTimeout) {
  auto outcomes = run_with_stall(4, 2, std::chrono::milliseconds(1600),
                                 [](Transport& t, const Deadline& d) { return t.barrier(d); });
  expect_named_within_timeout(outcomes, 2, "barrier");
  EXPECT_TRUE(contains(outcomes[0].status.message(), "(ranks 0, 1, 3 waited)")) << outcomes[0].status.message();
}

TEST(Stall, AllReduceNamesTheStalledRankWithinTheTimeout) {
  auto outcomes = run_with_stall(3, 0, std::chrono::milliseconds(1600), [](Transport& t, const Deadline& d) {
    double v = 1.0;
    return t.all_reduce(std::span<double>(&v, 1), ReduceOp::kSum, d);
  });
  expect_named_within_timeout(outcomes, 0, "all_reduce");
}

}  // namespace
}  // namespace epx
