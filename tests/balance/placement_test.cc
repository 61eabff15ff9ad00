#include "epx/balance/placement.h"

#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

namespace epx {
namespace {

std::vector<double> zipf(int num_experts, double s) {
  std::vector<double> load(num_experts);
  for (int e = 0; e < num_experts; ++e) load[e] = 1000.0 / std::pow(e + 1, s);
  return load;
}

// Every expert has a replica, slots add up, no rank holds an expert twice,
// and the map and the replica lists agree.
void expect_valid(const RedundantPlacement& p, int num_experts, int num_slots, int num_ranks) {
  ASSERT_EQ(p.num_experts(), num_experts);
  ASSERT_EQ(p.num_slots(), num_slots);
  ASSERT_EQ(p.num_ranks(), num_ranks);
  int filled = 0;
  for (int e = 0; e < num_experts; ++e) {
    EXPECT_GE(p.num_replicas(e), 1) << "expert " << e;
    std::set<int> ranks;
    for (int s : p.replicas(e)) {
      EXPECT_EQ(p.slot_expert()[s], e);
      EXPECT_TRUE(ranks.insert(p.rank_of_slot(s)).second) << "expert " << e << " twice on rank " << p.rank_of_slot(s);
    }
    filled += p.num_replicas(e);
  }
  int nonempty = 0;
  for (int s = 0; s < num_slots; ++s) nonempty += p.slot_expert()[s] >= 0;
  EXPECT_EQ(filled, nonempty);
}

// The smallest case, by hand: 4 experts, 6 slots, 2 ranks (global). Expert 0
// (load 8) gets a replica on each rank; the next heaviest per replica is
// expert 1 (load 6 -> 3 per replica).
TEST(PlaceExperts, TinyByHand) {
  const std::vector<double> load = {8, 6, 2, 2};
  auto p = place_experts(load, {.num_slots = 6, .num_nodes = 1, .ranks_per_node = 2, .policy = PlacementPolicy::kGlobal});
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->replica_counts(), (std::vector<int32_t>{2, 2, 1, 1}));
  const auto loads = rank_loads(*p, load);
  EXPECT_DOUBLE_EQ(loads[0], 9);  // 4 + 3 + 2
  EXPECT_DOUBLE_EQ(loads[1], 9);
  EXPECT_DOUBLE_EQ(balance(loads), 1.0);
  expect_valid(*p, 4, 6, 2);
  auto ep = p->to_expert_placement();
  ASSERT_TRUE(ep.is_ok());
  EXPECT_EQ(ep->num_experts(), 6);
  EXPECT_EQ(ep->rank_of(4), 1);
}

TEST(PlaceExperts, RandomLoadsAndShapesAreValid) {
  std::mt19937_64 rng(7);
  const int shapes[][4] = {  // experts, slots, nodes, ranks per node
      {8, 8, 1, 1},  {8, 8, 1, 4},   {8, 16, 2, 2},   {16, 24, 2, 4}, {64, 80, 2, 4},
      {12, 12, 1, 3}, {6, 32, 1, 4}, {5, 40, 2, 2},  {256, 288, 4, 8}, {3, 64, 1, 8}};
  for (const auto& shape : shapes) {
    for (int trial = 0; trial < 20; ++trial) {
      const int num_experts = shape[0];
      std::vector<double> load(num_experts);
      std::exponential_distribution<double> dist(1.0);
      for (auto& l : load) l = trial % 5 == 0 ? 0.0 : std::pow(dist(rng), 3);
      for (PlacementPolicy policy : {PlacementPolicy::kGlobal, PlacementPolicy::kHierarchical}) {
        const int groups = num_experts % (2 * shape[2]) == 0 ? 2 * shape[2] : 0;
        PlacementConfig c{.num_slots = shape[1], .num_nodes = shape[2], .ranks_per_node = shape[3],
                          .num_groups = groups, .policy = policy};
        auto p = place_experts(load, c);
        ASSERT_TRUE(p.is_ok()) << p.status().to_string();
        SCOPED_TRACE("experts " + std::to_string(num_experts) + " slots " + std::to_string(shape[1]));
        expect_valid(*p, num_experts, shape[1], shape[2] * shape[3]);
        // Rebalance it for other random loads: still valid, within the tolerance.
        std::vector<double> next(num_experts);
        for (auto& l : next) l = std::pow(dist(rng), 3);
        auto plan = rebalance(*p, next, c, 10);
        ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
        expect_valid(plan->placement, num_experts, shape[1], shape[2] * shape[3]);
        EXPECT_LE(plan->balance, plan->scratch_balance * 1.02 * (1 + 1e-12));
        EXPECT_EQ(plan->placement.policy(), p->policy());
        if (p->policy() == PlacementPolicy::kHierarchical) {
          for (const RedundantPlacement* q : {&*p, &plan->placement}) {
            const int group_size = num_experts / groups;
            for (int g = 0; g < groups; ++g) {
              std::set<int> nodes;
              for (int e = g * group_size; e < (g + 1) * group_size; ++e)
                for (int slot : q->replicas(e)) nodes.insert(q->rank_of_slot(slot) / shape[3]);
              EXPECT_EQ(nodes.size(), 1u) << "group " << g << " spans nodes";
            }
          }
        }
      }
    }
  }
}

TEST(PlaceExperts, ZipfLoadBalancesBelow1p05) {
  const auto load = zipf(64, 1.2);
  auto before = contiguous_placement(64, 8);
  ASSERT_TRUE(before.is_ok());
  const double before_balance = balance(rank_loads(*before, load));
  EXPECT_GT(before_balance, 1.5);
  // Global policy (hierarchical without groups is the same): with groups of
  // contiguous experts, Zipf puts most of the load in group 0, which cannot leave its node.
  auto p = place_experts(load, {.num_slots = 80, .num_nodes = 2, .ranks_per_node = 4});
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->policy(), PlacementPolicy::kGlobal);
  expect_valid(*p, 64, 80, 8);
  EXPECT_LT(balance(rank_loads(*p, load)), 1.05) << "before " << before_balance;
}

