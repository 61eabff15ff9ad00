// The transport contract on whichever world the binary runs in: in-process
// threads (epx_comm_tests) or MPI processes (epx_mpi_tests under mpirun,
// one rank per process). Each test checks the ranks this process holds.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "epx/comm/topology.h"
#include "epx/comm/transport.h"
#include "exchange/world.h"

namespace epx {
namespace {

using exchange_test::test_world;

Deadline seconds(int s) { return Deadline::after(std::chrono::seconds(s)); }

// The ranks a test uses: 4 threads in-process, every process under MPI.
int test_ranks() { return test_world().ranks_for(4); }

// Runs fn on a world of `num_ranks` ranks as `num_nodes` nodes (or as many
// as the MPI hosts, when they are several); statuses per rank.
std::vector<Status> run(int num_ranks, int num_nodes, const std::function<Status(Transport&)>& fn) {
  return test_world().run(*Topology::create(num_ranks, test_world().nodes_for(num_nodes)), fn);
}

#define EPX_NEED_RANKS(n)                                                                        \
  do {                                                                                           \
    if (test_ranks() < (n)) GTEST_SKIP() << "needs " << (n) << " ranks; this world has " << test_ranks(); \
  } while (false)

TEST(Transport, CollectivesSmallAndLarge) {
  const int R = test_ranks();
  // 3 floats fit the MPI backend's first round; 5000 do not (its second path).
  for (std::size_t count : {std::size_t{3}, std::size_t{5000}}) {
    SCOPED_TRACE(fmt::format("{} elements", count));
    std::vector<std::vector<float>> gathered(R), reduced(R), exchanged(R);
    auto statuses = run(R, 1, [&](Transport& t) -> Status {
      const int r = t.rank();
      std::vector<float> mine(count);
      for (std::size_t i = 0; i < count; ++i) mine[i] = 0.1f * static_cast<float>(r + 1) + static_cast<float>(i);
      gathered[r].resize(count * R);
      EPX_RETURN_IF_ERROR(t.all_gather(std::span<const float>(mine), std::span<float>(gathered[r]), seconds(30)));
      reduced[r] = mine;
      EPX_RETURN_IF_ERROR(t.all_reduce(std::span<float>(reduced[r]), ReduceOp::kSum, seconds(30)));
      std::vector<float> blocks(count * R);
      for (int d = 0; d < R; ++d)
        for (std::size_t i = 0; i < count; ++i) blocks[d * count + i] = static_cast<float>(r * 1000 + d) + i;
      exchanged[r].resize(count * R);
      return t.all_to_all(std::span<const float>(blocks), std::span<float>(exchanged[r]), seconds(30));
    });
    for (int r = 0; r < R; ++r) {
      if (!test_world().holds(r)) continue;
      // EXPECT, not ASSERT: under MPI every process must go on to the next run().
      EXPECT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
      if (!statuses[r].is_ok()) continue;
      for (int s = 0; s < R; ++s)
        for (std::size_t i = 0; i < count; i += 997) {
          EXPECT_EQ(gathered[r][s * count + i], 0.1f * static_cast<float>(s + 1) + static_cast<float>(i));
          EXPECT_EQ(exchanged[r][s * count + i], static_cast<float>(s * 1000 + r) + i);
        }
      for (std::size_t i = 0; i < count; i += 997) {
        float want = 0.1f * 1 + static_cast<float>(i);  // rank order, as the contract says
        for (int s = 1; s < R; ++s) want += 0.1f * static_cast<float>(s + 1) + static_cast<float>(i);
        EXPECT_EQ(reduced[r][i], want) << "element " << i;
      }
    }
  }
}

TEST(Transport, MismatchedSizesAreInvalidArgumentOnEveryRankAndHarmless) {
  EPX_NEED_RANKS(2);
  const int R = test_ranks();
  std::vector<Status> mismatch(R), after(R);
  auto statuses = run(R, 1, [&](Transport& t) -> Status {
    std::vector<int64_t> in(t.rank() == 1 ? 3 : 2, 7), out(in.size() * R);
    mismatch[t.rank()] = t.all_gather(std::span<const int64_t>(in), std::span<int64_t>(out), seconds(30));
    after[t.rank()] = t.barrier(seconds(30));
    return Status::ok();
  });
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    EXPECT_EQ(mismatch[r].code(), StatusCode::kInvalidArgument) << mismatch[r].to_string();
    EXPECT_NE(mismatch[r].message().find("rank 1 passed 24 bytes"), std::string::npos) << mismatch[r].to_string();
    EXPECT_TRUE(after[r].is_ok()) << "the transport must stay usable: " << after[r].to_string();
  }
}

TEST(Transport, MessagesRingAndTooSmallBuffer) {
  EPX_NEED_RANKS(2);
  const int R = test_ranks();
  std::vector<std::vector<int32_t>> got(R);
  std::vector<Status> small(R);
  auto statuses = run(R, 1, [&](Transport& t) -> Status {
    const int r = t.rank(), next = (r + 1) % R, prev = (r + R - 1) % R;
    std::vector<int32_t> mine(100000, r);  // 400 kB: past any eager limit
    EPX_ASSIGN_OR_RETURN(Request request, t.send_async(next, 5, std::as_bytes(std::span(mine))));
    got[r].assign(mine.size(), -1);
    EPX_ASSIGN_OR_RETURN(std::size_t n, t.recv(prev, 5, std::as_writable_bytes(std::span(got[r])), seconds(30)));
    if (n != mine.size() * 4) return internal_error("received {} bytes", n);
    EPX_RETURN_IF_ERROR(request.wait(seconds(30)));
    // A message larger than the receiver's buffer.
    std::vector<int32_t> big(64, r), tiny(8);
    EPX_ASSIGN_OR_RETURN(Request big_request, t.send_async(next, 6, std::as_bytes(std::span(big))));
    auto received = t.recv(prev, 6, std::as_writable_bytes(std::span(tiny)), seconds(30));
    small[r] = received.status();
    big_request.wait(seconds(30)).ignore();  // in-process the sender hears of it too
    return t.barrier(seconds(30));
  });
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    ASSERT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
    EXPECT_EQ(got[r].front(), (r + R - 1) % R);
    EXPECT_EQ(got[r].back(), (r + R - 1) % R);
    EXPECT_EQ(small[r].code(), StatusCode::kResourceExhausted) << small[r].to_string();
  }
}

