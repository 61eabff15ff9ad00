// The cost models on cases worked out by hand.
#include <gtest/gtest.h>

#include "epx/sim/calibration.h"
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
  const AllToAllCost hop = all_to_all(t, *topo, h, {.kernel = Kernel::kTwoHop, .row_bytes = 1000});
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
      all_to_all(t, *topo, h, {.kernel = Kernel::kTwoHop, .combine = true, .row_bytes = 1000, .remote_row_bytes = 2000});
  EXPECT_DOUBLE_EQ(back.loads[0].nic_in, 2e5);
  EXPECT_NEAR(back.time(0), 2e-3 + 5e-6, 1e-12);  // it receives; GPU 2 sends the message
  EXPECT_EQ(back.loads[2].messages, 1);  // the node-reduced rows to GPU 0 over the NIC
  EXPECT_EQ(back.loads[3].messages, 1);  // its rows to GPU 2 over NVLink
}

TEST(SimAllToAll, OwnNodeRowsNeverCrossTheNic) {
  // The two-hop case above plus 50 tokens GPU 0 keeps on its own node (to
  // GPU 1): DeepEP writes them straight into its receive buffer
  // (internode.cu), so GPU 0's NIC carries the same 1e5 B with or without
  // them; they reach GPU 1 over NVLink, through GPU 0's forwarding SMs.
  GroupTraffic t = empty_traffic(4, 2);
  t.pairs[0 * 4 + 2] = 100;
  t.pairs[0 * 4 + 3] = 100;
  t.node_pairs[0 * 2 + 1] = 100;
  auto topo = Topology::create(4, 2);
  const HardwareProfile h = hand_profile();
  const AllToAllCost remote_only = all_to_all(t, *topo, h, {.kernel = Kernel::kTwoHop, .row_bytes = 1000});
  t.pairs[0 * 4 + 1] = 50;
  t.node_pairs[0 * 2 + 0] = 50;
  const AllToAllCost c = all_to_all(t, *topo, h, {.kernel = Kernel::kTwoHop, .row_bytes = 1000});
  for (int g = 0; g < 4; ++g) {
    EXPECT_DOUBLE_EQ(c.loads[g].nic_out, remote_only.loads[g].nic_out) << g;
    EXPECT_DOUBLE_EQ(c.loads[g].nic_in, remote_only.loads[g].nic_in) << g;
  }
  EXPECT_DOUBLE_EQ(c.loads[0].nic_out, 1e5);
  EXPECT_DOUBLE_EQ(c.loads[1].nvl_in, 5e4);
  EXPECT_DOUBLE_EQ(c.loads[0].fwd, 5e4);  // GPU 0 forwards its own node's rows
  EXPECT_DOUBLE_EQ(c.loads[2].fwd, 2e5);  // GPU 2 forwards node 1's rows, its own included
}

// 2 nodes x `per_node` GPUs, every GPU sending `rows` tokens to every GPU
// (one expert each), so every (token, node) pair is `rows` too.
GroupTraffic uniform_traffic(int nodes, int per_node, double rows) {
  const int R = nodes * per_node;
  GroupTraffic t = empty_traffic(R, nodes);
  t.pairs.assign(R * R, rows);
  t.node_pairs.assign(R * nodes, rows);
  t.slot_rows.assign(R, rows * R);
  return t;
}

// hand_profile() with 2 forwarding SMs (comm.sms 4) of `per_sm` B/s each.
HardwareProfile forwarding_profile(double per_sm) {
  HardwareProfile h = hand_profile();
  h.comm_sms = 4;
  h.forward_sm_bandwidth = per_sm;
  return h;
}

