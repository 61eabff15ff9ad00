#include "epx/comm/inproc.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <ostream>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/core/clock.h"
#include "comm/inproc_helpers.h"

namespace epx {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

using comm_test::generous;
using comm_test::make_topology;

void expect_all_ok(const std::vector<Status>& statuses) {
  const Status first = first_error(statuses);
  EXPECT_TRUE(first.is_ok()) << first.to_string();
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A wrong value inside a rank's function, as an error that run() reports.
template <typename T>
Status expect_eq(const T& got, const T& want, std::string_view what) {
  if (got == want) return Status::ok();
  return internal_error("{}: got {}, want {}", what, got, want);
}

// ---------------------------------------------------------------------------
// One tiny hand-checkable scenario.

TEST(Inproc, TwoRanksByHand) {
  std::vector<Status> statuses = run_ranks(make_topology(2), [](Transport& t) -> Status {
    const int64_t mine = 10 * (t.rank() + 1);
    std::vector<int64_t> all(2, -1);
    EPX_RETURN_IF_ERROR(t.all_gather(std::span<const int64_t>(&mine, 1), std::span<int64_t>(all), generous()));
    EPX_RETURN_IF_ERROR(expect_eq(all, std::vector<int64_t>{10, 20}, "all_gather"));
    int32_t sum = t.rank() + 1;
    EPX_RETURN_IF_ERROR(t.all_reduce(std::span<int32_t>(&sum, 1), ReduceOp::kSum, generous()));
    return expect_eq(sum, 3, "all_reduce sum");
  });
  expect_all_ok(statuses);
}

TEST(Inproc, IdentityAndBackendName) {
  const Topology topology = make_topology(8, 2);
  expect_all_ok(run_ranks(topology, [](Transport& t) -> Status {
    EPX_RETURN_IF_ERROR(expect_eq(std::string(t.backend_name()), std::string("inproc"), "backend_name"));
    EPX_RETURN_IF_ERROR(expect_eq(t.num_ranks(), 8, "num_ranks"));
    EPX_RETURN_IF_ERROR(expect_eq(t.node(), t.rank() / 4, "node"));
    return expect_eq(t.local_rank(), t.rank() % 4, "local_rank");
  }));
  InprocWorld world(topology);
  EXPECT_EQ(world.topology().describe(), "2 nodes x 4 ranks");
  EXPECT_EQ(world.connect(5)->rank(), 5);
}

TEST(Topology, CreateRejectsBadShapes) {
  Result<Topology> none = Topology::create(0);
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(none.status().message(), "num_ranks = 0 must be at least 1");

  Result<Topology> uneven = Topology::create(6, 4);
  ASSERT_FALSE(uneven.is_ok());
  EXPECT_EQ(uneven.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(uneven.status().message(), "num_ranks = 6 is not a multiple of num_nodes = 4");

  Result<Topology> no_nodes = Topology::create(4, 0);
  ASSERT_FALSE(no_nodes.is_ok());
  EXPECT_EQ(no_nodes.status().message(), "num_nodes = 0 must be at least 1");

  Result<Topology> ok = Topology::create(8, 2);
  ASSERT_TRUE(ok.is_ok());
  EXPECT_EQ(ok->rank_of(1, 1), 5);
  EXPECT_TRUE(ok->same_node(4, 7));
  EXPECT_FALSE(ok->same_node(3, 4));
}

TEST(Inproc, FirstErrorNamesTheRank) {
  EXPECT_TRUE(first_error({Status::ok(), Status::ok()}).is_ok());
  const Status first = first_error({Status::ok(), invalid_argument("x = 3"), aborted("later")});
  EXPECT_EQ(first.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(first.message(), "rank 1: x = 3");
}

// ---------------------------------------------------------------------------
// Collectives and peer memory, swept over world sizes and node shapes.

struct Shape {
  int num_ranks;
  int num_nodes;
};

void PrintTo(const Shape& shape, std::ostream* os) {
  *os << shape.num_nodes << " nodes x " << shape.num_ranks / shape.num_nodes << " ranks";
}

class InprocShapeTest : public ::testing::TestWithParam<Shape> {
 protected:
  [[nodiscard]] Topology topology() const { return make_topology(GetParam().num_ranks, GetParam().num_nodes); }
};

std::string shape_name(const ::testing::TestParamInfo<Shape>& info) {
  return fmt::format("{}x{}", info.param.num_nodes, info.param.num_ranks / info.param.num_nodes);
}

INSTANTIATE_TEST_SUITE_P(Shapes, InprocShapeTest,
                         ::testing::Values(Shape{1, 1}, Shape{2, 1}, Shape{3, 1}, Shape{4, 1}, Shape{8, 1},
                                           Shape{4, 2}, Shape{8, 2}),
                         shape_name);

TEST_P(InprocShapeTest, BarrierWaitsForEveryRank) {
  constexpr int kRounds = 20;
  std::atomic<int> arrived{0};
  const int num_ranks = GetParam().num_ranks;
  expect_all_ok(run_ranks(topology(), [&](Transport& t) -> Status {
    for (int round = 0; round < kRounds; ++round) {
      // Every rank's increment for this round happens before anyone leaves the barrier.
      if ((round + t.rank()) % 3 == 0) std::this_thread::yield();
      arrived.fetch_add(1);
      EPX_RETURN_IF_ERROR(t.barrier(generous()));
      const int seen = arrived.load();
      if (seen < (round + 1) * num_ranks)
        return internal_error("round {}: {} arrivals seen after the barrier, want at least {}", round, seen,
                              (round + 1) * num_ranks);
    }
    const TransportCounters c = t.counters();
    EPX_RETURN_IF_ERROR(expect_eq(c.collective_calls, uint64_t{kRounds}, "collective_calls"));
    return expect_eq(c.collective_bytes, uint64_t{0}, "collective_bytes");
  }));
}

TEST_P(InprocShapeTest, AllGatherValuesEncodeRank) {
  constexpr int kPerRank = 3;
  const int num_ranks = GetParam().num_ranks;
  expect_all_ok(run_ranks(topology(), [&](Transport& t) -> Status {
    std::vector<int64_t> in(kPerRank);
    for (int i = 0; i < kPerRank; ++i) in[i] = 1000 * t.rank() + i + 1;
    std::vector<int64_t> out(static_cast<std::size_t>(num_ranks * kPerRank), -1);
    EPX_RETURN_IF_ERROR(t.all_gather(std::span<const int64_t>(in), std::span<int64_t>(out), generous()));
    std::vector<int64_t> want(out.size());
    for (int r = 0; r < num_ranks; ++r)
      for (int i = 0; i < kPerRank; ++i) want[r * kPerRank + i] = 1000 * r + i + 1;
    EPX_RETURN_IF_ERROR(expect_eq(out, want, "all_gather"));
    EPX_RETURN_IF_ERROR(expect_eq(t.counters().collective_calls, uint64_t{1}, "collective_calls"));
    return expect_eq(t.counters().collective_bytes, uint64_t{kPerRank * sizeof(int64_t)}, "collective_bytes");
  }));
}

TEST_P(InprocShapeTest, AllToAllBlocksEncodeSourceAndDestination) {
  constexpr int kPerBlock = 2;
  const int num_ranks = GetParam().num_ranks;
  expect_all_ok(run_ranks(topology(), [&](Transport& t) -> Status {
    std::vector<int32_t> in(static_cast<std::size_t>(num_ranks * kPerBlock));
    for (int dst = 0; dst < num_ranks; ++dst)
      for (int i = 0; i < kPerBlock; ++i) in[dst * kPerBlock + i] = 10000 * t.rank() + 100 * dst + i;
    std::vector<int32_t> out(in.size(), -1);
    EPX_RETURN_IF_ERROR(t.all_to_all(std::span<const int32_t>(in), std::span<int32_t>(out), generous()));
    std::vector<int32_t> want(out.size());
    for (int src = 0; src < num_ranks; ++src)
      for (int i = 0; i < kPerBlock; ++i) want[src * kPerBlock + i] = 10000 * src + 100 * t.rank() + i;
    return expect_eq(out, want, "all_to_all");
  }));
}

// Values whose f32 sum depends on the order of the additions.
float f32_value(int rank, int i) {
  const float big = static_cast<float>((rank * 5 + i * 3) % 7 - 3) * 1.1e7f;
  return big + 0.37f * static_cast<float>(rank * 13 + i * 7 + 1);
}

TEST_P(InprocShapeTest, AllReduceF32IsExactInRankOrder) {
  constexpr int kCount = 17;
  const int num_ranks = GetParam().num_ranks;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
    std::vector<float> want(kCount);
    for (int i = 0; i < kCount; ++i) {
      float acc = f32_value(0, i);
      for (int r = 1; r < num_ranks; ++r) {
        const float v = f32_value(r, i);
        if (op == ReduceOp::kSum) acc = acc + v;
        if (op == ReduceOp::kMax) acc = std::max(acc, v);
        if (op == ReduceOp::kMin) acc = std::min(acc, v);
      }
      want[i] = acc;
    }
    ASSERT_TRUE(std::any_of(want.begin(), want.end(), [](float v) { return v != 0.0f; }));
    expect_all_ok(run_ranks(topology(), [&](Transport& t) -> Status {
      std::vector<float> data(kCount);
      for (int i = 0; i < kCount; ++i) data[i] = f32_value(t.rank(), i);
      EPX_RETURN_IF_ERROR(t.all_reduce(std::span<float>(data), op, generous()));
      for (int i = 0; i < kCount; ++i) {
        if (std::bit_cast<uint32_t>(data[i]) != std::bit_cast<uint32_t>(want[i]))
          return internal_error("op {}: data[{}] = {} (bits {:#x}), want {} (bits {:#x})", static_cast<int>(op), i,
                                data[i], std::bit_cast<uint32_t>(data[i]), want[i], std::bit_cast<uint32_t>(want[i]));
      }
      return expect_eq(t.counters().collective_bytes, uint64_t{kCount * sizeof(float)}, "collective_bytes");
    }));
  }
}

template <typename T>
void check_all_reduce(const Topology& topology, ReduceOp op) {
  constexpr int kCount = 5;
  const int num_ranks = topology.num_ranks();
  auto value = [](int rank, int i) { return static_cast<T>((rank * 37 + i * 11) % 23 - 11) * static_cast<T>(3); };
  std::vector<T> want(kCount);
  for (int i = 0; i < kCount; ++i) {
    T acc = value(0, i);
    for (int r = 1; r < num_ranks; ++r) {
      if (op == ReduceOp::kSum) acc = acc + value(r, i);
      if (op == ReduceOp::kMax) acc = std::max(acc, value(r, i));
      if (op == ReduceOp::kMin) acc = std::min(acc, value(r, i));
    }
    want[i] = acc;
  }
  expect_all_ok(run_ranks(topology, [&](Transport& t) -> Status {
    std::vector<T> data(kCount);
    for (int i = 0; i < kCount; ++i) data[i] = value(t.rank(), i);
    EPX_RETURN_IF_ERROR(t.all_reduce(std::span<T>(data), op, generous()));
    return expect_eq(data, want, fmt::format("all_reduce {} op {}", dtype_name(dtype_of<T>()), static_cast<int>(op)));
  }));
}

TEST_P(InprocShapeTest, AllReduceOtherTypes) {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
    check_all_reduce<double>(topology(), op);
    check_all_reduce<int32_t>(topology(), op);
    check_all_reduce<int64_t>(topology(), op);
  }
}

// Mixed collectives of varying sizes back to back, with ranks running at
// different paces, so a fast rank is often one collective ahead.
TEST_P(InprocShapeTest, RepeatedCollectivesStayCorrect) {
  constexpr int kIterations = 200;
  const int num_ranks = GetParam().num_ranks;
  expect_all_ok(run_ranks(topology(), [&](Transport& t) -> Status {
    const int me = t.rank();
    for (int it = 0; it < kIterations; ++it) {
      const int k = 1 + (it * 7 + 3) % 13;
      if ((it + me) % 5 == 0) std::this_thread::yield();
      const std::string what = fmt::format("iteration {}", it);
      switch (it % 4) {
        case 0: {
          std::vector<int64_t> in(k), out(static_cast<std::size_t>(k * num_ranks), -1), want(out.size());
          for (int i = 0; i < k; ++i) in[i] = int64_t{it} * 1000000 + me * 1000 + i;
          for (int r = 0; r < num_ranks; ++r)
            for (int i = 0; i < k; ++i) want[r * k + i] = int64_t{it} * 1000000 + r * 1000 + i;
          EPX_RETURN_IF_ERROR(t.all_gather(std::span<const int64_t>(in), std::span<int64_t>(out), generous()));
          EPX_RETURN_IF_ERROR(expect_eq(out, want, what));
          break;
        }
        case 1: {
          std::vector<int64_t> in(static_cast<std::size_t>(k * num_ranks)), out(in.size(), -1), want(in.size());
          for (int d = 0; d < num_ranks; ++d)
            for (int i = 0; i < k; ++i) {
              in[d * k + i] = int64_t{it} * 1000000 + me * 10000 + d * 100 + i;
              want[d * k + i] = int64_t{it} * 1000000 + d * 10000 + me * 100 + i;
            }
          EPX_RETURN_IF_ERROR(t.all_to_all(std::span<const int64_t>(in), std::span<int64_t>(out), generous()));
          EPX_RETURN_IF_ERROR(expect_eq(out, want, what));
          break;
        }
        case 2: {
          std::vector<int64_t> data(k), want(k);
          for (int i = 0; i < k; ++i) {
            data[i] = int64_t{it} * 100 + me * i;
            want[i] = int64_t{it} * 100 * num_ranks + int64_t{i} * num_ranks * (num_ranks - 1) / 2;
          }
          EPX_RETURN_IF_ERROR(t.all_reduce(std::span<int64_t>(data), ReduceOp::kSum, generous()));
          EPX_RETURN_IF_ERROR(expect_eq(data, want, what));
          break;
        }
        default:
          EPX_RETURN_IF_ERROR(t.barrier(generous()));
      }
    }
    return Status::ok();
  }));
}

TEST_P(InprocShapeTest, PeerMemoryIsSharedWithinANode) {
  const Topology topo = topology();
  const int ranks_per_node = topo.ranks_per_node();
  constexpr std::size_t kSlot = 64;  // bytes each writer owns in a region
  const std::size_t bytes = kSlot * static_cast<std::size_t>(ranks_per_node) + 100;  // not a multiple of 64
  auto pattern = [](int writer, int owner, int i) { return int64_t{writer} * 1000000 + owner * 1000 + i; };
  expect_all_ok(run_ranks(topo, [&](Transport& t) -> Status {
    const int me = t.rank();
    EPX_ASSIGN_OR_RETURN(std::unique_ptr<PeerMemory> memory, t.map_peer_memory(bytes, generous()));
    EPX_RETURN_IF_ERROR(expect_eq(memory->size(), bytes, "size"));
    std::byte* local = memory->local();
    if (local == nullptr || reinterpret_cast<uintptr_t>(local) % 64 != 0)
      return internal_error("local() = {} is not 64-byte aligned", fmt::ptr(local));
    if (memory->peer(me) != local) return internal_error("peer({}) is not local()", me);
    if (memory->peer(-1) != nullptr || memory->peer(t.num_ranks()) != nullptr)
      return internal_error("peer() outside [0, num_ranks) is not nullptr");
    for (int r = 0; r < t.num_ranks(); ++r) {
      std::byte* region = memory->peer(r);
      if (topo.same_node(me, r) != (region != nullptr))
        return internal_error("peer({}) = {} on rank {} (same node: {})", r, fmt::ptr(region), me,
                              topo.same_node(me, r));
      if (r != me && region == local) return internal_error("peer({}) aliases rank {}'s region", r, me);
    }
    // Write this rank's slot in every same-node peer's region.
    for (int owner = 0; owner < t.num_ranks(); ++owner) {
      std::byte* region = memory->peer(owner);
      if (region == nullptr) continue;
      int64_t* slot = reinterpret_cast<int64_t*>(region + kSlot * static_cast<std::size_t>(t.local_rank()));
      for (int i = 0; i < 8; ++i) slot[i] = pattern(me, owner, i);
    }
    EPX_RETURN_IF_ERROR(t.barrier(generous()));
    for (int local_writer = 0; local_writer < ranks_per_node; ++local_writer) {
      const int writer = topo.rank_of(t.node(), local_writer);
      const int64_t* slot = reinterpret_cast<const int64_t*>(local + kSlot * static_cast<std::size_t>(local_writer));
      for (int i = 0; i < 8; ++i)
        EPX_RETURN_IF_ERROR(expect_eq(slot[i], pattern(writer, me, i), fmt::format("slot of rank {}", writer)));
    }
    // Nobody writes the tail: still zero-filled.
    for (std::size_t b = kSlot * static_cast<std::size_t>(ranks_per_node); b < bytes; ++b)
      EPX_RETURN_IF_ERROR(expect_eq(static_cast<int>(local[b]), 0, fmt::format("tail byte {}", b)));
    return t.barrier(generous());  // peers are done reading before anyone lets go
  }));
}

// Regions are refcounted: a PeerMemory keeps its node's regions alive after
// the world and the other ranks' PeerMemory objects are gone.
TEST(InprocPeerMemory, OutlivesTheWorld) {
  std::vector<std::unique_ptr<PeerMemory>> first(4), second(4);
  {
    InprocWorld world(make_topology(4, 2));
    expect_all_ok(world.run([&](Transport& t) -> Status {
      EPX_ASSIGN_OR_RETURN(first[t.rank()], t.map_peer_memory(256, generous()));
      first[t.rank()]->local()[0] = static_cast<std::byte>(0x50 + t.rank());
      EPX_RETURN_IF_ERROR(t.barrier(generous()));
      EPX_ASSIGN_OR_RETURN(second[t.rank()], t.map_peer_memory(256, generous()));
      return Status::ok();
    }));
  }
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(second[r]->local(), first[r]->local());
    EXPECT_EQ(second[r]->local()[0], std::byte{0}) << "a new mapping is zero-filled";
  }
  first[0].reset();
  second[0].reset();
  ASSERT_NE(first[1]->peer(0), nullptr);
  EXPECT_EQ(first[1]->peer(0)[0], std::byte{0x50});  // rank 0's region, still alive
  first[1]->peer(0)[1] = std::byte{7};
  EXPECT_EQ(first[1]->peer(0)[1], std::byte{7});
  EXPECT_EQ(first[3]->peer(2)[0], std::byte{0x52});
  EXPECT_EQ(first[3]->peer(1), nullptr);
}

TEST_P(InprocShapeTest, MessagesAroundARing) {
  constexpr int kRounds = 10;
  expect_all_ok(run_ranks(topology(), [&](Transport& t) -> Status {
    const int n = t.num_ranks();
    const int next = (t.rank() + 1) % n;
    const int prev = (t.rank() + n - 1) % n;
    for (int round = 0; round < kRounds; ++round) {
      const std::vector<int32_t> mine = {t.rank(), round, 7 * t.rank() + round};
      EPX_ASSIGN_OR_RETURN(Request request, t.send_async(next, /*tag=*/round % 3, std::as_bytes(std::span(mine))));
      std::vector<int32_t> got(3, -1);
      EPX_ASSIGN_OR_RETURN(std::size_t size,
                           t.recv(prev, round % 3, std::as_writable_bytes(std::span(got)), generous()));
      EPX_RETURN_IF_ERROR(expect_eq(size, sizeof(int32_t) * 3, "size"));
      EPX_RETURN_IF_ERROR(expect_eq(got, std::vector<int32_t>{prev, round, 7 * prev + round}, "ring payload"));
      EPX_RETURN_IF_ERROR(request.wait(generous()));
    }
    return Status::ok();
  }));
}

// Every rank sends kBytes to every other rank; messages across emulated
// nodes are counted as inter-node, the rest as intra-node.
TEST_P(InprocShapeTest, MessageCountersSplitByNode) {
  constexpr std::size_t kBytes = 4096 + 8;
  const Topology topo = topology();
  const int n = topo.num_ranks();
  InprocWorld world(topo);
  expect_all_ok(world.run([&](Transport& t) -> Status {
    std::vector<std::byte> payload(kBytes);
    for (std::size_t i = 0; i < kBytes; ++i) payload[i] = static_cast<std::byte>((t.rank() * 31 + i) & 0xff);
    std::vector<Request> requests;
    for (int peer = 0; peer < n; ++peer) {
      if (peer == t.rank()) continue;
      EPX_ASSIGN_OR_RETURN(Request request, t.send_async(peer, /*tag=*/1, payload));
      requests.push_back(std::move(request));
    }
    std::vector<std::byte> got(kBytes);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == t.rank()) continue;
      EPX_ASSIGN_OR_RETURN(std::size_t size, t.recv(peer, 1, got, generous()));
      EPX_RETURN_IF_ERROR(expect_eq(size, kBytes, "size"));
      for (std::size_t i = 0; i < kBytes; ++i)
        if (got[i] != static_cast<std::byte>((peer * 31 + i) & 0xff))
          return internal_error("byte {} from rank {} is wrong", i, peer);
    }
    for (Request& request : requests) EPX_RETURN_IF_ERROR(request.wait(generous()));
    const TransportCounters mine = t.counters();
    const uint64_t other_nodes = static_cast<uint64_t>(n - topo.ranks_per_node());
    EPX_RETURN_IF_ERROR(expect_eq(mine.inter_node_messages, other_nodes, "inter_node_messages"));
    return expect_eq(mine.intra_node_messages, static_cast<uint64_t>(topo.ranks_per_node() - 1), "intra_node_messages");
  }));
  const TransportCounters total = world.total_counters();
  const uint64_t inter_pairs = static_cast<uint64_t>(n) * static_cast<uint64_t>(n - topo.ranks_per_node());
  const uint64_t intra_pairs = static_cast<uint64_t>(n) * static_cast<uint64_t>(topo.ranks_per_node() - 1);
  EXPECT_EQ(total.inter_node_bytes, inter_pairs * kBytes);
  EXPECT_EQ(total.inter_node_messages, inter_pairs);
  EXPECT_EQ(total.intra_node_bytes, intra_pairs * kBytes);
  EXPECT_EQ(total.intra_node_messages, intra_pairs);
  EXPECT_EQ(total.collective_calls, 0u);

  // reset_counters() zeroes the calling rank's counters only.
  expect_all_ok(world.run([&](Transport& t) -> Status {
    if (t.rank() == 0) t.reset_counters();
    return Status::ok();
  }));
  const TransportCounters after = world.total_counters();
  const uint64_t rank0_inter = static_cast<uint64_t>(n - topo.ranks_per_node()) * kBytes;
  EXPECT_EQ(after.inter_node_bytes, inter_pairs * kBytes - rank0_inter);
}

