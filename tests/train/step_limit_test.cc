// The step-limit counts against a hand count on a tiny shape, the limit's
// choice of rank, and the rate probe's checks.
#include "epx/train/step_limit.h"

#include <gtest/gtest.h>

#include <array>
#include <mutex>

#include "epx/comm/inproc.h"
#include "epx/exchange/buffer.h"

namespace epx {
namespace {

// H = 2, F = 3, E = 2 experts on 2 ranks, one layer: rank 0's experts ran 3
// (token, slot) rows of 2 tokens, rank 1's 1 row of 1 token.
ModelConfig tiny_model() {
  ModelConfig m;
  m.num_layers = 1;
  m.layer.hidden = 2;
  m.layer.ffn_hidden = 3;
  m.layer.router = {.num_experts = 2, .topk = 2};
  return m;
}

LoadStats tiny_stats() {
  LoadStats s;
  s.tokens_per_expert = {3, 1};
  s.work_per_rank = {3, 1};
  s.tokens_per_rank = {2, 1};
  return s;
}

TEST(StepLimit, CountsByHandOnATinyShape) {
  // Rank 0: experts 18 x 3 rows x 2 x 3 = 324, router 6 x 2 tokens x 2 x 2 = 48.
  // Bytes: 2 tokens x 8 (f32 row of 2) x (dispatch + combine + 2 backward) = 64.
  auto work = step_work(tiny_model(), {tiny_stats()}, 1, 2);
  ASSERT_TRUE(work.is_ok()) << work.status().to_string();
  ASSERT_EQ(work->size(), 2u);
  EXPECT_DOUBLE_EQ((*work)[0].gemm_flops, 324 + 48);
  EXPECT_DOUBLE_EQ((*work)[0].exchange_bytes, 64);
  EXPECT_DOUBLE_EQ((*work)[1].gemm_flops, 108 + 48);
  EXPECT_DOUBLE_EQ((*work)[1].exchange_bytes, 32);
}

TEST(StepLimit, SharedExpertsDtypesLayersAndGroups) {
  ModelConfig m = tiny_model();
  m.layer.num_shared_experts = 1;  // 18 x 2 tokens x 2 x 3 = 216 per layer
  m.layer.dtype = DType::kBF16;    // rows of 4 bytes; the combine's partials stay f32 (8)
  // Two layers, counts summed over two EP groups (each rank's share: half).
  LoadStats twice = tiny_stats();
  for (auto* v : {&twice.work_per_rank, &twice.tokens_per_rank})
    for (int64_t& x : *v) x *= 2;
  auto work = step_work(m, {twice, twice}, 2, 2);
  ASSERT_TRUE(work.is_ok()) << work.status().to_string();
  EXPECT_DOUBLE_EQ((*work)[0].gemm_flops, 2 * (324 + 48 + 216));
  EXPECT_DOUBLE_EQ((*work)[0].exchange_bytes, 2 * (2 * 4 + 2 * 8 + 2 * 2 * 4));
}

TEST(StepLimit, Fp8DispatchAndReceiverCombine) {
  ModelConfig m = tiny_model();
  m.layer.hidden = 256;
  m.layer.dispatch_dtype = DType::kFP8E4M3;        // 256 codes + 2 f32 scales
  m.layer.combine_weights = CombineWeights::kReceiver;  // one f32 row per (token, slot)
  auto work = step_work(m, {tiny_stats()}, 1, 2);
  ASSERT_TRUE(work.is_ok()) << work.status().to_string();
  EXPECT_DOUBLE_EQ((*work)[0].exchange_bytes, 2 * 264.0 + 3 * 1024.0 + 2 * 2 * 1024.0);
}

// Token t of rank r goes to experts (r + t) % 8 and (r + 3 t + 1) % 8 (two on
// one rank when they share a block of 2), or only the first when t % 3 == 2.
std::vector<int32_t> routed(int rank, int num_tokens) {
  std::vector<int32_t> idx;
  for (int t = 0; t < num_tokens; ++t) {
    idx.push_back((rank + t) % 8);
    idx.push_back(t % 3 == 2 ? -1 : (rank + 3 * t + 1) % 8);
  }
  return idx;
}

// What the real exchange copied: every rank's dispatch payload bytes summed
// (ExchangeStats), against the dispatch share of step_work's bytes (a
// quarter for an f32 layer: dispatch, combine and two backward ways of the
// same rows) computed from the same routing's load statistics.
TEST(StepLimit, DispatchBytesMatchTheExchangesOwnCounters) {
  constexpr int kRanks = 4, kTokens = 6, kHidden = 16;
  auto topology = Topology::create(kRanks, 1);
  ASSERT_TRUE(topology.is_ok()) << topology.status().to_string();
  std::mutex mu;
  LoadStats global;
  int64_t copied = 0;
  const auto statuses = run_ranks(*topology, [&](Transport& t) -> Status {
    BufferConfig bc;
    bc.num_experts = 8, bc.hidden = kHidden, bc.dtype = DType::kF32, bc.max_topk = 2;
    bc.max_tokens_per_rank = kTokens;
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, bc));
    std::vector<int32_t> idx = routed(t.rank(), kTokens);
    std::vector<float> x(kTokens * kHidden, 1.0f);
    const TensorView topk = TensorView::contiguous(idx.data(), DType::kI32, {kTokens, 2});
    EPX_ASSIGN_OR_RETURN(LoadStats stats, compute_load_stats(topk, buffer->placement().expert_rank()));
    DispatchResult out;
    const DispatchInputs in{.x = TensorView::contiguous(x.data(), DType::kF32, {kTokens, kHidden}),
                            .topk_idx = topk, .topk_weights = {}};
    EPX_RETURN_IF_ERROR(buffer->dispatch(in, &out));
    std::lock_guard lock(mu);
    copied += out.stats.intra_node_payload_bytes + out.stats.inter_node_payload_bytes;
    if (global.work_per_rank.empty()) global = stats;
    else
      for (int r = 0; r < kRanks; ++r) {
        global.work_per_rank[r] += stats.work_per_rank[r];
        global.tokens_per_rank[r] += stats.tokens_per_rank[r];
      }
    return Status::ok();
  });
  ASSERT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
  ModelConfig m = tiny_model();
  m.layer.hidden = kHidden;
  m.layer.router = {.num_experts = 8, .topk = 2};
  auto work = step_work(m, {global}, 1, kTokens);
  ASSERT_TRUE(work.is_ok()) << work.status().to_string();
  double counted = 0;
  for (const StepWork& w : *work) counted += w.exchange_bytes / 4;
  EXPECT_GT(copied, 0);
  EXPECT_DOUBLE_EQ(counted, static_cast<double>(copied));
}