TEST(SimAllToAll, TwoHopOnOneNodeIsTheIntranodeKernel) {
  GroupTraffic t = empty_traffic(4, 1);
  t.pairs = {5, 10, 0, 30, 7, 0, 3, 1, 0, 0, 9, 20, 4, 4, 4, 4};
  auto topo = Topology::create(4, 1);
  const HardwareProfile h = hand_profile();
  const AllToAllCost flat = all_to_all(t, *topo, h, {.row_bytes = 1000});
  const AllToAllCost hop = all_to_all(t, *topo, h, {.kernel = Kernel::kTwoHop, .row_bytes = 1000});
  for (int g = 0; g < 4; ++g) {
    EXPECT_DOUBLE_EQ(hop.time(g), flat.time(g)) << g;
    EXPECT_DOUBLE_EQ(hop.loads[g].fwd, 0.0) << g;
  }
  EXPECT_EQ(kernel_of("two_hop", 1), Kernel::kFlat);
  EXPECT_EQ(kernel_of("two_hop", 2), Kernel::kTwoHop);
  EXPECT_EQ(kernel_of("low_latency", 1), Kernel::kLowLatency);
}

TEST(SimAllToAll, TheForwardingStageBindsWhenItIsTheSlowest) {
  // 2 x 2 GPUs, 100 rows of 1000 B between every pair. Each GPU forwards
  // 4 x 100 rows (from its own node and its peer's): 4e5 B; its NIC carries
  // 1e5 B out (one row per token to the other node). Forwarding at 2 SMs x
  // 1e7 B/s = 2e7 B/s: 20 ms, the NIC at 1e8 B/s: 1 ms, NVLink 1e9: 0.2 ms.
  GroupTraffic t = uniform_traffic(2, 2, 100);
  auto topo = Topology::create(4, 2);
  HardwareProfile h = forwarding_profile(1e7);
  const AllToAllOptions o{.kernel = Kernel::kTwoHop, .row_bytes = 1000};
  const AllToAllCost c = all_to_all(t, *topo, h, o);
  EXPECT_DOUBLE_EQ(c.loads[0].fwd, 4e5);
  EXPECT_NEAR(c.bandwidth_s[0], 4e5 / 2e7, 1e-12);
  h.nic_bandwidth *= 4;  // a faster NIC changes nothing while forwarding binds
  EXPECT_DOUBLE_EQ(all_to_all(t, *topo, h, o).time(0), c.time(0));
  h.forward_sm_bandwidth /= 2;  // slower forwarding: slower all-to-all
  EXPECT_NEAR(all_to_all(t, *topo, h, o).bandwidth_s[0], 4e5 / 1e7, 1e-12);
  h.forward_sm_bandwidth = 1e9;  // fast forwarding: the NIC (now 4e8 B/s) binds again
  EXPECT_NEAR(all_to_all(t, *topo, h, o).bandwidth_s[0], 1e5 / 4e8, 1e-12);
  h.forward_sm_bandwidth = 0;    // no forwarding limit (epx's own two-hop): the same
  EXPECT_NEAR(all_to_all(t, *topo, h, o).bandwidth_s[0], 1e5 / 4e8, 1e-12);
}

TEST(SimAllToAll, LowLatencySendsOneMessagePerTokenAndExpert) {
  // 2 x 2 GPUs, 100 (token, rank) rows between every pair, and each row is 2
  // experts at its destination (slot rows 800 per GPU): 200 messages of 1000
  // + 16 B per pair; the 2 pairs to the other node go through the NIC.
  GroupTraffic t = uniform_traffic(2, 2, 100);
  t.slot_rows.assign(4, 800);
  auto topo = Topology::create(4, 2);
  HardwareProfile h = hand_profile();
  h.message_overhead = 0;
  const AllToAllOptions o{.kernel = Kernel::kLowLatency, .row_bytes = 1000};
  const AllToAllCost c = all_to_all(t, *topo, h, o);
  EXPECT_DOUBLE_EQ(c.loads[0].nic_out, 2 * 200 * 1016.0);
  EXPECT_DOUBLE_EQ(c.loads[0].nvl_out, 200 * 1016.0);
  EXPECT_DOUBLE_EQ(c.loads[0].self, 200 * 1016.0);
  EXPECT_DOUBLE_EQ(c.loads[0].nic_messages, 400.0);
  EXPECT_DOUBLE_EQ(c.loads[0].fwd, 0.0);  // no forwarding
  // The NIC is the slowest link; then the receive phase copies what came in.
  EXPECT_NEAR(c.bandwidth_s[0], 2 * 200 * 1016.0 / 1e8 + 4 * 200 * 1016.0 / 5e11, 1e-12);
  EXPECT_NEAR(c.latency_s[0], 1e-6 + 5e-6, 1e-15);  // no per-(source, destination) message term
  // A per-message cost above the wire time binds: 400 messages x 1 ms.
  h.message_overhead = 1e-3;
  EXPECT_NEAR(all_to_all(t, *topo, h, o).bandwidth_s[0], 0.4 + 4 * 200 * 1016.0 / 5e11, 1e-9);
  // More messages, more time.
  t.slot_rows.assign(4, 1200);
  EXPECT_GT(all_to_all(t, *topo, h, o).time(0), 0.6);
  // Combine: the same messages back, no header.
  EXPECT_DOUBLE_EQ(all_to_all(t, *topo, h, {.kernel = Kernel::kLowLatency, .combine = true, .row_bytes = 1000})
                       .loads[0].nic_in,
                   2 * 300 * 1000.0);
}