// ---------------------------------------------------------------------------
// Messages.

TEST(InprocMessages, PingPong) {
  constexpr int kRounds = 50;
  expect_all_ok(run_ranks(make_topology(4, 2), [](Transport& t) -> Status {
    const int last = t.num_ranks() - 1;
    if (t.rank() != 0 && t.rank() != last) return Status::ok();
    const int other = t.rank() == 0 ? last : 0;
    int64_t value = 0;
    for (int round = 0; round < kRounds; ++round) {
      if (t.rank() == 0) {
        value = 2 * round;
        EPX_RETURN_IF_ERROR(t.send(other, 0, std::as_bytes(std::span(&value, 1)), generous()));
        EPX_ASSIGN_OR_RETURN(std::size_t size, t.recv(other, 0, std::as_writable_bytes(std::span(&value, 1)), generous()));
        EPX_RETURN_IF_ERROR(expect_eq(size, sizeof(value), "size"));
        EPX_RETURN_IF_ERROR(expect_eq(value, int64_t{2 * round + 1}, "pong"));
      } else {
        EPX_ASSIGN_OR_RETURN(std::size_t size, t.recv(other, 0, std::as_writable_bytes(std::span(&value, 1)), generous()));
        EPX_RETURN_IF_ERROR(expect_eq(size, sizeof(value), "size"));
        EPX_RETURN_IF_ERROR(expect_eq(value, int64_t{2 * round}, "ping"));
        ++value;
        EPX_RETURN_IF_ERROR(t.send(other, 0, std::as_bytes(std::span(&value, 1)), generous()));
      }
    }
    return Status::ok();
  }));
}