TEST(StepLimit, RefusesStatsOfOtherRankCounts) {
  LoadStats other = tiny_stats();
  other.work_per_rank = {1, 1, 1};
  other.tokens_per_rank = {1, 1, 1};
  auto work = step_work(tiny_model(), {tiny_stats(), other}, 1, 2);
  ASSERT_FALSE(work.is_ok());
  EXPECT_NE(work.status().message().find("layer 1's load statistics cover 3 ranks, layer 0's 2"), std::string::npos)
      << work.status().message();
  EXPECT_FALSE(step_work(tiny_model(), {tiny_stats()}, 0, 2).is_ok());
}

TEST(StepLimit, TheBusiestRankOrTheMachineBoundsTheStep) {
  // Rank 1 has fewer FLOPs but many more bytes: alone, its limit is larger.
  const std::vector<StepWork> work{{.gemm_flops = 4e9, .exchange_bytes = 1e9},
                                   {.gemm_flops = 2e9, .exchange_bytes = 8e9}};
  const MachineRates rates{.gemm_alone = 1e10, .memcpy_alone = 1e10, .gemm_all = 2e10, .memcpy_all = 2e10};
  const StepLimit l = step_limit(work, 1, 2, rates, 2.0);
  EXPECT_EQ(l.rank, 1);
  EXPECT_DOUBLE_EQ(l.gemm_seconds, 0.2);
  EXPECT_DOUBLE_EQ(l.exchange_seconds, 0.8);
  EXPECT_DOUBLE_EQ(l.fraction(), 0.5);
  EXPECT_NE(l.describe().find("limit 1e+03 ms, bound by rank 1 alone"), std::string::npos) << l.describe();
  EXPECT_NE(l.describe().find("(one thread measured): 50% of the limit"), std::string::npos) << l.describe();
  // Two cores' worth for four ranks (two EP groups of these two): the machine
  // does 12e9 FLOPs at 2e10 and 18e9 bytes at 2e10 = 1.5 s.
  const StepLimit m = step_limit(work, 2, 4, rates, 3.0);
  EXPECT_EQ(m.rank, -1);
  EXPECT_DOUBLE_EQ(m.gemm_seconds, 0.6);
  EXPECT_DOUBLE_EQ(m.exchange_seconds, 0.9);
  EXPECT_DOUBLE_EQ(m.fraction(), 0.5);
  EXPECT_NE(m.describe().find("bound by the machine (4 ranks at once)"), std::string::npos) << m.describe();
  EXPECT_NE(m.describe().find("(4 threads measured)"), std::string::npos) << m.describe();
  EXPECT_EQ(step_limit(work, 1, 2, MachineRates{}, 1.0).limit_seconds(), 0);  // no rates: no limit
}

TEST(StepLimit, RateProbeMeasuresAloneAndTogetherAndChecksItsInput) {
  auto rates = measure_machine_rates({.dtype = DType::kBF16, .hidden = 32, .ffn_hidden = 48, .rows = 16,
                                      .num_threads = 2, .seconds = 0.005});
  ASSERT_TRUE(rates.is_ok()) << rates.status().to_string();
  EXPECT_GT(rates->gemm_alone, 0);
  EXPECT_GT(rates->memcpy_alone, 0);
  EXPECT_GT(rates->gemm_all, 0);
  EXPECT_GT(rates->memcpy_all, 0);
  auto bad = measure_machine_rates({.dtype = DType::kI32, .hidden = 32, .ffn_hidden = 48});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("dtype i32 is not f32 or bf16"), std::string::npos) << bad.status().message();
  EXPECT_FALSE(measure_machine_rates({.hidden = 0, .ffn_hidden = 48}).is_ok());
}

}  // namespace
}  // namespace epx
