// Routing traces: the counts format parses to the counts it lists, malformed
// lines name file:line and the value, and a replayed trace keeps its skew.
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "epx/sim/simulator.h"
#include "observe/temp_dir.h"
#include "sim/routing_trace.h"
#include "sim/test_scenarios.h"

namespace epx::sim {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The smallest file to check by hand: 4 experts, 2 layers, steps 10 and 30
// given out of order, step 30 leaves layer 1 out (repeated from step 10),
// comments, a header, a line split by spaces and a Windows line end.
TEST(SimRoutingTrace, CountsFileParsesToTheCountsItLists) {
  const auto lines = lines_of(
      "# exported from a training log\n"
      "step,layer,e0,e1,e2,e3\n"
      "30, 0, 5, 6, 7, 8   # layer 1 left out\n"
      "\n"
      "10,0,1,2,3,4\r\n"
      "10 1 0 0 2.5 100\n");
  auto t = parse_counts_trace(lines, "t.csv", 4);
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  EXPECT_EQ(t->num_layers, 2);
  const std::vector<std::vector<double>> expected = {{1, 2, 3, 4}, {0, 0, 2.5, 100}, {5, 6, 7, 8}, {0, 0, 2.5, 100}};
  EXPECT_EQ(t->tokens, expected);
  EXPECT_EQ(detect_trace_format(lines), "counts");
  EXPECT_EQ(detect_trace_format(lines_of("\n{\"layers\":[]}")), "jsonl");
}

TEST(SimRoutingTrace, EveryMalformedLineNamesFileLineAndValue) {
  const std::pair<std::string, std::string> cases[] = {
      {"0,0,1,x,3", "t.csv:1: count of expert 1 = 'x' is not a number"},
      {"# c\n0,0,1,2,-3", "t.csv:2: count of expert 2 = '-3' is negative"},
      {"0,0,1,nan,3", "t.csv:1: count of expert 1 = 'nan' is not finite"},
      {"0,0,inf,2,3", "t.csv:1: count of expert 0 = 'inf' is not finite"},
      {"0,0,1,,3", "t.csv:1: count of expert 1 = '' is not a number"},
      {"0,0,1,2", "t.csv:1: 2 counts after step and layer; model.experts = 3 needs 3"},
      {"0,0,1,2,3,4", "t.csv:1: 4 counts after step and layer; model.experts = 3 needs 3"},
      {"-1,0,1,2,3", "t.csv:1: step '-1' is not an integer >= 0"},
      {"0,1.5,1,2,3", "t.csv:1: layer '1.5' is not an integer in [0, 1048576)"},
      {"0,0,1,2,3\n0,0,1,2,3", "t.csv:2: step 0 layer 0 again (first given on line 1)"},
      {"0,1,1,2,3\n1,0,1,2,3", "t.csv:1: the first step (0) has no layer 0"},
      {"step,layer,a,b,c\nstep,layer,a,b,c", "t.csv:2: step 'step' is not an integer >= 0"},
      {"# only a comment", "routing.trace = 't.csv' holds no steps"},
  };
  for (const auto& [text, expected] : cases) {
    auto t = parse_counts_trace(lines_of(text), "t.csv", 3);
    ASSERT_FALSE(t.is_ok()) << text;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(t.status().message().find(expected), std::string::npos) << text << "\n -> " << t.status().message();
  }
  std::istringstream in("0,0,1,2,3\n");
  auto bad_format = read_routing_trace(in, "t.csv", 3, 1, "csv");
  ASSERT_FALSE(bad_format.is_ok());
  EXPECT_NE(bad_format.status().message().find("routing.trace_format = 'csv' is not one of auto, jsonl, counts"),
            std::string::npos);
}

// The weights keep a top-k router's shares: capped at 1, the rest in
// proportion; an even trace is a flat popularity, zeros stay far below.
TEST(SimRoutingTrace, PopularityKeepsTheSharesATopKRouterCanReach) {
  const auto even = log_popularity_from_counts(std::vector<double>{5, 5, 5, 5}, 2);
  EXPECT_EQ(even[0], even[3]);
  const auto hot = log_popularity_from_counts(std::vector<double>{100, 0, 0, 0}, 2);
  EXPECT_EQ(hot[1], hot[3]);  // the second choice spread evenly over the others
  EXPECT_GT(hot[0] - hot[1], 2.0);
  const auto zero = log_popularity_from_counts(std::vector<double>{0, 0, 0, 0, 0, 0, 0, 100}, 1);
  EXPECT_LT(zero[0] - zero[7], -15.0);
  EXPECT_EQ(log_popularity_from_counts(std::vector<double>{0, 0}, 1), (std::vector<double>{0, 0}));
}

// 2 nodes x 4 GPUs, 16 experts (2 per GPU), top-2, one MoE layer, no shared
// expert, replaying `trace`.
Scenario trace_scenario(const std::string& trace) {
  Scenario s = testing::four_gpu_nodes(2, 8);
  s.model.layers = 1;
  s.model.shared_experts = 0;
  s.parallelism.tokens_per_gpu = 2048;
  s.routing.sample_tokens = 512;
  s.routing.distribution = "trace";
  s.routing.trace = trace;
  return s;
}

std::string counts_line(int step, const std::vector<double>& counts) {
  std::string line = fmt::format("{},0", step);
  for (double c : counts) line += fmt::format(",{}", c);
  return line + "\n";
}

// Expert shares that a top-2 router can produce (expert 0 in 70% of the
// tokens, expert 1 in 40%, the rest even): the replay's max_vio is the
// trace's, E x 0.7 / 2 - 1 = 4.6, within 10% (the proportional weights of
// before gave about 3.9).
TEST(SimRoutingTrace, AReplayedTraceKeepsItsSkew) {
  const epx::testing::TempDir dir;
  std::vector<double> counts(16, 90.0 / 14);
  counts[0] = 70;
  counts[1] = 40;
  std::ofstream(dir.file("skew.csv")) << counts_line(0, counts);
  auto r = simulate(trace_scenario(dir.file("skew.csv")));
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_NEAR(r->steps[0].max_vio, 16 * 0.7 / 2 - 1, 0.46);
}

// Every token's first choice is expert 13 (GPU 6): that GPU's expert GEMMs
// are the longest, and it is the one GPU that never waits for the others.
TEST(SimRoutingTrace, AOneHotTraceMakesItsExpertsGpuTheSlowest) {
  const epx::testing::TempDir dir;
  std::vector<double> counts(16, 0.0);
  counts[13] = 4096;
  std::ofstream(dir.file("hot.csv")) << counts_line(0, counts);
  auto r = simulate(trace_scenario(dir.file("hot.csv")), {.keep_trace = true});
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  std::vector<double> experts_ns(8, 0.0), idle_ns(8, 0.0);
  for (const TraceSpan& sp : r->trace) {
    if (sp.rank % 2 != 0) continue;  // communication tracks
    if (sp.name == "experts") experts_ns[sp.rank / 2] += double(sp.end_ns - sp.begin_ns);
    if (sp.name == "idle") idle_ns[sp.rank / 2] += double(sp.end_ns - sp.begin_ns);
  }
  for (int g = 0; g < 8; ++g) {
    if (g == 6) continue;
    EXPECT_GT(experts_ns[6], 3 * experts_ns[g]) << "GPU " << g;
    EXPECT_GT(idle_ns[g], idle_ns[6]) << "GPU " << g;
  }
  EXPECT_GT(r->steps[0].worst_idle, 0.3);
}

// The same counts as `epx train --metrics` lines and as the counts format
// give the same simulation, bit for bit.
TEST(SimRoutingTrace, JsonlAndCountsFormatsReplayTheSame) {
  const epx::testing::TempDir dir;
  std::ofstream jsonl(dir.file("t.jsonl")), csv(dir.file("t.csv"));
  for (int step = 0; step < 2; ++step) {
    std::vector<double> counts(16);
    std::string json_counts;
    for (int e = 0; e < 16; ++e) {
      counts[e] = double((e * 37 + step * 11) % 23 * (e % 3 + 1));
      json_counts += fmt::format("{}{}", e ? "," : "", counts[e]);
    }
    jsonl << "{\"step\":" << step << ",\"layers\":[{\"layer\":0,\"tokens_per_expert\":[" << json_counts << "]}]}\n";
    csv << counts_line(step, counts);
  }
  jsonl.close();
  csv.close();
  auto a = simulate(trace_scenario(dir.file("t.jsonl")));
  Scenario s = trace_scenario(dir.file("t.csv"));
  s.routing.trace_format = "counts";
  auto b = simulate(s);
  ASSERT_TRUE(a.is_ok() && b.is_ok()) << a.status().message() << b.status().message();
  ASSERT_EQ(a->steps.size(), b->steps.size());
  for (std::size_t i = 0; i < a->steps.size(); ++i) {
    EXPECT_EQ(a->steps[i].step_s, b->steps[i].step_s);
    EXPECT_EQ(a->steps[i].worst_idle, b->steps[i].worst_idle);
    EXPECT_EQ(a->steps[i].max_vio, b->steps[i].max_vio);
  }
  EXPECT_NE(a->steps[0].max_vio, a->steps[1].max_vio);  // the two steps differ: both were replayed
}

}  // namespace
}  // namespace epx::sim
