#include "epx/observe/run_log.h"

#include <sys/stat.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "epx/train/trainer.h"
#include "observe/temp_dir.h"

namespace epx {
namespace {

using epx::testing::TempDir;

void write_text(const std::string& path, const std::string& text, bool append = false) {
  std::ofstream out(path, append ? std::ios::binary | std::ios::app : std::ios::binary | std::ios::trunc);
  out << text;
}

// A small step line of the trainer's format.
std::string step_line(int64_t step, double loss = 1.5) {
  return fmt::format(R"({{"step":{},"loss":{},"main_loss":{},"lr":0.001,"grad_norm":1,"seconds":0.5,)"
                     R"("tokens_per_s":100,"layers":[],"ranks":[]}})",
                     step, loss, loss);
}

std::vector<StepRecord> read_all(const std::string& path, Status* status) {
  std::vector<StepRecord> out;
  *status = read_metrics(path, [&](StepRecord&& r) {
    out.push_back(std::move(r));
    return Status::ok();
  });
  return out;
}

StepReport sample_report() {
  StepReport report;
  report.step = 41;
  report.steps = 100;
  report.loss = 2.0625478;
  report.main_loss = 1.0 / 3.0;
  report.learning_rate = 3e-4;
  report.grad_norm = 0.125;
  report.seconds = 0.0123456789;
  report.tokens_per_second = 98765.4321;
  report.num_nodes = 2;
  for (int l = 0; l < 2; ++l) {
    LoadStats s;
    s.tokens_per_expert = {10 + l, 0, 7, 123456789012};
    s.tokens_per_rank = {5, 6 + l};
    s.num_dropped = 3 * l;
    s.max_vio = 0.75 + l;
    s.cv = 0.1 / 7;
    s.worst_rank = l;
    s.worst_rank_share = 0.6;
    s.idle_fraction = 0.25 * (l + 1);
    report.layers.push_back(s);
  }
  for (int r = 0; r < 2; ++r) {
    RankTimes t;
    t.router = 1e-5 * (r + 1);
    t.dispatch = 0.002;
    t.experts = 0.03;
    t.combine = 0.004;
    t.dense = 0.005;
    t.wait = 0.006 * r;
    t.sync = 0.007;
    t.total = 0.05;
    t.grad_reduce = 0.001;
    t.grad_wait = 0.0005;
    t.grad_bytes = 4096 * (r + 1);
    t.exchange_wait = 0.0031 * (r + 1);
    t.waited_for = 1 - r;
    t.late = 0.25 * r;
    t.slow_data = 1e-7 * (r + 3);
    report.ranks.push_back(t);
  }
  report.eplb = EplbReport{{1.5, 1.25}, {1.0625, 1.0}, 6, 123456};
  report.wait_matrix = WaitMatrixReport{2, {0, 0.125, 1.0 / 3.0, 0}, {0, 2e-6, 0.0625, 0}};
  return report;
}

// The trainer's own writer, read back: every field it writes comes back equal.
TEST(RunLog, ReadsBackWhatTheTrainerWrites) {
  const StepReport report = sample_report();
  Result<StepRecord> parsed = parse_step_record(report.to_json());
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string() << "\n" << report.to_json();
  const StepRecord& r = *parsed;
  EXPECT_EQ(r.step, 41);
  EXPECT_EQ(r.loss, report.loss);
  EXPECT_EQ(r.main_loss, report.main_loss);
  EXPECT_EQ(r.lr, report.learning_rate);
  EXPECT_EQ(r.grad_norm, report.grad_norm);
  EXPECT_EQ(r.seconds, report.seconds);
  EXPECT_EQ(r.tokens_per_s, report.tokens_per_second);
  EXPECT_EQ(r.num_nodes, 2);
  ASSERT_EQ(r.layers.size(), 2u);
  for (int l = 0; l < 2; ++l) {
    const LayerRecord& got = r.layers[l];
    const LoadStats& want = report.layers[l];
    EXPECT_EQ(got.layer, l);
    EXPECT_EQ(got.max_vio, want.max_vio);
    EXPECT_EQ(got.cv, want.cv);
    EXPECT_EQ(got.dropped, want.num_dropped);
    EXPECT_EQ(got.worst_rank, want.worst_rank);
    EXPECT_EQ(got.worst_rank_share, want.worst_rank_share);
    EXPECT_EQ(got.idle_fraction, want.idle_fraction);
    EXPECT_EQ(got.tokens_per_expert, want.tokens_per_expert);
    EXPECT_EQ(got.tokens_per_rank, want.tokens_per_rank);
  }
  ASSERT_EQ(r.ranks.size(), 2u);
  for (int k = 0; k < 2; ++k) {
    const RankRecord& got = r.ranks[k];
    const RankTimes& want = report.ranks[k];
    EXPECT_EQ(got.rank, k);
    EXPECT_EQ(got.router, want.router);
    EXPECT_EQ(got.dispatch, want.dispatch);
    EXPECT_EQ(got.experts, want.experts);
    EXPECT_EQ(got.combine, want.combine);
    EXPECT_EQ(got.dense, want.dense);
    EXPECT_EQ(got.wait, want.wait);
    EXPECT_EQ(got.sync, want.sync);
    EXPECT_EQ(got.total, want.total);
    EXPECT_EQ(got.grad_reduce, want.grad_reduce);
    EXPECT_EQ(got.grad_wait, want.grad_wait);
    EXPECT_EQ(got.grad_bytes, want.grad_bytes);
    EXPECT_EQ(got.exchange_wait, want.exchange_wait);
    EXPECT_EQ(got.waited_for, want.waited_for);
    EXPECT_EQ(got.late, want.late);
    EXPECT_EQ(got.slow_data, want.slow_data);
  }
  ASSERT_TRUE(r.eplb.has_value());
  EXPECT_EQ(r.eplb->balance_before, report.eplb->balance_before);
  EXPECT_EQ(r.eplb->balance_after, report.eplb->balance_after);
  EXPECT_EQ(r.eplb->moved_slots, 6);
  EXPECT_EQ(r.eplb->moved_bytes, 123456);
  ASSERT_TRUE(r.wait_matrix.has_value());
  EXPECT_EQ(r.wait_matrix->num_ranks, 2);
  EXPECT_EQ(r.wait_matrix->arrival, report.wait_matrix->arrival);
  EXPECT_EQ(r.wait_matrix->data, report.wait_matrix->data);
  EXPECT_DOUBLE_EQ(r.balancedness(), 1.0 - (0.25 + 0.5) / 2);
  EXPECT_DOUBLE_EQ(r.max_vio(), (0.75 + 1.75) / 2);
}

// A diverged run: the trainer writes its NaN loss as null, read back as NaN.
TEST(RunLog, ReadsBackTheTrainersNaNLoss) {
  StepReport report = sample_report();
  report.loss = std::nan("");
  report.grad_norm = std::numeric_limits<double>::infinity();
  const std::string line = report.to_json();
  EXPECT_NE(line.find("\"loss\":null"), std::string::npos) << line;
  Result<StepRecord> parsed = parse_step_record(line);
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_TRUE(std::isnan(parsed->loss));
  EXPECT_TRUE(std::isnan(parsed->grad_norm));
  EXPECT_EQ(parsed->main_loss, report.main_loss);
}

TEST(RunLog, ReadsTheWaitFieldsAndTheWaitMatrix) {
  const std::string line =
      R"({"step":7,"ranks":[{"rank":0,"exchange_wait":0.5,"waited_for":1,"late":0,"slow_data":0.25},)"
      R"({"rank":1,"exchange_wait":0,"waited_for":-1,"late":0.75,"slow_data":null}],)"
      R"("wait_matrix":{"num_ranks":2,"arrival":[0,0.75,0,0],"data":[0,0.125,null,0]}})";
  Result<StepRecord> parsed = parse_step_record(line);
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  ASSERT_EQ(parsed->ranks.size(), 2u);
  EXPECT_EQ(parsed->ranks[0].exchange_wait, 0.5);
  EXPECT_EQ(parsed->ranks[0].waited_for, 1);
  EXPECT_EQ(parsed->ranks[0].slow_data, 0.25);
  EXPECT_EQ(parsed->ranks[1].waited_for, -1);
  EXPECT_EQ(parsed->ranks[1].late, 0.75);
  EXPECT_TRUE(std::isnan(parsed->ranks[1].slow_data));
  ASSERT_TRUE(parsed->wait_matrix.has_value());
  const WaitMatrix& m = *parsed->wait_matrix;
  EXPECT_EQ(m.num_ranks, 2);
  EXPECT_EQ(m.arrival_at(0, 1), 0.75);
  EXPECT_EQ(m.data_at(0, 1), 0.125);
  EXPECT_TRUE(std::isnan(m.data_at(1, 0)));
}

TEST(RunLog, NullLossReadsAsNaN) {
  Result<StepRecord> parsed = parse_step_record(R"({"step":3,"loss":null,"main_loss":null,"grad_norm":null})");
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->step, 3);
  EXPECT_TRUE(std::isnan(parsed->loss));
  EXPECT_TRUE(std::isnan(parsed->main_loss));
  EXPECT_TRUE(std::isnan(parsed->grad_norm));
}

TEST(RunLog, ValLossOnlyWhereTheLineHasOne) {
  Result<StepRecord> with = parse_step_record(R"({"step":4,"loss":2.5,"val_loss":2.25})");
  ASSERT_TRUE(with.is_ok()) << with.status().to_string();
  ASSERT_TRUE(with->val_loss.has_value());
  EXPECT_EQ(*with->val_loss, 2.25);
  Result<StepRecord> null = parse_step_record(R"({"step":5,"val_loss":null})");
  ASSERT_TRUE(null.is_ok()) << null.status().to_string();
  ASSERT_TRUE(null->val_loss.has_value());
  EXPECT_TRUE(std::isnan(*null->val_loss));
  Result<StepRecord> without = parse_step_record(R"({"step":6,"loss":2.5})");
  ASSERT_TRUE(without.is_ok()) << without.status().to_string();
  EXPECT_FALSE(without->val_loss.has_value());
  EXPECT_FALSE(parse_step_record(R"({"step":6,"val_loss":"low"})").is_ok());
}

TEST(RunLog, IgnoresUnknownFieldsAndDefaultsMissingOnes) {
  Result<StepRecord> parsed = parse_step_record(
      R"({"future":{"a":[1,{"b":null}],"c":"x"},"step":9,"ranks":[{"rank":2,"new":[true]}],)"
      R"("layers":[{"layer":0,"gpu":"h200"}]})");
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->step, 9);
  EXPECT_TRUE(std::isnan(parsed->loss));  // missing: the default
  EXPECT_EQ(parsed->tokens_per_s, 0);
  ASSERT_EQ(parsed->ranks.size(), 1u);
  EXPECT_EQ(parsed->ranks[0].rank, 2);
  EXPECT_EQ(parsed->ranks[0].waited_for, -1);
  EXPECT_EQ(parsed->ranks[0].late, 0);
  ASSERT_EQ(parsed->layers.size(), 1u);
  EXPECT_TRUE(parsed->layers[0].tokens_per_expert.empty());
  EXPECT_FALSE(parsed->eplb.has_value());
}

