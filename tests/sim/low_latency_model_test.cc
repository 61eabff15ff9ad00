// The simulator's model of epx's CPU low-latency mode (Kernel::kLowLatencyEpx)
// against the LowLatencyBuffer it models: one dispatch on 2 emulated nodes x
// 2 ranks, its byte counters next to the model's loads for the same routing.
// The rows on each link (from the model's bytes at two row sizes) must be the
// rows the buffer copied inside the node and sent across, and the receive
// phase must copy the (token, expert) rows the buffer ended with. DeepEP's
// model (one message per (token, expert)) fails the same comparison.
#include <gtest/gtest.h>

#include <vector>

#include "epx/comm/inproc.h"
#include "epx/exchange/low_latency.h"
#include "epx/sim/cost.h"
#include "epx/sim/traffic.h"

namespace epx::sim {
namespace {

constexpr int kRanks = 4, kNodes = 2, kExperts = 8, kTopk = 4, kTokens = 6, kHidden = 32;

// Token t of rank r goes to experts base, base + 1, ... (mod 8), base = 3t + r:
// 2 to 3 experts of one rank, some of another, some on the other node.
int32_t expert_of(int rank, int t, int k) { return (3 * t + rank + k) % kExperts; }

// The (token, rank) rows between every pair and the rows of each expert.
GroupTraffic traffic_of_routing() {
  GroupTraffic tr;
  tr.num_ranks = kRanks;
  tr.num_nodes = kNodes;
  tr.pairs.assign(kRanks * kRanks, 0.0);
  tr.node_pairs.assign(kRanks * kNodes, 0.0);
  tr.slot_rows.assign(kExperts, 0.0);
  const int per_rank = kExperts / kRanks;
  for (int s = 0; s < kRanks; ++s)
    for (int t = 0; t < kTokens; ++t) {
      std::vector<bool> to(kRanks, false);
      for (int k = 0; k < kTopk; ++k) {
        const int e = expert_of(s, t, k);
        tr.slot_rows[e] += 1;
        to[e / per_rank] = true;
      }
      for (int d = 0; d < kRanks; ++d) tr.pairs[s * kRanks + d] += to[d] ? 1 : 0;
    }
  return tr;
}

// Each rank's dispatch counters from a real LowLatencyBuffer (f32 rows).
std::vector<ExchangeStats> dispatch_stats() {
  std::vector<ExchangeStats> stats(kRanks);
  const auto statuses = run_ranks(*Topology::create(kRanks, kNodes), [&](Transport& t) -> Status {
    LowLatencyConfig config;
    config.num_experts = kExperts;
    config.hidden = kHidden;
    config.dtype = DType::kF32;
    config.max_tokens_per_rank = kTokens;
    config.max_topk = kTopk;
    EPX_ASSIGN_OR_RETURN(auto buffer, LowLatencyBuffer::create(t, config));
    std::vector<float> x(kTokens * kHidden, 1.0f);
    std::vector<int32_t> idx(kTokens * kTopk);
    for (int tok = 0; tok < kTokens; ++tok)
      for (int k = 0; k < kTopk; ++k) idx[tok * kTopk + k] = expert_of(t.rank(), tok, k);
    LowLatencyDispatchResult result;
    EPX_RETURN_IF_ERROR(buffer->dispatch({TensorView::contiguous(x.data(), DType::kF32, {kTokens, kHidden}),
                                          TensorView::contiguous(idx.data(), DType::kI32, {kTokens, kTopk}), {}},
                                         &result));
    stats[t.rank()] = result.stats;
    return Status::ok();
  });
  EXPECT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
  return stats;
}

// Rows the model puts on each GPU's links: the growth of its bytes per byte of row.
struct ModelRows {
  std::vector<double> nvl_out, nic_out, receive;
};
ModelRows model_rows(Kernel kernel, const GroupTraffic& tr) {
  auto topo = Topology::create(kRanks, kNodes);
  HardwareProfile h;
  h.hbm_bandwidth = h.nvlink_bandwidth = h.nic_bandwidth = 1e9;
  const double row = kHidden * 4.0;
  const AllToAllCost a = all_to_all(tr, *topo, h, {.kernel = kernel, .row_bytes = row});
  const AllToAllCost b = all_to_all(tr, *topo, h, {.kernel = kernel, .row_bytes = 2 * row});
  ModelRows m;
  for (int g = 0; g < kRanks; ++g) {
    m.nvl_out.push_back((b.loads[g].nvl_out - a.loads[g].nvl_out) / row);
    m.nic_out.push_back((b.loads[g].nic_out - a.loads[g].nic_out) / row);
    m.receive.push_back((b.loads[g].receive - a.loads[g].receive) / row);
  }
  return m;
}

TEST(SimLowLatencyEpx, RowsOnEachLinkAreTheBuffersRows) {
  const GroupTraffic tr = traffic_of_routing();
  const std::vector<ExchangeStats> stats = dispatch_stats();
  const ModelRows m = model_rows(Kernel::kLowLatencyEpx, tr);
  const double row = kHidden * 4.0;
  double inter = 0;
  for (int g = 0; g < kRanks; ++g) {
    EXPECT_DOUBLE_EQ(m.nvl_out[g], stats[g].intra_node_payload_bytes / row) << "rank " << g;
    EXPECT_DOUBLE_EQ(m.nic_out[g], stats[g].inter_node_payload_bytes / row) << "rank " << g;
    EXPECT_DOUBLE_EQ(m.receive[g], static_cast<double>(stats[g].rows_received)) << "rank " << g;
    inter += m.nic_out[g];
  }
  EXPECT_GT(inter, 0.0);
  // DeepEP's model sends a message per (token, expert): more rows across nodes than the buffer.
  const ModelRows deepep = model_rows(Kernel::kLowLatency, tr);
  double deepep_inter = 0;
  for (int g = 0; g < kRanks; ++g) deepep_inter += deepep.nic_out[g];
  EXPECT_GT(deepep_inter, inter);
}

}  // namespace
}  // namespace epx::sim