TEST(InprocMessages, SameTagArrivesInOrder) {
  constexpr int kMessages = 20;
  expect_all_ok(run_ranks(make_topology(2), [](Transport& t) -> Status {
    if (t.rank() == 0) {
      std::vector<std::vector<int32_t>> payloads(kMessages);
      std::vector<Request> requests;
      for (int m = 0; m < kMessages; ++m) {
        payloads[m].assign(static_cast<std::size_t>(1 + m % 5), 100 * m);
        EPX_ASSIGN_OR_RETURN(Request request, t.send_async(1, 3, std::as_bytes(std::span(payloads[m]))));
        requests.push_back(std::move(request));
      }
      for (Request& request : requests) EPX_RETURN_IF_ERROR(request.wait(generous()));
      return Status::ok();
    }
    for (int m = 0; m < kMessages; ++m) {
      std::vector<int32_t> got(8, -1);
      EPX_ASSIGN_OR_RETURN(std::size_t size, t.recv(0, 3, std::as_writable_bytes(std::span(got)), generous()));
      EPX_RETURN_IF_ERROR(expect_eq(size, sizeof(int32_t) * (1 + m % 5), fmt::format("size of message {}", m)));
      EPX_RETURN_IF_ERROR(expect_eq(got[0], 100 * m, fmt::format("message {}", m)));
    }
    return Status::ok();
  }));
}

