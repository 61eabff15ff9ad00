// The simulator end to end on small scenarios: schedules, balancing, outputs.
#include <fstream>

#include <gtest/gtest.h>

#include "epx/sim/simulator.h"
#include "observe/temp_dir.h"

namespace epx::sim {
namespace {

// 1 node x 8 GPUs, 32 experts top-4, 2 layers; round hardware numbers.
Scenario small_scenario() {
  Scenario s;
  s.hardware.name = "test";
  s.hardware.bf16_flops = 1e15;
  s.hardware.sms = 100;
  s.hardware.comm_sms = 20;
  s.hardware.hbm_bandwidth = 3e12;
  s.hardware.nvlink_bandwidth = 1e11;
  s.hardware.nic_bandwidth = 2.5e10;
  s.hardware.nvlink_latency = 2e-6;
  s.cluster.nodes = 1;
  s.cluster.gpus_per_node = 8;
  s.model.layers = 2;
  s.model.hidden = 1024;
  s.model.expert_hidden = 512;
  s.model.experts = 32;
  s.model.topk = 4;
  s.parallelism.ep = 8;
  s.parallelism.micro_batches = 2;
  s.parallelism.tokens_per_gpu = 1024;
  s.routing.sample_tokens = 256;
  s.run.steps = 4;
  s.run.threads = 1;
  return s;
}

TEST(Simulator, NoOverlapHidesNothingAndOverlapSchedulesAreFaster) {
  Scenario s = small_scenario();
  s.model.shared_experts = 1;
  auto none = simulate(s);
  ASSERT_TRUE(none.is_ok()) << none.status().message();
  const Summary& n = none->summary;
  EXPECT_GT(n.comm_share.mean, 0.05);
  EXPECT_NEAR(n.exposed_comm.mean, n.comm_share.mean, 1e-12);  // nothing overlaps
  EXPECT_GT(n.mfu.mean, 0.0);
  EXPECT_LT(n.mfu.mean, 1.0);
  EXPECT_EQ(none->steps.size(), 4u);
  for (const char* overlap : {"shared", "chunked", "two_micro_batch"}) {
    s.schedule.overlap = overlap;
    auto r = simulate(s);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    EXPECT_LT(r->summary.exposed_comm.mean, n.exposed_comm.mean) << overlap;
    EXPECT_LT(r->summary.step_s.mean, n.step_s.mean) << overlap;
  }
}

TEST(Simulator, OneGpuStepIsTheSumOfItsPhasesByHand) {
  // One GPU, one expert, top-1, forward only, no overlap: nothing is random.
  // Every token's row is a local copy (HBM at 3e12 / 2 B/s) and the expert
  // gets all 1024 rows (8 tiles of 128, no padding).
  Scenario s = small_scenario();
  s.cluster.gpus_per_node = 1;
  s.parallelism.ep = 1;
  s.model.experts = 1;
  s.model.topk = 1;
  s.model.layers = 1;
  s.parallelism.mode = "forward";
  s.run.steps = 1;
  auto r = simulate(s);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const double rate = 1e15 * 0.66 * 1024 / (1024 + 64);  // peak x efficiency(1024 rows), default curve
  const double attention = 1024 * 8.0 * 1024 * 1024 / rate;
  const double router = 1024 * 2.0 * 1024 * 1 / rate;
  const double copy = 1024 * 2048.0 / 1.5e12;  // bf16 rows of 1024
  const double experts = 1024 * 6.0 * 1024 * 512 / rate;
  const double stage = attention + router + copy + experts + copy;
  EXPECT_NEAR(r->steps[0].stage_s, stage, 1e-15);
  EXPECT_NEAR(r->steps[0].step_s, 2 * stage, 1e-15);  // 2 micro-batches, 1 stage
  EXPECT_NEAR(r->steps[0].exposed_comm, 2 * copy / stage, 1e-12);
  EXPECT_NEAR(r->steps[0].worst_idle, 2 * copy / stage, 1e-12);
  EXPECT_NEAR(r->steps[0].tokens_per_s_per_gpu, 2 * 1024 / (2 * stage), 1e-6);
  // Model FLOPs per token: attention + router + top-1 expert.
  EXPECT_DOUBLE_EQ(r->model_flops_per_token, 8.0 * 1024 * 1024 + 2.0 * 1024 + 6.0 * 1024 * 512);
}

TEST(Simulator, PipelineBubbleMultipliesTheSlowestStage) {
  Scenario s = small_scenario();
  s.cluster.nodes = 3;
  s.model.layers = 3;
  s.model.dense_layers = 1;
  s.parallelism.pp_stages = 3;
  s.parallelism.micro_batches = 4;
  s.run.steps = 1;
  auto r = simulate(s);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  // Plus the transfers between stages, then the gradient all-reduce the last
  // unit's backward leaves exposed (dense, over each stage's 8 GPUs) and the optimizer.
  const StepStats& st = r->steps[0];
  EXPECT_GT(st.grad_exposed_s, 0.0);
  EXPECT_NEAR(st.pp_transfer_s, (4 + 3 - 1) * r->pipeline.per_unit_s, 1e-15);
  EXPECT_NEAR(st.step_s, (4 + 3 - 1) * st.stage_s + st.pp_transfer_s + st.grad_exposed_s + st.optimizer_s, 1e-15);
}

double late_worst_idle(const Scenario& s) {
  auto r = simulate(s);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  double sum = 0;
  int n = 0;
  for (std::size_t i = r->steps.size() / 2; i < r->steps.size(); ++i, ++n) sum += r->steps[i].worst_idle;
  return sum / n;
}

TEST(Simulator, BalancingReducesIdleOnASkewedScenario) {
  Scenario s = small_scenario();
  s.routing.distribution = "zipf";
  s.routing.zipf_s = 1.2;
  s.run.steps = 24;
  s.model.layers = 1;
  const double none = late_worst_idle(s);
  EXPECT_GT(none, 0.3);
  Scenario aux = s;
  aux.balancing.strategy = "aux";
  Scenario bias = s;
  bias.balancing.strategy = "bias";
  bias.balancing.bias_rate = 0.02;
  Scenario eplb = s;
  eplb.balancing.strategy = "eplb";
  eplb.balancing.eplb_redundant = 2;
  eplb.balancing.eplb_every = 2;
  Scenario capacity = s;
  capacity.balancing.strategy = "capacity";
  capacity.model.capacity_factor = 1.25;
  for (const Scenario* b : {&aux, &bias, &eplb, &capacity})
    EXPECT_LT(late_worst_idle(*b), none - 0.05) << b->balancing.strategy;
}

TEST(Simulator, TraceHasEveryGpuAndPercentilesAreNearestRank) {
  Scenario s = small_scenario();
  s.run.steps = 2;
  s.run.trace_step = 1;
  auto r = simulate(s, {.keep_trace = true});
  ASSERT_TRUE(r.is_ok());
  std::vector<int> per_track(16, 0);
  for (const TraceSpan& sp : r->trace) {
    ASSERT_GE(sp.rank, 0);
    ASSERT_LT(sp.rank, 16);
    EXPECT_LE(sp.begin_ns, sp.end_ns);
    ++per_track[sp.rank];
  }
  for (int track = 0; track < 16; ++track) EXPECT_GT(per_track[track], 0) << track;
  const Percentiles p = percentiles({5, 1, 4, 2, 3});
  EXPECT_EQ(p.p50, 3);
  EXPECT_EQ(p.p99, 5);
  EXPECT_EQ(p.mean, 3);
}

TEST(Simulator, ReplaysATraceInTheFormatEpxTrainWrites) {
  // Two steps of `epx train --metrics` lines (other fields trimmed): step 0
  // sends almost everything to expert 5, step 1 is even. max_vio follows.
  const epx::testing::TempDir dir;
  const std::string path = dir.file("sim_trace.jsonl");
  {
    std::ofstream out(path);
    std::string hot = "0", even = "100";
    for (int e = 1; e < 32; ++e) {
      hot += e == 5 ? ",100000" : ",0";
      even += ",100";
    }
    out << "{\"step\":0,\"layers\":[{\"layer\":0,\"tokens_per_expert\":[" << hot << "]}]}\n";
    out << "{\"step\":1,\"layers\":[{\"layer\":0,\"tokens_per_expert\":[" << even << "]}]}\n";
  }
  Scenario s = small_scenario();
  s.model.layers = 1;
  s.routing.distribution = "trace";
  s.routing.trace = path;
  s.run.steps = 2;
  auto r = simulate(s);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  // Step 0: expert 5 is in nearly every token's top-4 (load ~ tokens, mean
  // tokens x 4 / 32): max_vio near 7; step 1: near 0.
  EXPECT_GT(r->steps[0].max_vio, 6.0);
  EXPECT_LT(r->steps[1].max_vio, 1.0);
  EXPECT_GT(r->steps[0].worst_idle, r->steps[1].worst_idle);

  std::ofstream(path) << "{\"step\":0,\"layers\":[{\"layer\":0,\"tokens_per_expert\":[1,2,3]}]}\n";
  auto bad = simulate(s);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find(
                "sim_trace.jsonl:1: layers[0].tokens_per_expert must list model.experts = 32 counts"),
            std::string::npos)
      << bad.status().message();
}

// A line of another shape is an error naming the file, the line and the
// place in it; the JSON type errors it once threw crossed the API.
TEST(Simulator, AMalformedTraceIsAnErrorNotAnException) {
  const epx::testing::TempDir dir;
  const std::string path = dir.file("bad_trace.jsonl");
  Scenario s = small_scenario();
  s.model.layers = 1;
  s.routing.distribution = "trace";
  s.routing.trace = path;
  std::string negative = "{\"layers\":[{\"tokens_per_expert\":[0";
  for (int e = 1; e < 32; ++e) negative += e == 7 ? ",-1" : ",0";
  negative += "]}]}";
  const std::pair<std::string, std::string> cases[] = {
      {"{\"layers\":[1]}", "bad_trace.jsonl:1: layers[0].tokens_per_expert must list"},
      {"{\"layers\":[{\"tokens_per_expert\":\"x\"}]}", "bad_trace.jsonl:1: layers[0].tokens_per_expert must list"},
      {"[1]", "bad_trace.jsonl:1: no \"layers\" array"},
      {"\n{\"layers\":[{\"tokens_per_expert\":[1e400]}]}", "bad_trace.jsonl:2: not JSON"},
      {negative, "bad_trace.jsonl:1: layers[0].tokens_per_expert[7] = -1 is not a finite count >= 0"},
  };
  for (const auto& [line, expected] : cases) {
    std::ofstream(path) << line << "\n";
    auto r = simulate(s);
    ASSERT_FALSE(r.is_ok()) << line;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << line;
    EXPECT_NE(r.status().message().find(expected), std::string::npos) << line << ": " << r.status().message();
  }
}

TEST(Simulator, ResultsDoNotDependOnThreads) {
  Scenario s = small_scenario();
  s.routing.distribution = "lognormal";
  s.routing.drift = 0.1;
  auto a = simulate(s);
  s.run.threads = 3;
  auto b = simulate(s);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  for (std::size_t i = 0; i < a->steps.size(); ++i) EXPECT_EQ(a->steps[i].step_s, b->steps[i].step_s);
}

// Several stages and EP groups (units run on the simulator's threads) and the
// expert bias fed back between steps: every step's statistics and the trace
// are the same bits on one thread and on three.
TEST(Simulator, UnitsOnThreadsGiveTheSameBits) {
  Scenario s = small_scenario();
  s.cluster.nodes = 4;
  s.parallelism.ep = 4;
  s.parallelism.pp_stages = 2;
  s.parallelism.mode = "train";
  s.model.layers = 5;
  s.model.dense_layers = 1;
  s.routing.distribution = "lognormal";
  s.routing.drift = 0.1;
  s.balancing.strategy = "bias";
  s.run.steps = 3;
  s.run.trace_step = 1;
  ASSERT_EQ(s.ep_groups_per_stage(), 4);
  auto a = simulate(s, {.keep_trace = true});
  s.run.threads = 3;
  auto b = simulate(s, {.keep_trace = true});
  ASSERT_TRUE(a.is_ok() && b.is_ok()) << (a.is_ok() ? b.status() : a.status()).message();
  ASSERT_EQ(a->steps.size(), b->steps.size());
  for (std::size_t i = 0; i < a->steps.size(); ++i) {
    const StepStats &x = a->steps[i], &y = b->steps[i];
    EXPECT_EQ(x.step_s, y.step_s);
    EXPECT_EQ(x.worst_idle, y.worst_idle);
    EXPECT_EQ(x.mean_idle, y.mean_idle);
    EXPECT_EQ(x.exposed_comm, y.exposed_comm);
    EXPECT_EQ(x.max_vio, y.max_vio);
    EXPECT_EQ(x.grad_exposed_s, y.grad_exposed_s);
  }
  EXPECT_EQ(a->routed_gpu_layers, b->routed_gpu_layers);
  EXPECT_EQ(a->routed_gpu_layers, 3 * 4 * 4 * 4);  // steps x MoE layers x groups per stage x GPUs per group
  ASSERT_EQ(a->trace.size(), b->trace.size());
  ASSERT_FALSE(a->trace.empty());
  for (std::size_t i = 0; i < a->trace.size(); ++i) {
    EXPECT_EQ(a->trace[i].begin_ns, b->trace[i].begin_ns);
    EXPECT_EQ(a->trace[i].end_ns, b->trace[i].end_ns);
  }
  for (std::size_t k = 0; k < a->summary.phase_s.size(); ++k)
    EXPECT_EQ(a->summary.phase_s[k].second, b->summary.phase_s[k].second);
}

}  // namespace
}  // namespace epx::sim
