// `epx monitor`: a run's metrics as a live view, alert lines and a
// Prometheus textfile, all from one RunSnapshot (run_snapshot.h).
#include "monitor.h"
#include "supervise_events.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cli_checks.h"
#include "commands.h"
#include "epx/core/input_file.h"
#include "epx/observe/alerts.h"
#include "epx/observe/output_path.h"
#include "epx/observe/prometheus.h"
#include "epx/observe/run_log.h"
#include "epx/observe/run_snapshot.h"
#include "epx/observe/straggler.h"
#include "epx/observe/table.h"
#include "machine.h"

namespace epx::app {
namespace {

constexpr std::size_t kRecentAlerts = 8;  // alert lines (recent, and firing) listed in the terminal view
// --follow reads at most this much per poll, so catching up on a long run's
// file keeps memory bounded and the view refreshing.
constexpr std::size_t kMaxPollBytes = std::size_t{64} << 20;

std::atomic<bool> g_stop{false};
extern "C" void on_stop_signal(int) { g_stop = true; }

// SIGINT and SIGTERM end a --follow loop after a last refresh.
void catch_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// One monitor run: what it has read and where it writes.
struct Monitor {
  Monitor(const MonitorOptions& o, std::vector<AlertRule> rules)
      : options(o), tracker({o.window, o.hot_experts}), alerts(std::move(rules)) {}
  const MonitorOptions& options;
  RunTracker tracker;
  AlertEvaluator alerts;
  bool terminal = false;
  std::FILE* alert_stream = stderr;  // --once: stdout (the check's result)
  std::deque<std::string> recent;    // the last alert lines, for the terminal view
  double last_step_unix = 0;         // when a new step was last read
  bool dirty = false;                // records read since the last refresh
};

void feed(Monitor& m, const StepRecord& record) {
  m.tracker.add(record);
  for (const Alert& a : m.alerts.add(record)) {
    const std::string line = format_alert(a);
    fmt::print(m.alert_stream, "{}\n", line);
    m.recent.push_back(line);
    if (m.recent.size() > kRecentAlerts) m.recent.pop_front();
  }
  std::fflush(m.alert_stream);
  m.last_step_unix = unix_seconds();
  m.dirty = true;
}

std::string hot_text(const LayerSnapshot& l) {
  std::string out;
  for (const HotExpert& e : l.hot) out += fmt::format("{}e{} {:.1f}%", out.empty() ? "" : ", ", e.expert, 100 * e.share);
  return out;
}

std::string straggler_text(const RunSnapshot& s) {
  if (s.stragglers.empty()) return fmt::format("none over the last {} steps", s.window_steps);
  return describe(s.stragglers.front());
}

// The worst of the ranks by `value` (rank -1 when there are none).
template <typename F>
std::pair<int, double> worst_rank(const RunSnapshot& s, F value) {
  std::pair<int, double> worst{-1, 0.0};
  for (const RankSnapshot& r : s.ranks)
    if (worst.first < 0 || value(r) > worst.second) worst = {r.rank, value(r)};
  return worst;
}

// One line for logs: the run's headline figures.
std::string plain_line(const RunSnapshot& s) {
  const auto worst_layer = std::max_element(s.layers.begin(), s.layers.end(),
                                            [](const LayerSnapshot& a, const LayerSnapshot& b) { return a.max_vio < b.max_vio; });
  const auto idle = worst_rank(s, [](const RankSnapshot& r) { return r.idle_fraction; });
  const auto wait = worst_rank(s, [](const RankSnapshot& r) { return r.exchange_wait; });
  std::string line = fmt::format("{} step {} loss {:.4f} tok/s {:.0f} step_s {:.3g} balancedness {:.3f} maxvio {:.3f}",
                                 utc_now(), s.step, s.loss, s.tokens_per_s, s.seconds, s.balancedness, s.max_vio);
  if (worst_layer != s.layers.end())
    line += fmt::format(" (worst layer {} {:.3f})", worst_layer->layer, worst_layer->max_vio);
  line += fmt::format(" dropped {}", s.dropped_total);
  if (idle.first >= 0)
    line += fmt::format(" idle_max {:.3f} (rank {}) wait_max {:.3g}s (rank {})", idle.second, idle.first, wait.second,
                        wait.first);
  line += s.stragglers.empty() ? std::string(" straggler none")
                               : fmt::format(" straggler {} ({}, {:.0f}%)", s.stragglers.front().rank,
                                             cause_name(s.stragglers.front().cause), 100 * s.stragglers.front().share);
  return line;
}

// At most `max_rows` layers (0: all): the worst by MaxVio, in layer order, when there are more.
std::string layer_table(const RunSnapshot& s, std::size_t max_rows) {
  std::vector<const LayerSnapshot*> shown;
  for (const LayerSnapshot& l : s.layers) shown.push_back(&l);
  std::string note;
  if (max_rows > 0 && shown.size() > max_rows) {
    std::partial_sort(shown.begin(), shown.begin() + static_cast<std::ptrdiff_t>(max_rows), shown.end(),
                      [](const LayerSnapshot* a, const LayerSnapshot* b) { return a->max_vio > b->max_vio; });
    shown.resize(max_rows);
    std::sort(shown.begin(), shown.end(), [](const LayerSnapshot* a, const LayerSnapshot* b) { return a->layer < b->layer; });
    note = fmt::format("({} of {} layers: the worst by MaxVio; a taller terminal shows more)\n", max_rows, s.layers.size());
  }
  std::vector<std::vector<std::string>> rows;
  for (const LayerSnapshot* l : shown)
    rows.push_back({std::to_string(l->layer), fmt::format("{:.3f}", l->max_vio), fmt::format("{:.3f}", l->balancedness),
                    std::to_string(l->dropped), std::to_string(l->dropped_total), hot_text(*l)});
  return format_table({"layer", "MaxVio", "balancedness", "dropped", "dropped total", "hot experts (share of tokens)"},
                      rows) +
         note;
}

// Rows of the terminal, 0 when unknown (not a terminal).
std::size_t terminal_rows() {
  struct winsize ws {};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) != 0 || ws.ws_row == 0) return 0;
  return ws.ws_row;
}