TEST(Transport, PeerMemoryIsSharedInsideANodeOnly) {
  EPX_NEED_RANKS(2);
  const int R = test_ranks();
  const int nodes = test_world().nodes_for(R % 2 == 0 ? 2 : 1);  // two (emulated) nodes when they divide
  std::vector<std::string> seen(R);
  auto statuses = run(R, nodes, [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto memory, t.map_peer_memory(1000, seconds(30)));
    for (std::size_t i = 0; i < 1000; ++i)
      if (memory->local()[i] != std::byte{0}) return internal_error("peer memory is not zero-filled at byte {}", i);
    if (reinterpret_cast<std::uintptr_t>(memory->local()) % 64 != 0) return internal_error("not 64-byte aligned");
    EPX_RETURN_IF_ERROR(t.barrier(seconds(30)));  // everyone checked before anyone writes
    // Write my rank into every same-node peer's region at my slot.
    for (int p = 0; p < R; ++p) {
      std::byte* region = memory->peer(p);
      if (t.topology().same_node(p, t.rank()) != (region != nullptr))
        return internal_error("peer({}) is {} but rank {} is {} node", p, region ? "mapped" : "null", p,
                              t.topology().same_node(p, t.rank()) ? "on my" : "on another");
      if (region) region[t.rank() * 8] = static_cast<std::byte>(t.rank() + 1);
    }
    EPX_RETURN_IF_ERROR(t.barrier(seconds(30)));
    for (int p = 0; p < R; ++p) seen[t.rank()] += std::to_string(static_cast<int>(memory->local()[p * 8]));
    return t.barrier(seconds(30));
  });
  const Topology topology = *Topology::create(R, nodes);
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    ASSERT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
    std::string want;
    for (int p = 0; p < R; ++p) want += std::to_string(topology.same_node(p, r) ? p + 1 : 0);
    EXPECT_EQ(seen[r], want) << "rank " << r;
  }
}

