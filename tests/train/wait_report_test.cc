// The trainer's who-waited-for-whom fields (RankTimes::exchange_wait,
// waited_for, late, slow_data) and matrices (StepReport::wait_matrix), and
// metrics lines that stay JSON when a number is not finite.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "epx/observe/metrics.h"
#include "epx/train/trainer.h"
#include "train/tiny_config.h"

namespace epx {
namespace {

constexpr int kRanks = 4;
constexpr int kLate = 1;

// The sums the fields promise, from the matrices of a parsed line.
void check_line_against_matrix(const nlohmann::json& line) {
  const auto& m = line["wait_matrix"];
  const int R = m["num_ranks"].get<int>();
  ASSERT_EQ(R, kRanks);
  const std::vector<double> arrival = m["arrival"].get<std::vector<double>>();
  const std::vector<double> data = m["data"].get<std::vector<double>>();
  ASSERT_EQ(arrival.size(), static_cast<std::size_t>(R * R));
  ASSERT_EQ(data.size(), static_cast<std::size_t>(R * R));
  for (int r = 0; r < R; ++r) {
    const auto& rank = line["ranks"][r];
    double late = 0, slow_data = 0, most = 0;
    for (int q = 0; q < R; ++q) {
      late += arrival[q * R + r];
      slow_data += data[q * R + r];
      most = std::max(most, arrival[r * R + q] + data[r * R + q]);
      EXPECT_GE(arrival[r * R + q], 0.0);
      EXPECT_GE(data[r * R + q], 0.0);
    }
    EXPECT_EQ(arrival[r * R + r], 0.0);
    EXPECT_DOUBLE_EQ(rank["late"].get<double>(), late) << "rank " << r;
    EXPECT_DOUBLE_EQ(rank["slow_data"].get<double>(), slow_data) << "rank " << r;
    // The same seconds summed in another order: equal within rounding.
    EXPECT_GE(rank["exchange_wait"].get<double>(), most * (1 - 1e-12)) << "rank " << r;
  }
}

TEST(WaitReport, ALateRankIsNamedAndTheMatrixComesEveryNSteps) {
  TrainConfig c = testing::tiny_config({.num_ranks = kRanks, .steps = 4});
  c.wait_matrix_every = 2;
  // Not in step 0: its first GEMMs (oneDNN's JIT) take every rank longer than the sleep.
  c.before_step = [](int rank, int64_t step) -> Status {
    if (rank == kLate && step > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return Status::ok();
  };
  std::vector<nlohmann::json> lines;
  auto summary = train(c, [&](const StepReport& r) { lines.push_back(nlohmann::json::parse(r.to_json())); });
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  ASSERT_EQ(lines.size(), 4u);
  for (std::size_t step = 0; step < lines.size(); ++step) {
    SCOPED_TRACE(step);
    const nlohmann::json& line = lines[step];
    EXPECT_EQ(line.contains("wait_matrix"), step % 2 == 1);  // steps 2 and 4 of the run
    if (line.contains("wait_matrix")) check_line_against_matrix(line);
    if (step == 0) continue;
    for (int r = 0; r < kRanks; ++r) {
      const auto& rank = line["ranks"][r];
      if (r == kLate) continue;
      // Every other rank waited ~100 ms for rank 1 at the first dispatch of the step.
      EXPECT_EQ(rank["waited_for"].get<int>(), kLate) << "rank " << r;
      EXPECT_GE(rank["exchange_wait"].get<double>(), 0.080) << "rank " << r;
    }
    EXPECT_GE(line["ranks"][kLate]["late"].get<double>(), 3 * 0.080);
  }
}

TEST(WaitReport, NeverAndOffGiveNoMatrixAndZeros) {
  TrainConfig c = testing::tiny_config({.num_ranks = 2, .steps = 2});
  c.wait_matrix_every = 0;
  c.model.record_waits = false;
  std::vector<nlohmann::json> lines;
  auto summary = train(c, [&](const StepReport& r) { lines.push_back(nlohmann::json::parse(r.to_json())); });
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  for (const nlohmann::json& line : lines) {
    EXPECT_FALSE(line.contains("wait_matrix"));
    for (const auto& rank : line["ranks"]) {
      EXPECT_EQ(rank["exchange_wait"].get<double>(), 0.0);
      EXPECT_EQ(rank["waited_for"].get<int>(), -1);
    }
  }
}

// Ranks of different EP groups never meet in an exchange: with EP 2 on 4
// ranks each row has at most one rank (its EP peer) it waited for.
TEST(WaitReport, RanksOfOtherEpGroupsAreZero) {
  TrainConfig c = testing::tiny_config({.num_ranks = kRanks, .steps = 1});
  c.ep = 2;
  c.wait_matrix_every = 1;
  std::vector<nlohmann::json> lines;
  auto summary = train(c, [&](const StepReport& r) { lines.push_back(nlohmann::json::parse(r.to_json())); });
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  ASSERT_EQ(lines.size(), 1u);
  check_line_against_matrix(lines[0]);
  const std::vector<double> arrival = lines[0]["wait_matrix"]["arrival"].get<std::vector<double>>();
  const std::vector<double> data = lines[0]["wait_matrix"]["data"].get<std::vector<double>>();
  for (int r = 0; r < kRanks; ++r) {
    int waited_for = 0;
    for (int s = 0; s < kRanks; ++s) waited_for += arrival[r * kRanks + s] + data[r * kRanks + s] > 0 ? 1 : 0;
    EXPECT_LE(waited_for, 1) << "rank " << r;
  }
}

TEST(WaitReport, ANegativeEveryIsRefused) {
  TrainConfig c = testing::tiny_config({});
  c.wait_matrix_every = -1;
  const Status s = c.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("wait_matrix_every = -1"), std::string::npos) << s.to_string();
}

// A NaN loss (a diverged run) and an infinite gradient norm are written as
// null: the line is still JSON, and the metrics writer takes it.
TEST(WaitReport, NonFiniteNumbersAreWrittenAsNull) {
  StepReport report;
  report.loss = std::numeric_limits<double>::quiet_NaN();
  report.main_loss = std::numeric_limits<double>::quiet_NaN();
  report.grad_norm = std::numeric_limits<double>::infinity();
  report.learning_rate = 1e-3;
  report.ranks.resize(1);
  const std::string json = report.to_json();
  ASSERT_TRUE(nlohmann::json::accept(json)) << json;
  const nlohmann::json line = nlohmann::json::parse(json);
  EXPECT_TRUE(line["loss"].is_null()) << json;
  EXPECT_TRUE(line["main_loss"].is_null()) << json;
  EXPECT_TRUE(line["grad_norm"].is_null()) << json;
  EXPECT_EQ(line["lr"].get<double>(), 1e-3);

  const std::string path =
      (std::filesystem::temp_directory_path() / ("epx_wait_report_nan_" + std::to_string(::getpid()) + ".jsonl"))
          .string();
  {
    Result<MetricsWriter> writer = MetricsWriter::open(path);
    ASSERT_TRUE(writer.is_ok()) << writer.status().to_string();
    ASSERT_TRUE(writer->write(json).is_ok());
    ASSERT_TRUE(writer->close().is_ok());
  }
  std::ifstream in(path);
  std::string written;
  ASSERT_TRUE(std::getline(in, written));
  EXPECT_EQ(written, json);
  EXPECT_TRUE(nlohmann::json::accept(written));
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace epx