std::string rank_table(const RunSnapshot& s) {
  std::vector<std::vector<std::string>> rows;
  for (const RankSnapshot& r : s.ranks)
    rows.push_back({std::to_string(r.rank), fmt::format("{:.3f}", r.total), fmt::format("{:.3f}", r.idle_fraction),
                    fmt::format("{:.4f}", r.exchange_wait), r.waited_for < 0 ? "-" : std::to_string(r.waited_for)});
  return format_table({"rank", "step s", "idle", "exchange wait s", "waited for"}, rows);
}

// The full view: headline, layers, ranks, straggler, alerts. `max_layer_rows`
// bounds the layer table (0: every layer).
std::string view_text(const Monitor& m, const RunSnapshot& s, std::size_t max_layer_rows) {
  std::string out = fmt::format("epx monitor  {}  {}{}\n", m.options.metrics_path, utc_now(),
                                m.options.follow ? "  (following; Ctrl-C ends)" : "");
  if (s.records == 0) return out + "no step yet\n";
  out += fmt::format("step {}  loss {:.4f} (main {:.4f})  tokens/s {:.0f}  step {:.3f} s  balancedness {:.3f}  "
                     "MaxVio {:.3f}  dropped {}  ({} steps read)\n\n",
                     s.step, s.loss, s.main_loss, s.tokens_per_s, s.seconds, s.balancedness, s.max_vio,
                     s.dropped_total, s.records);
  out += layer_table(s, max_layer_rows) + "\n" + rank_table(s) + "\nstraggler: " + straggler_text(s) + "\n";
  const std::vector<Alert> firing = m.alerts.firing();
  out += fmt::format("\nalerts firing: {}\n", firing.empty() ? "none" : "");
  for (std::size_t i = 0; i < firing.size() && i < kRecentAlerts; ++i) out += "  " + format_alert(firing[i]) + "\n";
  if (firing.size() > kRecentAlerts) out += fmt::format("  ... and {} more\n", firing.size() - kRecentAlerts);
  if (!m.recent.empty()) out += "recent alert lines:\n";
  for (const std::string& line : m.recent) out += "  " + line + "\n";
  return out;
}

