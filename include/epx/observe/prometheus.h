// A run's state in the Prometheus text exposition format (version 0.0.4),
// for node_exporter's textfile collector: `epx monitor --prometheus
// $TEXTFILE_DIR/epx.prom` rewrites the file as the run goes, and the
// collector serves it with the node's other metrics.
//
//   std::string text = epx::format_prometheus(tracker.snapshot(), rules, evaluator.firing(), last_step_unix);
//   EPX_RETURN_IF_ERROR(epx::write_prometheus_file("/var/lib/node_exporter/epx.prom", text));
//
// Every family has HELP and TYPE lines; names carry their unit
// (`_seconds`, `_total` for counters), labels are `layer`, `rank`,
// `expert` and `rule`. The size is bounded: a few run-wide series, 3 per
// layer plus one per hot expert (RunTrackerOptions::hot_experts per layer),
// 3 per rank, one per alert rule; never ranks x ranks. The families and
// their meaning are listed in docs/operations.md (## Prometheus).
#pragma once

#include <span>
#include <string>
#include <vector>

#include "epx/core/status.h"
#include "epx/observe/alerts.h"
#include "epx/observe/run_snapshot.h"

namespace epx {

// `last_step_unix_seconds` (when the last new step was read) is written as
// epx_monitor_last_step_timestamp_seconds, so a dashboard can tell a stalled
// run from a healthy one; node_exporter's node_textfile_mtime_seconds tells
// whether the monitor itself still runs (it rewrites the file every refresh).
[[nodiscard]] std::string format_prometheus(const RunSnapshot& snapshot, std::span<const AlertRule> rules,
                                            std::span<const Alert> firing, double last_step_unix_seconds);

// Writes `text` to a temporary file in the same folder and renames it over
// `path`, so the collector never reads a half-written file. Errors name the
// path and the system's reason.
[[nodiscard]] Status write_prometheus_file(const std::string& path, const std::string& text);

}  // namespace epx
