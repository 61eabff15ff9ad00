#include "epx/observe/alerts.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <optional>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "epx/core/input_file.h"
#include "epx/observe/run_snapshot.h"

namespace epx {
namespace {

// The keys a rule may hold besides name and kind, each with its range.
enum class Key { kAbove, kForSteps, kWindow, kMinShare };

struct KeySpec {
  Key key;
  const char* name;
  double lo, hi;
  bool lo_open;   // (lo, hi] rather than [lo, hi]
  bool integer;
  std::optional<double> fallback;  // the default; none: the key is required
};

struct KindSpec {
  AlertKind kind;
  const char* name;
  std::vector<KeySpec> keys;
};

constexpr double kMaxFactor = 1e6;
constexpr int kMaxSteps = 1000000;
constexpr int kMaxWindow = 10000;

const std::vector<KindSpec>& kind_specs() {
  static const KeySpec for_steps{Key::kForSteps, "for_steps", 1, kMaxSteps, false, true, 1.0};
  static const std::vector<KindSpec> specs = {
      {AlertKind::kMaxVio, "max_vio", {{Key::kAbove, "above", 0, kMaxFactor, false, false, {}}, for_steps}},
      {AlertKind::kRankIdle, "rank_idle", {{Key::kAbove, "above", 0, 1, false, false, {}}, for_steps}},
      {AlertKind::kDropped, "dropped", {{Key::kAbove, "above", 0, 1e15, false, false, 0.0}, for_steps}},
      {AlertKind::kNanLoss, "nan_loss", {}},
      {AlertKind::kLossSpike,
       "loss_spike",
       {{Key::kAbove, "above", 1, kMaxFactor, true, false, {}},
        {Key::kWindow, "window", 2, kMaxWindow, false, true, 50.0},
        for_steps}},
      {AlertKind::kStraggler,
       "straggler",
       {{Key::kWindow, "window", 2, kMaxWindow, false, true, 20.0},
        {Key::kMinShare, "min_share", 0, 1, true, false, 0.3},
        {Key::kForSteps, "for_steps", 1, kMaxSteps, false, true, 5.0}}},
      {AlertKind::kSlowStep,
       "slow_step",
       {{Key::kAbove, "above", 1, kMaxFactor, true, false, {}},
        {Key::kWindow, "window", 2, kMaxWindow, false, true, 50.0},
        for_steps}},
  };
  return specs;
}

std::string kind_list() {
  std::string list;
  for (const KindSpec& k : kind_specs()) list += fmt::format("{}{}", list.empty() ? "" : ", ", k.name);
  return list;
}

std::string key_list(const KindSpec& spec) {
  std::string list = "name, kind";
  for (const KeySpec& k : spec.keys) list += fmt::format(", {}", k.name);
  return list;
}

std::string range_text(const KeySpec& k) {
  return fmt::format("{}{:g}, {:g}]", k.lo_open ? "(" : "[", k.lo, k.hi);
}

void store(AlertRule& rule, Key key, double v) {
  switch (key) {
    case Key::kAbove: rule.above = v; break;
    case Key::kForSteps: rule.for_steps = static_cast<int>(v); break;
    case Key::kWindow: rule.window = static_cast<int>(v); break;
    case Key::kMinShare: rule.min_share = v; break;
  }
}

// One key's value, checked against its range; `where` names the file and rule.
Status read_key(const KeySpec& k, const toml::node& node, const std::string& where, AlertRule& rule) {
  double v = 0;
  if (k.integer) {
    auto i = node.value_exact<int64_t>();
    if (!i) return invalid_argument("{}: {} must be an integer in {}", where, k.name, range_text(k));
    v = static_cast<double>(*i);
  } else {
    if (!node.is_number()) return invalid_argument("{}: {} must be a number in {}", where, k.name, range_text(k));
    v = *node.value<double>();
  }
  const bool low = k.lo_open ? !(v > k.lo) : !(v >= k.lo);
  if (low || !(v <= k.hi))
    return invalid_argument("{}: {} = {:g} is outside {}", where, k.name, v, range_text(k));
  store(rule, k.key, v);
  return Status::ok();
}

Result<std::string> string_key(const toml::table& t, const char* key, const std::string& where) {
  const toml::node* node = t.get(key);
  if (node == nullptr) return invalid_argument("{}: no '{}' (every rule needs a name and a kind)", where, key);
  auto v = node->value_exact<std::string>();
  if (!v || v->empty()) return invalid_argument("{}: {} must be a non-empty string", where, key);
  return *v;
}

const KindSpec* find_kind(const std::string& name) {
  for (const KindSpec& k : kind_specs())
    if (name == k.name) return &k;
  return nullptr;
}

// One [[rule]] table.
Result<AlertRule> parse_rule(const toml::table& t, const std::string& path, std::size_t index) {
  std::string where = fmt::format("{}: rule {}", path, index + 1);
  AlertRule rule;
  EPX_ASSIGN_OR_RETURN(rule.name, string_key(t, "name", where));
  where = fmt::format("{}: rule '{}'", path, rule.name);
  EPX_ASSIGN_OR_RETURN(std::string kind, string_key(t, "kind", where));
  const KindSpec* spec = find_kind(kind);
  if (spec == nullptr) return invalid_argument("{}: kind = '{}' is not one of {}", where, kind, kind_list());
  rule.kind = spec->kind;
  for (auto&& [name, node] : t) {
    const std::string key(name.str());
    if (key == "name" || key == "kind") continue;
    auto it = std::find_if(spec->keys.begin(), spec->keys.end(), [&](const KeySpec& k) { return key == k.name; });
    if (it == spec->keys.end())
      return invalid_argument("{}: unknown key '{}' (a {} rule takes {})", where, key, spec->name, key_list(*spec));
    EPX_RETURN_IF_ERROR(read_key(*it, node, where, rule));
  }
  for (const KeySpec& k : spec->keys) {
    if (t.get(k.name) != nullptr) continue;
    if (!k.fallback) return invalid_argument("{}: a {} rule needs {} (in {})", where, spec->name, k.name, range_text(k));
    store(rule, k.key, *k.fallback);
  }
  return rule;
}

Status syntax_error(const std::string& path, const toml::parse_error& e) {
  return invalid_argument("{}:{}:{}: {}", path, e.source().begin.line, e.source().begin.column, e.description());
}

Result<std::vector<AlertRule>> rules_from_table(const toml::table& table, const std::string& path) {
  std::vector<AlertRule> rules;
  for (auto&& [name, node] : table) {
    if (name.str() != "rule")
      return invalid_argument("{}: unknown key '{}' (a rule file holds [[rule]] tables only)", path, name.str());
    const toml::array* array = node.as_array();
    if (array == nullptr || !array->is_array_of_tables())
      return invalid_argument("{}: 'rule' must be written as [[rule]] tables", path);
    for (std::size_t i = 0; i < array->size(); ++i) {
      EPX_ASSIGN_OR_RETURN(AlertRule rule, parse_rule(*array->get(i)->as_table(), path, i));
      for (const AlertRule& r : rules)
        if (r.name == rule.name) return invalid_argument("{}: rule name '{}' is used twice", path, rule.name);
      rules.push_back(std::move(rule));
    }
  }
  return rules;
}

// The median of the last `n` values of `v` (n <= v.size(), n > 0).
double median_of_last(const std::deque<double>& v, std::size_t n) {
  std::vector<double> tail(v.end() - static_cast<std::ptrdiff_t>(n), v.end());
  const auto mid = tail.begin() + static_cast<std::ptrdiff_t>(n / 2);
  std::nth_element(tail.begin(), mid, tail.end());
  if (n % 2 == 1) return *mid;
  return (*mid + *std::max_element(tail.begin(), mid)) / 2;
}

std::string utc_text(std::chrono::system_clock::time_point t) {
  const std::time_t s = std::chrono::system_clock::to_time_t(t);
  std::tm tm{};
  gmtime_r(&s, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

}  // namespace

std::string_view alert_kind_name(AlertKind kind) {
  for (const KindSpec& k : kind_specs())
    if (k.kind == kind) return k.name;
  return "unknown";
}

Result<std::vector<AlertRule>> parse_alert_rules(std::string_view toml_text, const std::string& path) {
  toml::table table;
  try {
    table = toml::parse(toml_text, path);
  } catch (const toml::parse_error& e) {
    return syntax_error(path, e);
  }
  return rules_from_table(table, path);
}

Result<std::vector<AlertRule>> load_alert_rules(const std::string& path) {
  EPX_ASSIGN_OR_RETURN(std::string text, read_input_file(path, "the alert rule file", kMaxTomlBytes));
  return parse_alert_rules(text, path);
}

std::string format_alert(const Alert& a) {
  std::string where;
  if (a.layer >= 0) where += fmt::format(" layer={}", a.layer);
  if (a.rank >= 0) where += fmt::format(" rank={}", a.rank);
  return fmt::format("{} {} {}{} value={:.4g} threshold={:.4g} step={}{}", utc_text(a.time),
                     a.firing ? "FIRING" : "CLEARED", a.rule, where, a.value, a.threshold, a.step,
                     a.detail.empty() ? "" : fmt::format(" ({})", a.detail));
}

AlertEvaluator::AlertEvaluator(std::vector<AlertRule> rules)
    : rules_(std::move(rules)), now_([] { return std::chrono::system_clock::now(); }) {
  for (std::size_t i = 0; i < rules_.size(); ++i) {
    const auto w = static_cast<std::size_t>(std::max(0, rules_[i].window));
    if (rules_[i].kind == AlertKind::kStraggler) straggler_windows_.emplace(i, StragglerWindow(w));
    if (rules_[i].kind == AlertKind::kLossSpike || rules_[i].kind == AlertKind::kSlowStep)
      median_window_ = std::max(median_window_, w);
  }
}

void AlertEvaluator::observe(std::size_t rule_idx, int layer, int rank, bool holds, double value,
                             const std::string& detail, const StepRecord& record, std::vector<Alert>* out) {
  const AlertRule& rule = rules_[rule_idx];
  auto it = instances_.find({rule_idx, layer, rank});
  if (it == instances_.end()) {
    if (!holds) return;  // nothing to remember for a quiet instance
    it = instances_.emplace(Key{rule_idx, layer, rank}, Instance{}).first;
  }
  Instance& in = it->second;
  in.run = holds ? in.run + 1 : 0;
  const double threshold = rule.kind == AlertKind::kStraggler ? rule.min_share : rule.above;
  Alert now{rule.name, rule.kind, holds, record.step, layer, rank, value, threshold, detail, now_()};
  if (holds && !in.firing && in.run >= rule.for_steps) {  // starts
    in.firing = true;
    ++num_fired_;
    in.last = now;
    out->push_back(std::move(now));
  } else if (holds && in.firing) {  // goes on: remember the latest value
    in.last.value = value;
  } else if (!holds) {  // stops (reported if it had started) and is forgotten
    if (in.firing) out->push_back(std::move(now));
    instances_.erase(it);
  }
}

void AlertEvaluator::evaluate_straggler(std::size_t rule_idx, const StepRecord& record, std::vector<Alert>* out) {
  const AlertRule& rule = rules_[rule_idx];
  const StragglerWindow& window = straggler_windows_.at(rule_idx);
  // Quiet until the window is full.
  const std::vector<Straggler> found =
      window.size() >= static_cast<std::size_t>(rule.window) ? window.diagnose() : std::vector<Straggler>{};
  for (const RankRecord& r : record.ranks) {
    auto s = std::find_if(found.begin(), found.end(), [&](const Straggler& x) { return x.rank == r.rank; });
    const bool holds = s != found.end() && s->share >= rule.min_share;
    observe(rule_idx, -1, r.rank, holds, s == found.end() ? 0.0 : s->share,
            s == found.end() ? std::string() : describe(*s), record, out);
  }
}

void AlertEvaluator::evaluate_rule(std::size_t rule_idx, const StepRecord& record, std::vector<Alert>* out) {
  const AlertRule& rule = rules_[rule_idx];
  const auto w = static_cast<std::size_t>(std::max(1, rule.window));
  switch (rule.kind) {
    case AlertKind::kMaxVio:
      for (const LayerRecord& l : record.layers) observe(rule_idx, l.layer, -1, l.max_vio > rule.above, l.max_vio, {}, record, out);
      break;
    case AlertKind::kRankIdle:
      for (const RankRecord& r : record.ranks) {
        const double idle = rank_idle_fraction(r);
        observe(rule_idx, -1, r.rank, idle > rule.above, idle, {}, record, out);
      }
      break;
    case AlertKind::kDropped:
      for (const LayerRecord& l : record.layers)
        observe(rule_idx, l.layer, -1, static_cast<double>(l.dropped) > rule.above, static_cast<double>(l.dropped), {},
                record, out);
      break;
    case AlertKind::kNanLoss:
      observe(rule_idx, -1, -1, !std::isfinite(record.loss) || !std::isfinite(record.main_loss),
              std::isfinite(record.loss) ? record.main_loss : record.loss, {}, record, out);
      break;
    case AlertKind::kLossSpike: {
      const bool ready = losses_.size() >= w && std::isfinite(record.loss);
      const double median = ready ? median_of_last(losses_, w) : 0;
      observe(rule_idx, -1, -1, ready && record.loss > rule.above * median, record.loss,
              ready ? fmt::format("median of the last {} losses {:.4g}", w, median) : std::string(), record, out);
      break;
    }
    case AlertKind::kSlowStep: {
      const bool ready = seconds_.size() >= w;
      const double median = ready ? median_of_last(seconds_, w) : 0;
      observe(rule_idx, -1, -1, ready && record.seconds > rule.above * median, record.seconds,
              ready ? fmt::format("median of the last {} steps {:.4g} s", w, median) : std::string(), record, out);
      break;
    }
    case AlertKind::kStraggler: evaluate_straggler(rule_idx, record, out); break;
  }
}

std::vector<Alert> AlertEvaluator::add(const StepRecord& record) {
  for (auto& [idx, window] : straggler_windows_) window.add(record);
  std::vector<Alert> out;
  for (std::size_t i = 0; i < rules_.size(); ++i) evaluate_rule(i, record, &out);
  if (median_window_ > 0) {
    if (std::isfinite(record.loss)) losses_.push_back(record.loss);
    if (record.seconds > 0) seconds_.push_back(record.seconds);
    while (losses_.size() > median_window_) losses_.pop_front();
    while (seconds_.size() > median_window_) seconds_.pop_front();
  }
  return out;
}

std::vector<Alert> AlertEvaluator::firing() const {
  std::vector<Alert> out;
  for (const auto& [key, in] : instances_)
    if (in.firing) out.push_back(in.last);
  return out;
}

}  // namespace epx
