// EP x EDP training: 4 ranks as one EP group of 4, two of 2 and four of 1,
// and one rank holding every expert, train on the same global batch from the
// same seed and give the same loss curve, with each balancing strategy and
// with shared experts; the EP groups keep the same experts; a run resumes at
// its own layout with the same bits; bad layouts are refused naming the values.
//
// Tolerance: the layouts sum the same numbers in different orders (the dense
// gradients over 4 ranks or 1, each expert's rows from 1, 2 or 4 source
// ranks, then over the EDP group, and the combine's top-k terms across
// ranks), so the losses differ by fp32 reassociation (a few units in the
// last place of a float, ~6e-8 relative), which AdamW's normalised steps
// carry forward. Measured over these 8 steps: at most 1.4e-7 relative
// (printed by each test); the bound, kTolerance, is about 7 times that.
#include "epx/train/trainer.h"
#include "train/parameters_near.h"
#include "train/tiny_config.h"
#include "epx/train/memory_estimate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "observe/temp_dir.h"

namespace epx {
namespace {

// Relative, on loss, main loss and gradient norm: measured at most 1.4e-7
// (bias, 2026-12-01), so about 7 times that.
constexpr double kTolerance = 1e-6;

struct Curve {
  std::vector<double> loss, main_loss, grad_norm;
  int moved_slots = 0;  // eplb, over the run
  std::vector<std::vector<int64_t>> first_loads;  // step 0, per layer: global tokens per expert
  TrainSummary summary;
};

Curve run(const TrainConfig& config) {
  Curve curve;
  auto summary = train(
      config,
      [&](const StepReport& r) {
        curve.loss.push_back(r.loss);
        curve.main_loss.push_back(r.main_loss);
        curve.grad_norm.push_back(r.grad_norm);
        if (r.eplb) curve.moved_slots += r.eplb->num_moved_slots;
        if (r.step == 0)
          for (const LoadStats& s : r.layers) curve.first_loads.push_back(s.tokens_per_expert);
      },
      /*keep_parameters=*/true);
  EXPECT_TRUE(summary.is_ok()) << "ranks " << config.num_ranks << " ep " << config.ep << ": "
                               << summary.status().to_string();
  if (summary.is_ok()) curve.summary = std::move(summary).value();
  return curve;
}

double relative(double a, double b) { return std::abs(a - b) / std::max(std::abs(a), 1e-12); }

// The largest relative difference of `b` from `a` over the three curves.
double max_difference(const Curve& a, const Curve& b) {
  double worst = 0;
  for (std::size_t i = 0; i < std::min(a.loss.size(), b.loss.size()); ++i)
    worst = std::max({worst, relative(a.loss[i], b.loss[i]), relative(a.main_loss[i], b.main_loss[i]),
                      relative(a.grad_norm[i], b.grad_norm[i])});
  return worst;
}

TrainConfig layout(TrainConfig c, int num_ranks, int ep) {
  c.num_ranks = num_ranks;
  c.ep = ep;
  return c;
}

// 1 rank, then 4 ranks with EP 4, 2 and 1: every curve follows the 1-rank one.
void expect_layouts_agree(const TrainConfig& base, const char* what) {
  const TrainConfig c = [&] {
    TrainConfig t = base;
    t.synthetic.zipf_s = 1.2;  // skewed routing: hot experts, replicas with eplb
    return t;
  }();
  const Curve one = run(layout(c, 1, 0));
  ASSERT_EQ(one.loss.size(), static_cast<std::size_t>(c.steps));
  double worst = 0;
  for (int ep : {4, 2, 1}) {
    const Curve four = run(layout(c, 4, ep));
    ASSERT_EQ(four.loss.size(), one.loss.size()) << what << ", ep " << ep;
    const double diff = max_difference(one, four);
    worst = std::max(worst, diff);
    EXPECT_LE(diff, kTolerance) << what << ", ep " << ep;
    // The first step's routing is the same, and the statistics are global.
    EXPECT_EQ(four.first_loads, one.first_loads) << what << ", ep " << ep;
    for (std::size_t i = 0; i < one.loss.size(); ++i)
      EXPECT_NEAR(four.loss[i], one.loss[i], kTolerance * std::abs(one.loss[i])) << what << ", ep " << ep << ", step " << i;
  }
  EXPECT_GT(one.loss.front(), one.loss.back()) << what << ": the loss did not fall";
  std::printf("%s: largest relative difference of 4 ranks (EP 4, 2, 1) from 1 rank over %lld steps: %.3g\n", what,
              static_cast<long long>(c.steps), worst);
}

TrainConfig base() { return testing::tiny_config({.steps = 8, .batch_tokens = 128}); }

TEST(EpLayout, BiasBalancingGivesTheSameLossCurve) {
  TrainConfig c = base();
  c.balancing = {.expert_bias = true, .bias_rate = 1e-2f};
  expect_layouts_agree(c, "bias");
}

TEST(EpLayout, AuxLossGivesTheSameLossCurve) {
  TrainConfig c = base();
  c.balancing = {.aux_loss_coeff = 1e-2, .aux_loss = AuxLossKind::kMicroBatch};
  // The micro-batch loss is per rank, so only layouts with the same world
  // size share it: 4 ranks at every EP size.
  const Curve ep4 = run(layout(c, 4, 4));
  for (int ep : {2, 1}) {
    const Curve other = run(layout(c, 4, ep));
    ASSERT_EQ(other.loss.size(), ep4.loss.size());
    const double diff = max_difference(ep4, other);
    EXPECT_LE(diff, kTolerance) << "aux, ep " << ep;
    std::printf("aux (micro-batch): largest relative difference of EP %d from EP 4 (4 ranks): %.3g\n", ep, diff);
  }
  c.balancing.aux_loss = AuxLossKind::kGlobalBatch;
  expect_layouts_agree(c, "aux-global");
}

TEST(EpLayout, EplbGivesTheSameLossCurve) {
  TrainConfig c = base();
  c.balancing = {.expert_bias = true, .bias_rate = 1e-2f, .eplb = true, .eplb_every = 3};
  expect_layouts_agree(c, "bias+eplb");
}

// A re-placement rebuilds the layers after the backward: the step's report
// still counts the aux loss of its forward (main loss below the loss).
TEST(EpLayout, AuxLossIsReportedOnReplacementSteps) {
  TrainConfig c = layout(base(), 4, 2);
  c.synthetic.zipf_s = 1.2;
  c.balancing = {.aux_loss_coeff = 1e-2, .aux_loss = AuxLossKind::kGlobalBatch, .eplb = true, .eplb_every = 2};
  const Curve curve = run(c);
  ASSERT_EQ(curve.loss.size(), 8u);
  EXPECT_GT(curve.moved_slots, 0);
  for (std::size_t i = 0; i < curve.loss.size(); ++i) EXPECT_LT(curve.main_loss[i], curve.loss[i]) << "step " << i;
}

TEST(EpLayout, SharedExpertsGiveTheSameLossCurve) {
  TrainConfig c = base();
  c.model.layer.num_shared_experts = 1;
  c.balancing = {.expert_bias = true};
  expect_layouts_agree(c, "shared experts");
}

// Emulated nodes: EP groups of one node each (the exchange stays inside it),
// and EP groups that span both nodes (the two-hop path inside the group).
TEST(EpLayout, EmulatedNodesGiveTheSameLossCurve) {
  TrainConfig c = base();
  c.balancing = {.expert_bias = true, .bias_rate = 1e-2f};
  const Curve one = run(layout(c, 1, 0));
  struct Shape {
    int ranks, nodes, ep;
  };
  // The last: 4 nodes of 2 ranks, each EP group of 4 spans two of them.
  for (const Shape s : {Shape{8, 2, 4}, Shape{8, 2, 2}, Shape{8, 4, 4}}) {
    TrainConfig t = layout(c, s.ranks, s.ep);
    t.num_nodes = s.nodes;
    const Curve other = run(t);
    ASSERT_EQ(other.loss.size(), one.loss.size()) << s.ranks << " ranks, ep " << s.ep;
    EXPECT_LE(max_difference(one, other), kTolerance) << s.ranks << " ranks on " << s.nodes << " nodes, ep " << s.ep;
  }
}

// Every EP group holds the same experts after training, and the parameters
// follow the 1-rank run's.
TEST(EpLayout, ParametersFollowOneRank) {
  TrainConfig c = base();
  c.balancing = {.expert_bias = true};
  const Curve one = run(layout(c, 1, 0)), two = run(layout(c, 4, 2));
  testing::expect_parameters_near(one.summary.parameters, two.summary.parameters, 1e-4);
}

// Saved at EP 2 of 4 ranks after 3 steps, resumed at the same layout: the
// same bits as the run that never stopped.
TEST(EpLayout, ResumeAtTheSameLayoutGivesTheSameBits) {
  testing::TempDir dir;
  TrainConfig straight = layout(base(), 4, 2);
  // 12 slots: 6 per rank of an EP group of 2.
  straight.balancing = {.expert_bias = true, .eplb = true, .eplb_every = 2, .eplb_slots = 12};
  const Curve whole = run(straight);
  TrainConfig first = straight;
  first.steps = 3;
  first.save_dir = (dir.path() / "ckpt").string();
  const Curve a = run(first);
  TrainConfig second = straight;
  second.resume_dir = first.save_dir;
  const Curve b = run(second);
  std::vector<double> resumed = a.loss;
  resumed.insert(resumed.end(), b.loss.begin(), b.loss.end());
  EXPECT_EQ(resumed, whole.loss);
  EXPECT_EQ(b.summary.parameters, whole.summary.parameters);
  // Another EP size is another layout: it reshards (tests/train/reshard_test.cc).
  TrainConfig other = layout(second, 4, 4);
  auto note = resume_note(other);
  ASSERT_TRUE(note.is_ok()) << note.status().to_string();
  EXPECT_NE(note->find("(EP 2, 12 slots per layer, eplb) onto 4 ranks on 1 node (EP 4"), std::string::npos) << *note;
  auto s = train(other);
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
}

// An EP group of 2 holds twice the experts per rank of one of 4 (E / ep, or
// slots / ep with eplb): the memory estimate follows; the checkpoint, in
// logical order, holds each expert once whatever the EP size (one file per EP
// rank: only headers and meta.json lines differ).
TEST(EpLayout, MemoryAndCheckpointSizeFollowTheEpGroup) {
  auto expert_bytes = [](const TrainConfig& c) -> int64_t {
    auto e = estimate_train_memory(c);
    EXPECT_TRUE(e.is_ok()) << e.status().to_string();
    if (!e.is_ok()) return 0;
    for (const MemoryItem& item : e->items)
      if (item.name == "expert weights") return item.bytes;
    ADD_FAILURE() << "no expert weights item";
    return 0;
  };
  const TrainConfig four = layout(base(), 4, 4), two = layout(base(), 4, 2);
  EXPECT_GT(expert_bytes(four), 0);
  EXPECT_EQ(expert_bytes(two), 2 * expert_bytes(four));
  TrainConfig eplb = two;
  eplb.balancing = {.eplb = true, .eplb_slots = 12};  // 6 slots per rank of an EP group of 2
  EXPECT_EQ(expert_bytes(eplb), 3 * expert_bytes(four));
  testing::TempDir dir;
  TrainConfig save_four = four, save_two = two;
  save_four.save_dir = save_two.save_dir = (dir.path() / "ckpt").string();
  auto a = check_save(save_four), b = check_save(save_two);
  ASSERT_TRUE(a.is_ok() && b.is_ok()) << a.status().to_string() << b.status().to_string();
  EXPECT_GT(a->checkpoint_bytes, b->checkpoint_bytes);  // two more expert files
  EXPECT_LT(a->checkpoint_bytes - b->checkpoint_bytes, 1024);
}

TEST(EpLayout, BadLayoutsNameTheValues) {
  auto message = [](const TrainConfig& c) { return train(c).status().to_string(); };
  TrainConfig c = layout(base(), 4, 3);
  EXPECT_NE(message(c).find("ep = 3 must divide ranks = 4"), std::string::npos) << message(c);
  c = layout(base(), 4, -1);
  EXPECT_NE(message(c).find("ep = -1 is below 0"), std::string::npos) << message(c);
  c = layout(base(), 6, 3);
  c.num_nodes = 3;  // 2 ranks per node: an EP group of 3 would split one
  EXPECT_NE(message(c).find("ep = 3 splits nodes unevenly"), std::string::npos) << message(c);
  c = layout(base(), 8, 4);
  c.model.layer.router.num_experts = 6;
  EXPECT_NE(message(c).find("experts = 6 must be a multiple of ep = 4 (each EP group holds every expert once)"),
            std::string::npos)
      << message(c);
  c = layout(base(), 4, 2);
  c.balancing = {.eplb = true, .eplb_slots = 9};
  EXPECT_NE(message(c).find("eplb_slots = 9 must be a multiple of ep = 2"), std::string::npos) << message(c);
  // With eplb the default slots follow the EP group: 8 experts + 2 = 10.
  c.balancing.eplb_slots = 0;
  EXPECT_EQ(c.balancing.slots(8, c.ep_size()), 10);
}

}  // namespace
}  // namespace epx