TEST(SimAllToAll, EpxLowLatencySendsOneRowPerTokenAndRank) {
  // The same traffic as above through epx's CPU low-latency mode: 100
  // (token, rank) rows between every pair, 2 experts per row at each GPU.
  GroupTraffic t = uniform_traffic(2, 2, 100);
  t.slot_rows.assign(4, 800);
  auto topo = Topology::create(4, 2);
  const HardwareProfile h = hand_profile();
  // Dispatch: a row per (token, rank) of 1000 B + 8 B + 2 pairs x 8 B, none
  // to itself; one message per (source, destination); the owner copies its 4
  // sources x 200 (token, expert) rows into its experts' rows.
  const AllToAllOptions o{.kernel = Kernel::kLowLatencyEpx, .row_bytes = 1000};
  const AllToAllCost c = all_to_all(t, *topo, h, o);
  EXPECT_DOUBLE_EQ(c.loads[0].nic_out, 2 * 100 * 1024.0);
  EXPECT_DOUBLE_EQ(c.loads[0].nvl_out, 100 * 1024.0);
  EXPECT_DOUBLE_EQ(c.loads[0].self, 0.0);
  EXPECT_DOUBLE_EQ(c.loads[0].nic_messages, 0.0);
  EXPECT_EQ(c.loads[0].messages, 3);
  EXPECT_DOUBLE_EQ(c.loads[0].receive, 4 * 200 * 1000.0);
  EXPECT_NEAR(c.bandwidth_s[0], 2 * 100 * 1024.0 / 1e8 + 4 * 200 * 1000.0 / 5e11, 1e-12);
  EXPECT_NEAR(c.latency_s[0], 1e-6 + 5e-6 + 3 * 1e-7, 1e-15);
  // DeepEP's kernels send twice the rows for this traffic (a message per (token, expert)).
  EXPECT_DOUBLE_EQ(all_to_all(t, *topo, h, {.kernel = Kernel::kLowLatency, .row_bytes = 1000}).loads[0].nic_out,
                   2 * 200 * 1016.0);
  // Combine: a row per (token, expert) back (own experts read in place); the
  // source reduces its 4 x 200 (token, expert) rows.
  const AllToAllCost back = all_to_all(t, *topo, h, {.kernel = Kernel::kLowLatencyEpx, .combine = true, .row_bytes = 1000});
  EXPECT_DOUBLE_EQ(back.loads[0].nic_in, 2 * 200 * 1000.0);
  EXPECT_DOUBLE_EQ(back.loads[0].nvl_in, 200 * 1000.0);
  EXPECT_DOUBLE_EQ(back.loads[0].receive, 4 * 200 * 1000.0);
  // combine_per_rank: a row per (token, rank) back; the owner first sums its
  // 3 other sources' 200 pairs each, the source adds 3 x 100 rows and reads
  // its own 200 pairs. Its dispatch carries a 4 B weight per pair.
  const AllToAllCost per_rank = all_to_all(
      t, *topo, h, {.kernel = Kernel::kLowLatencyEpx, .combine = true, .row_bytes = 1000, .combine_per_rank = true});
  EXPECT_DOUBLE_EQ(per_rank.loads[0].nic_in, 2 * 100 * 1000.0);
  EXPECT_DOUBLE_EQ(per_rank.loads[0].receive, (3 * 200 + 3 * 100 + 200) * 1000.0);
  EXPECT_DOUBLE_EQ(
      all_to_all(t, *topo, h, {.kernel = Kernel::kLowLatencyEpx, .row_bytes = 1000, .combine_per_rank = true})
          .loads[0].nic_out,
      2 * 100 * 1032.0);
  EXPECT_EQ(kernel_of("low_latency_epx", 2), Kernel::kLowLatencyEpx);
  EXPECT_DOUBLE_EQ(compute_slowdown(h, Kernel::kLowLatencyEpx), 1.0);
}

