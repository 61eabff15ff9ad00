// The simulator's traffic is what the exchange really sends.
#include <random>

#include <gtest/gtest.h>

#include "epx/comm/inproc.h"
#include "epx/exchange/buffer.h"
#include "epx/sim/cost.h"
#include "epx/sim/traffic.h"

namespace epx::sim {
namespace {

// Distinct experts per token, some slots -1, rank 3 with no tokens.
std::vector<std::vector<int32_t>> random_routing(int ranks, int tokens, int experts, int topk, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> idx(ranks);
  for (int r = 0; r < ranks; ++r) {
    const int T = r == 3 ? 0 : tokens + r;
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> row;
      while (static_cast<int>(row.size()) < topk) {
        const int e = static_cast<int>(rng() % experts);
        if (std::find(row.begin(), row.end(), e) == row.end()) row.push_back(e);
      }
      for (int32_t& e : row)
        if (rng() % 5 == 0) e = -1;
      idx[r].insert(idx[r].end(), row.begin(), row.end());
    }
  }
  return idx;
}

TEST(SimTraffic, EqualsWhatTheExchangeSends) {
  // 2 nodes x 2 ranks, 8 experts, top-3: the real dispatch on in-process
  // ranks (two-hop), counting received rows by source rank, against the
  // simulator's pair matrix; the two-hop cost model's network bytes against
  // the bytes the exchange sent between nodes.
  constexpr int kRanks = 4, kNodes = 2, kExperts = 8, kTopk = 3, kHidden = 16, kTokens = 40;
  const auto routing = random_routing(kRanks, kTokens, kExperts, kTopk, 7);
  auto topo = Topology::create(kRanks, kNodes);
  auto placement = ExpertPlacement::contiguous(kExperts, kRanks);
  auto traffic = traffic_from_routing(routing, kTopk, *placement, *topo);
  ASSERT_TRUE(traffic.is_ok()) << traffic.status().message();

  std::vector<std::vector<int64_t>> received(kRanks, std::vector<int64_t>(kRanks, 0));
  std::vector<int64_t> inter_node_bytes(kRanks, 0);
  auto statuses = run_ranks(*topo, [&](Transport& transport) -> Status {
    const int rank = transport.rank();
    BufferConfig config;
    config.num_experts = kExperts;
    config.hidden = kHidden;
    config.dtype = DType::kF32;
    config.max_topk = kTopk;
    config.max_tokens_per_rank = kTokens + kRanks;
    config.algorithm = DispatchAlgorithm::kHierarchical;
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(transport, config));
    const int T = static_cast<int>(routing[rank].size()) / kTopk;
    std::vector<float> x(static_cast<std::size_t>(T) * kHidden, 1.0f);
    DispatchResult out;
    EPX_RETURN_IF_ERROR(buffer->dispatch({.x = TensorView::contiguous(x.data(), DType::kF32, {T, kHidden}),
                                          .topk_idx = TensorView::contiguous(routing[rank].data(), DType::kI32, {T, kTopk}),
                                          .topk_weights = {}},
                                         &out));
    const int64_t n = out.recv_src_rank.size(0);
    for (int64_t i = 0; i < n; ++i) ++received[rank][out.recv_src_rank.data_as<int32_t>()[i]];
    inter_node_bytes[rank] = out.stats.inter_node_payload_bytes;
    return Status::ok();
  });
  for (const Status& s : statuses) ASSERT_TRUE(s.is_ok()) << s.message();

  int64_t total = 0;
  for (int s = 0; s < kRanks; ++s)
    for (int d = 0; d < kRanks; ++d) {
      EXPECT_EQ(traffic->pair(s, d), static_cast<double>(received[d][s])) << s << " -> " << d;
      total += received[d][s];
    }
  EXPECT_GT(total, 100);  // not a vacuous comparison
  HardwareProfile h;
  h.nvlink_bandwidth = h.nic_bandwidth = h.hbm_bandwidth = 1e9;
  const AllToAllCost cost = all_to_all(*traffic, *topo, h, {.kernel = Kernel::kTwoHop, .row_bytes = kHidden * 4});
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(cost.loads[r].nic_out, static_cast<double>(inter_node_bytes[r])) << "rank " << r;
    if (r != 3) {
      EXPECT_GT(inter_node_bytes[r], 0);
    }
  }
}

TEST(SimTraffic, RouteGroupCountsEveryTokenOncePerRankAndScalesSamples) {
  // 8 GPUs on one node, 32 experts, top-4, uniform popularity: each routed
  // token reaches between 1 and 4 ranks, and expert loads sum to T x K.
  auto topo = Topology::create(8, 1);
  auto placement = ExpertPlacement::contiguous(32, 8);
  ModelConfig m;
  m.experts = 32;
  m.topk = 4;
  const RouterConfig router = make_router_config(m);
  const std::vector<double> pop(32, 0.0);
  RouteRequest q;
  q.router = &router;
  q.placement = &*placement;
  q.topology = &*topo;
  q.log_popularity = pop;
  q.tokens_per_gpu = 256;
  q.sample_tokens = 64;
  q.seed = 3;
  q.threads = 2;
  GroupTraffic t;
  ASSERT_TRUE(route_group(q, &t).is_ok());
  EXPECT_DOUBLE_EQ(t.scale, 4.0);
  int64_t load = 0;
  for (int64_t v : t.expert_load) load += v;
  EXPECT_EQ(load, 8 * 64 * 4);  // unscaled: the routed sample
  for (int s = 0; s < 8; ++s) {
    double row = 0;
    for (int d = 0; d < 8; ++d) row += t.pair(s, d);
    EXPECT_GE(row, 256.0);
    EXPECT_LE(row, 4 * 256.0);
    EXPECT_EQ(std::fmod(row, 4.0), 0.0);  // whole sampled tokens, times 4
  }
  // The same request gives the same draws with one thread.
  GroupTraffic again;
  q.threads = 1;
  ASSERT_TRUE(route_group(q, &again).is_ok());
  EXPECT_EQ(t.pairs, again.pairs);
  // A skewed popularity concentrates the load: expert 0 far above the mean.
  std::vector<double> skewed(32, 0.0);
  skewed[0] = 5.0;
  q.log_popularity = skewed;
  ASSERT_TRUE(route_group(q, &t).is_ok());
  EXPECT_GT(t.expert_load[0], 3 * (8 * 64 * 4 / 32));
}

}  // namespace
}  // namespace epx::sim
