// The report's page frame (ReportPage): sections as HTML, each chart's data as
// JSON beside it, the stylesheet and script inlined; and StepBins, the
// downsampling its charts are built from.
#include "epx/observe/report_page.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "observe/file_error.h"
#include "observe/report_assets.h"
#include "observe/report_html.h"

namespace epx {

StepBins::StepBins(int width, int max_bins, Values values)
    : width_(width), max_bins_(std::max(2, max_bins)), values_(values) {
  // Room for every bin at once: growing never moves the sums.
  const std::size_t cells = static_cast<std::size_t>(max_bins_) * static_cast<std::size_t>(width_);
  steps_.reserve(static_cast<std::size_t>(max_bins_));
  records_.reserve(static_cast<std::size_t>(max_bins_));
  counts_.reserve(cells);
  if (values_ == Values::kReal) sums_.reserve(cells);
}

std::size_t StepBins::open_row(int64_t step) {
  if (bin_of(added_) >= max_bins_) merge_pairs();
  const int bin = bin_of(added_++);
  if (bin == num_bins()) {
    steps_.push_back(0);
    records_.push_back(0);
    counts_.resize(counts_.size() + static_cast<std::size_t>(width_), 0);
    if (values_ == Values::kReal) sums_.resize(sums_.size() + static_cast<std::size_t>(width_), 0.0);
  }
  steps_[static_cast<std::size_t>(bin)] += static_cast<double>(step);
  ++records_[static_cast<std::size_t>(bin)];
  return static_cast<std::size_t>(bin) * static_cast<std::size_t>(width_);
}

void StepBins::add(int64_t step, std::span<const double> values) {
  EPX_CHECK(values_ == Values::kReal);
  const std::size_t row = open_row(step), n = std::min(values.size(), static_cast<std::size_t>(width_));
  double* sums = sums_.data() + row;
  int64_t* counts = counts_.data() + row;
  for (std::size_t c = 0; c < n; ++c) {
    if (std::isnan(values[c])) continue;
    sums[c] += values[c];
    ++counts[c];
  }
}

void StepBins::add(int64_t step, std::span<const int64_t> values) {
  EPX_CHECK(values_ == Values::kCounts);
  const std::size_t row = open_row(step), n = std::min(values.size(), static_cast<std::size_t>(width_));
  int64_t* sums = counts_.data() + row;
  for (std::size_t c = 0; c < n; ++c) sums[c] += values[c];
}

// Bin 2k and 2k+1 become bin k; the size doubles.
void StepBins::merge_pairs() {
  const std::size_t w = static_cast<std::size_t>(width_), bins = steps_.size();
  const std::size_t halves = (bins + 1) / 2;
  for (std::size_t k = 0; k < halves; ++k) {
    const std::size_t a = 2 * k, b = 2 * k + 1;
    const bool pair = b < bins;
    steps_[k] = steps_[a] + (pair ? steps_[b] : 0);
    records_[k] = records_[a] + (pair ? records_[b] : 0);
    for (std::size_t c = 0; c < w; ++c) counts_[k * w + c] = counts_[a * w + c] + (pair ? counts_[b * w + c] : 0);
    if (values_ == Values::kReal)
      for (std::size_t c = 0; c < w; ++c) sums_[k * w + c] = sums_[a * w + c] + (pair ? sums_[b * w + c] : 0);
  }
  steps_.resize(halves);
  records_.resize(halves);
  counts_.resize(halves * w);
  if (values_ == Values::kReal) sums_.resize(halves * w);
  bin_size_ *= 2;
}

double StepBins::mean_step(int bin) const {
  return steps_[static_cast<std::size_t>(bin)] / static_cast<double>(records_[static_cast<std::size_t>(bin)]);
}

double StepBins::sum(int bin, int column) const {
  const std::size_t i = static_cast<std::size_t>(bin) * static_cast<std::size_t>(width_) + static_cast<std::size_t>(column);
  return values_ == Values::kReal ? sums_[i] : static_cast<double>(counts_[i]);
}

double StepBins::mean(int bin, int column) const {
  const std::size_t i = static_cast<std::size_t>(bin) * static_cast<std::size_t>(width_) + static_cast<std::size_t>(column);
  const int64_t n = values_ == Values::kReal ? counts_[i] : records_[static_cast<std::size_t>(bin)];
  return n > 0 ? sum(bin, column) / static_cast<double>(n) : std::nan("");
}

namespace {

using observe_detail::html_escape;
using nlohmann::json;

// Numbers as floats: seven digits are plenty for a chart and halve the page.
json numbers(const std::vector<double>& values) {
  json out = json::array();
  for (double v : values) out.push_back(std::isfinite(v) ? json(static_cast<float>(v)) : json(nullptr));
  return out;
}

std::string chart_section(int id, const char* kind, const std::string& title, const std::string& note,
                          const json& data) {
  return fmt::format(
      "<section class=\"chart\" id=\"chart-{}\" data-kind=\"{}\"><h3>{}</h3><div class=\"plot\"></div>{}"
      "<script type=\"application/json\" class=\"chart-data\">{}</script></section>\n",
      id, kind, html_escape(title), note.empty() ? "" : "<p class=\"note\">" + html_escape(note) + "</p>",
      observe_detail::script_safe(data.dump(-1, ' ', false, json::error_handler_t::replace)));
}

// Each value as a byte: 0 at `min`, 255 at `max`, clipped.
std::string quantised(const Heatmap& h) {
  std::vector<uint8_t> q(h.values.size());
  const double span = h.max > h.min ? h.max - h.min : 1.0;
  for (std::size_t i = 0; i < q.size(); ++i) {
    const double f = std::isfinite(h.values[i]) ? (h.values[i] - h.min) / span : 0.0;
    q[i] = static_cast<uint8_t>(std::lround(std::clamp(f, 0.0, 1.0) * 255));
  }
  return observe_detail::base64(q);
}

}  // namespace

ReportPage::ReportPage(std::string title, std::string subtitle)
    : title_(std::move(title)), subtitle_(std::move(subtitle)) {}

void ReportPage::add_heading(std::string text) {
  body_.push_back("<h2 class=\"section\">" + html_escape(text) + "</h2>\n");
}

void ReportPage::add_paragraph(std::string text) { body_.push_back("<p>" + html_escape(text) + "</p>\n"); }

void ReportPage::add(ReportTable t) {
  std::string html = "<section class=\"table\"><h3>" + html_escape(t.title) + "</h3><table><tr>";
  for (const std::string& h : t.header) html += "<th>" + html_escape(h) + "</th>";
  html += "</tr>";
  for (const auto& row : t.rows) {
    html += "<tr>";
    for (std::size_t i = 0; i < row.size(); ++i) html += (i ? "<td class=\"num\">" : "<td>") + html_escape(row[i]) + "</td>";
    html += "</tr>";
  }
  body_.push_back(html + "</table></section>\n");
}

void ReportPage::add(LineChart c) {
  json series = json::array();
  for (const ChartSeries& s : c.series) {
    json one = {{"name", s.name}, {"y", numbers(s.y)}};
    if (!s.x.empty()) one["x"] = numbers(s.x);
    series.push_back(std::move(one));
  }
  const json data = {{"x", numbers(c.x)}, {"series", series}, {"marks", numbers(c.marks)},
                     {"marksLabel", c.marks_label}, {"xLabel", c.x_label}, {"yLabel", c.y_label}};
  body_.push_back(chart_section(num_charts_++, "line", c.title, c.note, data));
}

void ReportPage::add(Heatmap h) {
  const json data = {{"rows", h.rows},        {"cols", h.cols},         {"slices", h.slice_names},
                     {"min", h.min},          {"max", h.max},           {"unit", h.unit},
                     {"q", quantised(h)},     {"rowNames", h.row_names}, {"colNames", h.col_names},
                     {"markCols", h.mark_cols}, {"xLabel", h.x_label},  {"yLabel", h.y_label}};
  body_.push_back(chart_section(num_charts_++, "heatmap", h.title, h.note, data));
}

void ReportPage::add(StackedBars b) {
  const json data = {{"bars", b.bar_names}, {"parts", b.part_names}, {"values", numbers(b.values)}, {"unit", b.unit}};
  body_.push_back(chart_section(num_charts_++, "bars", b.title, b.note, data));
}

void ReportPage::add(Timeline t) {
  std::vector<std::string> names;
  json spans = json::array();
  for (const Timeline::Span& s : t.spans) {
    auto it = std::find(names.begin(), names.end(), s.name);
    if (it == names.end()) it = names.insert(names.end(), s.name);
    spans.push_back(s.lane);
    spans.push_back(it - names.begin());
    spans.push_back(static_cast<float>(s.begin));
    spans.push_back(static_cast<float>(s.end));
  }
  const json data = {{"lanes", t.lanes}, {"names", names}, {"spans", spans}, {"unit", t.unit}};
  body_.push_back(chart_section(num_charts_++, "timeline", t.title, t.note, data));
}

std::string ReportPage::html() const {
  std::string out = fmt::format(
      "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
      "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><title>{}</title><style>{}</style>"
      "</head>\n<body><header><h1>{}</h1><p>{}</p></header><main>\n",
      html_escape(title_), observe_detail::report_style(), html_escape(title_), html_escape(subtitle_));
  for (const std::string& part : body_) out += part;
  out += "</main><script>";
  out += observe_detail::report_script();
  out += "</script></body></html>\n";
  return out;
}

Status write_report(const ReportPage& page, const std::string& path, std::size_t* bytes) {
  const std::string html = page.html();
  if (bytes) *bytes = html.size();
  return observe_detail::write_file_atomically(path, html);
}

}  // namespace epx