TEST(InprocMessages, TagsAreIndependent) {
  expect_all_ok(run_ranks(make_topology(2), [](Transport& t) -> Status {
    if (t.rank() == 0) {
      const int32_t first = 111;
      const int32_t second = 222;
      EPX_ASSIGN_OR_RETURN(Request a, t.send_async(1, /*tag=*/1, std::as_bytes(std::span(&first, 1))));
      EPX_ASSIGN_OR_RETURN(Request b, t.send_async(1, /*tag=*/2, std::as_bytes(std::span(&second, 1))));
      EPX_RETURN_IF_ERROR(b.wait(generous()));
      return a.wait(generous());
    }
    int32_t got = 0;
    EPX_ASSIGN_OR_RETURN(std::size_t first_size, t.recv(0, 2, std::as_writable_bytes(std::span(&got, 1)), generous()));
    EPX_RETURN_IF_ERROR(expect_eq(first_size, sizeof(int32_t), "size"));
    EPX_RETURN_IF_ERROR(expect_eq(got, 222, "tag 2"));
    EPX_ASSIGN_OR_RETURN(std::size_t size, t.recv(0, 1, std::as_writable_bytes(std::span(&got, 1)), generous()));
    EPX_RETURN_IF_ERROR(expect_eq(size, sizeof(int32_t), "size"));
    return expect_eq(got, 111, "tag 1");
  }));
}

