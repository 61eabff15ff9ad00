#include "epx/train/memory_estimate.h"

#include <gtest/gtest.h>

#include "epx/comm/inproc.h"
#include "epx/exchange/buffer.h"
#include "epx/train/model.h"
#include "train/tiny_config.h"

namespace epx {
namespace {

TrainConfig tiny() { return testing::tiny_config({.ffn_hidden = 64}); }

int64_t item(const MemoryEstimate& e, const std::string& name) {
  for (const MemoryItem& i : e.items)
    if (i.name == name) return i.bytes;
  ADD_FAILURE() << "no item " << name;
  return -1;
}

TEST(MemoryEstimate, CountsExpertWeightsGradientsAndAdamWExactly) {
  auto e = estimate_train_memory(tiny());
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  // 2 layers x 2 local experts x (w1, w3, w2 of 32 x 64) x 4 bytes.
  const int64_t weights = int64_t{2} * 2 * 3 * 32 * 64 * 4;
  EXPECT_EQ(item(*e, "expert weights"), weights);
  EXPECT_EQ(item(*e, "expert gradients"), weights);
  EXPECT_EQ(item(*e, "expert AdamW moments"), 2 * weights);
  EXPECT_EQ(e->copies, 4);  // in-process: every rank in this process
}

TEST(MemoryEstimate, ExchangeRegionIsWhatTheBufferAllocates) {
  BufferConfig config;
  config.num_experts = 8;
  config.hidden = 32;
  config.dtype = DType::kBF16;
  config.max_topk = 2;
  config.max_tokens_per_rank = 24;
  std::vector<std::size_t> real(4);
  auto statuses = run_ranks(*Topology::create(4, 1), [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config));
    real[t.rank()] = buffer->region_bytes();
    return Status::ok();
  });
  ASSERT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
  EXPECT_GT(real[0], 0u);
  EXPECT_EQ(Buffer::estimate_region_bytes(config, 4), static_cast<int64_t>(real[0]));
}

// The region of the Buffer MoEModel creates for `c` on its ranks.
int64_t model_region_bytes(const TrainConfig& c) {
  auto m = c.resolved_model();
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  std::vector<int64_t> real(c.num_ranks, -1);
  auto statuses = run_ranks(*Topology::create(c.num_ranks, 1), [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto model, MoEModel::create(*m, t));
    real[t.rank()] = static_cast<int64_t>(model->buffer(0).region_bytes());
    return Status::ok();
  });
  EXPECT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
  return real[0];
}

// The estimate builds its BufferConfig as the model does: receiver weights
// (max_expanded_rows), an fp8 dispatch (gradient_dtype) and an uneven
// placement (the most local experts) each change the model's region, and the
// estimate must follow.
TEST(MemoryEstimate, ExchangeRegionIsTheModelsBuffer) {
  TrainConfig holder = tiny();
  holder.model.layer.router.topk = 4;  // above the 2 local experts of a contiguous placement
  TrainConfig receiver = holder;
  receiver.model.layer.combine_weights = CombineWeights::kReceiver;
  TrainConfig uneven = receiver;  // rank 0 holds 5 of the 8 experts
  uneven.model.placement = *ExpertPlacement::from_map({0, 0, 0, 0, 0, 1, 2, 3}, 4);
  TrainConfig fp8 = receiver;
  fp8.model.layer.hidden = 128;  // one fp8 scale block
  fp8.model.layer.dtype = DType::kBF16;
  fp8.model.layer.dispatch_dtype = DType::kFP8E4M3;
  int64_t holder_bytes = 0;
  for (const TrainConfig* c : {&holder, &receiver, &uneven, &fp8}) {
    auto e = estimate_train_memory(*c);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    const int64_t model = model_region_bytes(*c);
    EXPECT_GT(model, 0);
    EXPECT_EQ(item(*e, "exchange regions (receive and combine)"), model);
    if (c == &holder) holder_bytes = model;
  }
  // The cases differ, so the equalities above are not one case four times.
  EXPECT_GT(model_region_bytes(receiver), holder_bytes);
  EXPECT_GT(model_region_bytes(uneven), model_region_bytes(receiver));
}

TEST(MemoryEstimate, GrowsWithTheSettingsThatDriveIt) {
  TrainConfig c = tiny();
  const int64_t base = item(*estimate_train_memory(c), "activations and backward state");
  c.batch_tokens *= 4;
  EXPECT_GT(item(*estimate_train_memory(c), "activations and backward state"), 3 * base);
}

TEST(MemoryEstimate, ABillionExpertsIsRefusedNamingTheSetting) {
  TrainConfig c = tiny();
  c.model.layer.router.num_experts = 1000000000;
  auto e = estimate_train_memory(c);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  EXPECT_GT(e->total(), int64_t{1} << 40);
  const Status s = check_memory_fits(*e, {.bytes = int64_t{64} << 30, .source = "test"});
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("experts = 1000000000 needs"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("64 GiB is available (test)"), std::string::npos) << s.message();
}

// The settings that size a rank's experts or activations are the ones named.
std::string refusal(const TrainConfig& c) {
  auto e = estimate_train_memory(c);
  if (!e.is_ok()) return e.status().to_string();
  return check_memory_fits(*e, {.bytes = int64_t{64} << 30, .source = "test"}).message();
}

TEST(MemoryEstimate, EplbSlotsAreNamedAndNoPlacementIsBuilt) {
  TrainConfig c = tiny();
  c.model.layer.router.num_experts = 100000000;
  c.balancing = {.eplb = true, .eplb_slots = 400000000};
  // 10^8 slots per rank: sized by arithmetic (a placement map would be GBs).
  EXPECT_NE(refusal(c).find("eplb_slots = 400000000 needs"), std::string::npos) << refusal(c);
}

TEST(MemoryEstimate, SharedExpertsAreNamed) {
  TrainConfig c = tiny();
  c.model.layer.num_shared_experts = 100000000;
  auto e = estimate_train_memory(c);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  EXPECT_GT(item(*e, "shared-expert activations and backward state"), 0);
  EXPECT_NE(refusal(c).find("shared_experts = 100000000 needs"), std::string::npos) << refusal(c);
}

TEST(MemoryEstimate, HugeShapesSaturateInsteadOfWrapping) {
  TrainConfig c = tiny();
  c.model.layer.hidden = 1 << 30;
  c.model.layer.ffn_hidden = 1 << 30;
  auto e = estimate_train_memory(c);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  EXPECT_EQ(e->total(), kMemoryUnbounded);
  for (const MemoryItem& i : e->items) EXPECT_GE(i.bytes, 0) << i.name;
}

TEST(MemoryEstimate, BatchTokensAboveTheInt32LimitPerRankIsAnError) {
  TrainConfig c = tiny();
  c.num_ranks = 1;
  c.model.layer.router.num_experts = 8;
  c.batch_tokens = 99999999999;
  const auto e = estimate_train_memory(c);
  ASSERT_FALSE(e.is_ok());
  EXPECT_EQ(e.status().message(),
            "batch_tokens = 99999999999 is above the limit 2147483647 for ranks = 1 (2147483647 tokens per rank at most)");
}

}  // namespace
}  // namespace epx
