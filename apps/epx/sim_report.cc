// The simulated run's page: built from SimResult with the run report's frame.
#include "sim_report.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include <fmt/format.h>

#include "epx/observe/report_page.h"

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
                              row("gradient all-reduce busy", s.grad_sync_s, 1e3, " ms"),
                              row("gradient all-reduce exposed", s.grad_exposed_s, 1e3, " ms"),
                              row("gradient all-reduce hidden", s.grad_hidden, 100, "%"),
                              row("pipeline transfers (critical path)", s.pp_transfer_s, 1e3, " ms"),
                              row("optimizer update", s.optimizer_s, 1e3, " ms"),
                              row("weight all-gather (ZeRO-1)", s.param_gather_s, 1e3, " ms")}};
}

// How the step time is made, as the simulator adds it up (mean over the
// steps): (units + pp - 1) stage units, the pipeline transfers on the 1F1B
// critical path, the gradient all-reduce the backward does not hide, the
// optimizer update and the ZeRO-1 weight all-gathers.
void add_whole_step(ReportPage& page, const sim::Scenario& scenario, const sim::SimResult& r) {
  const sim::ParallelismConfig& p = scenario.parallelism;
  const int units = p.micro_batches / (scenario.schedule.overlap == "two_micro_batch" ? 2 : 1);
  double parts[5] = {};
  for (const sim::StepStats& st : r.steps) {
    const double each[5] = {(units + p.pp_stages - 1) * st.stage_s, st.pp_transfer_s, st.grad_exposed_s,
                            st.optimizer_s, st.param_gather_s};
    for (int i = 0; i < 5; ++i) parts[i] += 1e3 * each[i] / static_cast<double>(r.steps.size());
  }
  StackedBars step{.title = "Where the step time goes (mean over the steps)", .unit = "ms",
                   .note = fmt::format("{} stage units of {} micro-batch(es) over {} pipeline stages (1F1B: units + "
                                       "stages - 1 on the critical path); transfers between stages over {} ({:.2f} MiB "
                                       "per micro-batch per GPU); then what the backward leaves exposed of the "
                                       "gradient all-reduce (EDP {} ranks, dense over {}), the optimizer ({}{}) and "
                                       "its weight all-gathers.",
                                       units, units == p.micro_batches ? 1 : 2, p.pp_stages, r.pipeline.link,
                                       r.pipeline.bytes / (1 << 20), r.edp_ranks, r.dp_ranks,
                                       scenario.optimizer.kind, scenario.optimizer.zero ? ", ZeRO-1" : ""),
                   .bar_names = {"step"},
                   .part_names = {"pipeline stages (MoE and dense layers)", "pipeline transfers",
                                  "gradient all-reduce exposed", "optimizer update", "weight all-gather"},
                   .values = {parts, parts + 5}};
  page.add(std::move(step));
}

// Where the routing comes from and how skewed the expert load is.
std::string routing_source(const sim::Scenario& s, const sim::SimResult& r) {
  const sim::RoutingConfig& q = s.routing;
  std::string source = q.distribution;
  if (q.distribution == "zipf") source = fmt::format("Zipf popularity (s = {})", q.zipf_s);
  if (q.distribution == "lognormal") source = fmt::format("log-normal popularity (sigma = {})", q.lognormal_sigma);
  if (q.distribution == "uniform") source = "uniform popularity";
  if (q.distribution == "trace") source = fmt::format("replayed per-expert counts from {} (format {})", q.trace, q.trace_format);
  return fmt::format(
      "Routing: {}{}, seed {}; every GPU's tokens through epx's own router and dispatch layout ({} of {} tokens "
      "routed per GPU per layer, counts scaled by {:.4g}); balancing {}. Expert-load skew (MaxVio, p50 over the "
      "steps) {:.3g}, worst GPU idle (p50) {:.1f}%.",
      source, q.drift > 0 ? fmt::format(", drifting {} per step", q.drift) : "", q.seed, r.sampled_tokens,
      s.parallelism.tokens_per_gpu, r.sample_scale, s.balancing.strategy, r.summary.max_vio.p50,
      100 * r.summary.worst_idle.p50);
}

std::string kernel_family(const sim::Scenario& s) {
  const std::string& d = s.parallelism.dispatch;
  const std::string family =
      d == "low_latency"       ? "low-latency (one message per (token, expert), direct RDMA)"
      : d == "low_latency_epx" ? (s.parallelism.combine_per_rank
                                      ? "epx's CPU low-latency (a row per (token, rank) both ways)"
                                      : "epx's CPU low-latency (a row per (token, rank) out, per (token, expert) back)")
      : d == "two_hop"         ? "normal two-hop (NVLink inside a node, one NIC copy per node)"
                               : "flat (one copy per (token, rank))";
  return fmt::format("All-to-all kernel: {}; {} of {} SMs for communication (docs/simulator.md \"Kernel models\").",
                     family, s.hardware.comm_sms, s.hardware.sms);
}

// Step time, idle, exposed communication and the expert-load skew over the simulated steps.
void add_step_charts(ReportPage& page, const sim::SimResult& r) {
  StepBins bins(5, 1000);
  for (std::size_t i = 0; i < r.steps.size(); ++i) {
    const sim::StepStats& st = r.steps[i];
    const double v[5] = {1e3 * st.step_s, 100 * st.worst_idle, 100 * st.mean_idle, 100 * st.exposed_comm,
                         st.max_vio};
    bins.add(static_cast<int64_t>(i), v);
  }
  LineChart time{.title = "Step time", .x_label = "step", .y_label = "ms", .note = {}, .x = {},
                 .series = {{"step time", {}, {}}}, .marks = {}, .marks_label = {}};
  LineChart idle{.title = "Idle and exposed communication", .x_label = "step", .y_label = "% of stage", .note = {},
                 .x = {},
                 .series = {{"worst GPU idle", {}, {}}, {"mean GPU idle", {}, {}}, {"communication not hidden", {}, {}}},
                 .marks = {}, .marks_label = {}};
  LineChart skew{.title = "Expert-load skew", .x_label = "step", .y_label = "MaxVio", .note = {}, .x = {},
                 .series = {{"MaxVio (max expert load / mean - 1, worst layer)", {}, {}}}, .marks = {},
                 .marks_label = {}};
  for (int b = 0; b < bins.num_bins(); ++b) {
    time.x.push_back(bins.mean_step(b));
    idle.x.push_back(bins.mean_step(b));
    time.series[0].y.push_back(bins.mean(b, 0));
    for (int c = 0; c < 3; ++c) idle.series[static_cast<std::size_t>(c)].y.push_back(bins.mean(b, c + 1));
    skew.x.push_back(bins.mean_step(b));
    skew.series[0].y.push_back(bins.mean(b, 4));
  }
  if (bins.bin_size() > 1) time.note = idle.note = skew.note = fmt::format("Each point is the mean of {} steps.", bins.bin_size());
  page.add(std::move(time));
  page.add(std::move(idle));
  page.add(std::move(skew));
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
  page.add_paragraph(kernel_family(scenario));
  page.add_paragraph(routing_source(scenario, result));
  page.add(summary_table(result));
  if (scenario.parallelism.mode == "train" || scenario.parallelism.pp_stages > 1) {
    page.add_heading("The whole step");
    add_whole_step(page, scenario, result);
  }
  page.add_heading("Over the steps");
  add_step_charts(page, result);
  page.add_heading("One step, per GPU");
  add_traced_step(page, scenario, result);
  add_phases(page, result);
  return write_report(page, path);
}

}  // namespace epx::app