// 4 groups of 2 experts over 2 nodes of 2 ranks: groups {0,1} (load 10) and
// {6,7} (load 1) share a node; {2,3} (5) and {4,5} (4) the other.
TEST(PlaceExperts, HierarchicalKeepsGroupsOnOneNode) {
  const std::vector<double> load = {6, 4, 3, 2, 2, 2, 0.5, 0.5};
  PlacementConfig c{.num_slots = 12, .num_nodes = 2, .ranks_per_node = 2, .num_groups = 4,
                    .policy = PlacementPolicy::kHierarchical};
  auto p = place_experts(load, c);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->policy(), PlacementPolicy::kHierarchical);
  expect_valid(*p, 8, 12, 4);
  auto node_of = [&](int e) {
    std::set<int> nodes;
    for (int s : p->replicas(e)) nodes.insert(p->rank_of_slot(s) / 2);
    EXPECT_EQ(nodes.size(), 1u) << "expert " << e;
    return *nodes.begin();
  };
  for (int g = 0; g < 4; ++g) EXPECT_EQ(node_of(2 * g), node_of(2 * g + 1)) << "group " << g;
  EXPECT_EQ(node_of(0), node_of(6));
  EXPECT_EQ(node_of(2), node_of(4));
  EXPECT_NE(node_of(0), node_of(2));
  // Each node has 6 slots for 4 experts: on one, 0 (6) and 1 (4) get the extra two;
  // on the other 2 (3) and then 3 (2, tied with 4 and 5: the lower id).
  EXPECT_EQ(p->replica_counts(), (std::vector<int32_t>{2, 2, 2, 2, 1, 1, 1, 1}));
}

TEST(PlaceExperts, ReplicasCappedAtRanks) {
  // 2 experts, 2 ranks, 8 slots: at most 2 replicas each, 4 slots stay empty.
  auto p = place_experts({5, 1}, {.num_slots = 8, .num_nodes = 1, .ranks_per_node = 2});
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->replica_counts(), (std::vector<int32_t>{2, 2}));
  expect_valid(*p, 2, 8, 2);
}

