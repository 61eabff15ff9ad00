// The run report: a training run's metrics, accumulated record by record into
// bounded binned series (StepBins, report_page.h), and the report page built
// from them. `epx report` writes it.
//
//   epx::RunReport report;
//   EPX_RETURN_IF_ERROR(epx::read_run_metrics("metrics.jsonl", [&](epx::StepRecord&& s) {
//     report.add(std::move(s));
//     return epx::Status::ok();
//   }));
//   EPX_RETURN_IF_ERROR(epx::write_report(report.page("run 42"), "report.html"));
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "epx/observe/report_page.h"
#include "epx/observe/run_log.h"

namespace epx {

// What a run's report found, for the command's own summary line.
struct RunSummary {
  int64_t num_steps = 0, first_step = 0, last_step = 0;
  double final_loss = 0, mean_tokens_per_s = 0, mean_max_vio = 0, mean_balancedness = 0;
  // The held-out loss (StepRecord::val_loss): how many steps have one, the
  // last of them and its step (NaN and -1 when none has).
  int64_t num_val_losses = 0, last_val_step = -1;
  double last_val_loss = std::numeric_limits<double>::quiet_NaN();
  int64_t dropped = 0, eplb_replacements = 0, eplb_moved_slots = 0, eplb_moved_bytes = 0;
  int step_bin = 1, heatmap_bin = 1;  // steps per point of the line charts / per heatmap column
  bool has_wait_matrix = false;
  int64_t wait_matrix_step = -1;
  std::string straggler;  // describe() of the worst straggler, "rank 3 (compute): ..."; empty: none
  std::vector<MetricsResume> resumes;  // where the run was resumed, by step
};

// "from the checkpoint of step 6 (2 earlier records of step 6 and later left
// out: each step is shown once)", resumes joined by "; ".
[[nodiscard]] std::string describe_resumes(const std::vector<MetricsResume>& resumes);

struct RunReportOptions {
  int max_points = 1000;        // per line chart
  int max_heatmap_columns = 64;  // step bins of the expert-load heatmap
  int straggler_window = 100;    // last steps given to diagnose_stragglers
};

// Accumulates a run's records, one at a time, into bounded binned series.
class RunReport {
 public:
  explicit RunReport(RunReportOptions options = {});
  RunReport(RunReport&&) noexcept;
  RunReport& operator=(RunReport&&) noexcept;
  ~RunReport();

  void add(StepRecord&& record);
  // A resume found by the reader (read_run_metrics); a record's resumed_from
  // is one too. The summary lists each step once.
  void add_resume(const MetricsResume& resume);
  // A row the page's summary table ends with, for what the metrics do not
  // hold (e.g. a supervisor's restarts, from its events file).
  void add_summary_row(std::string name, std::string value);
  [[nodiscard]] RunSummary summary() const;
  // The page; `source` (the metrics file) is shown under the title.
  [[nodiscard]] ReportPage page(const std::string& source) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace epx