TEST(Transport, AMissingMessageTimesOutAndTheOthersHearOfIt) {
  EPX_NEED_RANKS(2);
  const int R = test_ranks();
  std::vector<Status> result(R);
  auto start = std::chrono::steady_clock::now();
  auto statuses = run(R, 1, [&](Transport& t) -> Status {
    if (t.rank() == 0) {
      std::vector<std::byte> out(16);
      result[0] = t.recv(1, 9, out, Deadline::after(std::chrono::milliseconds(300))).status();
    } else {
      result[t.rank()] = t.barrier(seconds(60));  // ends when rank 0's timeout is heard of, not after 60 s
    }
    return result[t.rank()];
  });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    EXPECT_EQ(result[r].code(), StatusCode::kDeadlineExceeded) << "rank " << r << ": " << result[r].to_string();
    if (r == 0) {
      EXPECT_NE(result[r].message().find("rank 1"), std::string::npos) << result[r].to_string();
    }
  }
  EXPECT_LT(waited, 30.0) << "the other ranks waited for their own deadline instead of hearing of rank 0's";
}

TEST(Transport, AnAbortEndsTheOthersWaitsWithItsReason) {
  EPX_NEED_RANKS(2);
  const int R = test_ranks();
  std::vector<Status> result(R);
  auto statuses = run(R, 1, [&](Transport& t) -> Status {
    if (t.rank() == R - 1) {
      t.abort(aborted("the test gives up on purpose"));
    }
    result[t.rank()] = t.barrier(seconds(60));
    return result[t.rank()];
  });
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    EXPECT_EQ(result[r].code(), StatusCode::kAborted) << "rank " << r << ": " << result[r].to_string();
    EXPECT_NE(result[r].message().find("the test gives up on purpose"), std::string::npos) << result[r].to_string();
  }
}

// ---------------------------------------------------------------------------
// Groups (Transport::split)

// The sum of the group's world ranks by all_reduce on the group, and its peer
// memory: mapped for the group ranks of this node, holding their world ranks.
Status check_group(Transport& group) {
  int64_t sum = group.world_rank(group.rank());
  EPX_RETURN_IF_ERROR(group.all_reduce(std::span<int64_t>(&sum, 1), ReduceOp::kSum, seconds(30)));
  int64_t want = 0;
  for (int r = 0; r < group.num_ranks(); ++r) want += group.world_rank(r);
  if (sum != want) return internal_error("all_reduce on the group: {}, want {}", sum, want);
  EPX_ASSIGN_OR_RETURN(auto memory, group.map_peer_memory(64, seconds(30)));
  const int32_t mine = group.world_rank(group.rank());
  std::memcpy(memory->local(), &mine, sizeof(mine));
  EPX_RETURN_IF_ERROR(group.barrier(seconds(30)));
  for (int r = 0; r < group.num_ranks(); ++r) {
    const std::byte* peer = memory->peer(r);
    if ((peer != nullptr) != group.topology().same_node(r, group.rank()))
      return internal_error("peer({}) is {}mapped", r, peer ? "" : "not ");
    int32_t seen = -1;
    if (peer) std::memcpy(&seen, peer, sizeof(seen));
    if (peer && seen != group.world_rank(r))
      return internal_error("the region of group rank {} holds {}, want {}", r, seen, group.world_rank(r));
  }
  // A ring of messages: each sends its world rank to the next group rank.
  const int next = (group.rank() + 1) % group.num_ranks();
  const int prev = (group.rank() + group.num_ranks() - 1) % group.num_ranks();
  EPX_ASSIGN_OR_RETURN(Request sent, group.send_async(next, 5, std::as_bytes(std::span(&mine, 1))));
  int32_t got = -1;
  EPX_RETURN_IF_ERROR(group.recv(prev, 5, std::as_writable_bytes(std::span(&got, 1)), seconds(30)).status());
  EPX_RETURN_IF_ERROR(sent.wait(seconds(30)));
  if (got != group.world_rank(prev)) return internal_error("got {} from group rank {}", got, prev);
  return group.barrier(seconds(30));
}

