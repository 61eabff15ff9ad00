// Resumed runs' metrics files: read_run_metrics gives each step once (the
// last history), cut_metrics_before_step cuts a file back to a checkpoint's
// step in one ftruncate and refuses a file epx did not write.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "epx/observe/run_log.h"
#include "observe/temp_dir.h"

namespace epx {
namespace {

using epx::testing::read_file;
using epx::testing::TempDir;

// Lines for steps [first, last], each with a loss that says which history it is from.
std::string lines(int64_t first, int64_t last, int history) {
  std::string out;
  for (int64_t s = first; s <= last; ++s) out += fmt::format("{{\"step\":{},\"loss\":{}}}\n", s, history);
  return out;
}

struct Read {
  std::vector<int64_t> steps;
  std::vector<double> losses;
  std::vector<MetricsResume> resumes;
};

Read read_run(const std::string& path) {
  Read r;
  const Status s = read_run_metrics(
      path,
      [&](StepRecord&& rec) {
        r.steps.push_back(rec.step);
        r.losses.push_back(rec.loss);
        return Status::ok();
      },
      &r.resumes);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return r;
}

TEST(ReadRunMetrics, EachStepOnceFromTheLastHistoryThatReachedIt) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  // Ran 0..5; resumed at 3, ran to 4; resumed at 2, ran to 6.
  std::ofstream(path) << lines(0, 5, 1) << lines(3, 4, 2) << lines(2, 6, 3);
  const Read r = read_run(path);
  EXPECT_EQ(r.steps, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(r.losses, (std::vector<double>{1, 1, 3, 3, 3, 3, 3}));
  ASSERT_EQ(r.resumes.size(), 2u);
  EXPECT_EQ(r.resumes[0].step, 3);
  EXPECT_EQ(r.resumes[0].replaced, 0);  // its records' steps were all taken again by the next history
  EXPECT_EQ(r.resumes[1].step, 2);
  EXPECT_EQ(r.resumes[1].replaced, 6);  // steps 2..5 of the first history, 3..4 of the second
}

TEST(ReadRunMetrics, AFileThatNeverGoesBackReadsAsItIs) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  std::ofstream(path) << lines(4, 7, 1) << "\n" << "{\"step\":8,\"lo";  // a blank line, a line still being written
  const Read r = read_run(path);
  EXPECT_EQ(r.steps, (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_TRUE(r.resumes.empty());
  const Status missing = read_run_metrics(dir.file("none.jsonl"), [](StepRecord&&) { return Status::ok(); });
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
}

TEST(CutMetrics, CutsBackToTheCheckpointsStepInPlace) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  std::ofstream(path) << lines(0, 5, 1) << "{\"step\":6,\"lo";  // killed while writing step 6
  auto cut = cut_metrics_before_step(path, 3);
  ASSERT_TRUE(cut.is_ok()) << cut.status().to_string();
  EXPECT_EQ(read_file(path), lines(0, 2, 1));
  EXPECT_EQ(cut->kept, 3);
  EXPECT_EQ(cut->removed, 3);
  EXPECT_EQ(cut->first_removed_step, 3);
  EXPECT_EQ(cut->last_removed_step, 5);
  // Nothing after the checkpoint's step: left as it is.
  cut = cut_metrics_before_step(path, 3);
  ASSERT_TRUE(cut.is_ok());
  EXPECT_EQ(cut->removed, 0);
  EXPECT_EQ(cut->bytes_removed, 0);
  EXPECT_EQ(read_file(path), lines(0, 2, 1));
}

TEST(CutMetrics, AnOlderFileWithStepsTwiceKeepsItsLastHistoryBeforeTheStep) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  std::ofstream(path) << lines(0, 5, 1) << lines(3, 5, 2);
  ASSERT_TRUE(cut_metrics_before_step(path, 5).is_ok());
  EXPECT_EQ(read_file(path), lines(0, 5, 1) + lines(3, 4, 2));
  const Read r = read_run(path);
  EXPECT_EQ(r.steps, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(r.losses, (std::vector<double>{1, 1, 1, 2, 2}));
}

TEST(CutMetrics, AFileEpxDidNotWriteIsRefusedAndUntouched) {
  TempDir dir;
  const std::string notes = dir.file("notes.txt");
  std::ofstream(notes) << lines(0, 1, 1) << "my notes\n" << lines(2, 3, 1);
  const auto cut = cut_metrics_before_step(notes, 1);
  EXPECT_EQ(cut.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(cut.status().message().find(notes + ":3: "), std::string::npos) << cut.status().message();
  EXPECT_EQ(read_file(notes), lines(0, 1, 1) + "my notes\n" + lines(2, 3, 1));
  const std::string tail = dir.file("tail.txt");
  std::ofstream(tail) << "no newline";
  EXPECT_FALSE(cut_metrics_before_step(tail, 0).is_ok());
  EXPECT_EQ(read_file(tail), "no newline");
  // A missing file stays missing.
  EXPECT_TRUE(cut_metrics_before_step(dir.file("none.jsonl"), 2).is_ok());
  EXPECT_EQ(dir.names(), (std::vector<std::string>{"notes.txt", "tail.txt"}));
}

}  // namespace
}  // namespace epx
