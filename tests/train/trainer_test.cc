// The training job: EP over R ranks follows one rank holding every expert,
// a resumed run continues with the same bits, the synthetic task is
// learnable, and bias balancing beats no balancing on MaxVio.
#include "epx/train/trainer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "observe/temp_dir.h"

namespace epx {
namespace {

TrainConfig tiny(int num_ranks, int64_t steps) {
  TrainConfig c;
  c.num_ranks = num_ranks;
  c.steps = steps;
  c.batch_tokens = 96;
  c.model.input_dim = c.synthetic.input_dim = 16;
  c.model.output_dim = c.synthetic.output_dim = 8;
  c.synthetic.num_clusters = 8;
  c.model.num_layers = 2;
  c.model.layer.hidden = 32;
  c.model.layer.ffn_hidden = 32;
  c.model.layer.router = {.num_experts = 8, .topk = 2, .normalize_weights = true};
  c.schedule = {.peak = 3e-3, .warmup_steps = 3, .total_steps = steps};
  return c;
}

struct Curve {
  std::vector<double> loss;
  std::vector<double> max_vio;
  TrainSummary summary;
};

Curve run(const TrainConfig& config) {
  Curve curve;
  auto summary = train(
      config,
      [&](const StepReport& r) {
        curve.loss.push_back(r.loss);
        double vio = 0;
        for (const LoadStats& s : r.layers) vio += s.max_vio;
        curve.max_vio.push_back(vio / static_cast<double>(r.layers.size()));
      },
      /*keep_parameters=*/true);
  EXPECT_TRUE(summary.is_ok()) << summary.status().to_string();
  if (summary.is_ok()) curve.summary = std::move(summary).value();
  return curve;
}

TEST(Trainer, FourRanksFollowOneRankHoldingEveryExpert) {
  TrainConfig one = tiny(1, 8), four = tiny(4, 8);
  // The global aux loss and the bias see the whole batch, however it is split.
  one.balancing = four.balancing = {.aux_loss_coeff = 1e-2, .aux_loss = AuxLossKind::kGlobalBatch, .expert_bias = true};
  const Curve a = run(one), b = run(four);
  ASSERT_EQ(a.loss.size(), 8u);
  ASSERT_EQ(b.loss.size(), 8u);
  for (std::size_t i = 0; i < a.loss.size(); ++i)
    EXPECT_NEAR(a.loss[i], b.loss[i], 1e-4 * std::abs(a.loss[i])) << "step " << i;
  ASSERT_EQ(a.summary.parameters.size(), b.summary.parameters.size());
  for (const auto& [name, values] : a.summary.parameters) {
    ASSERT_TRUE(b.summary.parameters.contains(name)) << name;
    const auto& other = b.summary.parameters.at(name);
    ASSERT_EQ(values.size(), other.size()) << name;
    double max_diff = 0, max_abs = 0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      max_diff = std::max(max_diff, static_cast<double>(std::abs(values[i] - other[i])));
      max_abs = std::max(max_abs, static_cast<double>(std::abs(values[i])));
    }
    EXPECT_GT(max_abs, 0.0) << name;
    // fp32 reassociation (sums split over ranks), amplified by 8 Adam steps.
    EXPECT_LE(max_diff, 1e-4 * std::max(1.0, max_abs)) << name;
  }
}

TEST(Trainer, ResumedRunContinuesWithTheSameBits) {
  testing::TempDir dir;
  TrainConfig straight = tiny(2, 6);
  straight.balancing = {.expert_bias = true, .bias_rate = 1e-2f, .capacity_factor = 1.5};
  const Curve whole = run(straight);

  TrainConfig first = straight;
  first.steps = 3;
  first.schedule.total_steps = 6;  // the same schedule as the straight run
  first.save_dir = (dir.path() / "ckpt").string();
  const Curve a = run(first);
  ASSERT_TRUE(std::filesystem::exists(dir.path() / "ckpt" / "meta.json"));
  TrainConfig second = straight;
  second.resume_dir = first.save_dir;
  const Curve b = run(second);

  std::vector<double> resumed = a.loss;
  resumed.insert(resumed.end(), b.loss.begin(), b.loss.end());
  ASSERT_EQ(resumed.size(), whole.loss.size());
  for (std::size_t i = 0; i < resumed.size(); ++i) EXPECT_EQ(resumed[i], whole.loss[i]) << "step " << i;
  ASSERT_FALSE(whole.summary.parameters.empty());
  for (const auto& [name, values] : whole.summary.parameters)
    EXPECT_EQ(values, b.summary.parameters.at(name)) << name << " differs after resume";
}

TEST(Trainer, ResumeRejectsAnotherRankCountAndAMissingFolder) {
  testing::TempDir dir;
  TrainConfig c = tiny(2, 2);
  c.save_dir = (dir.path() / "ckpt").string();
  run(c);
  TrainConfig other = tiny(4, 4);
  other.resume_dir = c.save_dir;
  auto s = train(other);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("written by 2 ranks on 1 nodes; this run has 4 ranks"), std::string::npos)
      << s.status().to_string();
  other.resume_dir = (dir.path() / "nothing").string();
  s = train(other);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound) << s.status().to_string();
}

// The synthetic task is learnable, and the bias keeps the experts balanced
// where an unbalanced router concentrates on the popular clusters' experts.
TEST(Trainer, SyntheticTaskIsLearnedAndBiasBalancingCutsMaxVio) {
  TrainConfig none = tiny(4, 200);
  none.synthetic.zipf_s = 1.2;
  none.schedule.peak = 5e-3;
  TrainConfig bias = none;
  bias.balancing = {.expert_bias = true, .bias_rate = 3e-3f};
  const Curve a = run(none), b = run(bias);
  ASSERT_EQ(a.loss.size(), 200u);
  std::printf("none: loss %.5f -> %.5f, MaxVio %.3f; bias: loss %.5f -> %.5f, MaxVio %.3f\n", a.summary.first_loss,
              a.summary.final_loss, a.summary.mean_max_vio, b.summary.first_loss, b.summary.final_loss,
              b.summary.mean_max_vio);
  EXPECT_LT(a.summary.final_loss, a.summary.first_loss / 5) << "loss did not fall fivefold";
  EXPECT_LT(b.summary.final_loss, b.summary.first_loss / 5);
  EXPECT_LT(b.summary.mean_max_vio, 0.6 * a.summary.mean_max_vio)
      << "bias " << b.summary.mean_max_vio << " vs none " << a.summary.mean_max_vio;
  // Balance is not free on a Zipf-skewed task: measured about 20% higher loss
  // at a third of the MaxVio (docs/benchmarks.md); a 30% bound catches a broken bias.
  EXPECT_LT(b.summary.final_loss, 1.3 * a.summary.final_loss) << "balancing cost too much loss";
}

TEST(Trainer, BadConfigsNameTheValue) {
  TrainConfig c = tiny(4, 2);
  c.model.layer.router.topk = 9;
  auto s = train(c);
  EXPECT_NE(s.status().message().find("topk"), std::string::npos) << s.status().to_string();
  c = tiny(4, 2);
  c.schedule.peak = -1;
  s = train(c);
  EXPECT_NE(s.status().message().find("learning rate -1"), std::string::npos) << s.status().to_string();
  c = tiny(3, 2);
  s = train(c);
  EXPECT_NE(s.status().message().find("experts = 8 must be a multiple of ranks = 3"), std::string::npos)
      << s.status().to_string();
  EXPECT_EQ(parse_balancing("bias+nope", {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_balancing("bias+capacity-score", {})->name(), "bias+capacity-score");
}

}  // namespace
}  // namespace epx