TEST(RunLog, MalformedLinesNameTheFieldAndTheLineStart) {
  const struct {
    const char* line;
    const char* expected;
  } cases[] = {
      {R"({"step":1,"loss":"high"})", "field \"loss\": "},
      {R"({"step":1,"layers":[{"layer":0},{"layer":1,"tokens_per_expert":[1,"x"]}]})",
       "field \"layers[1].tokens_per_expert\": "},
      {R"({"ranks":[{"rank":0,"waited_for":1.5}]})", "field \"ranks[0].waited_for\": "},
      {R"({"wait_matrix":{"num_ranks":2,"arrival":[0,1,2],"data":[0,0,0,0]}})",
       "arrival has 3 and data 4 numbers, num_ranks = 2 needs 4"},
      {R"([1,2])", "not a JSON object of the metrics format"},
      {R"(hello)", "not a JSON object"},
      {R"({"step":1,"loss":2)", ""},
      {R"({"step":1} {"step":2})", ""},
  };
  for (const auto& c : cases) {
    Result<StepRecord> parsed = parse_step_record(c.line);
    ASSERT_FALSE(parsed.is_ok()) << c.line;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << c.line;
    EXPECT_NE(parsed.status().message().find(c.expected), std::string::npos) << parsed.status().message();
    EXPECT_NE(parsed.status().message().find(std::string("in line '") + std::string(c.line).substr(0, 10)),
              std::string::npos)
        << parsed.status().message();
  }
}

