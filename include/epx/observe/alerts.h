// Alert rules over a run's metrics: read from a TOML file (a commented
// template: configs/monitor/alerts.toml), evaluated one StepRecord at a time
// by `epx monitor`.
//
//   EPX_ASSIGN_OR_RETURN(std::vector<epx::AlertRule> rules, epx::load_alert_rules("alerts.toml"));
//   epx::AlertEvaluator alerts(rules);
//   for (const epx::StepRecord& s : records)
//     for (const epx::Alert& a : alerts.add(s)) fmt::print(stderr, "{}\n", epx::format_alert(a));
//
// A rule file is a list of `[[rule]]` tables, each with a unique `name`, a
// `kind` and that kind's keys (docs/operations.md, ## Alert rules):
//   max_vio      a layer's MaxVio above `above` for `for_steps` steps in a row (per layer)
//   rank_idle    a rank's idle fraction (rank_idle_fraction) above `above` for `for_steps` steps (per rank)
//   dropped      a layer dropped more than `above` tokens in a step (default 0: any drop; per layer)
//   nan_loss     the loss or the main loss is NaN or infinite
//   loss_spike   the loss above `above` x the median of the previous `window` finite losses
//   straggler    diagnose_stragglers over the last `window` steps names a rank causing at
//                least `min_share` of the waiting, for `for_steps` steps in a row (per rank)
//   slow_step    a step's seconds above `above` x the median of the previous `window` steps
// An unknown key, a missing or repeated name, an unknown kind or a value out
// of its range is InvalidArgument naming the file, the rule, the key and the
// allowed range.
//
// An alert is reported once when its condition starts to hold (firing) and
// once when it stops (cleared), never on every step in between; each
// (rule, layer, rank) is its own instance. Rules that compare with a median
// stay quiet until `window` earlier steps are in.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "epx/core/status.h"
#include "epx/observe/run_log.h"
#include "epx/observe/straggler.h"

namespace epx {

enum class AlertKind { kMaxVio, kRankIdle, kDropped, kNanLoss, kLossSpike, kStraggler, kSlowStep };

// "max_vio", "rank_idle", "dropped", "nan_loss", "loss_spike", "straggler", "slow_step".
[[nodiscard]] std::string_view alert_kind_name(AlertKind kind);

struct AlertRule {
  std::string name;
  AlertKind kind = AlertKind::kNanLoss;
  double above = 0;      // the threshold: MaxVio, idle fraction, tokens, or a factor of the median
  int for_steps = 1;     // steps in a row before it fires (max_vio, rank_idle, straggler)
  int window = 0;        // steps of the median (loss_spike, slow_step) or of the diagnosis (straggler)
  double min_share = 0;  // straggler: its share of the window's waiting
};

// Parses a rule file's text; `path` names it in errors.
[[nodiscard]] Result<std::vector<AlertRule>> parse_alert_rules(std::string_view toml_text, const std::string& path);
// Reads and parses a rule file (NotFound when it does not exist).
[[nodiscard]] Result<std::vector<AlertRule>> load_alert_rules(const std::string& path);

struct Alert {
  std::string rule;
  AlertKind kind = AlertKind::kNanLoss;
  bool firing = true;  // true: the condition started to hold at `step`; false: it stopped (cleared)
  int64_t step = 0;
  int layer = -1;      // the layer it is about, -1 when it is not per layer
  int rank = -1;       // the rank it is about, -1 when it is not per rank
  double value = 0;    // what was measured at `step` (firing(): the latest value)
  double threshold = 0;
  std::string detail;  // more words where they help (a straggler's cause)
  std::chrono::system_clock::time_point time;  // when the evaluator saw it
};

// One line: "2026-12-01T20:30:00Z FIRING max-vio-high layer=3 value=1.52 threshold=1 step=120 (...)";
// CLEARED in place of FIRING when it stops.
[[nodiscard]] std::string format_alert(const Alert& alert);

class AlertEvaluator {
 public:
  explicit AlertEvaluator(std::vector<AlertRule> rules);

  // The alerts that start or stop at this step (records in step order).
  [[nodiscard]] std::vector<Alert> add(const StepRecord& record);
  // Every alert firing now, one per (rule, layer, rank).
  [[nodiscard]] std::vector<Alert> firing() const;
  // Alerts that started so far.
  [[nodiscard]] int64_t num_fired() const { return num_fired_; }
  [[nodiscard]] const std::vector<AlertRule>& rules() const { return rules_; }
  // Replaces the wall clock that stamps alerts (tests).
  void set_clock(std::function<std::chrono::system_clock::time_point()> now) { now_ = std::move(now); }

 private:
  struct Instance {
    int run = 0;  // steps in a row the condition held
    bool firing = false;
    Alert last;   // the start, with the latest value while firing
  };
  using Key = std::tuple<std::size_t, int, int>;  // rule index, layer, rank
  // One condition's value at this step: feeds the instance's run and reports a start or a stop.
  void observe(std::size_t rule_idx, int layer, int rank, bool holds, double value, const std::string& detail,
               const StepRecord& record, std::vector<Alert>* out);
  void evaluate_rule(std::size_t rule_idx, const StepRecord& record, std::vector<Alert>* out);
  void evaluate_straggler(std::size_t rule_idx, const StepRecord& record, std::vector<Alert>* out);

  std::vector<AlertRule> rules_;
  std::map<Key, Instance> instances_;
  std::deque<double> losses_, seconds_;  // the previous steps' finite losses and step times
  std::size_t median_window_ = 0;
  std::map<std::size_t, StragglerWindow> straggler_windows_;  // per straggler rule (by index)
  int64_t num_fired_ = 0;
  std::function<std::chrono::system_clock::time_point()> now_;
};

}  // namespace epx
