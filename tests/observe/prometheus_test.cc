#include "epx/observe/prometheus.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "epx/observe/run_snapshot.h"
#include "observe/monitor_records.h"
#include "observe/temp_dir.h"

namespace epx {
namespace {

using epx::testing::healthy_step;
using epx::testing::make_straggler;
using epx::testing::read_file;
using epx::testing::TempDir;

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  std::string value;
};

// Checks `text` against the text exposition format line by line and returns
// its samples: every line a HELP, a TYPE or a sample; a family's HELP and
// TYPE once, before its samples; names and labels well formed; values
// numbers, NaN or +-Inf; counters named *_total; no series twice.
std::vector<Sample> parse_exposition(const std::string& text) {
  static const std::regex help(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) \S.*)");
  static const std::regex type(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (gauge|counter))");
  static const std::regex sample(R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+))");
  static const std::regex label(R"(([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)\"(,|$))");
  static const std::regex number(R"(NaN|[+-]Inf|-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?)");
  std::set<std::string> helped, typed, series;
  std::map<std::string, std::string> types;
  std::vector<Sample> out;
  std::istringstream lines(text);
  std::string line;
  int n = 0;
  EXPECT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n');
  while (std::getline(lines, line)) {
    ++n;
    std::smatch m;
    if (std::regex_match(line, m, help)) {
      EXPECT_TRUE(helped.insert(m[1]).second) << "line " << n << ": second HELP for " << m[1];
      continue;
    }
    if (std::regex_match(line, m, type)) {
      EXPECT_TRUE(helped.count(m[1])) << "line " << n << ": TYPE before HELP";
      EXPECT_TRUE(typed.insert(m[1]).second) << "line " << n << ": second TYPE for " << m[1];
      types[m[1]] = m[2];
      if (m[2] == "counter") {
        EXPECT_TRUE(std::string(m[1]).ends_with("_total")) << line;
      }
      continue;
    }
    if (!std::regex_match(line, m, sample)) {
      ADD_FAILURE() << "line " << n << " is not HELP, TYPE or a sample: '" << line << "'";
      continue;
    }
    Sample s{m[1], {}, m[4]};
    EXPECT_TRUE(types.count(s.name)) << "line " << n << ": sample before its TYPE: " << line;
    EXPECT_TRUE(std::regex_match(s.value, number)) << "line " << n << ": value '" << s.value << "'";
    std::string labels = m[3];
    for (std::smatch l; !labels.empty() && std::regex_search(labels, l, label) && l.position() == 0;
         labels = l.suffix()) {
      EXPECT_TRUE(s.labels.emplace(l[1], l[2]).second) << "line " << n << ": label twice";
    }
    EXPECT_TRUE(labels.empty()) << "line " << n << ": bad labels '" << std::string(m[3]) << "'";
    EXPECT_TRUE(series.insert(s.name + "{" + std::string(m[3]) + "}").second) << "line " << n << ": series twice";
    out.push_back(std::move(s));
  }
  return out;
}

const Sample* find(const std::vector<Sample>& samples, const std::string& name,
                   const std::map<std::string, std::string>& labels = {}) {
  for (const Sample& s : samples)
    if (s.name == name && s.labels == labels) return &s;
  return nullptr;
}

std::vector<AlertRule> two_rules() {
  std::vector<AlertRule> rules(2);
  rules[0].name = "drops";
  rules[0].kind = AlertKind::kDropped;
  rules[1].name = "say \"hi\"\\now";  // quotes and a backslash, escaped in the label
  rules[1].kind = AlertKind::kNanLoss;
  return rules;
}

