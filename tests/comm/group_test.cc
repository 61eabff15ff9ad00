// Groups of the in-process transport (Transport::split) and split_parallel:
// ranks, topologies, world ranks, every service on a group, layout checks on
// every rank, and the failure rules (a failure anywhere ends every wait in the
// world and in its groups).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/comm/inproc.h"
#include "epx/comm/parallel_layout.h"
#include "epx/core/clock.h"
#include "comm/inproc_helpers.h"
#include "epx/exchange/buffer.h"

namespace epx {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

using comm_test::generous;
using comm_test::make_topology;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

template <typename T>
Status expect_eq(const T& got, const T& want, std::string_view what) {
  if (got == want) return Status::ok();
  return internal_error("{}: got {}, want {}", what, got, want);
}

void expect_all_ok(const std::vector<Status>& statuses) {
  const Status first = first_error(statuses);
  EXPECT_TRUE(first.is_ok()) << first.to_string();
}

// The world ranks of every rank of `group`, in group order.
std::vector<int> world_ranks(const Transport& group) {
  std::vector<int> out;
  for (int r = 0; r < group.num_ranks(); ++r) out.push_back(group.world_rank(r));
  return out;
}

// The sum of the group's world ranks, by all_reduce on the group.
Status check_group_sum(Transport& group) {
  int64_t sum = group.world_rank(group.rank());
  EPX_RETURN_IF_ERROR(group.all_reduce(std::span<int64_t>(&sum, 1), ReduceOp::kSum, generous()));
  int64_t want = 0;
  for (int w : world_ranks(group)) want += w;
  return expect_eq(sum, want, "all_reduce of the world ranks over the group");
}

// ---------------------------------------------------------------------------
// One tiny hand-checkable scenario: 4 ranks, odd and even.

TEST(Group, OddAndEvenByHand) {
  expect_all_ok(run_ranks(make_topology(4), [](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto group, t.split(t.rank() % 2, t.rank(), generous()));
    EPX_RETURN_IF_ERROR(expect_eq(group->num_ranks(), 2, "num_ranks"));
    EPX_RETURN_IF_ERROR(expect_eq(group->rank(), t.rank() / 2, "rank"));
    const std::vector<int> want = t.rank() % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    EPX_RETURN_IF_ERROR(expect_eq(world_ranks(*group), want, "world ranks"));
    EPX_RETURN_IF_ERROR(expect_eq(std::string(group->backend_name()), std::string("inproc"), "backend"));
    int32_t sum = t.rank();
    EPX_RETURN_IF_ERROR(group->all_reduce(std::span<int32_t>(&sum, 1), ReduceOp::kSum, generous()));
    EPX_RETURN_IF_ERROR(expect_eq(sum, t.rank() % 2 == 0 ? 2 : 4, "sum over the group"));
    // The world still works beside its groups.
    return t.barrier(generous());
  }));
}

TEST(Group, KeyOrdersTheRanks) {
  expect_all_ok(run_ranks(make_topology(4), [](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto group, t.split(0, -t.rank(), generous()));
    EPX_RETURN_IF_ERROR(expect_eq(group->rank(), 3 - t.rank(), "rank"));
    EPX_RETURN_IF_ERROR(expect_eq(world_ranks(*group), std::vector<int>{3, 2, 1, 0}, "world ranks"));
    // Equal keys keep the parent's order.
    EPX_ASSIGN_OR_RETURN(auto same, t.split(0, 7, generous()));
    return expect_eq(same->rank(), t.rank(), "rank with equal keys");
  }));
}

TEST(Group, TopologyHasTheNodesOfItsRanks) {
  expect_all_ok(run_ranks(make_topology(8, 2), [](Transport& t) -> Status {
    // Inside a node: {0 1} {2 3} ...; across nodes: {0 4} {1 5} ...
    EPX_ASSIGN_OR_RETURN(auto inside, t.split(t.rank() / 2, t.rank(), generous()));
    EPX_RETURN_IF_ERROR(expect_eq(inside->topology().describe(), std::string("1 node x 2 ranks"), "inside"));
    EPX_ASSIGN_OR_RETURN(auto across, t.split(t.rank() % 4, t.rank(), generous()));
    EPX_RETURN_IF_ERROR(expect_eq(across->topology().describe(), std::string("2 nodes x 1 rank"), "across"));
    EPX_RETURN_IF_ERROR(expect_eq(across->node(), t.node(), "node of the group rank"));
    EPX_ASSIGN_OR_RETURN(auto half, t.split(t.local_rank() / 2, t.rank(), generous()));  // {0 1 4 5} {2 3 6 7}
    EPX_RETURN_IF_ERROR(expect_eq(half->topology().describe(), std::string("2 nodes x 2 ranks"), "half"));
    EPX_RETURN_IF_ERROR(check_group_sum(*inside));
    EPX_RETURN_IF_ERROR(check_group_sum(*across));
    return check_group_sum(*half);
  }));
}