TEST(RunLog, ReadMetricsNamesTheLineNumberAndDeliversTheLinesBefore) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  write_text(path, step_line(0) + "\n\n" + step_line(1) + "\n{\"step\":2,\"loss\":[]}\n" + step_line(3) + "\n");
  Status status;
  std::vector<StepRecord> records = read_all(path, &status);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find(path + ":4: field \"loss\""), std::string::npos) << status.message();
  ASSERT_EQ(records.size(), 2u);  // the blank line 2 is skipped
  EXPECT_EQ(records[1].step, 1);
}

TEST(RunLog, ReadMetricsLeavesOutAPartialLastLine) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  write_text(path, step_line(0) + "\n" + step_line(1) + "\n" + step_line(2).substr(0, 30));
  Status status;
  std::vector<StepRecord> records = read_all(path, &status);
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].step, 0);
  EXPECT_EQ(records[1].step, 1);
}

TEST(RunLog, ReadMetricsMissingFileIsNotFoundAndACallbackErrorStops) {
  TempDir dir;
  Status status;
  read_all(dir.file("absent.jsonl"), &status);
  EXPECT_EQ(status.code(), StatusCode::kNotFound);
  EXPECT_NE(status.message().find("absent.jsonl"), std::string::npos);

  const std::string path = dir.file("m.jsonl");
  write_text(path, step_line(0) + "\n" + step_line(1) + "\n" + step_line(2) + "\n");
  int calls = 0;
  status = read_metrics(path, [&](StepRecord&& r) {
    ++calls;
    return r.step == 1 ? aborted("enough at step {}", r.step) : Status::ok();
  });
  EXPECT_EQ(status.code(), StatusCode::kAborted);
  EXPECT_EQ(calls, 2);
}

