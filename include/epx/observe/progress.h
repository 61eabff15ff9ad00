// ProgressBar: how far a long loop (training steps, benchmark repetitions) has
// got, on stderr by default.
//
//   epx::ProgressBar bar(num_steps, "train");
//   for (int64_t step = 1; step <= num_steps; ++step) {
//     ...
//     bar.update(step, fmt::format("loss {:.3f}", loss));
//   }
//   bar.finish();
//
// On a terminal (isatty) one line is redrawn in place with '\r':
//   train [##########..........]  500/1000  41.2/s  ETA 0:12  loss 0.123
// at most about 10 times a second (the first update, the last step and finish
// always draw). Anywhere else (a log file, a pipe) plain lines are printed,
// never '\r', about every 10% of `total` and at the last step:
//   train: 500/1000 (50%) loss 0.123
// `finish` ends the bar: on a terminal it draws the final state with the
// elapsed time in place of the ETA ("in 0:24") and a newline; in plain style
// it prints a last line unless that line was just printed. A terminal bar
// destroyed unfinished ends its line, so later output starts on a fresh one.
// `total <= 0` means the total is unknown: no percentage, bar or ETA, and the
// plain style prints only at finish. `ProgressStyle` forces either style.
// Rate and ETA are averages since construction.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>

namespace epx {

enum class ProgressStyle { kAuto, kTerminal, kPlain };

class ProgressBar {
 public:
  ProgressBar(int64_t total, std::string label, std::FILE* stream = stderr,
              ProgressStyle style = ProgressStyle::kAuto);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // `done` items of `total` are finished; `extra` is appended (e.g. "loss 0.123").
  void update(int64_t done, std::string_view extra = {});
  void finish(std::string_view extra = {});

  [[nodiscard]] bool terminal() const { return terminal_; }
  // Replaces the monotonic clock (nanoseconds) used for rate, ETA and the
  // redraw limit, e.g. by a fake one in a test. Resets the start time.
  void set_clock(std::function<int64_t()> now_ns);

 private:
  void draw_terminal(std::string_view extra, bool final_draw);
  void print_plain(std::string_view extra);

  int64_t total_;
  std::string label_;
  std::FILE* stream_;
  bool terminal_;
  std::function<int64_t()> now_ns_;
  int64_t start_ns_ = 0;
  int64_t last_draw_ns_ = 0;
  int64_t done_ = 0;
  int64_t last_printed_done_ = -1;  // plain style
  int64_t next_plain_decile_ = 1;   // plain style: the next 10% step to print
  std::size_t last_width_ = 0;      // terminal style: characters of the last line
  bool drawn_ = false;
  bool finished_ = false;
};

}  // namespace epx