// A small change in load: +-5% noise and two experts trading loads (a heavy
// one with a light one in the second case, which the current placement cannot absorb).
class RebalanceSmallChange : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(RebalanceSmallChange, MovesLessThanScratchWithinTolerance) {
  const auto [groups, swap_a, swap_b] = GetParam();
  const PlacementConfig c{.num_slots = 80, .num_nodes = 2, .ranks_per_node = 4, .num_groups = groups};
  auto load = zipf(64, 1.2);
  auto current = place_experts(load, c);
  ASSERT_TRUE(current.is_ok());
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> jitter(0.95, 1.05);
  for (auto& l : load) l *= jitter(rng);
  std::swap(load[swap_a], load[swap_b]);
  auto scratch = place_experts(load, c);
  ASSERT_TRUE(scratch.is_ok());
  const int64_t bytes = 1 << 20;
  const int64_t scratch_bytes = moved_bytes(*current, *scratch, bytes);
  auto plan = rebalance(*current, load, c, bytes);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  expect_valid(plan->placement, 64, 80, 8);
  EXPECT_GT(scratch_bytes, 0);
  EXPECT_LT(plan->moved_bytes, scratch_bytes);
  EXPECT_LE(plan->num_moved_slots, 8) << "of " << scratch_bytes / bytes << " from scratch";
  EXPECT_EQ(plan->moved_bytes, moved_bytes(*current, plan->placement, bytes));
  EXPECT_EQ(plan->moved_bytes, plan->num_moved_slots * bytes);
  EXPECT_EQ(plan->scratch_balance, balance(rank_loads(*scratch, load)));
  EXPECT_LE(plan->balance, plan->scratch_balance * 1.02);
  EXPECT_DOUBLE_EQ(plan->balance, balance(rank_loads(plan->placement, load)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, RebalanceSmallChange,
                         ::testing::Values(std::make_tuple(8, 10, 40), std::make_tuple(0, 10, 40),
                                           std::make_tuple(0, 20, 21), std::make_tuple(8, 30, 50),
                                           std::make_tuple(0, 2, 50), std::make_tuple(8, 1, 5)));

TEST(Rebalance, UnchangedLoadMovesNothing) {
  const PlacementConfig c{.num_slots = 24, .num_nodes = 2, .ranks_per_node = 2, .policy = PlacementPolicy::kGlobal};
  const auto load = zipf(16, 1.0);
  auto current = place_experts(load, c);
  ASSERT_TRUE(current.is_ok());
  auto plan = rebalance(*current, load, c, 100);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->moved_bytes, 0);
}

TEST(ChooseReplicas, ModuloIsDeterministicAndUsesEveryReplica) {
  const auto load = zipf(16, 1.2);
  auto p = place_experts(load, {.num_slots = 32, .num_nodes = 1, .ranks_per_node = 4});
  ASSERT_TRUE(p.is_ok());
  const int num_tokens = 64, topk = 2;
  std::vector<int32_t> idx(num_tokens * topk);
  for (int t = 0; t < num_tokens; ++t) {
    idx[t * topk] = t % 16;
    idx[t * topk + 1] = t % 5 == 0 ? -1 : 0;
  }
  for (ReplicaChoice choice : {ReplicaChoice::kTokenModulo, ReplicaChoice::kLeastLoaded}) {
    auto a = choose_replicas(*p, idx, topk, choice);
    auto b = choose_replicas(*p, idx, topk, choice);
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    EXPECT_EQ(*a, *b);
    std::vector<int> used(32, 0);
    for (size_t i = 0; i < idx.size(); ++i) {
      if (idx[i] < 0) {
        EXPECT_EQ((*a)[i], -1);
        continue;
      }
      ASSERT_GE((*a)[i], 0);
      EXPECT_EQ(p->slot_expert()[(*a)[i]], idx[i]);
      ++used[(*a)[i]];
    }
    ASSERT_GE(p->num_replicas(0), 2);
    for (int s : p->replicas(0)) EXPECT_GT(used[s], 0) << "slot " << s;
    if (choice == ReplicaChoice::kTokenModulo) {
      EXPECT_EQ((*a)[2 * topk + 0], p->replicas(2)[2 % p->num_replicas(2)]);
    }
  }
  idx[3] = 16;
  auto bad = choose_replicas(*p, idx, topk, ReplicaChoice::kTokenModulo);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().message(), "topk_idx[1][1] = 16 is outside [0, 16)");
}

void expect_invalid(const std::vector<double>& load, const PlacementConfig& c, const std::string& message) {
  auto p = place_experts(load, c);
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.status().message(), message);
}

TEST(PlaceExperts, RejectsBadInput) {
  const std::vector<double> load(8, 1.0);
  expect_invalid(load, {.num_slots = 6, .num_nodes = 1, .ranks_per_node = 2},
                 "num_slots = 6 is fewer than the 8 experts");
  expect_invalid(load, {.num_slots = 10, .num_nodes = 1, .ranks_per_node = 4},
                 "num_slots = 10 is not a multiple of num_ranks = 4 (1 nodes x 4 ranks per node)");
  expect_invalid(load, {.num_slots = 8, .num_nodes = 1, .ranks_per_node = 2, .num_groups = 3},
                 "num_groups = 3 does not divide the 8 experts");
  auto negative = load;
  negative[5] = -0.5;
  expect_invalid(negative, {.num_slots = 8, .num_nodes = 1, .ranks_per_node = 2},
                 "load[5] = -0.5 is negative; loads must be >= 0");
  auto nan = load;
  nan[2] = std::numeric_limits<double>::quiet_NaN();
  expect_invalid(nan, {.num_slots = 8, .num_nodes = 1, .ranks_per_node = 2},
                 "load[2] = nan is not finite; loads must be finite and >= 0");
}

}  // namespace
}  // namespace epx