TEST(InprocMessages, LargeMessage) {
  static constexpr std::size_t kBytes = std::size_t{8} << 20;
  expect_all_ok(run_ranks(make_topology(2, 2), [](Transport& t) -> Status {
    if (t.rank() == 0) {
      std::vector<uint32_t> payload(kBytes / 4);
      for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint32_t>(i * 2654435761u);
      return t.send(1, 9, std::as_bytes(std::span(payload)), generous());
    }
    std::vector<uint32_t> got(kBytes / 4 + 16, 0);
    EPX_ASSIGN_OR_RETURN(std::size_t size, t.recv(0, 9, std::as_writable_bytes(std::span(got)), generous()));
    EPX_RETURN_IF_ERROR(expect_eq(size, kBytes, "size"));
    for (std::size_t i = 0; i < kBytes / 4; ++i)
      if (got[i] != static_cast<uint32_t>(i * 2654435761u)) return internal_error("word {} is wrong", i);
    return expect_eq(t.counters().inter_node_bytes, uint64_t{0}, "receiver's inter_node_bytes");
  }));
}

TEST(InprocMessages, TooSmallBufferIsResourceExhaustedOnBothSides) {
  Status send_status, recv_status;
  expect_all_ok(run_ranks(make_topology(2), [&](Transport& t) -> Status {
    if (t.rank() == 0) {
      std::vector<std::byte> big(100, std::byte{1});
      std::vector<std::byte> small(10, std::byte{2});
      send_status = t.send(1, 4, big, generous());
      return t.send(1, 4, small, generous());  // the FIFO goes on after a dropped message
    }
    std::vector<std::byte> out(64);
    recv_status = t.recv(0, 4, out, generous()).status();
    EPX_ASSIGN_OR_RETURN(std::size_t size, t.recv(0, 4, out, generous()));
    EPX_RETURN_IF_ERROR(expect_eq(size, std::size_t{10}, "size of the next message"));
    return expect_eq(static_cast<int>(out[0]), 2, "next message");
  }));
  EXPECT_EQ(recv_status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(recv_status.message(),
            "message from rank 0 with tag 4 is 100 bytes but out holds 64 bytes; the message was dropped");
  EXPECT_EQ(send_status.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(contains(send_status.message(), "is 100 bytes but the receiver's buffer holds 64 bytes"))
      << send_status.message();
}

TEST(InprocMessages, BadPeerOrTagIsInvalidArgument) {
  expect_all_ok(run_ranks(make_topology(3), [](Transport& t) -> Status {
    const std::byte b{0};
    std::byte out{0};
    const Status too_high = t.send_async(3, 0, std::span(&b, 1)).status();
    EPX_RETURN_IF_ERROR(expect_eq(too_high.to_string(), std::string("InvalidArgument: peer = 3 is outside [0, 3)"),
                                  "send to 3"));
    const Status negative = t.recv(-1, 0, std::span(&out, 1), generous()).status();
    EPX_RETURN_IF_ERROR(expect_eq(negative.message(), std::string("peer = -1 is outside [0, 3)"), "recv from -1"));
    const Status tag = t.send_async(0, -2, std::span(&b, 1)).status();
    EPX_RETURN_IF_ERROR(expect_eq(tag.message(), std::string("tag = -2 must be at least 0"), "tag -2"));
    return t.barrier(generous());  // bad arguments do not poison the world
  }));
}

TEST(InprocMessages, SendToSelf) {
  expect_all_ok(run_ranks(make_topology(1), [](Transport& t) -> Status {
    const int64_t value = 42;
    EPX_ASSIGN_OR_RETURN(Request request, t.send_async(0, 0, std::as_bytes(std::span(&value, 1))));
    int64_t got = 0;
    EPX_ASSIGN_OR_RETURN(std::size_t size, t.recv(0, 0, std::as_writable_bytes(std::span(&got, 1)), generous()));
    EPX_RETURN_IF_ERROR(request.wait(generous()));
    EPX_RETURN_IF_ERROR(expect_eq(size, sizeof(value), "size"));
    EPX_RETURN_IF_ERROR(expect_eq(got, value, "value"));
    return expect_eq(t.counters().intra_node_bytes, uint64_t{sizeof(value)}, "intra_node_bytes");
  }));
}

// ---------------------------------------------------------------------------
// Failures: deadlines, aborts, mismatched arguments.

// Each waiting rank has its own deadline; whichever passes first, every rank
// stalled by the absent one reports DeadlineExceeded, not Aborted.
TEST(InprocFailure, MissingRankMakesBarrierTimeOut) {
  Stopwatch watch;
  std::vector<Status> statuses = run_ranks(make_topology(4), [&](Transport& t) -> Status {
    if (t.rank() == 0) return Status::ok();  // never arrives
    if (t.rank() == 2) std::this_thread::sleep_for(milliseconds(20));
    return t.barrier(Deadline::after(milliseconds(200)));
  });
  EXPECT_LT(watch.seconds(), 5.0);  // no hang; not a speed test
  EXPECT_TRUE(statuses[0].is_ok());
  for (int r = 1; r < 4; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kDeadlineExceeded) << statuses[r].to_string();
    EXPECT_TRUE(contains(statuses[r].message(), fmt::format("rank {} waited", r))) << statuses[r].message();
    EXPECT_TRUE(contains(statuses[r].message(), "in barrier #1")) << statuses[r].message();
    EXPECT_TRUE(contains(statuses[r].message(), "rank 0 did not arrive (ranks 1, 2, 3 waited)")) << statuses[r].message();
  }
}

TEST(InprocFailure, FailingRankAbortsBlockedPeers) {
  Stopwatch watch;
  std::vector<Status> statuses = run_ranks(make_topology(4, 2), [](Transport& t) -> Status {
    if (t.rank() == 2) return invalid_argument("rank 2 rejects its input");
    if (t.rank() == 0) {
      std::byte out{};
      return t.recv(2, 0, std::span(&out, 1), Deadline::after(seconds(30))).status();
    }
    return t.barrier(Deadline::after(seconds(30)));
  });
  EXPECT_LT(watch.seconds(), 10.0);  // far below the 30 s deadline: woken by the abort
  EXPECT_EQ(statuses[2].code(), StatusCode::kInvalidArgument);
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kAborted) << statuses[r].to_string();
    EXPECT_TRUE(contains(statuses[r].message(), "rank 2 failed: InvalidArgument: rank 2 rejects its input"))
        << statuses[r].message();
  }
  EXPECT_TRUE(contains(statuses[0].message(), "recv from rank 2 with tag 0 on rank 0 aborted"))
      << statuses[0].message();
}

