#include "epx/observe/alerts.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "observe/monitor_records.h"
#include "observe/temp_dir.h"

namespace epx {
namespace {

using epx::testing::healthy_step;
using epx::testing::make_straggler;

std::vector<AlertRule> rules_of(std::string_view text) {
  Result<std::vector<AlertRule>> rules = parse_alert_rules(text, "rules.toml");
  EXPECT_TRUE(rules.is_ok()) << rules.status().to_string();
  return rules.is_ok() ? *rules : std::vector<AlertRule>{};
}

std::string error_of(std::string_view text) {
  Result<std::vector<AlertRule>> rules = parse_alert_rules(text, "rules.toml");
  EXPECT_FALSE(rules.is_ok());
  return rules.is_ok() ? std::string() : rules.status().message();
}

// The alerts of each step, in order.
std::vector<std::vector<Alert>> run(AlertEvaluator& e, const std::vector<StepRecord>& steps) {
  std::vector<std::vector<Alert>> out;
  for (const StepRecord& s : steps) out.push_back(e.add(s));
  return out;
}

// A tiny hand-checkable case first: one layer's MaxVio above 1 for steps 1..4
// with for_steps = 3 fires once at step 3 and clears once at step 5.
TEST(Alerts, MaxVioFiresOnceAfterForStepsAndClearsOnce) {
  AlertEvaluator e(rules_of("[[rule]]\nname = \"vio\"\nkind = \"max_vio\"\nabove = 1.0\nfor_steps = 3\n"));
  std::vector<StepRecord> steps;
  for (int i = 0; i < 7; ++i) {
    steps.push_back(healthy_step(i));
    if (i >= 1 && i <= 4) steps.back().layers[1].max_vio = 1.5 + i;
  }
  const auto alerts = run(e, steps);
  for (int i : {0, 1, 2, 4, 6}) EXPECT_TRUE(alerts[i].empty()) << "step " << i;
  ASSERT_EQ(alerts[3].size(), 1u);
  EXPECT_TRUE(alerts[3][0].firing);
  EXPECT_EQ(alerts[3][0].rule, "vio");
  EXPECT_EQ(alerts[3][0].layer, 1);
  EXPECT_EQ(alerts[3][0].rank, -1);
  EXPECT_EQ(alerts[3][0].step, 3);
  EXPECT_DOUBLE_EQ(alerts[3][0].value, 4.5);
  EXPECT_DOUBLE_EQ(alerts[3][0].threshold, 1.0);
  ASSERT_EQ(alerts[5].size(), 1u);
  EXPECT_FALSE(alerts[5][0].firing);
  EXPECT_EQ(alerts[5][0].layer, 1);
  EXPECT_EQ(e.num_fired(), 1);
  EXPECT_TRUE(e.firing().empty());
}

TEST(Alerts, ARunShorterThanForStepsNeverFires) {
  AlertEvaluator e(rules_of("[[rule]]\nname = \"vio\"\nkind = \"max_vio\"\nabove = 1.0\nfor_steps = 3\n"));
  std::vector<StepRecord> steps;
  for (int i = 0; i < 8; ++i) {
    steps.push_back(healthy_step(i));
    if (i % 3 != 2) steps.back().layers[0].max_vio = 2;  // two in a row, then a quiet one
  }
  for (const auto& a : run(e, steps)) EXPECT_TRUE(a.empty());
  EXPECT_EQ(e.num_fired(), 0);
}

TEST(Alerts, DroppedFiresPerLayerWithTheCount) {
  AlertEvaluator e(rules_of("[[rule]]\nname = \"drops\"\nkind = \"dropped\"\n"));
  StepRecord s = healthy_step(0, 3);
  s.layers[0].dropped = 7;
  s.layers[2].dropped = 1;
  const std::vector<Alert> a = e.add(s);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].layer, 0);
  EXPECT_DOUBLE_EQ(a[0].value, 7);
  EXPECT_EQ(a[1].layer, 2);
  EXPECT_EQ(e.firing().size(), 2u);
  // Still dropping in layer 0: no new line; layer 2 stopped: cleared.
  StepRecord t = healthy_step(1, 3);
  t.layers[0].dropped = 3;
  const std::vector<Alert> b = e.add(t);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_FALSE(b[0].firing);
  EXPECT_EQ(b[0].layer, 2);
  ASSERT_EQ(e.firing().size(), 1u);
  EXPECT_DOUBLE_EQ(e.firing()[0].value, 3);  // the latest value while firing
}

