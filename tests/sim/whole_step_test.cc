// The whole training step in the simulator: activation transfers between
// pipeline stages, the optimizer step (and ZeRO-1), and that the step time is
// exactly the sum of its parts.
#include <fstream>

#include <gtest/gtest.h>

#include "epx/sim/optimizer.h"
#include "epx/sim/pipeline.h"
#include "epx/sim/simulator.h"
#include "observe/temp_dir.h"
#include "sim/test_scenarios.h"

namespace epx::sim {
namespace {

// `nodes` x 4 GPUs, EP 4, `pp` stages, 4 micro-batches, a message overhead.
Scenario small(int nodes, int pp) {
  Scenario s = testing::four_gpu_nodes(nodes, 4);
  s.hardware.message_overhead = 1e-7;
  s.parallelism.pp_stages = pp;
  s.parallelism.micro_batches = 4;
  return s;
}

SimResult run(const Scenario& s) {
  auto r = simulate(s);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return r.is_ok() ? std::move(r).value() : SimResult{};
}

// step = (units + pp - 1) x stage + the transfers + exposed all-reduce + optimizer + gathers.
double parts_of(const StepStats& st, int units, int pp) {
  return (units + pp - 1) * st.stage_s + st.pp_transfer_s + st.grad_exposed_s + st.optimizer_s + st.param_gather_s;
}

TEST(SimWholeStep, PipelineTransfersOnlyWithStagesAndGrowWithHiddenAndTokens) {
  auto one = pipeline_transfer(small(2, 1));
  ASSERT_TRUE(one.is_ok());
  EXPECT_EQ(one->per_unit_s, 0.0);
  EXPECT_EQ(one->link, "none");
  EXPECT_EQ(run(small(2, 1)).steps[0].pp_transfer_s, 0.0);

  Scenario s = small(2, 2);
  auto base = pipeline_transfer(s);
  ASSERT_TRUE(base.is_ok());
  EXPECT_DOUBLE_EQ(base->bytes, 512.0 * 512 * 2);  // tokens x hidden x bf16
  EXPECT_GT(base->per_unit_s, 0.0);
  for (const char* key : {"model.hidden", "parallelism.tokens_per_gpu"}) {
    Scenario bigger = s;
    ASSERT_TRUE(set_value(bigger, key, "1024").is_ok());
    auto t = pipeline_transfer(bigger);
    ASSERT_TRUE(t.is_ok());
    EXPECT_GT(t->seconds, base->seconds) << key;
    EXPECT_DOUBLE_EQ(t->bytes, 2 * base->bytes) << key;
  }
  s.model.activation_dtype = "f32";
  EXPECT_DOUBLE_EQ(pipeline_transfer(s)->bytes, 2 * base->bytes);
}

TEST(SimWholeStep, SameNodeStagesUseNvlinkAndOtherNodesTheNic) {
  // 1 node x 4, PP 2: stages of 2 GPUs in one node. EP 2 for 2-GPU stages.
  Scenario in_node = small(1, 2);
  in_node.parallelism.ep = 2;
  auto a = pipeline_transfer(in_node);
  ASSERT_TRUE(a.is_ok());
  const double bytes = 512.0 * 512 * 2;
  EXPECT_EQ(a->link, "nvlink");
  EXPECT_NEAR(a->seconds, bytes / 1e11 + 2e-6 + 1e-7, 1e-15);
  EXPECT_NEAR(a->per_unit_s, 2 * a->seconds, 1e-15);  // forward activations, backward gradients
  // 2 nodes x 4, PP 2: a stage per node, every pair across.
  auto b = pipeline_transfer(small(2, 2));
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(b->link, "nic");
  EXPECT_NEAR(b->seconds, bytes / 1e10 + 5e-6 + 1e-7, 1e-15);
  // One NIC per node shared by its 4 senders (emulated hosts).
  Scenario shared = small(2, 2);
  shared.hardware.nic_shared_per_node = true;
  EXPECT_NEAR(pipeline_transfer(shared)->seconds, 4 * bytes / 1e10 + 5e-6 + 1e-7, 1e-15);
  // Forward only: the activations, no gradients back; two micro-batches per unit: twice.
  Scenario fwd = small(2, 2);
  fwd.parallelism.mode = "forward";
  EXPECT_NEAR(pipeline_transfer(fwd)->per_unit_s, b->seconds, 1e-15);
  Scenario two = small(2, 2);
  two.schedule.overlap = "two_micro_batch";
  EXPECT_NEAR(pipeline_transfer(two)->per_unit_s, 4 * b->seconds, 1e-15);
}

TEST(SimWholeStep, OptimizerScalesWithTheParametersHeldAndZeroShardsIt) {
  const Scenario s = small(2, 1);  // EP 4 over 8 GPUs: EDP 2, dense over 8
  const GroupShape edp{2, 2, 1, 4, 8}, world{8, 2, 4, 1, 8};
  const GradientBytes held = parameters_held(s, 0);
  const OptimizerCost c = optimizer_cost(s, held, edp, world);
  // f32 master, gradient and moments: read 16 bytes, write 12.
  EXPECT_DOUBLE_EQ(c.bytes_per_param, 28.0);
  EXPECT_DOUBLE_EQ(c.params, held.expert() + held.dense());
  EXPECT_NEAR(c.update_s, c.params * 28.0 / 3e12, 1e-15);
  EXPECT_EQ(c.gather_s, 0.0);
  // Twice the experts on the same GPUs: more parameters held, a longer update.
  Scenario more = s;
  more.model.experts = 32;
  const GradientBytes held2 = parameters_held(more, 0);
  EXPECT_DOUBLE_EQ(held2.expert(), 2 * held.expert());
  EXPECT_GT(optimizer_cost(more, held2, edp, world).update_s, c.update_s);
  // A measured optimizer rate replaces the HBM's; emulated hosts: x GPUs / cores.
  Scenario rate = s;
  rate.hardware.optimizer_bandwidth = 1e9;
  EXPECT_NEAR(optimizer_cost(rate, held, edp, world).update_s, c.params * 28.0 / 1e9, 1e-12);
  rate.hardware.host_cores = 2;
  EXPECT_NEAR(optimizer_cost(rate, held, edp, world).update_s, 4 * c.params * 28.0 / 1e9, 1e-12);
  // bf16 moments: 8 bytes less per parameter.
  Scenario bf16 = s;
  bf16.optimizer.moment_dtype = "bf16";
  EXPECT_DOUBLE_EQ(optimizer_cost(bf16, held, edp, world).bytes_per_param, 20.0);
  // ZeRO-1: experts over EDP 2, dense over 8; the weights all-gathered after.
  Scenario zero = s;
  zero.optimizer.zero = true;
  const OptimizerCost z = optimizer_cost(zero, held, edp, world);
  EXPECT_DOUBLE_EQ(z.params, held.expert() / 2 + held.dense() / 8);
  EXPECT_LT(z.update_s, c.update_s);
  EXPECT_GT(z.gather_s, 0.0);
  EXPECT_EQ(z.gather_expert.algorithm, "ring all-gather");
  // Off, or forward only: nothing.
  Scenario none = s;
  none.optimizer.kind = "none";
  EXPECT_EQ(optimizer_cost(none, held, edp, world).seconds(), 0.0);
  none = s;
  none.parallelism.mode = "forward";
  EXPECT_EQ(optimizer_cost(none, held, edp, world).seconds(), 0.0);
}

TEST(SimWholeStep, ZeroReduceScattersTheGradientsAndGathersHalfAnAllReduce) {
  Scenario s = small(2, 1);
  s.parallelism.allreduce = "ring";
  const GroupShape world{8, 2, 4, 1, 8};
  const AllReduceCost full = all_reduce_cost(1e6, world, s.hardware, "ring");
  const AllReduceCost half = half_all_reduce_cost(1e6, world, s.hardware, "ring", "all-gather");
  EXPECT_NEAR(half.seconds, full.seconds / 2, 1e-15);
  EXPECT_NEAR(half.bytes_sent, full.bytes_sent / 2, 1e-9);
  Scenario zero = s;
  zero.optimizer.zero = true;
  EXPECT_NEAR(gradient_reduce_cost(1e6, world, zero).seconds, full.seconds / 2, 1e-15);
  const SimResult a = run(s), b = run(zero);
  EXPECT_LT(b.steps[0].grad_sync_s, a.steps[0].grad_sync_s);
  EXPECT_GT(b.steps[0].param_gather_s, 0.0);
}

TEST(SimWholeStep, TheStepIsItsPartsAndTurningOnePartOffRemovesExactlyIt) {
  for (bool zero : {false, true}) {
    Scenario s = small(4, 2);  // a stage on 2 nodes, stages across the NIC
    s.optimizer.zero = zero;
    const SimResult all = run(s);
    ASSERT_EQ(all.steps.size(), 2u);
    for (const StepStats& st : all.steps) {
      EXPECT_NEAR(st.step_s, parts_of(st, 4, 2), 1e-12) << zero;
      EXPECT_GT(st.pp_transfer_s, 0.0);
      EXPECT_GT(st.optimizer_s, 0.0);
      EXPECT_EQ(st.param_gather_s > 0, zero);
    }
    Scenario no_pp = s;
    no_pp.parallelism.pp_transfers = false;
    const SimResult a = run(no_pp);
    for (std::size_t i = 0; i < a.steps.size(); ++i) {
      EXPECT_EQ(a.steps[i].stage_s, all.steps[i].stage_s);
      EXPECT_NEAR(all.steps[i].step_s - a.steps[i].step_s, all.steps[i].pp_transfer_s, 1e-12);
    }
    if (zero) continue;  // without ZeRO the all-reduce is the same with or without the optimizer
    Scenario no_opt = s;
    no_opt.optimizer.kind = "none";
    const SimResult b = run(no_opt);
    for (std::size_t i = 0; i < b.steps.size(); ++i) {
      EXPECT_EQ(b.steps[i].optimizer_s, 0.0);
      EXPECT_NEAR(all.steps[i].step_s - b.steps[i].step_s, all.steps[i].optimizer_s, 1e-12);
    }
  }
}

TEST(SimWholeStep, NothingButRemovingAPartShortensTheStep) {
  // Every part is >= 0, so the step is at least the MoE stages' 1F1B plus the
  // exposed all-reduce (the step before pipeline transfers and the optimizer).
  for (int pp : {1, 2, 4}) {
    for (const char* overlap : {"none", "two_micro_batch"}) {
      Scenario s = small(4, pp);
      s.schedule.overlap = overlap;
      const int units = s.parallelism.micro_batches / (std::string(overlap) == "two_micro_batch" ? 2 : 1);
      for (const StepStats& st : run(s).steps) {
        EXPECT_GE(st.pp_transfer_s, 0.0);
        EXPECT_GE(st.optimizer_s, 0.0);
        EXPECT_GE(st.step_s, (units + pp - 1) * st.stage_s + st.grad_exposed_s) << pp << overlap;
        EXPECT_NEAR(st.step_s, parts_of(st, units, pp), 1e-12) << pp << overlap;
        EXPECT_EQ(st.pp_transfer_s > 0, pp > 1);
      }
    }
  }
}

TEST(SimWholeStep, KeysAreCheckedByNameAndTheFileIsNamed) {
  Scenario s = small(2, 1);
  s.optimizer.kind = "sgd";
  EXPECT_EQ(s.validate().message(), "optimizer.kind = 'sgd' is not one of adamw, none");
  s = small(2, 1);
  s.optimizer.weight_copy_dtype = "f16";
  EXPECT_EQ(s.validate().message(), "optimizer.weight_copy_dtype = 'f16' is not one of none, bf16, fp8");
  s = small(2, 1);
  s.model.activation_dtype = "int8";
  EXPECT_EQ(s.validate().message(), "model.activation_dtype = 'int8' is not one of fp8, bf16, f32");
  ASSERT_TRUE(set_value(s, "optimizer.zero", "true").is_ok());
  EXPECT_TRUE(s.optimizer.zero);
  EXPECT_FALSE(set_value(s, "parallelism.pp_transfers", "maybe").is_ok());
  const epx::testing::TempDir dir;
  const std::string path = dir.file("bad_optimizer.toml");
  std::ofstream(path) << "[hardware.compute]\nbf16_flops = 1e15\n[hardware.memory]\nhbm_bandwidth = 3e12\n"
                         "[hardware.nvlink]\nbandwidth = 1e11\n[optimizer]\nmoment_dtype = \"fp8\"\n";
  auto bad = load_scenario(path);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().message(), path + ": optimizer.moment_dtype = 'fp8' is not one of f32, bf16");
}

}  // namespace
}  // namespace epx::sim