// Redraws the view in place: cursor home, each line cleared to its end, the rest of the screen cleared.
void draw_terminal(const std::string& text) {
  std::string out = "\x1b[H";
  std::size_t start = 0;
  while (start < text.size()) {
    const std::size_t nl = text.find('\n', start);
    out += text.substr(start, nl - start) + "\x1b[K\n";
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  out += "\x1b[J";
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
}

Status write_prometheus(const Monitor& m, const RunSnapshot& s) {
  if (m.options.prometheus_path.empty()) return Status::ok();
  const std::vector<Alert> firing = m.alerts.firing();
  return write_prometheus_file(m.options.prometheus_path,
                               format_prometheus(s, m.alerts.rules(), firing, m.last_step_unix));
}

// --events: "supervised: 1 restart, 8 steps lost; ..." (re-read at each
// refresh: the supervisor appends to it), or "" when not given.
std::string restarts_line(const Monitor& m) {
  if (m.options.events_path.empty()) return "";
  auto h = read_restart_history(m.options.events_path);
  return h.is_ok() ? "supervised: " + describe_restarts(*h) + "\n"
                   : "supervised: " + std::string(h.status().message()) + "\n";
}

// One refresh: the view (or the plain line, only when there is news) and the Prometheus file.
Status refresh(Monitor& m, bool in_place) {
  const RunSnapshot s = m.tracker.snapshot();
  if (m.terminal) {
    if (in_place) {
      // The layer table gets the rows the rest of the view leaves (ranks, alerts, headline).
      const std::size_t rows = terminal_rows(), others = s.ranks.size() + 2 * kRecentAlerts + 16;
      draw_terminal(view_text(m, s, rows > others + 5 ? rows - others - 1 : (rows > 0 ? 4 : 0)) + restarts_line(m));
    } else {
      fmt::print("{}{}", view_text(m, s, 0), restarts_line(m));
    }
  } else if (m.dirty && s.records > 0) {
    fmt::print("{}\n{}", plain_line(s), restarts_line(m));
  }
  std::fflush(stdout);
  m.dirty = false;
  return write_prometheus(m, s);
}

Status read_all(Monitor& m) {
  return read_run_metrics(m.options.metrics_path, [&](StepRecord&& r) {  // each step once (a resumed run)
    feed(m, r);
    return Status::ok();
  });
}

// A metrics file with no complete step record: missing, empty, or a first
// line still being written (idle_s > 0: after --idle-exit seconds of waiting).
Status no_records(const std::string& path, double idle_s) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(path, ec);
  if (idle_s > 0)
    return exists ? failed_precondition("'{}' held no complete step record after {} s without change (--idle-exit)",
                                        path, idle_s)
                  : not_found("'{}' did not appear within {} s (--idle-exit); is a run writing its metrics there "
                              "(epx train --metrics)?",
                              path, idle_s);
  return failed_precondition("'{}' holds no complete step record (empty, or a run's first line still being written); "
                             "--follow waits for one",
                             path);
}

// A missing or record-less file is the user's to fix (2); a bad line or a read failure 1.
int exit_code_of_read(const Status& st) {
  return st.code() == StatusCode::kNotFound || st.code() == StatusCode::kFailedPrecondition ? kExitUsage : kExitFailed;
}

