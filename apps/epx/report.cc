// `epx report`: reads a run's metrics once, streaming, into a RunReport and
// writes its page; prints what it found.
#include "report.h"

#include <chrono>
#include <cmath>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_checks.h"
#include "epx/observe/output_path.h"
#include "epx/observe/run_log.h"
#include "epx/observe/run_report.h"
#include "supervise_events.h"

namespace epx::app {
namespace {

nlohmann::json resumes_json(const std::vector<MetricsResume>& resumes) {
  nlohmann::json out = nlohmann::json::array();
  for (const MetricsResume& r : resumes) out.push_back({{"step", r.step}, {"replaced", r.replaced}});
  return out;
}

nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

nlohmann::json summary_json(const RunSummary& s, const std::string& path, double seconds) {
  nlohmann::json out = {{"output", path},
                        {"steps", s.num_steps},
                        {"first_step", s.first_step},
                        {"last_step", s.last_step},
                        {"final_loss", finite_or_null(s.final_loss)},
                        {"mean_tokens_per_s", s.mean_tokens_per_s},
                        {"mean_max_vio", s.mean_max_vio},
                        {"mean_balancedness", s.mean_balancedness},
                        {"dropped", s.dropped},
                        {"eplb_replacements", s.eplb_replacements},
                        {"eplb_moved_slots", s.eplb_moved_slots},
                        {"straggler", s.straggler},
                        {"wait_matrix_step", s.wait_matrix_step},
                        {"steps_per_point", s.step_bin},
                        {"steps_per_heatmap_column", s.heatmap_bin},
                        {"seconds", seconds},
                        {"resumes", resumes_json(s.resumes)}};
  if (s.num_val_losses > 0) {  // only runs that wrote a validation loss
    out["val_losses"] = s.num_val_losses;
    out["last_val_loss"] = finite_or_null(s.last_val_loss);
    out["last_val_step"] = s.last_val_step;
  }
  return out;
}

}  // namespace

CLI::App* add_report_command(CLI::App& app, ReportOptions& o) {
  CLI::App* cmd = app.add_subcommand(
      "report",
      "A run's metrics (epx train --metrics) as one self-contained HTML page: loss, tokens/s, expert load per layer "
      "over steps with EPLB re-placements, MaxVio and balancedness, per-rank times and idle, the wait matrix and "
      "the straggler, and a summary (docs/operations.md, The run report)");
  cmd->add_option("metrics", o.metrics_path, "The metrics file (JSON Lines, one object per step)")->required();
  cmd->add_option("-o,--output", o.output_path, "The HTML file to write (replaced atomically)")->capture_default_str();
  cmd->add_option("--max-points", o.max_points,
                  "At most this many points per line chart: steps are binned (power-of-two bins, mean per bin)")
      ->transform(in_range(2, 1000000))
      ->capture_default_str();
  cmd->add_option("--heatmap-columns", o.heatmap_columns, "At most this many step bins in the expert-load heatmap")
      ->transform(in_range(2, 4096))
      ->capture_default_str();
  cmd->add_option("--straggler-window", o.straggler_window, "The last steps the straggler diagnosis looks at")
      ->transform(in_range(1, 100000))
      ->capture_default_str();
  cmd->add_flag("--json", o.json, "Print one JSON object (what the page summarises) instead of the text lines");
  cmd->add_option("--events", o.events_path,
                  "The run's epx supervise --events file: also print its restarts, lost steps, failed ranks and "
                  "excluded hosts");
  return cmd;
}

int run_report(const ReportOptions& o) {
  const CommandPath inputs[] = {{"metrics", o.metrics_path, false}};
  const CommandPath outputs[] = {{"--output", o.output_path, false}};
  if (Status s = check_outputs_apart(inputs, outputs); !s.is_ok()) {
    fmt::print(stderr, "epx report: {}\n", s.message());
    return kExitUsage;
  }
  if (Status s = check_output_writable(o.output_path, "--output", /*renamed_into_place=*/true); !s.is_ok()) {
    fmt::print(stderr, "epx report: {}\n", s.message());
    return kExitUsage;
  }
  std::optional<RestartHistory> restarts;
  if (!o.events_path.empty()) {
    auto read = read_restart_history(o.events_path);
    if (!read.is_ok()) {
      fmt::print(stderr, "epx report: {}\n", read.status().message());
      return kExitUsage;
    }
    restarts = *read;
  }
  const auto start = std::chrono::steady_clock::now();
  RunReport report(RunReportOptions{.max_points = o.max_points, .max_heatmap_columns = o.heatmap_columns,
                                    .straggler_window = o.straggler_window});
  // Each step once: a resumed run's file may hold the steps after its checkpoint twice.
  std::vector<MetricsResume> resumes;
  Status read = read_run_metrics(
      o.metrics_path,
      [&](StepRecord&& r) {
        report.add(std::move(r));
        return Status::ok();
      },
      &resumes);
  for (const MetricsResume& r : resumes) report.add_resume(r);
  if (restarts) report.add_summary_row("supervised (epx supervise --events)", describe_restarts(*restarts));
  if (!read.is_ok()) {
    fmt::print(stderr, "epx report: {}\n", read.message());
    const StatusCode code = read.code();
    return code == StatusCode::kInvalidArgument || code == StatusCode::kNotFound ? kExitUsage : kExitFailed;
  }
  const RunSummary sum = report.summary();
  if (sum.num_steps == 0) {
    fmt::print(stderr, "epx report: '{}' holds no complete step record; nothing written\n", o.metrics_path);
    return kExitUsage;
  }
  std::size_t bytes = 0;
  if (Status s = write_report(report.page(o.metrics_path), o.output_path, &bytes); !s.is_ok()) {
    fmt::print(stderr, "epx report: {}\n", s.message());
    return kExitFailed;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (o.json) {
    nlohmann::json j = summary_json(sum, o.output_path, seconds);
    if (restarts) j["supervised"] = restarts_json(*restarts);
    fmt::print("{}\n", j.dump());
    return kExitOk;
  }
  fmt::print("wrote {} ({:.1f} KiB) from {} steps in {:.2f} s\n", o.output_path, bytes / 1024.0, sum.num_steps,
             seconds);
  const std::string val = sum.num_val_losses > 0 ? fmt::format(", last validation loss {:.4g} (step {})",
                                                                sum.last_val_loss, sum.last_val_step)
                                                  : std::string();
  fmt::print("final loss {:.4g}{}, mean tokens/s {:.0f}, mean MaxVio {:.3g}, balancedness {:.1f}%, dropped {}, "
             "EPLB re-placements {}, straggler: {}\n",
             sum.final_loss, val, sum.mean_tokens_per_s, sum.mean_max_vio, 100 * sum.mean_balancedness, sum.dropped,
             sum.eplb_replacements, sum.straggler.empty() ? "none" : sum.straggler);
  if (!sum.resumes.empty()) fmt::print("resumed {}\n", describe_resumes(sum.resumes));
  if (restarts) fmt::print("supervised: {}\n", describe_restarts(*restarts));
  return kExitOk;
}

}  // namespace epx::app