TEST(SimAllToAll, TimeGrowsWithTheBytesInEveryKernel) {
  GroupTraffic t = uniform_traffic(2, 2, 100);
  auto topo = Topology::create(4, 2);
  const HardwareProfile h = forwarding_profile(5e7);
  for (Kernel k : {Kernel::kFlat, Kernel::kTwoHop, Kernel::kLowLatency, Kernel::kLowLatencyEpx}) {
    double last = 0;
    for (double bytes : {100.0, 1000.0, 10000.0}) {
      const double now = all_to_all(t, *topo, h, {.kernel = k, .row_bytes = bytes}).time(0);
      EXPECT_GT(now, last) << static_cast<int>(k) << " " << bytes;
      last = now;
    }
  }
}

TEST(SimAllToAll, OnlyTheNormalKernelsTakeSmsFromCompute) {
  HardwareProfile h;
  h.sms = 132;
  h.comm_sms = 24;
  EXPECT_DOUBLE_EQ(compute_slowdown(h, Kernel::kTwoHop), 132.0 / 108.0);
  EXPECT_DOUBLE_EQ(compute_slowdown(h, Kernel::kFlat), 132.0 / 108.0);
  EXPECT_DOUBLE_EQ(compute_slowdown(h, Kernel::kLowLatency), 1.0);
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

TEST(SimCalibration, TheFitReproducesBothCalibrationPoints) {
  // configs/hardware/h800.toml's physical figures, the fitted ones left at
  // neutral starting values: the fit must find them again.
  HardwareProfile h;
  h.bf16_flops = 989e12;
  h.sms = 132;
  h.hbm_bandwidth = 3.35e12;
  h.nvlink_bandwidth = 160e9;
  h.nvlink_latency = 1e-6;
  h.nic_bandwidth = 50e9;
  h.nic_efficiency = 0.97;
  h.nic_latency = 3e-6;
  h.comm_sms = 24;
  h.message_overhead = 1e-7;
  auto fit = fit_deepep(h);
  ASSERT_TRUE(fit.is_ok()) << fit.status().message();
  ASSERT_EQ(fit->points.size(), 4u);
  // Each point's mean of dispatch and combine within 1% (what is fitted);
  // one efficiency serves both directions, and DeepEP's EP8 ones differ by
  // 3%, so each direction within 2%.
  for (std::size_t i = 0; i < 4; i += 2) {
    const auto &d = fit->points[i], &c = fit->points[i + 1];
    EXPECT_NEAR((d.fitted_gbs + c.fitted_gbs) / (d.published_gbs + c.published_gbs), 1.0, 0.01) << d.name;
  }
  for (const auto& p : fit->points) EXPECT_NEAR(p.fitted_gbs / p.published_gbs, 1.0, 0.02) << p.name;
  EXPECT_GT(fit->nvlink_efficiency, 0.5);
  EXPECT_LT(fit->nvlink_efficiency, 1.0);
  // At EP16 the forwarding stage binds, not the NIC: a NIC twice as fast
  // leaves the fitted model's EP16 figure where it is.
  h.nvlink_efficiency = fit->nvlink_efficiency;
  h.forward_sm_bandwidth = fit->forward_sm_bandwidth;
  auto at = estimate_exchange(deepep_scenario(h, 2, 4096));
  h.nic_bandwidth *= 2;
  auto faster_nic = estimate_exchange(deepep_scenario(h, 2, 4096));
  ASSERT_TRUE(at.is_ok() && faster_nic.is_ok());
  EXPECT_DOUBLE_EQ(faster_nic->dispatch_s, at->dispatch_s);
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
