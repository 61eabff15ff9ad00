#include "epx/comm/parallel_layout.h"

#include <gtest/gtest.h>

#include <vector>

namespace epx {
namespace {

ParallelLayout make(int ranks, int nodes, int ep) {
  Result<Topology> topology = Topology::create(ranks, nodes);
  EPX_CHECK(topology.is_ok());
  Result<ParallelLayout> layout = ParallelLayout::create(*topology, ep);
  EPX_CHECK(layout.is_ok());
  return *layout;
}

TEST(ParallelLayout, EpGroupsAreContiguousAndEdpGroupsStrided) {
  const ParallelLayout l = make(8, 2, 2);
  EXPECT_EQ(l.ep(), 2);
  EXPECT_EQ(l.edp(), 4);
  EXPECT_EQ(l.ep_members(1), (std::vector<int>{2, 3}));
  EXPECT_EQ(l.edp_members(1), (std::vector<int>{1, 3, 5, 7}));
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(l.ep_members(l.ep_group(r))[l.ep_rank(r)], r);
    EXPECT_EQ(l.edp_members(l.edp_group(r))[l.edp_rank(r)], r);
  }
}

TEST(ParallelLayout, ZeroMeansOneGroupOfAllRanks) {
  const ParallelLayout l = make(4, 1, 0);
  EXPECT_EQ(l.ep(), 4);
  EXPECT_EQ(l.edp(), 1);
  EXPECT_EQ(l.edp_members(3), (std::vector<int>{3}));
}

TEST(ParallelLayout, DescribeNamesEveryGroupAndItsNodes) {
  EXPECT_EQ(make(8, 2, 4).describe(),
            "8 ranks on 2 nodes x 4 ranks: EP 4 x EDP 2\n"
            "EP group 0: ranks 0 1 2 3 (node 0)\n"
            "EP group 1: ranks 4 5 6 7 (node 1)\n"
            "EDP group 0: ranks 0 4 (nodes 0 1)\n"
            "EDP group 1: ranks 1 5 (nodes 0 1)\n"
            "EDP group 2: ranks 2 6 (nodes 0 1)\n"
            "EDP group 3: ranks 3 7 (nodes 0 1)");
}

TEST(ParallelLayout, RejectsSizesThatDoNotDivide) {
  Result<Topology> t = Topology::create(12, 2);
  ASSERT_TRUE(t.is_ok());
  Result<ParallelLayout> bad = ParallelLayout::create(*t, 5);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("ep = 5 must divide ranks = 12"), std::string::npos);
  bad = ParallelLayout::create(*t, 4);  // 6 ranks per node: EP groups of 4 would straddle nodes
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("splits nodes unevenly"), std::string::npos);
  EXPECT_TRUE(ParallelLayout::create(*t, 12).is_ok());
  EXPECT_TRUE(ParallelLayout::create(*t, 3).is_ok());
}

}  // namespace
}  // namespace epx
