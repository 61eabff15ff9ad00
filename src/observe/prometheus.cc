#include "epx/observe/prometheus.h"

#include <cmath>

#include <fmt/format.h>

#include "observe/file_error.h"

namespace epx {
namespace {

// A sample value as the format spells it: NaN, +Inf, -Inf, else the shortest
// text that reads back to the same double.
std::string value_text(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

// A label value with \, " and newline escaped.
std::string escape_label(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

// Appends one family: its HELP and TYPE lines, then the samples.
class Family {
 public:
  Family(std::string* out, std::string_view name, std::string_view type, std::string_view help)
      : out_(out), name_(name) {
    *out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  void sample(double v) { *out_ += fmt::format("{} {}\n", name_, value_text(v)); }
  void sample(std::string_view labels, double v) { *out_ += fmt::format("{}{{{}}} {}\n", name_, labels, value_text(v)); }

 private:
  std::string* out_;
  std::string_view name_;
};

void run_families(std::string* out, const RunSnapshot& s, double last_step_unix) {
  Family(out, "epx_monitor_records_total", "counter", "Steps epx monitor has read from the metrics file.")
      .sample(static_cast<double>(s.records));
  Family(out, "epx_monitor_last_step_timestamp_seconds", "gauge",
         "Unix time epx monitor last read a new step (it stops moving when the run stops writing).")
      .sample(last_step_unix);
  if (s.records == 0) return;
  Family(out, "epx_train_step", "gauge", "The last step read (0-based).").sample(static_cast<double>(s.step));
  Family(out, "epx_train_loss", "gauge", "Loss of the last step (main + auxiliary).").sample(s.loss);
  Family(out, "epx_train_main_loss", "gauge", "Task loss of the last step.").sample(s.main_loss);
  Family(out, "epx_train_step_seconds", "gauge", "Wall time of the last step.").sample(s.seconds);
  Family(out, "epx_train_tokens_per_second", "gauge", "Tokens per second of the last step.").sample(s.tokens_per_s);
  Family(out, "epx_train_balancedness", "gauge",
         "Mean over layers of mean/max work across ranks in the last step (1 = even).")
      .sample(s.balancedness);
  Family(out, "epx_train_max_vio", "gauge", "Mean over layers of MaxVio (max expert load / mean - 1).").sample(s.max_vio);
  Family(out, "epx_train_dropped_tokens_total", "counter", "Tokens dropped over every layer and step read.")
      .sample(static_cast<double>(s.dropped_total));
}

void layer_families(std::string* out, const RunSnapshot& s) {
  if (s.layers.empty()) return;
  Family max_vio(out, "epx_layer_max_vio", "gauge", "MaxVio of the layer in the last step (max expert load / mean - 1).");
  for (const LayerSnapshot& l : s.layers) max_vio.sample(fmt::format("layer=\"{}\"", l.layer), l.max_vio);
  Family bal(out, "epx_layer_balancedness", "gauge", "Mean/max work across ranks of the layer in the last step.");
  for (const LayerSnapshot& l : s.layers) bal.sample(fmt::format("layer=\"{}\"", l.layer), l.balancedness);
  Family dropped(out, "epx_layer_dropped_tokens_total", "counter", "Tokens the layer dropped over every step read.");
  for (const LayerSnapshot& l : s.layers)
    dropped.sample(fmt::format("layer=\"{}\"", l.layer), static_cast<double>(l.dropped_total));
  Family hot(out, "epx_expert_token_share", "gauge",
             "Share of the layer's routed tokens of each of its hottest experts in the last step (top few only).");
  for (const LayerSnapshot& l : s.layers)
    for (const HotExpert& e : l.hot) hot.sample(fmt::format("layer=\"{}\",expert=\"{}\"", l.layer, e.expert), e.share);
}

void rank_families(std::string* out, const RunSnapshot& s) {
  if (s.ranks.empty()) return;
  Family idle(out, "epx_rank_idle_fraction", "gauge",
              "Share of the rank's last step spent waiting for other ranks (barrier + exchange waits).");
  for (const RankSnapshot& r : s.ranks) idle.sample(fmt::format("rank=\"{}\"", r.rank), r.idle_fraction);
  Family wait(out, "epx_rank_exchange_wait_seconds", "gauge",
              "Seconds the rank waited for others in the last step's dispatches and combines.");
  for (const RankSnapshot& r : s.ranks) wait.sample(fmt::format("rank=\"{}\"", r.rank), r.exchange_wait);
  Family step(out, "epx_rank_step_seconds", "gauge", "The rank's time in the last step.");
  for (const RankSnapshot& r : s.ranks) step.sample(fmt::format("rank=\"{}\"", r.rank), r.total);
}

void straggler_families(std::string* out, const RunSnapshot& s) {
  const Straggler* top = s.stragglers.empty() ? nullptr : &s.stragglers.front();
  Family(out, "epx_straggler_rank", "gauge", "The rank that made the others wait most over the window; -1: none.")
      .sample(top ? top->rank : -1);
  Family(out, "epx_straggler_share", "gauge", "Its share of all the waiting in the window (0 when none).")
      .sample(top ? top->share : 0.0);
  Family cause(out, "epx_straggler_cause", "gauge", "1 for the straggler's cause, 0 for the others.");
  for (StragglerCause c : {StragglerCause::kCompute, StragglerCause::kLink, StragglerCause::kHotExpert})
    cause.sample(fmt::format("cause=\"{}\"", escape_label(cause_name(c))), top && top->cause == c ? 1.0 : 0.0);
}

void alert_families(std::string* out, std::span<const AlertRule> rules, std::span<const Alert> firing) {
  if (rules.empty()) return;
  Family f(out, "epx_alerts_firing", "gauge", "Instances (layers, ranks or the run) of the alert rule firing now.");
  for (const AlertRule& rule : rules) {
    int n = 0;
    for (const Alert& a : firing) n += a.rule == rule.name ? 1 : 0;
    f.sample(fmt::format("rule=\"{}\"", escape_label(rule.name)), n);
  }
}

}  // namespace

std::string format_prometheus(const RunSnapshot& snapshot, std::span<const AlertRule> rules,
                              std::span<const Alert> firing, double last_step_unix_seconds) {
  std::string out;
  run_families(&out, snapshot, last_step_unix_seconds);
  if (snapshot.records > 0) {
    layer_families(&out, snapshot);
    rank_families(&out, snapshot);
    straggler_families(&out, snapshot);
  }
  alert_families(&out, rules, firing);
  return out;
}

Status write_prometheus_file(const std::string& path, const std::string& text) {
  return observe_detail::write_file_atomically(path, text);
}

}  // namespace epx