// Lines wide enough (a layer of 256 experts) that the file spans several of
// the reader's blocks, which two threads parse: every record, in order, and
// an error deep in the file still names its line.
TEST(RunLog, ReadMetricsKeepsTheOrderAcrossBlocksAndThreads) {
  TempDir dir;
  const std::string path = dir.file("big.jsonl");
  std::vector<int64_t> loads(256);
  for (int e = 0; e < 256; ++e) loads[e] = 1000 + e;
  const std::string layer = fmt::format(R"({{"layer":0,"max_vio":0.5,"tokens_per_expert":[{}]}})", fmt::join(loads, ","));
  std::string layers = layer;
  for (int l = 1; l < 8; ++l) layers += "," + layer;
  const int num_steps = 4000;  // about 40 MB: five 8 MiB blocks and more
  {
    std::ofstream out(path, std::ios::binary);
    for (int s = 0; s < num_steps; ++s)
      out << fmt::format(R"({{"step":{},"loss":{},"layers":[{}]}})", s, s * 0.5, layers) << '\n';
  }
  ASSERT_GT(std::filesystem::file_size(path), std::size_t{32} << 20);
  int64_t expected = 0;
  bool in_order = true;
  Status status = read_metrics(path, [&](StepRecord&& r) {
    in_order = in_order && r.step == expected && r.loss == expected * 0.5 && r.layers.size() == 8 &&
               r.layers[7].tokens_per_expert[255] == 1255;
    ++expected;
    return Status::ok();
  });
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  EXPECT_TRUE(in_order);
  EXPECT_EQ(expected, num_steps);

  write_text(path, "{\"step\":\n", /*append=*/true);  // line num_steps + 1
  write_text(path, step_line(num_steps + 1) + "\n", /*append=*/true);
  expected = 0;
  status = read_metrics(path, [&](StepRecord&&) {
    ++expected;
    return Status::ok();
  });
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find(fmt::format(":{}: ", num_steps + 1)), std::string::npos) << status.message();
  EXPECT_EQ(expected, num_steps);
}