TEST(Group, RejectsAGroupThatIsNotNodeMajorOnEveryRank) {
  // Keys interleave the nodes: 0 4 1 5 2 6 3 7.
  std::vector<Status> statuses = run_ranks(make_topology(8, 2), [](Transport& t) -> Status {
    return t.split(0, t.local_rank() * 2 + t.node(), generous()).status();
  });
  for (int r = 0; r < 8; ++r) {
    ASSERT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << r << ": " << statuses[r].to_string();
    EXPECT_TRUE(contains(statuses[r].message(), "group 0 (world ranks 0, 4, 1, 5, 2, 6, 3, 7) lives on nodes 0, 1, 0, 1"))
        << statuses[r].message();
  }
  // 4 ranks on node 0 and 2 on node 1 in one group.
  statuses = run_ranks(make_topology(8, 2), [](Transport& t) -> Status {
    return t.split(t.rank() < 6 ? 0 : 1, 0, generous()).status();
  });
  for (int r = 0; r < 8; ++r) {
    ASSERT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << r;
    EXPECT_TRUE(contains(statuses[r].message(), "group 0 (world ranks 0, 1, 2, 3, 4, 5) lives on nodes 0, 0, 0, 0, 1, 1"))
        << statuses[r].message();
  }
}

TEST(Group, RejectsANegativeColorOnEveryRank) {
  std::vector<Status> statuses = run_ranks(make_topology(3), [](Transport& t) -> Status {
    return t.split(t.rank() == 1 ? -1 : 0, 0, generous()).status();
  });
  for (const Status& s : statuses) {
    ASSERT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_TRUE(contains(s.message(), "rank 1 passed color -1")) << s.message();
  }
}

TEST(Group, AGroupOfAGroupNamesWorldRanks) {
  expect_all_ok(run_ranks(make_topology(8, 2), [](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto node, t.split(t.node(), t.rank(), generous()));         // {0..3} {4..7}
    EPX_ASSIGN_OR_RETURN(auto pair, node->split(node->rank() % 2, 0, generous()));    // {4 6} {5 7} on node 1
    const int w = t.rank();
    const std::vector<int> want = {w - (w % 4) + (w % 2), w - (w % 4) + (w % 2) + 2};
    EPX_RETURN_IF_ERROR(expect_eq(world_ranks(*pair), want, "world ranks of a group of a group"));
    return check_group_sum(*pair);
  }));
}

TEST(Group, PeerMemoryAndMessagesStayInsideTheGroup) {
  expect_all_ok(run_ranks(make_topology(8, 2), [](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto group, t.split(t.local_rank() / 2, t.rank(), generous()));  // {0 1 4 5} {2 3 6 7}
    EPX_ASSIGN_OR_RETURN(auto memory, group->map_peer_memory(64, generous()));
    const int32_t mine = t.rank();
    std::memcpy(memory->local(), &mine, sizeof(mine));
    EPX_RETURN_IF_ERROR(group->barrier(generous()));
    for (int r = 0; r < group->num_ranks(); ++r) {
      std::byte* peer = memory->peer(r);
      const bool same_node = group->topology().same_node(r, group->rank());
      EPX_RETURN_IF_ERROR(expect_eq(peer != nullptr, same_node, fmt::format("peer({}) mapped", r)));
      int32_t seen = -1;
      if (peer) std::memcpy(&seen, peer, sizeof(seen));
      if (peer) EPX_RETURN_IF_ERROR(expect_eq(seen, group->world_rank(r), fmt::format("region of group rank {}", r)));
    }
    // A ring of messages on the group: each sends its world rank to the next.
    const int next = (group->rank() + 1) % group->num_ranks();
    const int prev = (group->rank() + group->num_ranks() - 1) % group->num_ranks();
    EPX_ASSIGN_OR_RETURN(Request sent, group->send_async(next, 3, std::as_bytes(std::span(&mine, 1))));
    int32_t got = -1;
    EPX_ASSIGN_OR_RETURN(std::size_t size, group->recv(prev, 3, std::as_writable_bytes(std::span(&got, 1)), generous()));
    EPX_RETURN_IF_ERROR(sent.wait(generous()));
    EPX_RETURN_IF_ERROR(expect_eq(size, sizeof(got), "message size"));
    EPX_RETURN_IF_ERROR(expect_eq(got, group->world_rank(prev), "message from the previous group rank"));
    // Group rank 1 -> 2 crosses nodes ({0 1} on node 0, {4 5} on node 1).
    const TransportCounters c = group->counters();
    const uint64_t want_inter = group->rank() == 1 || group->rank() == 3 ? 1 : 0;
    return expect_eq(c.inter_node_messages, want_inter, "inter-node messages of the group");
  }));
}

