// The cost models on cases worked out by hand.
#include <gtest/gtest.h>

#include "epx/sim/cost.h"

namespace epx::sim {
namespace {

// Round numbers: NVLink 1 GB/s, NIC 0.1 GB/s, HBM copies at 0.5 TB/s.
HardwareProfile hand_profile() {
  HardwareProfile h;
  h.bf16_flops = 1e12;
  h.hbm_bandwidth = 1e12;
  h.nvlink_bandwidth = 1e9;
  h.nvlink_latency = 1e-6;
  h.nic_bandwidth = 1e8;
  h.nic_latency = 5e-6;
  h.message_overhead = 1e-7;
  return h;
}

GroupTraffic empty_traffic(int ranks, int nodes) {
  GroupTraffic t;
  t.num_ranks = ranks;
  t.num_nodes = nodes;
  t.pairs.assign(ranks * ranks, 0.0);
  t.node_pairs.assign(ranks * nodes, 0.0);
  return t;
}

TEST(SimAllToAll, TwoGpusOneLink) {
  // GPU 0 sends 100 rows of 1000 B to GPU 1: 1e5 B over 1 GB/s = 100 us on
  // both ends; GPU 0 also pays the link latency and one message.
  GroupTraffic t = empty_traffic(2, 1);
  t.pairs[0 * 2 + 1] = 100;
  t.node_pairs[0] = 100;
  auto topo = Topology::create(2, 1);
  const AllToAllCost c = all_to_all(t, *topo, hand_profile(), {.row_bytes = 1000});
  EXPECT_DOUBLE_EQ(c.loads[0].nvl_out, 1e5);
  EXPECT_DOUBLE_EQ(c.loads[1].nvl_in, 1e5);
  EXPECT_EQ(c.loads[0].messages, 1);
  EXPECT_NEAR(c.time(0), 100e-6 + 1e-6 + 1e-7, 1e-12);
  EXPECT_NEAR(c.time(1), 100e-6 + 1e-6, 1e-12);
  // Half the bytes (a chunk) pays the latency again.
  EXPECT_NEAR(c.time(0, 0.5), 50e-6 + 1e-6 + 1e-7, 1e-12);
  // Combine goes back: GPU 1 sends, in the combine's own row size.
  const AllToAllCost back = all_to_all(t, *topo, hand_profile(), {.combine = true, .row_bytes = 2000});
  EXPECT_DOUBLE_EQ(back.loads[1].nvl_out, 2e5);
  EXPECT_NEAR(back.time(1), 200e-6 + 1e-6 + 1e-7, 1e-12);
  EXPECT_NEAR(back.time(0), 200e-6 + 1e-6, 1e-12);
}

TEST(SimAllToAll, HotReceiverSetsTheTimeOfItsPeers) {
  // GPUs 1, 2, 3 each send 100 rows of 1000 B to GPU 0; GPU 4 takes no part.
  // GPU 0 receives 3e5 B: 300 us; its senders need only 100 us for their own
  // link but finish with the hot receiver.
  GroupTraffic t = empty_traffic(5, 1);
  for (int s = 1; s <= 3; ++s) t.pairs[s * 5 + 0] = 100;
  auto topo = Topology::create(5, 1);
  HardwareProfile h = hand_profile();
  h.message_overhead = 0;
  const AllToAllCost c = all_to_all(t, *topo, h, {.row_bytes = 1000});
  EXPECT_NEAR(c.time(0), 300e-6 + 1e-6, 1e-12);
  for (int s = 1; s <= 3; ++s) EXPECT_NEAR(c.time(s), 300e-6 + 1e-6, 1e-12) << "GPU " << s;
  EXPECT_EQ(c.time(4), 0.0);
  // Halving the NVLink efficiency doubles the bandwidth part.
  h.nvlink_efficiency = 0.5;
  EXPECT_NEAR(all_to_all(t, *topo, h, {.row_bytes = 1000}).time(2), 600e-6 + 1e-6, 1e-12);
}

TEST(SimAllToAll, TwoHopCrossesTheNetworkOncePerNode) {
  // 2 nodes x 2 GPUs. GPU 0 sends 100 tokens, each to both GPUs of node 1
  // (ranks 2 and 3): 200 (token, rank) pairs but 100 (token, node) pairs.
  GroupTraffic t = empty_traffic(4, 2);
  t.pairs[0 * 4 + 2] = 100;
  t.pairs[0 * 4 + 3] = 100;
  t.node_pairs[0 * 2 + 1] = 100;
  auto topo = Topology::create(4, 2);
  const HardwareProfile h = hand_profile();

  // Flat: 2e5 B leave GPU 0 over its NIC at 0.1 GB/s = 2 ms.
  const AllToAllCost flat = all_to_all(t, *topo, h, {.row_bytes = 1000});
  EXPECT_DOUBLE_EQ(flat.loads[0].nic_out, 2e5);
  EXPECT_NEAR(flat.time(0), 2e-3 + 5e-6 + 2e-7, 1e-12);

  // Two-hop: 1e5 B over the network to GPU 2 (same local rank 0), which keeps
  // its own rows (an HBM copy) and forwards 1e5 B to GPU 3 over NVLink.
  const AllToAllCost hop = all_to_all(t, *topo, h, {.two_hop = true, .row_bytes = 1000});
  EXPECT_DOUBLE_EQ(hop.loads[0].nic_out, 1e5);
  EXPECT_DOUBLE_EQ(hop.loads[2].nic_in, 1e5);
  EXPECT_DOUBLE_EQ(hop.loads[2].self, 1e5);
  EXPECT_DOUBLE_EQ(hop.loads[2].nvl_out, 1e5);
  EXPECT_DOUBLE_EQ(hop.loads[3].nvl_in, 1e5);
  EXPECT_DOUBLE_EQ(hop.loads[3].nic_in, 0.0);
  EXPECT_NEAR(hop.time(0), 1e-3 + 5e-6 + 1e-7, 1e-12);          // the NIC, one message
  EXPECT_NEAR(hop.time(3), 1e-3 + 1e-6, 1e-12);                 // waits for the sender's NIC
  EXPECT_NEAR(hop.time(2), 1e-3 + 1e-6 + 5e-6 + 1e-7, 1e-12);   // NIC in, NVLink out, one message

  // Combine brings partial sums back between nodes in f32 (2000 B here).
  const AllToAllCost back =
      all_to_all(t, *topo, h, {.two_hop = true, .combine = true, .row_bytes = 1000, .remote_row_bytes = 2000});
  EXPECT_DOUBLE_EQ(back.loads[0].nic_in, 2e5);
  EXPECT_NEAR(back.time(0), 2e-3 + 5e-6, 1e-12);  // it receives; GPU 2 sends the message
  EXPECT_EQ(back.loads[2].messages, 1);  // the node-reduced rows to GPU 0 over the NIC
  EXPECT_EQ(back.loads[3].messages, 1);  // its rows to GPU 2 over NVLink
}

TEST(SimAllToAll, LocalNodeThroughTheNicStageWhenTheProfileSaysSo) {
  // The two-hop case above plus 50 tokens GPU 0 keeps on its own node (to
  // GPU 1): with nic_stages_local_node they pass GPU 0's NIC stage (a
  // loopback: out and in), 1.5e5 B out at 0.1 GB/s = 1.5 ms.
  GroupTraffic t = empty_traffic(4, 2);
  t.pairs[0 * 4 + 1] = 50;
  t.pairs[0 * 4 + 2] = 100;
  t.pairs[0 * 4 + 3] = 100;
  t.node_pairs[0 * 2 + 0] = 50;
  t.node_pairs[0 * 2 + 1] = 100;
  auto topo = Topology::create(4, 2);
  HardwareProfile h = hand_profile();
  EXPECT_DOUBLE_EQ(all_to_all(t, *topo, h, {.two_hop = true, .row_bytes = 1000}).loads[0].nic_out, 1e5);
  h.nic_stages_local_node = true;
  const AllToAllCost c = all_to_all(t, *topo, h, {.two_hop = true, .row_bytes = 1000});
  EXPECT_DOUBLE_EQ(c.loads[0].nic_out, 1.5e5);
  EXPECT_DOUBLE_EQ(c.loads[0].nic_in, 5e4);
  EXPECT_DOUBLE_EQ(c.loads[1].nvl_in, 5e4);  // still delivered over NVLink
  EXPECT_NEAR(c.time(0), 1.5e-3 + 1e-6 + 5e-6 + 2e-7, 1e-12);
}

TEST(SimAllToAll, HostCopyBandwidthBoundsAnEmulatedCluster) {
  // Every copy of the group goes through one host at 1e8 B/s: 4 pairs of
  // 1e5 B = 4 ms, whatever each "link" could do.
  GroupTraffic t = empty_traffic(2, 1);
  t.pairs = {100, 100, 100, 100};
  auto topo = Topology::create(2, 1);
  HardwareProfile h = hand_profile();
  h.host_copy_bandwidth = 1e8;
  h.nvlink_latency = 0;
  h.message_overhead = 0;
  const AllToAllCost c = all_to_all(t, *topo, h, {.row_bytes = 1000});
  EXPECT_NEAR(c.time(0), 4e-3, 1e-12);
  EXPECT_NEAR(c.time(1), 4e-3, 1e-12);
}

TEST(SimGroupedGemm, PadsToTheTileAndLosesEfficiencyWithFewRows) {
  HardwareProfile h;
  h.gemm_efficiency = 0.7;
  h.gemm_half_rows = 32;
  h.gemm_tile = 128;
  EXPECT_DOUBLE_EQ(gemm_efficiency(0, h), 0.0);
  EXPECT_DOUBLE_EQ(gemm_efficiency(32, h), 0.35);
  // Experts with 0, 1 and 200 rows, 1 MFLOP per row, 1 TFLOP/s peak:
  // 1 row -> 128 padded rows at 0.7 / 33; 200 rows -> 256 at 0.7 * 200 / 232.
  const std::vector<double> rows = {0, 1, 200};
  EXPECT_NEAR(grouped_gemm_time(rows, 1e6, 1e12, h), 0.006458514285714286, 1e-15);
  // Half of each expert's rows (a chunk): 0.5 -> 128 at 0.7 * 0.5 / 32.5; 100 -> 128 at 0.7 * 100 / 132.
  EXPECT_NEAR(grouped_gemm_time(rows, 1e6, 1e12, h, 0.5), 128e6 / (1e12 * 0.7 * 0.5 / 32.5) + 128e6 / (1e12 * 0.7 * 100 / 132),
              1e-15);
}

}  // namespace
}  // namespace epx::sim