TEST(InprocFailure, ExceptionBecomesInternalAndAbortsPeers) {
  std::vector<Status> statuses = run_ranks(make_topology(3), [](Transport& t) -> Status {
    if (t.rank() == 1) throw std::runtime_error("boom");
    return t.barrier(Deadline::after(seconds(30)));
  });
  EXPECT_EQ(statuses[1].code(), StatusCode::kInternal);
  EXPECT_EQ(statuses[1].message(), "rank 1 threw an exception: boom");
  EXPECT_EQ(statuses[0].code(), StatusCode::kAborted) << statuses[0].to_string();
  EXPECT_EQ(statuses[2].code(), StatusCode::kAborted) << statuses[2].to_string();
  const Status first = first_error(statuses);
  EXPECT_EQ(first.code(), StatusCode::kAborted);
  EXPECT_TRUE(contains(first.message(), "rank 0: barrier #1 on rank 0 aborted: rank 1 failed")) << first.message();
}

TEST(InprocFailure, EveryCallAfterAnAbortReturnsAborted) {
  InprocWorld world(make_topology(3));
  std::vector<Status> statuses = world.run([](Transport& t) -> Status {
    EPX_RETURN_IF_ERROR(t.barrier(generous()));
    if (t.rank() == 0) t.abort(internal_error("injected failure"));
    std::vector<Status> later;
    later.push_back(t.barrier(generous()));
    int64_t v = 1, all[3];
    later.push_back(t.all_gather(std::span<const int64_t>(&v, 1), std::span<int64_t>(all), generous()));
    later.push_back(t.all_reduce(std::span<int64_t>(&v, 1), ReduceOp::kMax, generous()));
    later.push_back(t.map_peer_memory(64, generous()).status());
    later.push_back(t.send_async((t.rank() + 1) % 3, 0, std::as_bytes(std::span(&v, 1))).status());
    later.push_back(t.recv((t.rank() + 2) % 3, 0, std::as_writable_bytes(std::span(&v, 1)), generous()).status());
    for (const Status& s : later) {
      if (s.code() != StatusCode::kAborted || !contains(s.message(), "Internal: injected failure"))
        return internal_error("after the abort got {}", s.to_string());
    }
    return Status::ok();
  });
  expect_all_ok(statuses);
  // The world stays poisoned for later runs.
  statuses = world.run([](Transport& t) -> Status { return t.barrier(generous()); });
  for (const Status& s : statuses) EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
}