// --follow: poll, feed, refresh every --interval, until a signal or --idle-exit.
int follow(Monitor& m) {
  auto follower = MetricsFollower::open(m.options.metrics_path);
  if (!follower.is_ok()) {
    fmt::print(stderr, "epx monitor: {}\n", follower.status().message());
    return kExitUsage;
  }
  catch_stop_signals();
  const double poll_s = std::min(m.options.interval, 0.1);
  double last_news = now_seconds(), last_refresh = -1e300;
  while (!g_stop) {
    // A malformed line is said once and skipped: the follower goes on past it.
    Result<std::vector<StepRecord>> fresh = follower->poll(kMaxPollBytes);
    const double now = now_seconds();
    if (!fresh.is_ok()) {
      fmt::print(stderr, "epx monitor: {}: {} (skipped)\n", m.options.metrics_path, fresh.status().message());
      last_news = now;
    } else {
      for (const StepRecord& r : *fresh) feed(m, r);
      if (!fresh->empty()) last_news = now;
    }
    if (now - last_refresh >= m.options.interval) {
      if (Status st = refresh(m, true); !st.is_ok()) fmt::print(stderr, "epx monitor: {}\n", st.message());
      last_refresh = now;
    }
    if (m.options.idle_exit > 0 && now - last_news >= m.options.idle_exit) break;
    std::this_thread::sleep_for(std::chrono::duration<double>(poll_s));
  }
  // The lines written since the last poll, then a last refresh.
  if (Result<std::vector<StepRecord>> last = follower->poll(kMaxPollBytes); last.is_ok())
    for (const StepRecord& r : *last) feed(m, r);
  if (Status st = refresh(m, true); !st.is_ok()) {
    fmt::print(stderr, "epx monitor: {}\n", st.message());
    return kExitFailed;
  }
  // --idle-exit on a run that never wrote a step: said, and not a success.
  if (!g_stop && m.tracker.records() == 0) {
    fmt::print(stderr, "epx monitor: {}\n", no_records(m.options.metrics_path, m.options.idle_exit).message());
    return kExitFailed;
  }
  return kExitOk;
}

// --once: every rule over the whole file; alert lines and a verdict on stdout.
int check_once(Monitor& m) {
  Status st = read_all(m);
  if (st.is_ok() && m.tracker.records() == 0) st = no_records(m.options.metrics_path, 0);
  if (!st.is_ok()) {
    fmt::print(stderr, "epx monitor: {}\n", st.message());
    return exit_code_of_read(st);
  }
  if (Status st = write_prometheus(m, m.tracker.snapshot()); !st.is_ok()) {
    fmt::print(stderr, "epx monitor: {}\n", st.message());
    return kExitFailed;
  }
  fmt::print("{}", restarts_line(m));
  if (m.alerts.num_fired() == 0) {
    fmt::print("epx monitor --once: no alert over {} steps ({} rules)\n", m.tracker.records(), m.alerts.rules().size());
    return kExitOk;
  }
  fmt::print("epx monitor --once: {} alerts fired over {} steps ({} still firing at the end)\n", m.alerts.num_fired(),
             m.tracker.records(), m.alerts.firing().size());
  return kExitFailed;
}

// Bad combinations, unwritable outputs and a metrics path that is no regular
// file, before anything is read: exit 2.
Status check_options(const MonitorOptions& o) {
  if (o.once && o.alerts_path.empty()) return invalid_argument("--once needs --alerts RULES.toml (the rules to check)");
  if (o.idle_exit > 0 && !o.follow) return invalid_argument("--idle-exit {} needs --follow", o.idle_exit);
  const CommandPath inputs[] = {{"metrics", o.metrics_path, false}, {"--alerts", o.alerts_path, false}};
  const CommandPath outputs[] = {{"--prometheus", o.prometheus_path, false}};
  EPX_RETURN_IF_ERROR(check_outputs_apart(inputs, outputs));
  if (o.check && o.alerts_path.empty()) return invalid_argument("--check needs --alerts RULES.toml (the rules to check)");
  // A FIFO, a device or a directory is refused here; with --follow (or
  // --check, before a run) the file may appear later.
  if (Result<InputFile> metrics = InputFile::open(o.metrics_path, "the metrics file", -1);
      !metrics.is_ok() && !((o.follow || o.check) && metrics.status().code() == StatusCode::kNotFound))
    return metrics.status();
  if (!o.prometheus_path.empty())
    EPX_RETURN_IF_ERROR(check_output_writable(o.prometheus_path, "--prometheus", /*renamed_into_place=*/true));
  return Status::ok();
}

}  // namespace

