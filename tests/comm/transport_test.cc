// The transport contract on whichever world the binary runs in: in-process
// threads (epx_comm_tests) or MPI processes (epx_mpi_tests under mpirun,
// one rank per process). Each test checks the ranks this process holds.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <numeric>
#include <string>
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
