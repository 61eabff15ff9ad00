// The layer's bf16 copies of its weights: made on the first
// forward, made again after every write (an optimizer step, a checkpoint
// load), and not made again while nothing changed. A write that forgets
// Parameter::mark_written() fails the next forward, naming the parameter.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <vector>

#include "epx/comm/inproc.h"
#include "epx/comm/parallel_layout.h"
#include "epx/core/random.h"
#include "epx/layer/moe_layer.h"
#include "epx/train/optimizer.h"
#include "train/checkpoint.h"

namespace epx {
namespace {

constexpr int kTokens = 24, kHidden = 16;

MoELayerConfig bf16_layer() {
  MoELayerConfig c;
  c.hidden = kHidden;
  c.ffn_hidden = 12;
  c.router = {.num_experts = 4, .topk = 2, .normalize_weights = true};
  c.num_shared_experts = 1;
  c.dtype = DType::kBF16;
  c.compute_dtype = DType::kBF16;
  c.seed = 5;
  c.init_std = 0.5f;
  return c;
}

// One in-process rank holding a layer, its buffer and inputs.
struct OneRank {
  std::unique_ptr<Buffer> buffer;
  std::unique_ptr<MoELayer> layer;
  std::vector<float> x, grad;

  static Result<OneRank> create(Transport& t, const MoELayerConfig& c) {
    OneRank r;
    EPX_ASSIGN_OR_RETURN(r.buffer, Buffer::create(t, {.num_experts = c.router.num_experts, .hidden = c.hidden,
                                                      .dtype = c.dtype, .max_topk = c.router.topk,
                                                      .max_tokens_per_rank = kTokens, .placement = {}}));
    EPX_ASSIGN_OR_RETURN(r.layer, MoELayer::create(c, t, *r.buffer, 0));
    r.x.resize(kTokens * kHidden), r.grad.resize(kTokens * kHidden);
    for (std::size_t i = 0; i < r.x.size(); ++i) {
      r.x[i] = static_cast<float>(standard_normal(1, 0, i));
      r.grad[i] = static_cast<float>(standard_normal(2, 0, i));
    }
    return r;
  }
  TensorView view(std::vector<float>& v) { return TensorView::contiguous(v.data(), DType::kF32, {kTokens, kHidden}); }
  Result<std::vector<float>> forward() {
    std::vector<float> out(x.size());
    EPX_RETURN_IF_ERROR(layer->forward(view(x), view(out)));
    return out;
  }
  // forward, backward and one AdamW step: every parameter's values change.
  Status train_step(AdamW& adam) {
    for (Parameter* p : layer->parameters()) p->zero_grad();
    std::vector<float> out(x.size()), grad_x(x.size());
    EPX_RETURN_IF_ERROR(layer->forward(view(x), view(out)));
    EPX_RETURN_IF_ERROR(layer->backward(view(grad), view(grad_x)));
    adam.step(layer->parameters(), 1e-2);
    return Status::ok();
  }
};

void run_one_rank(const std::function<Status(Transport&)>& body) {
  auto topology = Topology::create(1);
  ASSERT_TRUE(topology.is_ok());
  const std::vector<Status> statuses = run_ranks(*topology, body);
  EXPECT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
}

TEST(LayerWeightCopies, MadeOnceWhileNothingChanges) {
  run_one_rank([](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(OneRank r, OneRank::create(t, bf16_layer()));
    EPX_ASSIGN_OR_RETURN(const std::vector<float> first, r.forward());
    EXPECT_EQ(r.layer->weight_copies(), 6);  // w1, w3, w2 of the routed and of the shared experts
    EPX_ASSIGN_OR_RETURN(const std::vector<float> second, r.forward());
    EXPECT_EQ(r.layer->weight_copies(), 6);
    EXPECT_EQ(first, second);
    return Status::ok();
  });
}

TEST(LayerWeightCopies, F32GemmsCopyNothing) {
  run_one_rank([](Transport& t) -> Status {
    MoELayerConfig c = bf16_layer();
    c.dtype = DType::kF32, c.compute_dtype = DType::kF32;
    EPX_ASSIGN_OR_RETURN(OneRank r, OneRank::create(t, c));
    EPX_RETURN_IF_ERROR(r.forward().status());
    EXPECT_EQ(r.layer->weight_copies(), 0);
    return Status::ok();
  });
}

// After a step the output is that of a fresh layer given the stepped values.
TEST(LayerWeightCopies, OptimizerStepRefreshesEveryCopy) {
  run_one_rank([](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(OneRank r, OneRank::create(t, bf16_layer()));
    AdamW adam;
    EPX_RETURN_IF_ERROR(r.train_step(adam));
    EPX_ASSIGN_OR_RETURN(const std::vector<float> stepped, r.forward());
    EXPECT_EQ(r.layer->weight_copies(), 12);
    EPX_ASSIGN_OR_RETURN(OneRank fresh, OneRank::create(t, bf16_layer()));
    EPX_ASSIGN_OR_RETURN(const std::vector<float> before, fresh.forward());
    EXPECT_NE(before, stepped) << "the step should change the output";
    const std::vector<Parameter*> from = r.layer->parameters(), to = fresh.layer->parameters();
    for (std::size_t i = 0; i < from.size(); ++i) {
      to[i]->value = from[i]->value;
      to[i]->mark_written();
    }
    EPX_ASSIGN_OR_RETURN(const std::vector<float> expected, fresh.forward());
    EXPECT_EQ(stepped, expected);
    return Status::ok();
  });
}

// A load over values that moved on gives back the saved values' output.
TEST(LayerWeightCopies, CheckpointLoadRefreshesEveryCopy) {
  const std::string dir = ::testing::TempDir() + "/epx_weight_copy_ckpt";
  std::filesystem::remove_all(dir);
  run_one_rank([&](Transport& t) -> Status {
    const MoELayerConfig config = bf16_layer();
    EPX_ASSIGN_OR_RETURN(OneRank r, OneRank::create(t, config));
    EPX_ASSIGN_OR_RETURN(const ParallelLayout layout, ParallelLayout::create(t.topology(), 1));
    AdamW adam;
    EPX_RETURN_IF_ERROR(r.train_step(adam));
    detail::CheckpointMeta meta;
    meta.step = 1, meta.fingerprint = "weight-copy-test", meta.num_ranks = 1, meta.num_nodes = 1, meta.ep = 1;
    meta.num_slots = config.router.num_experts;
    std::vector<Parameter*> params = r.layer->parameters();
    MoELayer* layers[] = {r.layer.get()};
    const auto deadline = Deadline::after(Milliseconds(20000));
    EPX_RETURN_IF_ERROR(detail::save_checkpoint(dir, 1, meta, t, layout, params, adam, layers, deadline));
    EPX_ASSIGN_OR_RETURN(const std::vector<float> saved, r.forward());
    EPX_RETURN_IF_ERROR(r.train_step(adam));
    EPX_ASSIGN_OR_RETURN(const std::vector<float> moved_on, r.forward());
    EXPECT_NE(saved, moved_on);
    const int64_t copies = r.layer->weight_copies();
    detail::CheckpointMeta expected;
    expected.fingerprint = meta.fingerprint;
    EPX_ASSIGN_OR_RETURN(const std::string path, detail::resolve_checkpoint(dir));
    EPX_RETURN_IF_ERROR(detail::load_checkpoint(path, &expected, t, params, adam, layers, deadline));
    EPX_ASSIGN_OR_RETURN(const std::vector<float> loaded, r.forward());
    EXPECT_EQ(r.layer->weight_copies(), copies + 6);
    EXPECT_EQ(loaded, saved);
    return Status::ok();
  });
  std::filesystem::remove_all(dir);
}

TEST(LayerWeightCopies, WriteWithoutMarkWrittenNamesTheParameter) {
  run_one_rank([](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(OneRank r, OneRank::create(t, bf16_layer()));
    EPX_RETURN_IF_ERROR(r.forward().status());
    Parameter* w2 = r.layer->expert_parameters()[2];
    w2->value[0] += 1.0f;
    const Status stale = r.forward().status();
    EXPECT_EQ(stale.code(), StatusCode::kInternal) << stale.to_string();
    EXPECT_NE(stale.message().find(w2->name), std::string::npos) << stale.to_string();
    EXPECT_NE(stale.message().find("mark_written"), std::string::npos) << stale.to_string();
    w2->mark_written();
    EPX_RETURN_IF_ERROR(r.forward().status());
    EXPECT_EQ(r.layer->weight_copies(), 7);
    return Status::ok();
  });
}

}  // namespace
}  // namespace epx