TEST(Prometheus, TheFormatLineByLineWithTheValues) {
  RunTracker tracker({.window = 4, .hot_experts = 2});
  for (int i = 0; i < 4; ++i) {
    StepRecord s = healthy_step(i);
    s.layers[1].max_vio = 0.5;
    s.layers[1].idle_fraction = 0.25;
    s.layers[1].dropped = 3;
    s.layers[1].tokens_per_expert[5] = 30;  // 30 of 100 tokens
    s.ranks[1].exchange_wait = 0.125;
    s.loss = i == 3 ? std::numeric_limits<double>::quiet_NaN() : 2.0;
    make_straggler(s, 2, 0.3);
    tracker.add(s);
  }
  const std::vector<AlertRule> rules = two_rules();
  Alert firing;
  firing.rule = "drops";
  const std::string text = format_prometheus(tracker.snapshot(), rules, std::span<const Alert>(&firing, 1), 1.5e9);
  const std::vector<Sample> samples = parse_exposition(text);
  auto value = [&](const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    const Sample* s = find(samples, name, labels);
    EXPECT_NE(s, nullptr) << name << " missing in\n" << text;
    return s ? s->value : std::string("(missing)");
  };
  EXPECT_EQ(value("epx_train_step"), "3");
  EXPECT_EQ(value("epx_train_loss"), "NaN");
  EXPECT_EQ(value("epx_monitor_records_total"), "4");
  EXPECT_EQ(value("epx_layer_max_vio", {{"layer", "1"}}), "0.5");
  EXPECT_EQ(value("epx_layer_balancedness", {{"layer", "1"}}), "0.75");
  EXPECT_EQ(value("epx_layer_dropped_tokens_total", {{"layer", "1"}}), "12");
  EXPECT_EQ(value("epx_train_dropped_tokens_total"), "12");
  EXPECT_EQ(value("epx_expert_token_share", {{"layer", "1"}, {"expert", "5"}}), "0.3");
  EXPECT_EQ(value("epx_rank_exchange_wait_seconds", {{"rank", "1"}}), "0.3");  // make_straggler's wait
  EXPECT_EQ(value("epx_straggler_rank"), "2");
  EXPECT_EQ(value("epx_straggler_cause", {{"cause", "compute"}}), "1");
  EXPECT_EQ(value("epx_alerts_firing", {{"rule", "drops"}}), "1");
  EXPECT_EQ(value("epx_alerts_firing", {{"rule", "say \\\"hi\\\"\\\\now"}}), "0");
  EXPECT_EQ(value("epx_monitor_last_step_timestamp_seconds"), "1500000000");
}

// 61 layers x 256 experts on 64 ranks: the file grows with layers x hot
// experts and with ranks, never with experts or ranks x ranks.
TEST(Prometheus, StaysBoundedForABigRun) {
  RunTracker tracker({.window = 2, .hot_experts = 4});
  for (int i = 0; i < 2; ++i) tracker.add(healthy_step(i, 61, 256, 64));
  const std::vector<AlertRule> rules = two_rules();
  const std::vector<Sample> samples = parse_exposition(format_prometheus(tracker.snapshot(), rules, {}, 0));
  std::size_t per_layer = 0, per_rank = 0, other = 0;
  for (const Sample& s : samples) {
    EXPECT_FALSE(s.labels.count("layer") && s.labels.count("rank")) << s.name;
    if (s.labels.count("layer")) ++per_layer;
    else if (s.labels.count("rank")) ++per_rank;
    else ++other;
  }
  EXPECT_EQ(per_layer, 61u * (3 + 4));
  EXPECT_EQ(per_rank, 64u * 3);
  EXPECT_LE(other, 20u);
}

TEST(Prometheus, BeforeTheFirstStepOnlyTheMonitorsOwnSeries) {
  const std::vector<Sample> samples = parse_exposition(format_prometheus(RunTracker().snapshot(), {}, {}, 0));
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[0].name, "epx_monitor_records_total");
}

TEST(Prometheus, WritesAtomicallyAndLeavesNoTemporaryFile) {
  TempDir dir;
  const std::string path = dir.file("epx.prom");
  ASSERT_TRUE(write_prometheus_file(path, "a 1\n").is_ok());
  ASSERT_TRUE(write_prometheus_file(path, "b 2\n").is_ok());
  EXPECT_EQ(read_file(path), "b 2\n");
  EXPECT_EQ(dir.names(), std::vector<std::string>{"epx.prom"});
  const Status missing = write_prometheus_file(dir.file("no/such/epx.prom"), "a 1\n");
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("no/such/epx.prom"), std::string::npos) << missing.message();
}

// Prometheus's own checker, where Debian's `prometheus` package put it.
TEST(Prometheus, PromtoolAcceptsTheFile) {
  if (std::system("command -v promtool > /dev/null 2>&1") != 0) GTEST_SKIP() << "no promtool (Debian: prometheus)";
  TempDir dir;
  const std::string path = dir.file("epx.prom");
  RunTracker tracker;
  StepRecord s = healthy_step(0);
  make_straggler(s, 1, 0.2);
  tracker.add(s);
  const std::vector<AlertRule> rules = two_rules();
  ASSERT_TRUE(write_prometheus_file(path, format_prometheus(tracker.snapshot(), rules, {}, 1.7e9)).is_ok());
  const std::string out = dir.file("promtool.txt");
  const int rc = std::system(("promtool check metrics < " + path + " > " + out + " 2>&1").c_str());
  EXPECT_EQ(rc, 0) << read_file(out) << "\n" << read_file(path);
}

}  // namespace
}  // namespace epx