// A duplicate used from another thread: TransportGroups.ADuplicateRunsBesideItsParentOnAnotherThread
// (transport_test.cc, in-process and under MPI).

// ---------------------------------------------------------------------------
// Failures

// A stall in a group: TransportGroups.AStallInAGroupEndsTheWorldsWaits
// (transport_test.cc, in-process and under MPI).

// An abort of the world ends a wait in a group, and later calls on the group
// fail at once.
TEST(GroupFailure, AnAbortOfTheWorldEndsTheGroups) {
  std::vector<Status> statuses = run_ranks(make_topology(4), [](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto group, t.split(t.rank() % 2, t.rank(), generous()));
    if (t.rank() == 0) {
      std::this_thread::sleep_for(milliseconds(50));
      t.abort(internal_error("rank 0 gave up"));
      return group->barrier(generous());
    }
    if (t.rank() == 1) return group->barrier(generous());  // waits for rank 3, which never comes
    return Status::ok();
  });
  EXPECT_TRUE(statuses[2].is_ok() && statuses[3].is_ok());
  for (int r : {0, 1}) {
    ASSERT_EQ(statuses[r].code(), StatusCode::kAborted) << r << ": " << statuses[r].to_string();
    EXPECT_TRUE(contains(statuses[r].message(), "rank 0 gave up")) << statuses[r].message();
  }
}

// A failure in one group reaches a sibling group through the world, and the
// world itself.
TEST(GroupFailure, AnAbortInAGroupReachesItsSiblingsAndTheWorld) {
  std::vector<Status> statuses = run_ranks(make_topology(4), [](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto group, t.split(t.rank() % 2, t.rank(), generous()));
    if (t.rank() == 1) {
      std::this_thread::sleep_for(milliseconds(50));
      group->abort(internal_error("the odd group gave up"));
      return t.barrier(generous());
    }
    if (t.rank() == 0) return group->barrier(generous());  // waits for rank 2, which never comes
    return Status::ok();
  });
  EXPECT_TRUE(statuses[2].is_ok() && statuses[3].is_ok());
  for (int r : {0, 1}) {
    ASSERT_EQ(statuses[r].code(), StatusCode::kAborted) << r << ": " << statuses[r].to_string();
    EXPECT_TRUE(contains(statuses[r].message(), "in group 1 (world ranks 1, 3): ")) << statuses[r].message();
    EXPECT_TRUE(contains(statuses[r].message(), "the odd group gave up")) << statuses[r].message();
  }
}

// ---------------------------------------------------------------------------
// split_parallel

