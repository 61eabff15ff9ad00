// RunReport: a training run's metrics, accumulated record by record into
// bounded binned series, and the page built from them.
#include "epx/observe/run_report.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include <fmt/format.h>

#include "epx/observe/straggler.h"
#include "observe/report_html.h"

namespace epx {
namespace {

// The columns of the line charts, one StepBins column each.
enum Column { kLoss, kMainLoss, kTokensPerS, kSeconds, kMaxVioMean, kMaxVioMax, kBalMean, kBalMin, kNumColumns };

// Where a re-placement happened: the record's position (for the heatmap's
// bins) and its step (for the line charts).
struct Mark {
  int64_t ordinal = 0, step = 0;
};
constexpr std::size_t kMaxMarks = 4096;

// A rank's times summed over the steps.
struct RankSums {
  double router = 0, dispatch = 0, experts = 0, combine = 0, dense = 0, wait = 0, sync = 0, total = 0;
  double exchange_wait = 0;
  int64_t steps = 0;
};

// The expert-load heatmap shows each expert's tokens over its layer's mean
// expert, from 0 to this (clipped above).
constexpr double kLoadScaleMax = 3.0;

std::string percent(double v) { return std::isfinite(v) ? fmt::format("{:.1f}%", 100 * v) : "n/a"; }
std::string number(double v) { return std::isfinite(v) ? fmt::format("{:.4g}", v) : "n/a"; }

}  // namespace

std::string describe_resumes(const std::vector<MetricsResume>& resumes) {
  std::string out;
  for (const MetricsResume& r : resumes) {
    out += fmt::format("{}from the checkpoint of step {}", out.empty() ? "" : "; ", r.step);
    if (r.replaced > 0)
      out += fmt::format(" ({} earlier record{} of step {} and later left out: each step is shown once)", r.replaced,
                         r.replaced == 1 ? "" : "s", r.step);
  }
  return out;
}

namespace {

}  // namespace

struct RunReport::State {
  explicit State(RunReportOptions o)
      : options(o),
        series(kNumColumns, o.max_points),
        val_series(1, o.max_points),
        window(static_cast<std::size_t>(std::max(1, o.straggler_window))) {}
  RunReportOptions options;
  StepBins series;
  StepBins val_series;  // the records that hold a val_loss, binned by themselves
  std::unique_ptr<StepBins> load;       // [layer][expert] tokens
  std::unique_ptr<StepBins> layer_vio;  // [layer] max_vio
  std::vector<double> scratch_vio;  // one record's max_vio per layer, reused
  int num_layers = 0, num_experts = 0;
  int64_t num_records = 0, first_step = 0, last_step = 0, odd_layouts = 0;
  double final_loss = std::numeric_limits<double>::quiet_NaN();
  double last_val_loss = std::numeric_limits<double>::quiet_NaN();
  int64_t num_val_losses = 0, last_val_step = -1;
  double sum_tokens_per_s = 0, sum_max_vio = 0, sum_balancedness = 0;
  int64_t dropped = 0, eplb_count = 0, eplb_slots = 0, eplb_bytes = 0;
  std::vector<Mark> marks;
  std::vector<RankSums> ranks;
  std::optional<WaitMatrix> wait_matrix;
  int64_t wait_matrix_step = -1;
  StragglerWindow window;
  std::vector<std::vector<int64_t>> set_aside;  // the expert loads, out of a record while it is copied
  std::map<int64_t, int64_t> resumes;  // step resumed from -> earlier records it replaced
  std::vector<std::vector<std::string>> extra_rows;  // add_summary_row

  void add_series(const StepRecord& r);
  void add_val_loss(const StepRecord& r);
  void add_layers(const StepRecord& r);
  void add_ranks(const StepRecord& r);
  void keep_for_diagnosis(StepRecord& r);

