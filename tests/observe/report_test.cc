// The run report without a browser: step binning, what RunReport sums, and
// that each chart's embedded data is valid JSON of the right shape.
#include "epx/observe/run_report.h"

#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "observe/report_html.h"
#include "observe/temp_dir.h"

namespace epx {
namespace {

// Records of a run with `layers` layers of `experts` experts and `ranks` ranks:
// expert e of every layer gets e + 1 tokens per step (expert 0 cold, the
// last one hot), rank 2 makes the others wait, step 3 re-places experts.
StepRecord make_step(int64_t step, int layers = 2, int experts = 4, int ranks = 3) {
  StepRecord r;
  r.step = step;
  r.loss = 5.0 - 0.1 * static_cast<double>(step);
  r.main_loss = r.loss - 0.01;
  r.tokens_per_s = 1000;
  r.seconds = 0.5;
  for (int l = 0; l < layers; ++l) {
    LayerRecord layer;
    layer.layer = l;
    layer.max_vio = 0.5 + l;
    layer.idle_fraction = 0.25;
    layer.dropped = l == 0 ? 1 : 0;
    for (int e = 0; e < experts; ++e) layer.tokens_per_expert.push_back(e + 1);
    r.layers.push_back(layer);
  }
  for (int k = 0; k < ranks; ++k) {
    RankRecord t;
    t.rank = k;
    t.router = 0.01, t.dispatch = 0.02, t.experts = 0.1, t.combine = 0.02, t.wait = k == 2 ? 0 : 0.05, t.total = 0.3;
    t.exchange_wait = k == 2 ? 0 : 0.04;
    t.waited_for = k == 2 ? -1 : 2;
    t.late = k == 2 ? 0.08 : 0;
    r.ranks.push_back(t);
  }
  if (step == 3) r.eplb = EplbRecord{.balance_before = {1.5, 1.4}, .balance_after = {1.1, 1.1}, .moved_slots = 6,
                                     .moved_bytes = 1 << 20};
  return r;
}

TEST(StepBins, OneBinPerStepUntilTheLimitThenMeansOfPairs) {
  StepBins bins(1, 4);
  for (int s = 0; s < 4; ++s) bins.add(s, std::vector<double>{double(s)});
  EXPECT_EQ(bins.num_bins(), 4);
  EXPECT_EQ(bins.bin_size(), 1);
  bins.add(4, std::vector<double>{4.0});  // a fifth bin would be over the limit: pairs merge
  ASSERT_EQ(bins.bin_size(), 2);
  ASSERT_EQ(bins.num_bins(), 3);
  EXPECT_DOUBLE_EQ(bins.mean(0, 0), 0.5);
  EXPECT_DOUBLE_EQ(bins.mean(1, 0), 2.5);
  EXPECT_DOUBLE_EQ(bins.mean(2, 0), 4.0);
  EXPECT_DOUBLE_EQ(bins.mean_step(1), 2.5);
  for (int s = 5; s < 1000; ++s) bins.add(s, std::vector<double>{double(s)});
  EXPECT_LE(bins.num_bins(), 4);
  EXPECT_EQ(bins.bin_size(), 256);  // 1000 records in at most 4 bins of a power of two
  EXPECT_DOUBLE_EQ(bins.mean(0, 0), 127.5);
}

TEST(StepBins, NanIsLeftOutOfTheMean) {
  StepBins bins(2, 8);
  bins.add(0, std::vector<double>{1.0, std::nan("")});
  bins.add(1, std::vector<double>{3.0, std::nan("")});
  bins.add(2, std::vector<double>{5.0, 7.0});
  for (int s = 3; s < 9; ++s) bins.add(s, std::vector<double>{0.0, 0.0});  // 9 records: bins of 2
  EXPECT_DOUBLE_EQ(bins.mean(0, 0), 2.0);
  EXPECT_TRUE(std::isnan(bins.mean(0, 1)));
  EXPECT_DOUBLE_EQ(bins.mean(1, 1), 3.5);
}

TEST(StepBins, CountsSumExactlyAndAddCountsMatchesAdd) {
  StepBins a(3, 2, StepBins::Values::kCounts), b(3, 2, StepBins::Values::kCounts);
  const int64_t big = int64_t{1} << 60;  // beyond a double's exact integers once summed
  for (int s = 0; s < 5; ++s) {
    const std::vector<int64_t> row = {s, 10 * s, s == 0 ? big : 1};
    a.add(s, std::span<const int64_t>(row));
    b.add_counts(s, [&](int64_t* sums) {
      for (std::size_t c = 0; c < row.size(); ++c) sums[c] += row[c];
    });
  }
  ASSERT_EQ(a.bin_size(), 4);  // 5 records in 2 bins
  ASSERT_EQ(a.num_bins(), 2);
  for (int bin = 0; bin < 2; ++bin)
    for (int c = 0; c < 3; ++c) EXPECT_EQ(a.sum(bin, c), b.sum(bin, c)) << bin << "," << c;
  EXPECT_DOUBLE_EQ(a.mean(0, 1), 15.0);  // (0 + 10 + 20 + 30) / 4
  EXPECT_DOUBLE_EQ(a.mean(1, 0), 4.0);
  EXPECT_EQ(a.sum(0, 2), static_cast<double>(big + 3));
}

TEST(ReportEncoding, Base64AndScriptSafety) {
  const std::vector<uint8_t> bytes = {'M', 'a', 'n', 0xff, 0};
  EXPECT_EQ(observe_detail::base64(bytes), "TWFu/wA=");
  EXPECT_EQ(observe_detail::script_safe("{\"t\":\"</script><b>\"}"), "{\"t\":\"<\\/script><b>\"}");
  EXPECT_EQ(observe_detail::html_escape("a<b & \"c\">"), "a&lt;b &amp; &quot;c&quot;&gt;");
}

TEST(RunReport, SummarySumsTheRun) {
  RunReport report;
  for (int s = 0; s < 10; ++s) report.add(make_step(s));
  const RunSummary sum = report.summary();
  EXPECT_EQ(sum.num_steps, 10);
  EXPECT_EQ(sum.first_step, 0);
  EXPECT_EQ(sum.last_step, 9);
  EXPECT_DOUBLE_EQ(sum.final_loss, 5.0 - 0.9);
  EXPECT_DOUBLE_EQ(sum.mean_tokens_per_s, 1000);
  EXPECT_EQ(sum.dropped, 10);  // one per step in layer 0
  EXPECT_EQ(sum.eplb_replacements, 1);
  EXPECT_EQ(sum.eplb_moved_slots, 6);
  EXPECT_EQ(sum.step_bin, 1);
  EXPECT_FALSE(sum.has_wait_matrix);
}

// Every chart's JSON, in page order, with its kind.
std::vector<std::pair<std::string, nlohmann::json>> charts_of(const std::string& html) {
  std::vector<std::pair<std::string, nlohmann::json>> out;
  const std::string kind_key = "data-kind=\"", data_key = "class=\"chart-data\">";
  for (std::size_t at = html.find(kind_key); at != std::string::npos; at = html.find(kind_key, at + 1)) {
    const std::size_t kind_end = html.find('"', at + kind_key.size());
    const std::size_t data = html.find(data_key, at) + data_key.size();
    const std::size_t data_end = html.find("</script>", data);
    out.emplace_back(html.substr(at + kind_key.size(), kind_end - at - kind_key.size()),
                     nlohmann::json::parse(html.substr(data, data_end - data)));
  }
  return out;
}

TEST(RunReport, PageHoldsEveryChartWithValidData) {
  RunReport report;
  for (int s = 0; s < 10; ++s) {
    StepRecord r = make_step(s);
    if (s == 8) r.wait_matrix = WaitMatrix{.num_ranks = 3, .arrival = {0, 0, 0.08, 0, 0, 0.08, 0, 0, 0},
                                           .data = {0, 0, 0.001, 0, 0, 0, 0, 0, 0}};
    report.add(std::move(r));
  }
  const std::string html = report.page("run <1>.jsonl").html();
  EXPECT_NE(html.find("run &lt;1&gt;.jsonl"), std::string::npos);
  for (const char* load : {"src=", "href=", "url(", "@import", "https://", "fetch("})
    EXPECT_EQ(html.find(load), std::string::npos) << "the page must load nothing, but holds " << load;
  EXPECT_NE(html.find("Wait matrix of step 8"), std::string::npos);
  const auto charts = charts_of(html);
  std::vector<std::string> kinds;
  for (const auto& [kind, data] : charts) kinds.push_back(kind);
  // loss, tokens/s, MaxVio, balancedness; expert load, whole run, MaxVio per layer; times, idle; wait matrix.
  EXPECT_EQ(kinds, (std::vector<std::string>{"line", "line", "line", "line", "heatmap", "heatmap", "heatmap", "bars",
                                             "bars", "heatmap"}));
  const nlohmann::json& loss = charts[0].second;
  ASSERT_EQ(loss["x"].size(), 10u);
  EXPECT_FLOAT_EQ(loss["series"][0]["y"][9].get<float>(), 4.1f);
  EXPECT_EQ(loss["marks"], nlohmann::json::array({3.0}));
  const nlohmann::json& load = charts[4].second;
  EXPECT_EQ(load["slices"].size(), 2u);  // one per layer
  EXPECT_EQ(load["rows"], 4);            // experts
  EXPECT_EQ(load["cols"], 10);           // one step per column
  EXPECT_EQ(load["markCols"], nlohmann::json::array({3}));
  // base64 of slices x rows x cols bytes: expert 3 carries 4 / 2.5 = 1.6x the mean, on a 0..3 scale.
  const std::string q = load["q"];
  EXPECT_EQ(q.size(), (2u * 4 * 10 + 2) / 3 * 4);
  const nlohmann::json& waits = charts[9].second;
  EXPECT_EQ(waits["rows"], 3);
  EXPECT_DOUBLE_EQ(waits["max"].get<double>(), 80.0);  // ms
}

// The validation series of the loss chart, or nullptr when it has none.
const nlohmann::json* val_series(const nlohmann::json& loss) {
  for (const nlohmann::json& s : loss["series"])
    if (s["name"] == "validation loss (held out)") return &s;
  return nullptr;
}

TEST(RunReport, ValidationLossIsItsOwnSeriesAtItsSteps) {
  RunReport report;
  for (int s = 0; s < 10; ++s) {
    StepRecord r = make_step(s);
    if (s % 4 == 3) r.val_loss = 4.5 - 0.25 * s;  // steps 3 and 7
    report.add(std::move(r));
  }
  const RunSummary sum = report.summary();
  EXPECT_EQ(sum.num_val_losses, 2);
  EXPECT_EQ(sum.last_val_step, 7);
  EXPECT_DOUBLE_EQ(sum.last_val_loss, 2.75);
  const std::string html = report.page("run").html();
  const auto charts = charts_of(html);
  const nlohmann::json& loss = charts[0].second;
  ASSERT_EQ(loss["series"].size(), 3u);  // loss, main loss, validation loss
  EXPECT_EQ(loss["series"][0].count("x"), 0u);  // the training series follow the chart's x
  const nlohmann::json* val = val_series(loss);
  ASSERT_NE(val, nullptr);
  EXPECT_EQ((*val)["x"], nlohmann::json::array({3.0, 7.0}));
  EXPECT_EQ((*val)["y"], nlohmann::json::array({3.75, 2.75}));
  EXPECT_NE(html.find("last validation loss (held out)</td><td class=\"num\">2.75 (step 7; 2 evaluations)"),
            std::string::npos);
}

TEST(RunReport, NoValidationLossNoSeries) {
  RunReport report;
  for (int s = 0; s < 10; ++s) report.add(make_step(s));
  EXPECT_EQ(report.summary().num_val_losses, 0);
  EXPECT_EQ(report.summary().last_val_step, -1);
  const std::string html = report.page("run").html();
  const auto charts = charts_of(html);
  EXPECT_EQ(charts[0].second["series"].size(), 2u);
  EXPECT_EQ(val_series(charts[0].second), nullptr);
  EXPECT_EQ(html.find("validation"), std::string::npos);
}

TEST(RunReport, SummaryRowsAddedByTheCallerEndTheSummaryEscaped) {
  RunReport report;
  for (int s = 0; s < 4; ++s) report.add(make_step(s));
  EXPECT_EQ(report.page("run").html().find("supervised"), std::string::npos);
  report.add_summary_row("supervised", "1 restart, 3 steps lost; rank 1 on <b>: killed");
  const std::string html = report.page("run").html();
  const std::size_t row = html.find("supervised");
  ASSERT_NE(row, std::string::npos);
  EXPECT_NE(html.find("1 restart, 3 steps lost; rank 1 on &lt;b&gt;: killed", row), std::string::npos);
  EXPECT_GT(row, html.find("downsampling"));  // after the built-in rows
}

TEST(RunReport, ManyValidationLossesAreBinnedWithinMaxPoints) {
  RunReport report(RunReportOptions{.max_points = 8, .max_heatmap_columns = 4, .straggler_window = 10});
  for (int s = 0; s < 40; ++s) {
    StepRecord r = make_step(s, 1, 2, 2);
    if (s % 2 == 1) r.val_loss = static_cast<double>(s);  // 20 evaluations
    report.add(std::move(r));
  }
  const auto charts = charts_of(report.page("run").html());
  const nlohmann::json* val = val_series(charts[0].second);
  ASSERT_NE(val, nullptr);
  ASSERT_EQ((*val)["x"].size(), 5u);  // 20 evaluations, 4 per point
  EXPECT_EQ((*val)["x"], (*val)["y"]);  // each point the mean of its evaluations: value = step
  EXPECT_DOUBLE_EQ((*val)["x"][0].get<double>(), 4.0);  // steps 1, 3, 5, 7
  EXPECT_EQ(report.summary().last_val_step, 39);
}

TEST(RunReport, BigRunsStayWithinTheLimits) {
  RunReport report(RunReportOptions{.max_points = 100, .max_heatmap_columns = 16, .straggler_window = 10});
  for (int s = 0; s < 1000; ++s) report.add(make_step(s, 1, 8, 2));
  const RunSummary sum = report.summary();
  EXPECT_EQ(sum.step_bin, 16);  // 1000 steps in <= 100 points
  EXPECT_EQ(sum.heatmap_bin, 64);
  const auto charts = charts_of(report.page("big").html());
  EXPECT_LE(charts[0].second["x"].size(), 100u);
  EXPECT_GE(charts[0].second["x"].size(), 50u);
  EXPECT_LE(charts[4].second["cols"].get<int>(), 16);
  EXPECT_NE(report.page("big").html().find("mean of 16 consecutive steps"), std::string::npos);
}

TEST(RunReport, WriteReportReplacesTheFile) {
  testing::TempDir dir;
  RunReport report;
  report.add(make_step(0));
  std::size_t bytes = 0;
  ASSERT_TRUE(write_report(report.page("x"), dir.file("r.html"), &bytes).is_ok());
  EXPECT_GT(bytes, 1000u);
  const Status missing = write_report(report.page("x"), dir.file("no/such/folder/r.html"));
  EXPECT_EQ(missing.code(), StatusCode::kNotFound) << missing.to_string();
}

}  // namespace
}  // namespace epx
