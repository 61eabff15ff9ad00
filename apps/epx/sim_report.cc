// The simulated run's page: built from SimResult with the run report's frame.
#include "sim_report.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include <fmt/format.h>

#include "epx/observe/report.h"

namespace epx::app {
namespace {

// GPUs drawn in the timeline and the per-GPU bars (the first ones of EP group 0).
constexpr int kMaxGpus = 16;

using Interval = std::pair<int64_t, int64_t>;

// Sorted, merged intervals.
std::vector<Interval> union_of(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const Interval& i : v) {
    if (!out.empty() && i.first <= out.back().second)
      out.back().second = std::max(out.back().second, i.second);
    else
      out.push_back(i);
  }
  return out;
}

int64_t length(const std::vector<Interval>& v) {
  int64_t n = 0;
  for (const Interval& i : v) n += i.second - i.first;
  return n;
}

// The time two merged interval lists overlap.
int64_t overlap(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  int64_t n = 0;
  for (std::size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    n += std::max<int64_t>(0, std::min(a[i].second, b[j].second) - std::max(a[i].first, b[j].first));
    (a[i].second < b[j].second) ? ++i : ++j;
  }
  return n;
}

// One GPU of the traced step, split into compute, communication alone and
// nothing running (ms); the three add up to the traced stage.
struct GpuSplit {
  double compute = 0, comm_only = 0, idle = 0;
};

std::vector<GpuSplit> split_gpus(const std::vector<TraceSpan>& trace, int num_gpus, int64_t begin, int64_t end) {
  std::vector<std::vector<Interval>> busy(static_cast<std::size_t>(num_gpus)), comm(busy.size());
  for (const TraceSpan& s : trace) {
    const int g = s.rank / 2;
    if (g >= num_gpus || s.name == "idle") continue;
    (s.rank % 2 == 0 ? busy : comm)[static_cast<std::size_t>(g)].push_back({s.begin_ns, s.end_ns});
  }
  std::vector<GpuSplit> out;
  for (int g = 0; g < num_gpus; ++g) {
    const auto b = union_of(busy[static_cast<std::size_t>(g)]), c = union_of(comm[static_cast<std::size_t>(g)]);
    const int64_t compute = length(b), comm_only = length(c) - overlap(b, c);
    out.push_back({1e-6 * static_cast<double>(compute), 1e-6 * static_cast<double>(comm_only),
                   1e-6 * static_cast<double>(std::max<int64_t>(0, end - begin - compute - comm_only))});
  }
  return out;
}

ReportTable summary_table(const sim::SimResult& r) {
  const sim::Summary& s = r.summary;
  auto row = [](const std::string& name, const sim::Percentiles& p, double scale, const char* unit) {
    auto f = [&](double v) {
      const double x = v * scale;
      return std::abs(x) >= 1e4 ? fmt::format("{:.0f}{}", x, unit) : fmt::format("{:.4g}{}", x, unit);
    };
    return std::vector<std::string>{name, f(p.p50), f(p.p99), f(p.mean)};
  };
  return ReportTable{.title = "Summary (per step)",
                     .header = {"", "p50", "p99", "mean"},
                     .rows = {row("step time", s.step_s, 1e3, " ms"), row("worst GPU idle", s.worst_idle, 100, "%"),
                              row("communication not hidden (share of stage)", s.exposed_comm, 100, "%"),
                              row("communication busy (share of stage)", s.comm_share, 100, "%"),
                              row("tokens/s/GPU", s.tokens_per_s_per_gpu, 1, ""), row("MFU", s.mfu, 100, "%"),
                              row("MaxVio (expert load)", s.max_vio, 1, ""),
                              row("gradient all-reduce exposed", s.grad_exposed_s, 1e3, " ms")}};
}

// Step time, idle and exposed communication over the simulated steps.
void add_step_charts(ReportPage& page, const sim::SimResult& r) {
  StepBins bins(4, 1000);
  for (std::size_t i = 0; i < r.steps.size(); ++i) {
    const sim::StepStats& st = r.steps[i];
    const double v[4] = {1e3 * st.step_s, 100 * st.worst_idle, 100 * st.mean_idle, 100 * st.exposed_comm};
    bins.add(static_cast<int64_t>(i), v);
  }
  LineChart time{.title = "Step time", .x_label = "step", .y_label = "ms", .note = {}, .x = {}, .series = {{"step time", {}}},
                 .marks = {}, .marks_label = {}};
  LineChart idle{.title = "Idle and exposed communication", .x_label = "step", .y_label = "% of stage", .note = {},
                 .x = {}, .series = {{"worst GPU idle", {}}, {"mean GPU idle", {}}, {"communication not hidden", {}}},
                 .marks = {}, .marks_label = {}};
  for (int b = 0; b < bins.num_bins(); ++b) {
    time.x.push_back(bins.mean_step(b));
    idle.x.push_back(bins.mean_step(b));
    time.series[0].y.push_back(bins.mean(b, 0));
    for (int c = 0; c < 3; ++c) idle.series[static_cast<std::size_t>(c)].y.push_back(bins.mean(b, c + 1));
  }
  if (bins.bin_size() > 1) time.note = idle.note = fmt::format("Each point is the mean of {} steps.", bins.bin_size());
  page.add(std::move(time));
  page.add(std::move(idle));
}

// The traced step: per-GPU timelines and the split of each GPU's time.
void add_traced_step(ReportPage& page, const sim::Scenario& scenario, const sim::SimResult& r) {
  int num_gpus = 0;
  int64_t begin = INT64_MAX, end = INT64_MIN;
  for (const TraceSpan& s : r.trace) {
    num_gpus = std::max(num_gpus, s.rank / 2 + 1);
    begin = std::min(begin, s.begin_ns);
    end = std::max(end, s.end_ns);
  }
  if (r.trace.empty()) {
    page.add_paragraph("The simulator kept no trace of a step.");
    return;
  }
  const int shown = std::min(num_gpus, kMaxGpus);
  const std::string which = shown < num_gpus ? fmt::format("the first {} of {} GPUs", shown, num_gpus) : "every GPU";
  Timeline t{.title = fmt::format("Timelines of step {} (first stage with an MoE layer, EP group 0)",
                                  scenario.run.trace_step),
             .unit = "ms", .note = fmt::format("Each GPU's compute stream and its communication stream; {}.", which),
             .lanes = {}, .spans = {}};
  for (int g = 0; g < shown; ++g) {
    t.lanes.push_back(fmt::format("GPU {} compute", g));
    t.lanes.push_back(fmt::format("GPU {} comm", g));
  }
  for (const TraceSpan& s : r.trace)
    if (s.rank < 2 * shown)
      t.spans.push_back({s.rank, s.name, 1e-6 * static_cast<double>(s.begin_ns - begin),
                         1e-6 * static_cast<double>(s.end_ns - begin)});
  page.add(std::move(t));

  StackedBars split{.title = "Where each GPU's time went in the traced step", .unit = "ms",
                    .note = "Compute: the compute stream busy. Communication only: in flight with no compute "
                            "running (exposed). Idle: nothing running.",
                    .bar_names = {}, .part_names = {"compute", "communication only (exposed)", "idle"}, .values = {}};
  const std::vector<GpuSplit> gpus = split_gpus(r.trace, shown, begin, end);
  for (int g = 0; g < shown; ++g) {
    split.bar_names.push_back(fmt::format("GPU {}", g));
    const GpuSplit& s = gpus[static_cast<std::size_t>(g)];
    split.values.insert(split.values.end(), {s.compute, s.comm_only, s.idle});
  }
  page.add(std::move(split));
}

void add_phases(ReportPage& page, const sim::SimResult& r) {
  StackedBars phases{.title = "Time per GPU per stage unit by task (forward + backward)", .unit = "ms", .note = {},
                     .bar_names = {"mean GPU"}, .part_names = {}, .values = {}};
  for (const auto& [name, seconds] : r.summary.phase_s) {
    phases.part_names.push_back(name);
    phases.values.push_back(1e3 * seconds);
  }
  page.add(std::move(phases));
}

}  // namespace

Status write_sim_report(const sim::Scenario& scenario, const sim::SimResult& result, const std::string& description,
                        const std::string& path) {
  ReportPage page("epx simulated run",
                  fmt::format("{} steps of {} GPUs ({})", scenario.run.steps, scenario.num_gpus(), scenario.hardware.name));
  std::istringstream lines(description);
  for (std::string line; std::getline(lines, line);)
    if (!line.empty()) page.add_paragraph(line);
  page.add(summary_table(result));
  page.add_heading("Over the steps");
  add_step_charts(page, result);
  page.add_heading("One step, per GPU");
  add_traced_step(page, scenario, result);
  add_phases(page, result);
  return write_report(page, path);
}

}  // namespace epx::app
