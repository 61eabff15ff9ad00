// The gradient all-reduces of EP x EDP training in the simulator: bytes by
// hand, the ring and hierarchical costs, the pick between them, and the
// bucketed overlap with the backward.
#include <gtest/gtest.h>

#include "epx/sim/grad_sync.h"
#include "epx/sim/simulator.h"
#include "sim/test_scenarios.h"

namespace epx::sim {
namespace {

// 2 nodes x 4 GPUs, 16 experts top-2, 4 layers, an embedding and a head.
Scenario two_node_scenario(int ep) {
  Scenario s = testing::four_gpu_nodes(2, ep);
  s.model.embedding_params = 1000;
  s.model.head_params = 2000;
  return s;
}

Result<GroupShape> edp_of(int ranks, int nodes, int ep) {
  EPX_ASSIGN_OR_RETURN(Topology topo, Topology::create(ranks, nodes));
  EPX_ASSIGN_OR_RETURN(ParallelLayout layout, ParallelLayout::create(topo, ep));
  return edp_shape(layout, topo);
}

TEST(SimGradSync, GradientBytesEqualTheFormula) {
  const Scenario s = two_node_scenario(/*ep=*/2);
  const GradientBytes b = gradient_bytes(s, 0);
  ASSERT_EQ(b.expert_per_layer.size(), 4u);
  const double H = 512, F = 256;
  // 16 experts over EP 2: 8 per GPU, 3 matrices each, f32.
  EXPECT_DOUBLE_EQ(b.expert_per_layer[0], 4.0 * 8 * 3 * H * F);
  // Two norms, Q/K/V/O (8 H^2 FLOPs = 4 H^2 parameters), router H x 16, one shared expert.
  EXPECT_DOUBLE_EQ(b.dense_per_layer[0], 4.0 * (2 * H + 4 * H * H + H * 16 + 3 * H * F));
  EXPECT_DOUBLE_EQ(b.embedding, 4.0 * 1000);
  EXPECT_DOUBLE_EQ(b.head, 4.0 * (2000 + H));
  EXPECT_DOUBLE_EQ(b.expert(), 4 * b.expert_per_layer[0]);

  Scenario half = s;
  half.model.grad_dtype = "bf16";
  half.model.attention = false;
  const GradientBytes h = gradient_bytes(half, 0);
  EXPECT_DOUBLE_EQ(h.dense_per_layer[0], 2.0 * (H + H * 16 + 3 * H * F));
  EXPECT_DOUBLE_EQ(h.expert_per_layer[0], b.expert_per_layer[0] / 2);
}

TEST(SimGradSync, RingSendsTwiceNMinusOneOverNTimesTheBytesOverTheSlowestLink) {
  const Scenario s = two_node_scenario(2);
  const HardwareProfile& hw = s.hardware;
  const double B = 64e6;
  // Four ranks on one node: NVLink only.
  const GroupShape one_node{4, 1, 4, 1, 4};
  const AllReduceCost in_node = all_reduce_cost(B, one_node, hw, "ring");
  EXPECT_EQ(in_node.algorithm, "ring");
  EXPECT_DOUBLE_EQ(in_node.bytes_sent, 2.0 * 3 / 4 * B);
  EXPECT_DOUBLE_EQ(in_node.nic_bytes_sent, 0.0);
  EXPECT_NEAR(in_node.seconds, 1.5 * B / 1e11 + 6 * 2e-6, 1e-12);
  // Across two nodes the NIC (10x slower) sets the time.
  const GroupShape two_nodes{4, 2, 2, 1, 8};
  const AllReduceCost across = all_reduce_cost(B, two_nodes, hw, "ring");
  EXPECT_DOUBLE_EQ(across.bytes_sent, 1.5 * B);
  EXPECT_NEAR(across.seconds, 1.5 * B / 1e10 + 6 * 5e-6, 1e-12);
  // One rank: nothing to send.
  const AllReduceCost alone = all_reduce_cost(B, GroupShape{}, hw, "auto");
  EXPECT_EQ(alone.algorithm, "none");
  EXPECT_EQ(alone.bytes_sent, 0.0);
  EXPECT_EQ(alone.seconds, 0.0);
}

TEST(SimGradSync, EpxsOwnAllGatherSendsNMinusOneTimesTheBytes) {
  Scenario s = two_node_scenario(2);
  s.hardware.nic_shared_per_node = true;
  const double B = 8e6;
  // EDP {0 2 4 6} on 2 nodes (2 per node), two such groups per node: each rank receives 3 B,
  // 2 B of it from the other node; the node's link carries 2 members x 2 groups x 2 B.
  const GroupShape edp{4, 2, 2, 2, 8};
  const AllReduceCost c = all_reduce_cost(B, edp, s.hardware, "allgather");
  EXPECT_EQ(c.algorithm, "allgather");
  EXPECT_DOUBLE_EQ(c.bytes_sent, 3 * B);
  EXPECT_DOUBLE_EQ(c.nic_bytes_sent, 2 * B);
  EXPECT_NEAR(c.seconds, 8 * B / 1e10 + 2 * 5e-6, 1e-12);
  // Two ranks: the same bytes as the ring.
  const GroupShape pair{2, 2, 1, 2, 4};
  EXPECT_DOUBLE_EQ(all_reduce_cost(B, pair, s.hardware, "allgather").bytes_sent,
                   all_reduce_cost(B, pair, s.hardware, "ring").bytes_sent);
}

TEST(SimGradSync, EpxsMpiChunkedAllReduceSendsWhatARingSends) {
  Scenario s = two_node_scenario(2);
  s.hardware.nic_shared_per_node = true;
  const double B = 8e6;
  // EDP {0 2 4 6} on 2 nodes (2 per node), two groups per node: each rank sends 2 x 3/4 B, to the
  // other node 2 x 2/4 B; the node's link carries 2 members x 2 groups x B.
  const GroupShape edp{4, 2, 2, 2, 8};
  const AllReduceCost c = all_reduce_cost(B, edp, s.hardware, "chunked");
  EXPECT_EQ(c.algorithm, "chunked");
  EXPECT_DOUBLE_EQ(c.bytes_sent, all_reduce_cost(B, edp, s.hardware, "ring").bytes_sent);
  EXPECT_DOUBLE_EQ(c.nic_bytes_sent, B);
  EXPECT_LT(c.nic_bytes_sent, all_reduce_cost(B, edp, s.hardware, "allgather").nic_bytes_sent);
}

TEST(SimGradSync, EdpGroupsFollowTheParallelLayout) {
  // 8 ranks on 2 nodes. EP 2: EDP {0 2 4 6}, two per node, two such groups per node.
  auto ep2 = edp_of(8, 2, 2);
  ASSERT_TRUE(ep2.is_ok()) << ep2.status().message();
  EXPECT_EQ(ep2->num_ranks, 4);
  EXPECT_EQ(ep2->num_nodes, 2);
  EXPECT_EQ(ep2->ranks_per_node, 2);
  EXPECT_EQ(ep2->groups_per_node, 2);
  // EP 4: one EP group per node, EDP {0 4}: one rank per node, four groups per node.
  auto ep4 = edp_of(8, 2, 4);
  ASSERT_TRUE(ep4.is_ok());
  EXPECT_EQ(ep4->num_ranks, 2);
  EXPECT_EQ(ep4->ranks_per_node, 1);
  EXPECT_EQ(ep4->groups_per_node, 4);
  // EP 8: EDP 1.
  auto ep8 = edp_of(8, 2, 8);
  ASSERT_TRUE(ep8.is_ok());
  EXPECT_EQ(ep8->num_ranks, 1);
}

TEST(SimGradSync, PicksHierarchicalForBigGradientsAcrossASlowNicAndRingWhenLatencyRules) {
  Scenario s = two_node_scenario(2);
  const GroupShape world{8, 2, 4, 1, 8};
  const double B = 256e6;
  const AllReduceCost ring = all_reduce_cost(B, world, s.hardware, "ring");
  const AllReduceCost hier = all_reduce_cost(B, world, s.hardware, "hierarchical");
  // Ring: 2 x 7/8 B through the NIC. Hierarchical: 2 x 3/4 B over NVLink, 2 x 1/2 x B/4 through the NIC.
  EXPECT_NEAR(ring.seconds, 1.75 * B / 1e10 + 14 * 5e-6, 1e-9);
  EXPECT_NEAR(hier.seconds, 1.5 * B / 1e11 + 0.25 * B / 1e10 + 6 * 2e-6 + 2 * 5e-6, 1e-9);
  EXPECT_DOUBLE_EQ(hier.nic_bytes_sent, 0.25 * B);
  const AllReduceCost pick = all_reduce_cost(B, world, s.hardware, "auto");
  EXPECT_EQ(pick.algorithm, "hierarchical");
  EXPECT_DOUBLE_EQ(pick.seconds, hier.seconds);
  // A few bytes and a slow step inside the node: the ring's fewer NVLink steps win.
  s.hardware.nvlink_latency = 1e-3;
  EXPECT_EQ(all_reduce_cost(1024, world, s.hardware, "auto").algorithm, "ring");
  // Ranks of a node sharing one NIC: the hierarchical step sends 4 ranks' shares through it.
  s.hardware.nvlink_latency = 2e-6;
  s.hardware.nic_shared_per_node = true;
  const AllReduceCost shared = all_reduce_cost(B, world, s.hardware, "hierarchical");
  EXPECT_NEAR(shared.seconds, 1.5 * B / 1e11 + 4 * 0.25 * B / 1e10 + 6 * 2e-6 + 2 * 5e-6, 1e-9);
}

TEST(SimGradSync, BucketsStartWhenTheirLayerIsDoneAndHideBehindTheBackward) {
  Scenario s = two_node_scenario(2);
  s.hardware.nic_bandwidth = 1e12;  // fast: every bucket fits behind the next layer's backward
  GradSyncInput in;
  in.bytes.expert_per_layer = {2e6, 2e6, 2e6};
  in.bytes.dense_per_layer = {0, 0, 0};
  in.layer_backward_end_s = {0.3, 0.2, 0.1};  // backward runs layer 2, 1, 0
  in.backward_start_s = 0.0;
  in.backward_end_s = 0.3;
  auto shape = edp_of(8, 2, 2);
  ASSERT_TRUE(shape.is_ok());
  in.edp = *shape;
  in.world = GroupShape{};  // one rank: no dense all-reduce
  const GradSyncResult on = schedule_grad_sync(in, s);
  ASSERT_EQ(on.buckets.size(), 3u);  // 2 MB each, bucket 1 MiB: one per layer
  EXPECT_DOUBLE_EQ(on.buckets[0].start_s, 0.1);
  EXPECT_DOUBLE_EQ(on.buckets[1].start_s, 0.2);
  EXPECT_GT(on.exposed_s, 0.0);  // the last bucket (layer 0) starts when the backward ends
  EXPECT_LT(on.exposed_s, on.busy_s / 2);
  s.parallelism.grad_overlap = false;
  const GradSyncResult off = schedule_grad_sync(in, s);
  EXPECT_DOUBLE_EQ(off.exposed_s, off.busy_s);
  EXPECT_DOUBLE_EQ(off.hidden_share, 0.0);
  EXPECT_NEAR(on.busy_s, off.busy_s, 1e-15);
  // Smaller layers share a bucket while they fit: layers 2 and 1 (0.8 MiB), then layer 0 alone.
  in.bytes.expert_per_layer = {0.4 * (1 << 20), 0.4 * (1 << 20), 0.4 * (1 << 20)};
  const GradSyncResult packed = schedule_grad_sync(in, s);
  ASSERT_EQ(packed.buckets.size(), 2u);
  EXPECT_DOUBLE_EQ(packed.buckets[0].bytes, 0.8 * (1 << 20));
  EXPECT_DOUBLE_EQ(packed.buckets[0].ready_s, 0.3);  // overlap off: after the backward
  s.parallelism.grad_overlap = true;
  const GradSyncResult packed_on = schedule_grad_sync(in, s);
  EXPECT_DOUBLE_EQ(packed_on.buckets[0].ready_s, 0.2);  // layer 1's backward end
  EXPECT_DOUBLE_EQ(packed_on.buckets[1].ready_s, 0.3);
}

TEST(SimGradSync, OverlapNeverMakesAStepSlower) {
  bool some_hidden = false;  // and the sweep does reach a case where it helps
  for (int ep : {2, 4, 8}) {
    for (int64_t bucket : {int64_t{0}, int64_t{1} << 18, int64_t{4} << 20}) {
      Scenario s = two_node_scenario(ep);
      s.parallelism.grad_bucket_bytes = bucket;
      auto on = simulate(s);
      s.parallelism.grad_overlap = false;
      auto off = simulate(s);
      ASSERT_TRUE(on.is_ok() && off.is_ok()) << on.status().message() << off.status().message();
      for (std::size_t i = 0; i < on->steps.size(); ++i) {
        EXPECT_LE(on->steps[i].step_s, off->steps[i].step_s + 1e-12) << "ep " << ep << " bucket " << bucket;
        EXPECT_LE(on->steps[i].grad_exposed_s, off->steps[i].grad_exposed_s + 1e-12);
        EXPECT_NEAR(off->steps[i].grad_exposed_s, off->steps[i].grad_sync_s, 1e-12);
        EXPECT_GT(off->steps[i].grad_sync_s, 0.0);
        some_hidden |= on->steps[i].step_s < off->steps[i].step_s * 0.99;
      }
    }
  }
  EXPECT_TRUE(some_hidden);
}

TEST(SimGradSync, EdpOneSendsNoExpertGradientsAndTheStepIncludesTheExposedAllReduce) {
  Scenario s = two_node_scenario(/*ep=*/8);  // one EP group of all 8 GPUs
  s.parallelism.grad_overlap = false;
  auto r = simulate(s);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->edp_ranks, 1);
  EXPECT_EQ(r->dp_ranks, 8);
  EXPECT_GT(r->expert_grad_bytes, 0.0);
  EXPECT_EQ(r->grad_sync.edp.bytes_sent, 0.0);
  EXPECT_EQ(r->grad_sync.edp.algorithm, "none");
  for (const Bucket& b : r->grad_sync.buckets) EXPECT_FALSE(b.expert);
  // EP 2: EDP 4 over both nodes; the buckets carry every expert byte once.
  auto r2 = simulate(two_node_scenario(2));
  ASSERT_TRUE(r2.is_ok());
  EXPECT_EQ(r2->edp_ranks, 4);
  double expert_bytes = 0;
  for (const Bucket& b : r2->grad_sync.buckets)
    if (b.expert) expert_bytes += b.bytes;
  EXPECT_DOUBLE_EQ(expert_bytes, r2->expert_grad_bytes);
  // With overlap off the whole all-reduce follows the stage, then the optimizer.
  const StepStats& st = r->steps[0];
  EXPECT_NEAR(st.step_s, st.stage_s + st.grad_exposed_s + st.optimizer_s, 1e-12);
  EXPECT_GT(st.grad_exposed_s, 0.0);
}

TEST(SimGradSync, ScenarioKeysAreCheckedByName) {
  Scenario s = two_node_scenario(2);
  s.parallelism.allreduce = "tree";
  EXPECT_EQ(s.validate().message(), "parallelism.allreduce = 'tree' is not one of ring, hierarchical, auto, allgather, chunked");
  s = two_node_scenario(2);
  s.model.grad_dtype = "fp8";
  EXPECT_EQ(s.validate().message(), "model.grad_dtype = 'fp8' is not one of f32, bf16");
  s = two_node_scenario(2);
  ASSERT_TRUE(set_value(s, "parallelism.grad_overlap", "false").is_ok());
  EXPECT_FALSE(s.parallelism.grad_overlap);
  EXPECT_FALSE(set_value(s, "parallelism.grad_overlap", "maybe").is_ok());
}

}  // namespace
}  // namespace epx::sim