// Lines of exactly 1 KiB: a line starts exactly where each of the reader's
// 8 MiB regions starts, and one ends exactly where each ends.
TEST(RunLog, ReadMetricsSplitsExactlyAtRegionBoundaries) {
  TempDir dir;
  const std::string path = dir.file("aligned.jsonl");
  const int num_steps = 3 * 8192 + 5;
  {
    std::ofstream out(path, std::ios::binary);
    for (int s = 0; s < num_steps; ++s) {
      std::string line = fmt::format(R"({{"step":{},"pad":")", s);
      line += std::string(1024 - line.size() - 3, 'x') + "\"}";
      ASSERT_EQ(line.size(), 1023u);
      out << line << '\n';
    }
  }
  int64_t expected = 0;
  bool in_order = true;
  Status status = read_metrics(path, [&](StepRecord&& r) {
    in_order = in_order && r.step == expected++;
    return Status::ok();
  });
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  EXPECT_TRUE(in_order);
  EXPECT_EQ(expected, num_steps);
}

std::vector<int64_t> steps_of(const Result<std::vector<StepRecord>>& records) {
  std::vector<int64_t> out;
  for (const StepRecord& r : *records) out.push_back(r.step);
  return out;
}

TEST(RunLogFollower, WaitsForTheFileAndKeepsThePartialLine) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  Result<MetricsFollower> follower = MetricsFollower::open(path);
  ASSERT_TRUE(follower.is_ok()) << follower.status().to_string();
  Result<std::vector<StepRecord>> got = follower->poll();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_TRUE(got->empty());  // not there yet

  const std::string second = step_line(1);
  write_text(path, step_line(0) + "\n" + second.substr(0, 20));
  got = follower->poll();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(steps_of(got), std::vector<int64_t>{0});
  EXPECT_EQ(follower->lines_read(), 1);

  got = follower->poll();
  ASSERT_TRUE(got.is_ok());
  EXPECT_TRUE(got->empty());  // nothing new

  write_text(path, second.substr(20) + "\n" + step_line(2) + "\n" + step_line(3) + "\n", /*append=*/true);
  got = follower->poll();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(steps_of(got), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(follower->lines_read(), 4);
}

TEST(RunLogFollower, FollowsAGrowingFileInBoundedPolls) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  MetricsFollower follower = std::move(MetricsFollower::open(path)).value();
  std::vector<int64_t> seen;
  for (int s = 0; s < 50; ++s) {
    write_text(path, step_line(s) + "\n", /*append=*/true);
    if (s % 7 == 0) {
      // A quarter of a line per poll at most: several polls per line.
      for (;;) {
        Result<std::vector<StepRecord>> got = follower.poll(step_line(s).size() / 4);
        ASSERT_TRUE(got.is_ok()) << got.status().to_string();
        for (int64_t step : steps_of(got)) seen.push_back(step);
        if (follower.lines_read() == s + 1) break;
      }
    }
  }
  Result<std::vector<StepRecord>> got = follower.poll();
  ASSERT_TRUE(got.is_ok());
  for (int64_t step : steps_of(got)) seen.push_back(step);
  ASSERT_EQ(seen.size(), 50u);
  for (int s = 0; s < 50; ++s) EXPECT_EQ(seen[s], s);
}