TEST(Alerts, NanLossFiresAndClears) {
  AlertEvaluator e(rules_of("[[rule]]\nname = \"nan\"\nkind = \"nan_loss\"\n"));
  StepRecord s = healthy_step(0);
  EXPECT_TRUE(e.add(s).empty());
  s.step = 1;
  s.loss = std::numeric_limits<double>::quiet_NaN();
  const std::vector<Alert> a = e.add(s);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_TRUE(std::isnan(a[0].value));
  s.step = 2;
  s.loss = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(e.add(s).empty());  // still not finite: no new line
  const std::vector<Alert> c = e.add(healthy_step(3));
  ASSERT_EQ(c.size(), 1u);
  EXPECT_FALSE(c[0].firing);
}

TEST(Alerts, LossSpikeAgainstTheMedianOfTheWindow) {
  AlertEvaluator e(rules_of("[[rule]]\nname = \"spike\"\nkind = \"loss_spike\"\nabove = 2\nwindow = 4\n"));
  std::vector<StepRecord> steps;
  for (double loss : {9.0, 1.0, 1.2, 0.8, 1.0, 2.1, 1.0}) {
    steps.push_back(healthy_step(static_cast<int64_t>(steps.size())));
    steps.back().loss = loss;
  }
  // Step 0's 9.0 has no window before it: quiet. Step 5: 2.1 > 2 x median(1.0, 1.2, 0.8, 1.0) = 2.0.
  const auto alerts = run(e, steps);
  for (int i : {0, 1, 2, 3, 4}) EXPECT_TRUE(alerts[i].empty()) << "step " << i;
  ASSERT_EQ(alerts[5].size(), 1u);
  EXPECT_DOUBLE_EQ(alerts[5][0].value, 2.1);
  EXPECT_DOUBLE_EQ(alerts[5][0].threshold, 2);
  EXPECT_NE(alerts[5][0].detail.find("median of the last 4 losses 1"), std::string::npos) << alerts[5][0].detail;
  ASSERT_EQ(alerts[6].size(), 1u);
  EXPECT_FALSE(alerts[6][0].firing);
}

TEST(Alerts, SlowStepAgainstTheMedianStepTime) {
  AlertEvaluator e(rules_of("[[rule]]\nname = \"slow\"\nkind = \"slow_step\"\nabove = 1.5\nwindow = 3\n"));
  std::vector<StepRecord> steps;
  for (double sec : {1.0, 1.1, 0.9, 1.6, 1.0}) {
    steps.push_back(healthy_step(static_cast<int64_t>(steps.size())));
    steps.back().seconds = sec;
  }
  // Step 3: 1.6 > 1.5 x median(1.0, 1.1, 0.9) = 1.5; step 4: 1.0 < 1.5 x 1.1.
  const auto alerts = run(e, steps);
  for (int i : {0, 1, 2}) EXPECT_TRUE(alerts[i].empty()) << "step " << i;
  ASSERT_EQ(alerts[3].size(), 1u);
  EXPECT_TRUE(alerts[3][0].firing);
  EXPECT_DOUBLE_EQ(alerts[3][0].value, 1.6);
  ASSERT_EQ(alerts[4].size(), 1u);
  EXPECT_FALSE(alerts[4][0].firing);
}

TEST(Alerts, RankIdleNamesTheRank) {
  AlertEvaluator e(rules_of("[[rule]]\nname = \"idle\"\nkind = \"rank_idle\"\nabove = 0.25\n"));
  StepRecord s = healthy_step(0);
  s.ranks[3].wait = 0.2;
  s.ranks[3].exchange_wait = 0.1;  // (0.2 + 0.1) / 1.0 = 0.3
  s.ranks[1].wait = 0.2;           // 0.2: below
  const std::vector<Alert> a = e.add(s);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].rank, 3);
  EXPECT_EQ(a[0].layer, -1);
  EXPECT_NEAR(a[0].value, 0.3, 1e-12);
}