  // The page's sections.
  void add_summary(ReportPage& page, const RunSummary& sum) const;
  void add_training(ReportPage& page) const;
  void add_balance(ReportPage& page) const;
  void add_expert_load(ReportPage& page) const;
  void add_rank_times(ReportPage& page) const;
  void add_waits(ReportPage& page, const RunSummary& sum) const;
  [[nodiscard]] LineChart loss_chart() const;
  [[nodiscard]] LineChart line_chart(std::string title, std::string y_label, std::vector<Column> columns,
                                     std::vector<std::string> names) const;
};

void RunReport::State::add_series(const StepRecord& r) {
  double vio_max = r.layers.empty() ? 0 : -std::numeric_limits<double>::infinity();
  double bal_min = r.layers.empty() ? 1 : std::numeric_limits<double>::infinity();
  for (const LayerRecord& l : r.layers) {
    vio_max = std::max(vio_max, l.max_vio);
    bal_min = std::min(bal_min, l.balancedness());
    dropped += l.dropped;
  }
  const double values[kNumColumns] = {r.loss,        r.main_loss, r.tokens_per_s,     r.seconds,
                                      r.max_vio(),   vio_max,     r.balancedness(),   bal_min};
  series.add(r.step, values);
  sum_tokens_per_s += r.tokens_per_s;
  sum_max_vio += r.max_vio();
  sum_balancedness += r.balancedness();
  final_loss = r.loss;
}

// Validation losses are sparse (every N steps): binned over the records that
// have one, so a long run keeps at most max_points of them too.
void RunReport::State::add_val_loss(const StepRecord& r) {
  if (!r.val_loss) return;
  const double value = *r.val_loss;
  val_series.add(r.step, std::span<const double>(&value, 1));
  last_val_loss = value;
  last_val_step = r.step;
  ++num_val_losses;
}

// The expert loads and per-layer MaxVio; the layout (layers x experts) is the
// first record's, and a record of another layout is counted, not drawn.
void RunReport::State::add_layers(const StepRecord& r) {
  if (r.layers.empty()) return;
  if (!load) {
    num_layers = static_cast<int>(r.layers.size());
    num_experts = static_cast<int>(r.layers[0].tokens_per_expert.size());
    load = std::make_unique<StepBins>(num_layers * num_experts, options.max_heatmap_columns,
                                      StepBins::Values::kCounts);
    layer_vio = std::make_unique<StepBins>(num_layers, 4 * options.max_heatmap_columns);
  }
  bool same = static_cast<int>(r.layers.size()) == num_layers;
  for (const LayerRecord& l : r.layers) same = same && static_cast<int>(l.tokens_per_expert.size()) == num_experts;
  if (!same) {
    ++odd_layouts;
    return;
  }
  std::vector<double>& vio = scratch_vio;
  vio.resize(static_cast<std::size_t>(num_layers));
  for (int l = 0; l < num_layers; ++l) vio[static_cast<std::size_t>(l)] = r.layers[static_cast<std::size_t>(l)].max_vio;
  load->add_counts(r.step, [&](int64_t* sums) {
    for (const LayerRecord& layer : r.layers) {
      for (int64_t tokens : layer.tokens_per_expert) *sums++ += tokens;
    }
  });
  layer_vio->add(r.step, vio);
}

void RunReport::State::add_ranks(const StepRecord& r) {
  if (ranks.size() < r.ranks.size()) ranks.resize(r.ranks.size());
  for (std::size_t i = 0; i < r.ranks.size(); ++i) {
    const RankRecord& t = r.ranks[i];
    RankSums& s = ranks[i];
    s.router += t.router, s.dispatch += t.dispatch, s.experts += t.experts, s.combine += t.combine;
    s.dense += t.dense, s.wait += t.wait, s.sync += t.sync, s.total += t.total, s.exchange_wait += t.exchange_wait;
    ++s.steps;
  }
}

// A copy of the record without its expert loads (the diagnosis reads the
// ranks and tokens_per_rank); the record itself stays the reader's to reuse.
void RunReport::State::keep_for_diagnosis(StepRecord& r) {
  set_aside.resize(r.layers.size());
  for (std::size_t l = 0; l < r.layers.size(); ++l) set_aside[l].swap(r.layers[l].tokens_per_expert);
  window.add(r);
  for (std::size_t l = 0; l < r.layers.size(); ++l) set_aside[l].swap(r.layers[l].tokens_per_expert);
}

RunReport::RunReport(RunReportOptions options) : state_(std::make_unique<State>(options)) {}
RunReport::RunReport(RunReport&&) noexcept = default;
RunReport& RunReport::operator=(RunReport&&) noexcept = default;
RunReport::~RunReport() = default;

void RunReport::add(StepRecord&& r) {
  State& s = *state_;
  if (s.num_records == 0) s.first_step = r.step;
  s.last_step = r.step;
  s.add_series(r);
  s.add_val_loss(r);
  s.add_layers(r);
  s.add_ranks(r);
  if (r.eplb) {
    ++s.eplb_count;
    s.eplb_slots += r.eplb->moved_slots;
    s.eplb_bytes += r.eplb->moved_bytes;
    if (s.marks.size() < kMaxMarks) s.marks.push_back({s.num_records, r.step});
  }
  if (r.wait_matrix) {
    s.wait_matrix = *r.wait_matrix;
    s.wait_matrix_step = r.step;
  }
  if (r.resumed_from >= 0) add_resume({.step = r.resumed_from, .replaced = 0});
  ++s.num_records;
  s.keep_for_diagnosis(r);
}

void RunReport::add_resume(const MetricsResume& resume) {
  int64_t& replaced = state_->resumes[resume.step];
  replaced = std::max(replaced, resume.replaced);
}

void RunReport::add_summary_row(std::string name, std::string value) {
  state_->extra_rows.push_back({std::move(name), std::move(value)});
}

RunSummary RunReport::summary() const {
  const State& s = *state_;
  RunSummary out;
  out.num_steps = s.num_records;
  out.first_step = s.first_step;
  out.last_step = s.last_step;
  out.final_loss = s.final_loss;
  out.num_val_losses = s.num_val_losses;
  out.last_val_step = s.last_val_step;
  out.last_val_loss = s.last_val_loss;
  const double n = s.num_records > 0 ? static_cast<double>(s.num_records) : 1.0;
  out.mean_tokens_per_s = s.sum_tokens_per_s / n;
  out.mean_max_vio = s.sum_max_vio / n;
  out.mean_balancedness = s.sum_balancedness / n;
  out.dropped = s.dropped;
  out.eplb_replacements = s.eplb_count;
  out.eplb_moved_slots = s.eplb_slots;
  out.eplb_moved_bytes = s.eplb_bytes;
  out.step_bin = static_cast<int>(s.series.bin_size());
  out.heatmap_bin = s.load ? static_cast<int>(s.load->bin_size()) : 1;
  out.has_wait_matrix = s.wait_matrix.has_value();
  out.wait_matrix_step = s.wait_matrix_step;
  const std::vector<Straggler> found = s.window.diagnose();
  if (!found.empty()) out.straggler = describe(found[0]);
  for (const auto& [step, replaced] : s.resumes) out.resumes.push_back({.step = step, .replaced = replaced});
  return out;
}

void RunReport::State::add_summary(ReportPage& page, const RunSummary& sum) const {
  ReportTable t{.title = "Summary", .header = {"", ""}, .rows = {}};
  t.rows.push_back({"steps", fmt::format("{} (steps {} to {})", sum.num_steps, sum.first_step, sum.last_step)});
  t.rows.push_back({"final loss", number(sum.final_loss)});
  if (sum.num_val_losses > 0)
    t.rows.push_back({"last validation loss (held out)",
                      fmt::format("{} (step {}; {} evaluation{})", number(sum.last_val_loss), sum.last_val_step,
                                  sum.num_val_losses, sum.num_val_losses == 1 ? "" : "s")});
  t.rows.push_back({"mean tokens/s", fmt::format("{:.0f}", sum.mean_tokens_per_s)});
  t.rows.push_back({"mean MaxVio (mean over layers)", number(sum.mean_max_vio)});
  t.rows.push_back({"mean balancedness (mean/max work over ranks, mean over layers)", percent(sum.mean_balancedness)});
  t.rows.push_back({"dropped tokens (all layers, all steps)", fmt::format("{}", sum.dropped)});
  t.rows.push_back({"EPLB re-placements", fmt::format("{} ({} slots moved, {:.1f} MiB)", sum.eplb_replacements,
                                                      sum.eplb_moved_slots, sum.eplb_moved_bytes / 1048576.0)});
  t.rows.push_back({"straggler (last " + std::to_string(options.straggler_window) + " steps)",
                    sum.straggler.empty() ? "none" : sum.straggler});
  t.rows.push_back({"downsampling", fmt::format("line charts: {} step(s) per point; expert-load heatmap: {} step(s) "
                                                "per column; each the mean of its steps",
                                                sum.step_bin, sum.heatmap_bin)});
  if (!sum.resumes.empty()) t.rows.push_back({"resumed", describe_resumes(sum.resumes)});
  if (odd_layouts > 0)
    t.rows.push_back({"records left out of the heatmaps",
                      fmt::format("{} (their layers x experts differ from the first record's)", odd_layouts)});
  for (const std::vector<std::string>& row : extra_rows) t.rows.push_back(row);
  page.add(std::move(t));
}

LineChart RunReport::State::line_chart(std::string title, std::string y_label, std::vector<Column> columns,
                                       std::vector<std::string> names) const {
  LineChart c{.title = std::move(title), .x_label = "step", .y_label = std::move(y_label), .note = {}, .x = {},
              .series = {}, .marks = {}, .marks_label = "EPLB re-placement"};
  for (int b = 0; b < series.num_bins(); ++b) c.x.push_back(series.mean_step(b));
  for (std::size_t i = 0; i < columns.size(); ++i) {
    ChartSeries s{.name = names[i], .y = {}, .x = {}};
    for (int b = 0; b < series.num_bins(); ++b) s.y.push_back(series.mean(b, columns[i]));
    c.series.push_back(std::move(s));
  }
  for (const Mark& m : marks) c.marks.push_back(static_cast<double>(m.step));
  if (series.bin_size() > 1)
    c.note = fmt::format("Each point is the mean of {} consecutive steps.", series.bin_size());
  return c;
}

// The training losses, and the validation loss as its own series of points
// at the steps that have one.
LineChart RunReport::State::loss_chart() const {
  LineChart c = line_chart("Loss", "loss", {kLoss, kMainLoss}, {"loss", "main loss (without the balancing losses)"});
  if (num_val_losses == 0) return c;
  ChartSeries val{.name = "validation loss (held out)", .y = {}, .x = {}};
  for (int b = 0; b < val_series.num_bins(); ++b) {
    val.x.push_back(val_series.mean_step(b));
    val.y.push_back(val_series.mean(b, 0));
  }
  c.series.push_back(std::move(val));
  if (val_series.bin_size() > 1)
    c.note += fmt::format("{}Each validation point is the mean of {} consecutive evaluations.",
                          c.note.empty() ? "" : " ", val_series.bin_size());
  return c;
}

void RunReport::State::add_training(ReportPage& page) const {
  page.add_heading("Training");
  page.add(loss_chart());
  page.add(line_chart("Throughput", "tokens/s", {kTokensPerS}, {"tokens/s"}));
}

void RunReport::State::add_balance(ReportPage& page) const {
  page.add_heading("Expert balance");
  page.add(line_chart("MaxVio (max expert load / mean - 1)", "MaxVio", {kMaxVioMean, kMaxVioMax},
                      {"mean over layers", "worst layer"}));
  LineChart bal = line_chart("Balancedness (mean / max work over ranks)", "balancedness", {kBalMean, kBalMin},
                             {"mean over layers", "worst layer"});
  page.add(std::move(bal));
}

// Per layer: each expert's tokens over the layer's mean expert, per step
// bin; and the whole run's per (layer, expert) picture.
void RunReport::State::add_expert_load(ReportPage& page) const {
  if (!load || load->num_bins() == 0 || num_experts == 0) {
    page.add_paragraph("No per-expert loads in this file.");
    return;
  }
  const int bins = load->num_bins(), L = num_layers, E = num_experts;
  Heatmap h{.title = "Expert load over steps", .x_label = "step", .y_label = "expert", .note = {}, .unit = "x mean",
            .rows = E, .cols = bins, .slice_names = {}, .values = {}, .min = 0, .max = kLoadScaleMax,
            .row_names = {}, .col_names = {}, .mark_cols = {}};
  h.values.resize(static_cast<std::size_t>(L) * E * bins);
  for (int l = 0; l < L; ++l) {
    h.slice_names.push_back(fmt::format("layer {}", l));
    for (int b = 0; b < bins; ++b) {
      double mean = 0;
      for (int e = 0; e < E; ++e) mean += load->mean(b, l * E + e);
      mean /= E;
      for (int e = 0; e < E; ++e)
        h.values[(static_cast<std::size_t>(l) * E + e) * bins + b] = mean > 0 ? load->mean(b, l * E + e) / mean : 0;
    }
  }
  for (int b = 0; b < bins; ++b) h.col_names.push_back(fmt::format("{:.0f}", load->mean_step(b)));
  for (const Mark& m : marks) {
    const int col = load->bin_of(m.ordinal);
    if (h.mark_cols.empty() || h.mark_cols.back() != col) h.mark_cols.push_back(col);
  }
  h.note = fmt::format("Tokens routed to each expert over the layer's mean expert (1 = even; clipped at {}x); pick the "
                       "layer above. {} step(s) per column. Red lines: EPLB re-placements.",
                       kLoadScaleMax, load->bin_size());
  page.add(std::move(h));

  std::vector<double> load_total(static_cast<std::size_t>(L) * E, 0.0);
  for (int b = 0; b < bins; ++b)
    for (int i = 0; i < L * E; ++i) load_total[static_cast<std::size_t>(i)] += load->sum(b, i);
  Heatmap all{.title = "Expert load over the whole run", .x_label = "expert", .y_label = "layer", .note = {},
              .unit = "x mean", .rows = L, .cols = E, .slice_names = {"all steps"}, .values = {}, .min = 0,
              .max = kLoadScaleMax, .row_names = {}, .col_names = {}, .mark_cols = {}};
  for (int l = 0; l < L; ++l) {
    double mean = 0;
    for (int e = 0; e < E; ++e) mean += load_total[static_cast<std::size_t>(l * E + e)];
    mean /= E;
    for (int e = 0; e < E; ++e)
      all.values.push_back(mean > 0 ? load_total[static_cast<std::size_t>(l * E + e)] / mean : 0);
  }
  all.note = "Each layer's tokens per expert over all steps, over the layer's mean expert: hot experts stand out.";
  page.add(std::move(all));

  const int vbins = layer_vio->num_bins();
  Heatmap vio{.title = "MaxVio per layer over steps", .x_label = "step", .y_label = "layer", .note = {}, .unit = "",
              .rows = L, .cols = vbins, .slice_names = {"MaxVio"}, .values = {}, .min = 0, .max = 0,
              .row_names = {}, .col_names = {}, .mark_cols = {}};
  for (int l = 0; l < L; ++l)
    for (int b = 0; b < vbins; ++b) vio.values.push_back(layer_vio->mean(b, l));
  for (double v : vio.values) vio.max = std::max(vio.max, std::isfinite(v) ? v : 0);
  for (int b = 0; b < vbins; ++b) vio.col_names.push_back(fmt::format("{:.0f}", layer_vio->mean_step(b)));
  vio.note = fmt::format("{} step(s) per column.", layer_vio->bin_size());
  page.add(std::move(vio));
}

void RunReport::State::add_rank_times(ReportPage& page) const {
  page.add_heading("Ranks");
  if (ranks.empty()) {
    page.add_paragraph("No per-rank times in this file.");
    return;
  }
  StackedBars times{.title = "Time per step by phase", .unit = "ms per step", .note = {}, .bar_names = {},
                    .part_names = {"router", "dispatch", "experts", "combine", "dense", "waiting", "sync", "other"},
                    .values = {}};
  StackedBars idle{.title = "Idle: waiting for other ranks", .unit = "% of step", .note = {}, .bar_names = {},
                   .part_names = {"in dispatch/combine (exchange wait)", "at the step barrier (waiting)"},
                   .values = {}};
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const RankSums& s = ranks[r];
    const double n = s.steps > 0 ? static_cast<double>(s.steps) : 1.0;
    const double named = s.router + s.dispatch + s.experts + s.combine + s.dense + s.wait + s.sync;
    times.bar_names.push_back(fmt::format("rank {}", r));
    for (double v : {s.router, s.dispatch, s.experts, s.combine, s.dense, s.wait, s.sync, std::max(0.0, s.total - named)})
      times.values.push_back(1e3 * v / n);
    idle.bar_names.push_back(fmt::format("rank {}", r));
    idle.values.push_back(s.total > 0 ? 100 * s.exchange_wait / s.total : 0);
    idle.values.push_back(s.total > 0 ? 100 * s.wait / s.total : 0);
  }
  times.note = "Mean over the run. Dispatch and combine include the time they waited for other ranks' data.";
  idle.note = "Mean over the run: time blocked on other ranks over the step's total.";
  page.add(std::move(times));
  page.add(std::move(idle));
}

