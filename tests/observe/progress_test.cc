#include "epx/observe/progress.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include <fmt/format.h>

namespace epx {
namespace {

// A tmpfile() (not a terminal) whose contents can be read back.
class CapturedStream {
 public:
  CapturedStream() : file_(std::tmpfile()) {}
  ~CapturedStream() { std::fclose(file_); }
  std::FILE* get() const { return file_; }
  std::string contents() const {
    std::fflush(file_);
    std::rewind(file_);
    std::string out;
    char buf[4096];
    std::size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof(buf), file_)) > 0) out.append(buf, n);
    std::fseek(file_, 0, SEEK_END);
    return out;
  }

 private:
  std::FILE* file_;
};

TEST(Progress, PlainLinesEveryTenPercent) {
  CapturedStream out;
  ASSERT_NE(out.get(), nullptr);
  {
    ProgressBar bar(100, "train", out.get());
    EXPECT_FALSE(bar.terminal());
    for (int i = 1; i <= 100; ++i) bar.update(i, fmt::format("loss {}", i));
    bar.finish();  // the last line was just printed: nothing more
  }
  std::string want;
  for (int p = 10; p <= 100; p += 10) want += fmt::format("train: {}/100 ({}%) loss {}\n", p, p, p);
  EXPECT_EQ(out.contents(), want);
}

TEST(Progress, PlainLargeStepsSmallTotalAndFinishExtra) {
  CapturedStream out;
  {
    ProgressBar bar(1000, "bench", out.get(), ProgressStyle::kPlain);
    for (int i = 250; i <= 1000; i += 250) bar.update(i);
    bar.finish("done in 3 s");
  }
  {
    ProgressBar bar(7, "small", out.get());
    for (int i = 1; i <= 7; ++i) bar.update(i);
    bar.update(7);  // the last step twice: printed once
  }
  {
    ProgressBar bar(10, "stopped", out.get());
    bar.update(3);
    bar.finish();  // stopped early: the final state is printed
  }
  EXPECT_EQ(out.contents(),
            "bench: 250/1000 (25%)\nbench: 500/1000 (50%)\nbench: 750/1000 (75%)\nbench: 1000/1000 (100%)\n"
            "bench: 1000/1000 (100%) done in 3 s\n"
            "small: 1/7 (14%)\nsmall: 2/7 (28%)\nsmall: 3/7 (42%)\nsmall: 4/7 (57%)\nsmall: 5/7 (71%)\n"
            "small: 6/7 (85%)\nsmall: 7/7 (100%)\n"
            "stopped: 3/10 (30%)\n");
}

TEST(Progress, PlainUnknownTotalPrintsAtFinishOnly) {
  CapturedStream out;
  ProgressBar bar(0, "read", out.get());
  for (int i = 1; i <= 42; ++i) bar.update(i);
  EXPECT_EQ(out.contents(), "");
  bar.finish("eof");
  EXPECT_EQ(out.contents(), "read: 42 eof\n");
}

// The terminal style, forced onto a file, with a fake clock: each draw is
// "\r" + the line, padded with spaces over a longer previous line; redraws
// come at most every 100 ms except for the last step and finish.
TEST(Progress, TerminalStyleRedrawsOneLine) {
  CapturedStream out;
  int64_t now = 0;
  ProgressBar bar(100, "train", out.get(), ProgressStyle::kTerminal);
  EXPECT_TRUE(bar.terminal());
  bar.set_clock([&] { return now; });
  now = 1'000'000'000;
  bar.update(10, "loss 0.5");  // first update: drawn
  now = 1'050'000'000;
  bar.update(11, "loss 0.4");  // 50 ms later: skipped
  now = 1'200'000'000;
  bar.update(12);  // 200 ms after the first draw: drawn, padded over "  loss 0.5"
  now = 1'250'000'000;
  bar.update(100);  // the last step: drawn at once
  now = 10'000'000'000;
  bar.finish("loss 0.1");
  const std::string l1 = "train [##..................] 10/100  10.0/s  ETA 0:09  loss 0.5";
  const std::string l2 = "train [##..................] 12/100  10.0/s  ETA 0:09";
  const std::string l3 = "train [####################] 100/100  80.0/s  ETA 0:00";
  const std::string l4 = "train [####################] 100/100  10.0/s  in 0:10  loss 0.1";
  const std::string want = "\r" + l1 + "\r" + l2 + std::string(l1.size() - l2.size(), ' ') + "\r" + l3 + "\r" +
                           l4 + "\n";  // l3 is longer than l2 and l4 than l3: no padding
  EXPECT_EQ(out.contents(), want);
  const std::string got = out.contents();
  EXPECT_EQ(std::count(got.begin(), got.end(), '\n'), 1);
}

TEST(Progress, TerminalUnfinishedBarEndsItsLine) {
  CapturedStream out;
  {
    ProgressBar bar(0, "scan", out.get(), ProgressStyle::kTerminal);
    int64_t now = 0;
    bar.set_clock([&] { return now; });
    now = 2'000'000'000;
    bar.update(5);
  }
  EXPECT_EQ(out.contents(), "\rscan 5  2.50/s\n");
}

}  // namespace
}  // namespace epx