TEST(Alerts, StragglerPersistingForStepsNamesTheRank) {
  AlertEvaluator e(rules_of(
      "[[rule]]\nname = \"straggler\"\nkind = \"straggler\"\nwindow = 3\nfor_steps = 2\nmin_share = 0.5\n"));
  std::vector<StepRecord> steps;
  for (int i = 0; i < 8; ++i) {
    steps.push_back(healthy_step(i));
    make_straggler(steps.back(), 2, 0.3);
  }
  const auto alerts = run(e, steps);
  // The window is full at step 2; two steps in a row: fires at step 3.
  for (int i : {0, 1, 2}) EXPECT_TRUE(alerts[i].empty()) << "step " << i;
  ASSERT_EQ(alerts[3].size(), 1u);
  EXPECT_EQ(alerts[3][0].rank, 2);
  EXPECT_GE(alerts[3][0].value, 0.5);
  EXPECT_FALSE(alerts[3][0].detail.empty());
  for (int i : {4, 5, 6, 7}) EXPECT_TRUE(alerts[i].empty()) << "step " << i;
  EXPECT_EQ(e.num_fired(), 1);
}

TEST(Alerts, FormatsOneLineWithTimeRuleWhereValueAndThreshold) {
  AlertEvaluator e(rules_of("[[rule]]\nname = \"idle\"\nkind = \"rank_idle\"\nabove = 0.25\n"));
  e.set_clock([] { return std::chrono::system_clock::time_point(std::chrono::seconds(1796083200)); });
  StepRecord s = healthy_step(41);
  s.ranks[2].wait = 0.5;
  const std::vector<Alert> a = e.add(s);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(format_alert(a[0]), "2026-12-01T00:00:00Z FIRING idle rank=2 value=0.5 threshold=0.25 step=41");
}

TEST(Alerts, RejectsBadRulesNamingTheKeyAndTheRange) {
  EXPECT_EQ(error_of("[[rule]]\nname = \"a\"\nkind = \"max_vio\"\nabove = 1\nabov = 2\n"),
            "rules.toml: rule 'a': unknown key 'abov' (a max_vio rule takes name, kind, above, for_steps)");
  EXPECT_EQ(error_of("[[rule]]\nname = \"a\"\nkind = \"rank_idle\"\nabove = 1.5\n"),
            "rules.toml: rule 'a': above = 1.5 is outside [0, 1]");
  EXPECT_EQ(error_of("[[rule]]\nname = \"a\"\nkind = \"loss_spike\"\nabove = 1\n"),
            "rules.toml: rule 'a': above = 1 is outside (1, 1e+06]");
  EXPECT_EQ(error_of("[[rule]]\nname = \"a\"\nkind = \"max_vio\"\nabove = 1\nfor_steps = 2.5\n"),
            "rules.toml: rule 'a': for_steps must be an integer in [1, 1e+06]");
  EXPECT_EQ(error_of("[[rule]]\nname = \"a\"\nkind = \"max_vio\"\n"),
            "rules.toml: rule 'a': a max_vio rule needs above (in [0, 1e+06])");
  EXPECT_EQ(error_of("[[rule]]\nname = \"a\"\nkind = \"maxvio\"\n"),
            "rules.toml: rule 'a': kind = 'maxvio' is not one of max_vio, rank_idle, dropped, nan_loss, loss_spike, "
            "straggler, slow_step");
  EXPECT_EQ(error_of("[[rule]]\nkind = \"dropped\"\n"),
            "rules.toml: rule 1: no 'name' (every rule needs a name and a kind)");
  EXPECT_EQ(error_of("[[rule]]\nname = \"a\"\nkind = \"dropped\"\n[[rule]]\nname = \"a\"\nkind = \"nan_loss\"\n"),
            "rules.toml: rule name 'a' is used twice");
  EXPECT_EQ(error_of("rules = 1\n"), "rules.toml: unknown key 'rules' (a rule file holds [[rule]] tables only)");
  EXPECT_NE(error_of("[[rule]\n").find("rules.toml:1:"), std::string::npos);
}

TEST(Alerts, AMissingFileIsNotFound) {
  epx::testing::TempDir dir;
  Result<std::vector<AlertRule>> rules = load_alert_rules(dir.file("none.toml"));
  ASSERT_FALSE(rules.is_ok());
  EXPECT_EQ(rules.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace epx