void RunReport::State::add_waits(ReportPage& page, const RunSummary& sum) const {
  page.add_heading("Who waited for whom");
  page.add_paragraph(sum.straggler.empty() ? "Straggler: none (nobody waited noticeably in the last steps)."
                                           : "Straggler: " + sum.straggler);
  if (!wait_matrix || wait_matrix->num_ranks <= 0) {
    page.add_paragraph("No wait matrix in this file (epx train --wait-matrix-every N writes one every N steps).");
    return;
  }
  const WaitMatrix& w = *wait_matrix;
  const int R = w.num_ranks;
  Heatmap h{.title = fmt::format("Wait matrix of step {}", wait_matrix_step), .x_label = "waited for rank",
            .y_label = "rank", .note = {}, .unit = "ms", .rows = R, .cols = R,
            .slice_names = {"arrival: waited for the rank to arrive", "data: waited for the rank's data"},
            .values = {}, .min = 0, .max = 0, .row_names = {}, .col_names = {}, .mark_cols = {}};
  for (const std::vector<double>* m : {&w.arrival, &w.data})
    for (std::size_t i = 0; i < static_cast<std::size_t>(R) * R; ++i) h.values.push_back(i < m->size() ? 1e3 * (*m)[i] : 0);
  for (double v : h.values) h.max = std::max(h.max, v);
  if (h.max <= 0) h.max = 1;
  h.note = "Row r, column s: how long rank r waited for rank s in the step's dispatches and combines. A bright "
           "column is a rank the others wait for.";
  page.add(std::move(h));
}

ReportPage RunReport::page(const std::string& source) const {
  const State& s = *state_;
  const RunSummary sum = summary();
  ReportPage page("epx run report", fmt::format("{}: {} steps, {} MoE layers x {} experts, {} ranks", source,
                                                sum.num_steps, s.num_layers, s.num_experts, s.ranks.size()));
  s.add_summary(page, sum);
  s.add_training(page);
  s.add_balance(page);
  s.add_expert_load(page);
  s.add_rank_times(page);
  s.add_waits(page, sum);
  return page;
}

}  // namespace epx