// 65 MiB without a newline (a sparse file of zero bytes) is not a metrics
// file: the reader and a follower refuse it instead of holding it all.
TEST(RunLog, ALineWithoutEndIsRefusedNotHeld) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  write_text(path, step_line(0) + "\n");
  std::filesystem::resize_file(path, std::filesystem::file_size(path) + (std::size_t{65} << 20));
  Status status;
  std::vector<StepRecord> records = read_all(path, &status);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find(path + ":2: the line runs over 67108864 bytes without a newline"),
            std::string::npos)
      << status.message();
  ASSERT_EQ(records.size(), 1u);

  MetricsFollower follower = std::move(MetricsFollower::open(path)).value();
  Status followed;
  int64_t steps = 0;
  for (int poll = 0; poll < 80 && followed.is_ok(); ++poll) {
    Result<std::vector<StepRecord>> got = follower.poll(std::size_t{1} << 20);
    if (got.is_ok()) steps += static_cast<int64_t>(got->size());
    else followed = got.status();
  }
  EXPECT_EQ(steps, 1);
  EXPECT_EQ(followed.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(followed.message().find(path + ":2: the line runs over 67108864 bytes"), std::string::npos)
      << followed.message();
}

// A FIFO is refused without blocking, by the reader and by a follower.
TEST(RunLog, AFifoIsRefusedWithoutBlocking) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  Status status;
  read_all(path, &status);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("is a FIFO (named pipe), not a regular file"), std::string::npos) << status.message();
  MetricsFollower follower = std::move(MetricsFollower::open(path)).value();
  Result<std::vector<StepRecord>> got = follower.poll();
  ASSERT_FALSE(got.is_ok());
  EXPECT_NE(got.status().message().find("is a FIFO (named pipe)"), std::string::npos) << got.status().message();
}

TEST(RunLogFollower, StartsOverOnATruncatedOrReplacedFile) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  MetricsFollower follower = std::move(MetricsFollower::open(path)).value();
  write_text(path, step_line(0) + "\n" + step_line(1) + "\n" + step_line(2) + "\n");
  Result<std::vector<StepRecord>> got = follower.poll();
  ASSERT_TRUE(got.is_ok());
  EXPECT_EQ(got->size(), 3u);

  // A new run over the path (truncated, shorter): from its start.
  write_text(path, step_line(0, 9.0) + "\n");
  got = follower.poll();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(steps_of(got), std::vector<int64_t>{0});
  EXPECT_EQ((*got)[0].loss, 9.0);
  EXPECT_EQ(follower.lines_read(), 1);

  // Truncated and already longer again: the byte before the read position is
  // no longer the newline it was.
  write_text(path, R"({"step":0,"loss":7,"padding":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"})"
                   "\n" + step_line(1) + "\n");
  got = follower.poll();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(steps_of(got), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ((*got)[0].loss, 7.0);

  // Replaced by another file (rename over the path), longer than the old one.
  const std::string other = dir.file("other.jsonl");
  std::string text;
  for (int s = 0; s < 5; ++s) text += step_line(s, 3.0) + "\n";
  write_text(other, text);
  std::filesystem::rename(other, path);
  got = follower.poll();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(steps_of(got), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(follower.lines_read(), 5);

  // Removed: nothing new until it is back.
  std::filesystem::remove(path);
  got = follower.poll();
  ASSERT_TRUE(got.is_ok());
  EXPECT_TRUE(got->empty());
}

TEST(RunLogFollower, ReportsAMalformedLineOnceAndGoesOn) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  MetricsFollower follower = std::move(MetricsFollower::open(path)).value();
  write_text(path, step_line(0) + "\n" + "{\"step\":true}\n" + step_line(2) + "\n");
  Result<std::vector<StepRecord>> got = follower.poll();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(steps_of(got), std::vector<int64_t>{0});
  got = follower.poll();
  ASSERT_FALSE(got.is_ok());
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find(path + ":2: field \"step\""), std::string::npos) << got.status().message();
  got = follower.poll();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(steps_of(got), std::vector<int64_t>{2});
  EXPECT_EQ(follower.lines_read(), 3);
}

}  // namespace
}  // namespace epx