TEST(InprocFailure, RecvWithNoSenderTimesOut) {
  Status recv_status, later;
  std::vector<Status> statuses = run_ranks(make_topology(2), [&](Transport& t) -> Status {
    if (t.rank() == 0) return Status::ok();
    std::byte out{};
    recv_status = t.recv(0, 5, std::span(&out, 1), Deadline::after(milliseconds(200))).status();
    later = t.barrier(generous());
    return Status::ok();
  });
  expect_all_ok(statuses);
  EXPECT_EQ(recv_status.code(), StatusCode::kDeadlineExceeded) << recv_status.to_string();
  EXPECT_TRUE(contains(recv_status.message(), "in recv from rank 0 with tag 5; no message arrived"))
      << recv_status.message();
  EXPECT_EQ(later.code(), StatusCode::kAborted);
  EXPECT_TRUE(contains(later.message(), "barrier #1 on rank 1 aborted: DeadlineExceeded: rank 1 waited"))
      << later.message();
}

TEST(InprocFailure, SendWithNoReceiverTimesOut) {
  std::vector<Status> statuses = run_ranks(make_topology(2), [](Transport& t) -> Status {
    if (t.rank() == 1) return Status::ok();
    const int32_t v = 7;
    return t.send(1, 2, std::as_bytes(std::span(&v, 1)), Deadline::after(milliseconds(200)));
  });
  EXPECT_EQ(statuses[0].code(), StatusCode::kDeadlineExceeded) << statuses[0].to_string();
  EXPECT_TRUE(contains(statuses[0].message(), "in send to rank 1 with tag 2 (4 bytes)")) << statuses[0].message();
}