// A Buffer on the EP group: one expert per group rank, token t of each rank
// to expert t % ep; recv rows come from the group's ranks, and combining the
// received rows gives x back.
Status dispatch_and_combine_on(Transport& ep_group, int world_rank) {
  constexpr int kTokens = 6;
  constexpr int kHidden = 4;
  const int ep = ep_group.num_ranks();
  BufferConfig config;
  config.num_experts = ep;
  config.hidden = kHidden;
  config.dtype = DType::kF32;
  config.max_topk = 1;
  config.max_tokens_per_rank = kTokens;
  EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(ep_group, config));
  std::vector<float> x(kTokens * kHidden);
  std::vector<int32_t> idx(kTokens);
  for (int t = 0; t < kTokens; ++t) {
    idx[t] = t % ep;
    for (int c = 0; c < kHidden; ++c) x[t * kHidden + c] = static_cast<float>(1000 * world_rank + 10 * t + c);
  }
  DispatchResult recv;
  DispatchInputs inputs;
  inputs.x = TensorView::contiguous(x.data(), DType::kF32, {kTokens, kHidden});
  inputs.topk_idx = TensorView::contiguous(idx.data(), DType::kI32, {kTokens, 1});
  EPX_RETURN_IF_ERROR(buffer->dispatch(inputs, &recv));
  // Each group rank sends kTokens / ep tokens here (kTokens is a multiple of 1, 2 and 6 / ep).
  int64_t want_recv = 0;
  for (int t = 0; t < kTokens; ++t) want_recv += t % ep == ep_group.rank() ? ep : 0;
  EPX_RETURN_IF_ERROR(expect_eq(recv.recv_x.size(0), want_recv, "rows received"));
  for (int64_t i = 0; i < recv.recv_x.size(0); ++i) {
    const int src = recv.recv_src_rank.data_as<int32_t>()[i];
    const int token = recv.recv_src_idx.data_as<int32_t>()[i];
    const float first = recv.recv_x.data_as<float>()[i * kHidden];
    EPX_RETURN_IF_ERROR(expect_eq(first, static_cast<float>(1000 * ep_group.world_rank(src) + 10 * token),
                                  fmt::format("row {} (group rank {}, token {})", i, src, token)));
  }
  std::vector<float> out(kTokens * kHidden, -1.0f);
  EPX_RETURN_IF_ERROR(buffer->combine(recv.recv_x, recv.handle,
                                      TensorView::contiguous(out.data(), DType::kF32, {kTokens, kHidden})));
  return expect_eq(out, x, "combine of the dispatched rows");
}

Status check_parallel_groups(Transport& world, int ep) {
  const ParallelLayout layout = *ParallelLayout::create(world.topology(), ep);
  EPX_ASSIGN_OR_RETURN(ParallelGroups groups, split_parallel(world, layout, generous()));
  const int w = world.rank();
  EPX_RETURN_IF_ERROR(expect_eq(groups.ep->rank(), layout.ep_rank(w), "EP rank"));
  EPX_RETURN_IF_ERROR(expect_eq(groups.edp->rank(), layout.edp_rank(w), "EDP rank"));
  EPX_RETURN_IF_ERROR(expect_eq(world_ranks(*groups.ep), layout.ep_members(layout.ep_group(w)), "EP members"));
  EPX_RETURN_IF_ERROR(expect_eq(world_ranks(*groups.edp), layout.edp_members(layout.edp_group(w)), "EDP members"));
  // 8 ranks on 2 nodes: EP 2 stays inside a node, EP 4 fills one; EDP spans both.
  const std::string ep_topology = ep == 2 ? "1 node x 2 ranks" : "1 node x 4 ranks";
  const std::string edp_topology = ep == 2 ? "2 nodes x 2 ranks" : "2 nodes x 1 rank";
  EPX_RETURN_IF_ERROR(expect_eq(groups.ep->topology().describe(), ep_topology, "EP topology"));
  EPX_RETURN_IF_ERROR(expect_eq(groups.edp->topology().describe(), edp_topology, "EDP topology"));
  EPX_RETURN_IF_ERROR(check_group_sum(*groups.ep));
  EPX_RETURN_IF_ERROR(check_group_sum(*groups.edp));
  return dispatch_and_combine_on(*groups.ep, w);
}

TEST(SplitParallel, EightRanksOnTwoNodesWithEp2And4) {
  for (int ep : {2, 4}) {
    SCOPED_TRACE(fmt::format("ep = {}", ep));
    expect_all_ok(run_ranks(make_topology(8, 2), [ep](Transport& t) { return check_parallel_groups(t, ep); }));
  }
}

TEST(SplitParallel, RejectsALayoutOfAnotherWorld) {
  const ParallelLayout layout = *ParallelLayout::create(make_topology(4), 2);
  std::vector<Status> statuses = run_ranks(make_topology(2), [&](Transport& t) -> Status {
    return split_parallel(t, layout, generous()).status();
  });
  for (const Status& s : statuses) {
    ASSERT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(s.message(), "the layout is for 4 ranks but the transport has 2")) << s.message();
  }
}

}  // namespace
}  // namespace epx
