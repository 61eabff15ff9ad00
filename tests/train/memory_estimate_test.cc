#include "epx/train/memory_estimate.h"

#include <gtest/gtest.h>

#include "epx/comm/inproc.h"
#include "epx/exchange/buffer.h"
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