TEST(InprocFailure, MismatchedAllGatherSizesOnEveryRank) {
  std::vector<Status> got(3);
  expect_all_ok(run_ranks(make_topology(3), [&](Transport& t) -> Status {
    const std::size_t per_rank = t.rank() == 1 ? 2 : 1;
    std::vector<int64_t> in(per_rank, 5), out(per_rank * 3);
    got[t.rank()] = t.all_gather(std::span<const int64_t>(in), std::span<int64_t>(out), generous());
    return t.barrier(generous());  // a consistent rejection does not poison the world
  }));
  for (const Status& s : got) {
    EXPECT_EQ(s.to_string(),
              "InvalidArgument: all_gather_bytes #1: rank 0 passed 8 bytes but rank 1 passed 16 bytes; every rank "
              "must pass the same size");
  }
}

TEST(InprocFailure, MismatchedArgumentsOnEveryRank) {
  std::vector<std::vector<Status>> got(4);
  expect_all_ok(run_ranks(make_topology(4, 2), [&](Transport& t) -> Status {
    std::vector<Status>& mine = got[t.rank()];
    // all_to_all: rank 3's out is one block short.
    std::vector<int32_t> in(4, 1), out(t.rank() == 3 ? 3 : 4);
    mine.push_back(t.all_to_all(std::span<const int32_t>(in), std::span<int32_t>(out), generous()));
    // all_reduce: rank 2 passes one element more.
    std::vector<float> data(t.rank() == 2 ? 3 : 2, 1.0f);
    mine.push_back(t.all_reduce(std::span<float>(data), ReduceOp::kSum, generous()));
    // all_reduce of an unsupported dtype.
    uint16_t half[2] = {0, 0};
    mine.push_back(t.all_reduce_raw(half, 2, DType::kBF16, ReduceOp::kSum, generous()));
    // map_peer_memory: rank 1 asks for more.
    mine.push_back(t.map_peer_memory(t.rank() == 1 ? 256 : 128, generous()).status());
    // Different collectives.
    if (t.rank() == 0) {
      mine.push_back(t.barrier(generous()));
    } else {
      int64_t v = 0, all[4];
      mine.push_back(t.all_gather(std::span<const int64_t>(&v, 1), std::span<int64_t>(all), generous()));
    }
    return t.barrier(generous());
  }));
  const std::vector<std::string> want = {
      "all_to_all_bytes #1: rank 3 passed in of 16 bytes and out of 12 bytes; they must be equal and a multiple of "
      "num_ranks = 4",
      "all_reduce_raw #2: rank 0 passed 2 elements but rank 2 passed 3; every rank must pass the same count",
      "all_reduce_raw #3: dtype bf16 cannot be reduced; use f32, f64, i32 or i64",
      "map_peer_memory #4: rank 0 asked for 128 bytes but rank 1 asked for 256 bytes; every rank must ask for the "
      "same size",
      "collective #5: rank 0 called barrier but rank 1 called all_gather_bytes; every rank must call the "
      "collectives in the same order",
  };
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(got[r].size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[r][i].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << got[r][i].to_string();
      EXPECT_EQ(got[r][i].message(), want[i]) << "rank " << r;
    }
  }
}

TEST(Inproc, WorldRunsSeveralTimes) {
  InprocWorld world(make_topology(4, 2));
  for (int run = 0; run < 3; ++run) {
    expect_all_ok(world.run([&](Transport& t) -> Status {
      int64_t v = t.rank() + run;
      EPX_RETURN_IF_ERROR(t.all_reduce(std::span<int64_t>(&v, 1), ReduceOp::kSum, generous()));
      return expect_eq(v, int64_t{6 + 4 * run}, "sum");
    }));
  }
  EXPECT_EQ(world.total_counters().collective_calls, 12u);
  EXPECT_EQ(world.total_counters().collective_bytes, 12u * sizeof(int64_t));
}

}  // namespace
}  // namespace epx