CLI::App* add_monitor_command(CLI::App& app, MonitorOptions& o) {
  CLI::App* cmd = app.add_subcommand(
      "monitor",
      "Watch a run's metrics (epx train --metrics FILE; also a run still writing, also an MPI run's file): step, "
      "loss, tokens/s, MaxVio and balancedness per layer, hot experts, dropped tokens, idle and exchange wait per "
      "rank, the current straggler; alert rules (one line per alert on stderr) and a Prometheus textfile "
      "(docs/operations.md)");
  cmd->add_option("metrics", o.metrics_path, "The metrics file (JSON Lines, one object per step)")->required();
  CLI::Option* follow = cmd->add_flag(
      "--follow", o.follow,
      "Keep reading as the run appends (a file not there yet reads as empty until it appears) until Ctrl-C, SIGTERM "
      "or --idle-exit; without it the file is read once and its last state shown");
  cmd->add_flag("--plain", o.plain,
                "One plain line per update (UTC time, step, loss, tokens/s, balance, drops, worst idle and wait, "
                "straggler) instead of the view; with --follow the default when stdout is not a terminal");
  cmd->add_flag("--once", o.once,
                "Check the whole file against --alerts and exit: alert lines and a verdict on stdout, exit 1 when any "
                "rule fired, 0 when none did (for cron and CI)")
      ->excludes(follow);
  cmd->add_flag("--check", o.check,
                "Check the --alerts rules and that --prometheus can be written, read no metrics (the file need not "
                "exist yet) and exit: 0 fine, 2 not (a job script's check before the run starts)")
      ->excludes(follow)
      ->excludes("--once");
  cmd->add_option("--alerts", o.alerts_path,
                  "Alert rules (TOML; template configs/monitor/alerts.toml). Each alert is one line on stderr when it "
                  "starts (FIRING) and when it stops (CLEARED); --once prints them on stdout");
  cmd->add_option("--prometheus", o.prometheus_path,
                  "Write the Prometheus text format to this file (for node_exporter's textfile collector, e.g. "
                  "$TEXTFILE_DIR/epx.prom), replaced atomically at every refresh");
  cmd->add_option("--interval", o.interval, "Seconds between refreshes of the view, the plain line and --prometheus")
      ->transform(in_range(0.01, 3600.0))
      ->capture_default_str();
  cmd->add_option("--window", o.window, "Steps over which the view names the straggler (diagnose_stragglers)")
      ->transform(in_range(1, 10000))
      ->capture_default_str();
  cmd->add_option("--idle-exit", o.idle_exit,
                  "With --follow: exit 0 once the file has not grown for this many seconds (the run ended); 0 = never")
      ->transform(in_range(0.0, 1e6))
      ->capture_default_str();
  cmd->add_option("--events", o.events_path,
                  "The run's epx supervise --events file: a line under the view with its restarts, lost steps, "
                  "failed ranks and excluded hosts");
  cmd->add_option("--hot-experts", o.hot_experts, "Busiest experts shown per layer (view and Prometheus)")
      ->transform(in_range(0, 64))
      ->capture_default_str();
  return cmd;
}

int run_monitor(const MonitorOptions& o) {
  if (Status st = check_options(o); !st.is_ok()) {
    fmt::print(stderr, "epx monitor: {}\n", st.message());
    return kExitUsage;
  }
  std::vector<AlertRule> rules;
  if (!o.alerts_path.empty()) {
    Result<std::vector<AlertRule>> loaded = load_alert_rules(o.alerts_path);
    if (!loaded.is_ok()) {
      fmt::print(stderr, "epx monitor: {}\n", loaded.status().message());
      return kExitUsage;
    }
    rules = std::move(*loaded);
  }
  if (o.check) {
    fmt::print("epx monitor --check: {} rules in {}{}\n", rules.size(), o.alerts_path,
               o.prometheus_path.empty() ? "" : fmt::format("; {} can be written", o.prometheus_path));
    return kExitOk;
  }
  Monitor m(o, std::move(rules));
  m.terminal = !o.plain && !o.once && ::isatty(STDOUT_FILENO) != 0;
  if (o.once) {
    m.alert_stream = stdout;
    return check_once(m);
  }
  if (o.follow) return follow(m);
  Status read = read_all(m);
  if (read.is_ok() && m.tracker.records() == 0) read = no_records(o.metrics_path, 0);
  if (!read.is_ok()) {
    fmt::print(stderr, "epx monitor: {}\n", read.message());
    return exit_code_of_read(read);
  }
  // Read once: the whole view (also into a pipe or a file) unless --plain.
  m.terminal = !o.plain;
  if (Status st = refresh(m, false); !st.is_ok()) {
    fmt::print(stderr, "epx monitor: {}\n", st.message());
    return kExitFailed;
  }
  return kExitOk;
}

}  // namespace epx::app
