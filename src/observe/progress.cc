#include "epx/observe/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "epx/core/clock.h"

namespace epx {
namespace {

constexpr int64_t kRedrawIntervalNs = 100'000'000;  // at most ~10 redraws a second
constexpr int kBarWidth = 20;

// "41.2", "3.07", "1234": about three significant digits, never an exponent.
std::string format_rate(double rate) {
  // Thresholds on the rounded value: 9.9996 prints as "10.0", not "10.00".
  if (rate >= 99.95) return fmt::format("{:.0f}", rate);
  if (rate >= 9.995) return fmt::format("{:.1f}", rate);
  return fmt::format("{:.2f}", rate);
}

// "0:07", "12:34", "3:02:01".
std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

bool is_terminal(std::FILE* stream) {
  const int fd = stream ? ::fileno(stream) : -1;
  return fd >= 0 && ::isatty(fd) == 1;
}

}  // namespace

ProgressBar::ProgressBar(int64_t total, std::string label, std::FILE* stream, ProgressStyle style)
    : total_(total),
      label_(std::move(label)),
      stream_(stream),
      terminal_(style == ProgressStyle::kTerminal || (style == ProgressStyle::kAuto && is_terminal(stream))),
      now_ns_([] { return epx::now_ns(); }),
      start_ns_(now_ns_()) {}

ProgressBar::~ProgressBar() {
  // Leave the cursor on a fresh line if the bar was drawn but not finished.
  if (terminal_ && drawn_ && !finished_ && stream_) {
    std::fputc('\n', stream_);
    std::fflush(stream_);
  }
}

void ProgressBar::set_clock(std::function<int64_t()> now_ns) {
  now_ns_ = std::move(now_ns);
  start_ns_ = now_ns_();
  last_draw_ns_ = start_ns_;
}

void ProgressBar::update(int64_t done, std::string_view extra) {
  if (finished_ || stream_ == nullptr) return;
  done_ = done;
  if (terminal_) {
    const bool last_step = total_ > 0 && done >= total_;
    if (!drawn_ || last_step || now_ns_() - last_draw_ns_ >= kRedrawIntervalNs) draw_terminal(extra, false);
    return;
  }
  if (total_ <= 0) return;
  // Print when `done` reaches the next 10% step (skipping steps passed at once) or the end.
  const int64_t decile = done >= total_ ? 10 : done * 10 / total_;
  if (decile >= next_plain_decile_ || (done >= total_ && last_printed_done_ != done)) {
    print_plain(extra);
    next_plain_decile_ = decile + 1;
  }
}

void ProgressBar::finish(std::string_view extra) {
  if (finished_ || stream_ == nullptr) return;
  if (terminal_) {
    draw_terminal(extra, true);
  } else if (last_printed_done_ != done_ || !extra.empty()) {
    print_plain(extra);
  }
  finished_ = true;
}

void ProgressBar::draw_terminal(std::string_view extra, bool final_draw) {
  const int64_t now = now_ns_();
  const double elapsed = static_cast<double>(now - start_ns_) * 1e-9;
  const double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0.0;
  std::string line = label_;
  if (total_ > 0) {
    const double fraction = std::clamp(static_cast<double>(done_) / static_cast<double>(total_), 0.0, 1.0);
    const int filled = static_cast<int>(fraction * kBarWidth);
    line += fmt::format(" [{}{}] {}/{}", std::string(filled, '#'), std::string(kBarWidth - filled, '.'), done_,
                        total_);
  } else {
    line += fmt::format(" {}", done_);
  }
  line += fmt::format("  {}/s", format_rate(rate));
  if (final_draw) {
    line += fmt::format("  in {}", format_duration(elapsed));
  } else if (total_ > 0) {
    line += rate > 0 ? fmt::format("  ETA {}", format_duration(static_cast<double>(total_ - done_) / rate))
                     : std::string("  ETA --:--");
  }
  if (!extra.empty()) line += fmt::format("  {}", extra);
  // Blank out what is left of a longer previous line.
  const std::size_t width = line.size();
  if (width < last_width_) line.append(last_width_ - width, ' ');
  last_width_ = width;
  std::fputc('\r', stream_);
  std::fputs(line.c_str(), stream_);
  if (final_draw) std::fputc('\n', stream_);
  std::fflush(stream_);
  drawn_ = true;
  last_draw_ns_ = now;
}

void ProgressBar::print_plain(std::string_view extra) {
  std::string line = fmt::format("{}: {}", label_, done_);
  if (total_ > 0) line += fmt::format("/{} ({}%)", total_, done_ * 100 / total_);
  if (!extra.empty()) line += fmt::format(" {}", extra);
  line += '\n';
  std::fputs(line.c_str(), stream_);
  std::fflush(stream_);
  last_printed_done_ = done_;
}

}  // namespace epx