// Groups inside a node (color: node) and across nodes (color: local rank).
TEST(TransportGroups, InsideAndAcrossNodes) {
  const int R = test_ranks();
  const int nodes = R % 2 == 0 ? 2 : 1;
  auto statuses = run(R, nodes, [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto inside, t.split(t.node(), t.rank(), seconds(30)));
    EPX_ASSIGN_OR_RETURN(auto across, t.split(t.local_rank(), t.rank(), seconds(30)));
    if (inside->num_ranks() != t.topology().ranks_per_node() || inside->topology().num_nodes() != 1)
      return internal_error("the group of node {} is {}", t.node(), inside->topology().describe());
    if (across->num_ranks() != t.topology().num_nodes() || across->rank() != t.node())
      return internal_error("the group of local rank {} is {}; rank {} in it", t.local_rank(),
                            across->topology().describe(), across->rank());
    EPX_RETURN_IF_ERROR(check_group(*inside));
    EPX_RETURN_IF_ERROR(check_group(*across));
    return t.barrier(seconds(30));
  });
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
  }
}

// 8 ranks on 2 nodes, one group per node. World rank 5 (rank 1 of group 1)
// stalls past the deadline of its group's barrier: its group names it by
// world rank, and ranks blocked in the world (rank 0) and in the other group
// (ranks 1-3, waiting for rank 0) end at once, not at their own 20 s deadlines.
TEST(TransportGroups, AStallInAGroupEndsTheWorldsWaits) {
  EPX_SKIP_UNLESS_RUNNABLE(8, 2);
  std::vector<Status> result(8);
  std::vector<double> waited(8, 0.0);
  test_world().run(*Topology::create(8, 2), [&](Transport& t) -> Status {
    const int r = t.rank();
    auto group = t.split(t.node(), r, seconds(30));
    if (!group.is_ok()) return result[r] = group.status();
    const auto start = std::chrono::steady_clock::now();
    if (r == 5) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      result[r] = (*group)->barrier(seconds(20));
    } else if (t.node() == 1) {
      result[r] = (*group)->barrier(Deadline::after(std::chrono::milliseconds(300)));
    } else {
      result[r] = r == 0 ? t.barrier(seconds(20)) : (*group)->barrier(seconds(20));
    }
    waited[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return result[r];
  });
  for (int r = 0; r < 8; ++r) {
    if (!test_world().holds(r)) continue;
    SCOPED_TRACE(fmt::format("rank {}: {}", r, result[r].to_string()));
    const std::string& message = result[r].message();
    if (r == 4 || r == 6 || r == 7) {
      EXPECT_EQ(result[r].code(), StatusCode::kDeadlineExceeded);
      EXPECT_NE(message.find("rank 5 (rank 1 of the group) did not arrive"), std::string::npos);
    } else {
      EXPECT_TRUE(result[r].code() == StatusCode::kDeadlineExceeded || result[r].code() == StatusCode::kAborted);
      EXPECT_NE(message.find("rank 5 (rank 1 of the group)"), std::string::npos);
      EXPECT_LT(waited[r], r == 5 ? 10.0 : 8.5) << "waited for its own deadline instead of hearing of group 1's";
    }
  }
}

}  // namespace
}  // namespace epx

namespace epx {
namespace {

// MPI frees a shared window collectively: ranks that destroy their
// PeerMemory objects in different orders must get an error, not a hang or
// two mismatched frees. (In-process regions are reference-counted, so any
// order is fine there.)
TEST(Transport, PeerMemoryFreedInDifferentOrdersIsAnError) {
  EPX_NEED_RANKS(2);
  if (test_world().name() != "mpi") GTEST_SKIP() << "only the MPI backend frees peer memory collectively";
  const int R = test_ranks();
  auto statuses = run(R, 1, [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto a, t.map_peer_memory(64, seconds(30)));
    EPX_ASSIGN_OR_RETURN(auto b, t.map_peer_memory(64, seconds(30)));
    if (t.rank() % 2 == 0) {
      a.reset();
      b.reset();
    } else {
      b.reset();
      a.reset();
    }
    return t.barrier(seconds(30));
  });
  // A rank may hear of another node's mismatch before its own frees (still
  // in its second map_peer_memory): its run's status is the error then.
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    EXPECT_FALSE(statuses[r].is_ok()) << "rank " << r;
    EXPECT_NE(statuses[r].message().find("in the same order"), std::string::npos) << statuses[r].to_string();
  }
}

}  // namespace
}  // namespace epx
