// The report page: one self-contained HTML page (no network, no external
// scripts or fonts) built of sections, each a table, a line chart, a heatmap,
// a bar chart or a timeline. `epx report` fills it from a training run's
// metrics (RunReport, run_report.h); `epx sim run --report` fills the same
// frame with a simulated run.
//
//   epx::ReportPage page("epx simulated run", "scenario.toml");
//   page.add(epx::ReportTable{.title = "Summary", .header = {"what", "value"}, .rows = {{"steps", "12"}}});
//   EPX_RETURN_IF_ERROR(epx::write_report(page, "report.html"));
//
// The page's inline script draws every chart from data embedded in the page
// (line charts, bars and timelines as SVG, heatmaps on a canvas) and marks
// each drawn chart with data-rendered="N" (the points, cells, bars or spans
// it drew), which the browser test checks.
//
// Big runs are downsampled as records arrive (StepBins): steps fall into bins
// of a power-of-two size, doubled (neighbouring bins merged) whenever the
// bins would exceed the limit, and each bin shows the mean of its steps; the
// page states the bin size. Memory is bounded by the limits, not by the run.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "epx/core/status.h"

namespace epx {

// Columns of numbers accumulated per step into at most `max_bins` bins of
// `bin_size` consecutive records (a power of two). When a record would open
// bin `max_bins`, neighbouring bins are merged and the size doubles, so the
// bins always cover every record added, each the mean of its records.
// Values::kReal takes doubles and leaves NaN out of a bin's mean (a bin of
// only NaN reads NaN); Values::kCounts takes integers (token counts), summed
// exactly and about four times faster.
class StepBins {
 public:
  enum class Values { kReal, kCounts };
  StepBins(int width, int max_bins, Values values = Values::kReal);
  void add(int64_t step, std::span<const double> values);   // kReal
  void add(int64_t step, std::span<const int64_t> values);  // kCounts
  // kCounts, without gathering the record into one span first: `fill(sums)`
  // adds the record's `width()` counts into sums[0, width()).
  template <typename Fill>
  void add_counts(int64_t step, Fill&& fill) {
    fill(counts_.data() + open_row(step));
  }
  [[nodiscard]] int width() const { return width_; }
  [[nodiscard]] int num_bins() const { return static_cast<int>(steps_.size()); }
  [[nodiscard]] int64_t bin_size() const { return bin_size_; }
  [[nodiscard]] double mean_step(int bin) const;  // the bin's x
  [[nodiscard]] double mean(int bin, int column) const;
  [[nodiscard]] double sum(int bin, int column) const;
  // The bin that holds the record added as number `ordinal` (0-based).
  [[nodiscard]] int bin_of(int64_t ordinal) const { return static_cast<int>(ordinal / bin_size_); }

 private:
  std::size_t open_row(int64_t step);  // the offset of the row the next record adds to
  void merge_pairs();
  int width_, max_bins_;
  Values values_;
  int64_t bin_size_ = 1, added_ = 0;
  std::vector<double> steps_;     // per bin: sum of the steps
  std::vector<int64_t> records_;  // per bin: records in it
  std::vector<double> sums_;      // kReal: [bin][column]
  std::vector<int64_t> counts_;   // kReal: values that were not NaN; kCounts: the sums
};

// One line of a LineChart; NaN leaves a gap. A series with its own `x` (a
// sparse one, e.g. a validation loss measured every N steps) is drawn as
// points joined by a line at those x; without, it follows the chart's x.
struct ChartSeries {
  std::string name;
  std::vector<double> y;
  std::vector<double> x;  // empty: the chart's x; else as long as y
};

struct LineChart {
  std::string title, x_label, y_label, note;
  std::vector<double> x;
  std::vector<ChartSeries> series;  // each as long as x, or as its own x
  std::vector<double> marks;        // x positions marked by a vertical line (EPLB re-placements)
  std::string marks_label;
};

// A grid of values (rows x cols) in one or more slices (a selector picks the
// slice shown), drawn as coloured cells from `min` to `max` (values outside
// are clipped); quantised to 256 levels in the page.
struct Heatmap {
  std::string title, x_label, y_label, note, unit;
  int rows = 0, cols = 0;
  std::vector<std::string> slice_names;  // one per slice
  std::vector<double> values;            // [slice][row][col]
  double min = 0, max = 1;
  std::vector<std::string> row_names, col_names;  // empty: numbered from 0
  std::vector<int> mark_cols;                     // columns marked by a line (EPLB re-placements)
};

// One horizontal stacked bar per name, in parts.
struct StackedBars {
  std::string title, unit, note;
  std::vector<std::string> bar_names, part_names;
  std::vector<double> values;  // [bar][part]
};

// Spans on lanes over time (a Gantt chart of one step).
struct Timeline {
  std::string title, unit, note;
  std::vector<std::string> lanes;
  struct Span {
    int lane = 0;
    std::string name;
    double begin = 0, end = 0;
  };
  std::vector<Span> spans;
};

struct ReportTable {
  std::string title;
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
};

class ReportPage {
 public:
  ReportPage(std::string title, std::string subtitle);
  void add_heading(std::string text);
  void add_paragraph(std::string text);  // plain text, escaped
  void add(ReportTable table);
  void add(LineChart chart);
  void add(Heatmap chart);
  void add(StackedBars chart);
  void add(Timeline chart);
  // The whole page.
  [[nodiscard]] std::string html() const;
  [[nodiscard]] int num_charts() const { return num_charts_; }

 private:
  std::string title_, subtitle_;
  std::vector<std::string> body_;  // HTML fragments in order
  int num_charts_ = 0;
};

// Writes the page to a temporary file beside `path` and renames it over
// `path`; `bytes` (when given) receives the page's size. NotFound when the
// folder does not exist; otherwise the path and the system's reason.
[[nodiscard]] Status write_report(const ReportPage& page, const std::string& path, std::size_t* bytes = nullptr);

}  // namespace epx
