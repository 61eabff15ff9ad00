// Who waited for whom (WaitRecord): a delay injected on one rank is
// attributed to that rank, as an arrival wait when the rank comes late to the
// operations, as a data wait when its rows leave late (its link is slow).
// The delays are real sleeps; the bounds leave 20 ms of a 100 ms delay to a
// busy machine's scheduling.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "epx/comm/inproc.h"
#include "epx/comm/topology.h"
#include "epx/exchange/buffer.h"

namespace epx {
namespace {

constexpr int kRanks = 4;
constexpr int kHidden = 16;
constexpr int kTokens = 8;
constexpr auto kDelay = std::chrono::milliseconds(100);
constexpr double kAttributed = 0.080;  // at least this much of kDelay lands on the delayed rank
constexpr double kSmall = 0.040;       // no other wait comes near the delay

// A transport whose inter-node messages from one rank leave `delay` late: a
// slow link of that rank, below the exchange (which does not know).
class SlowLinkTransport final : public Transport {
 public:
  SlowLinkTransport(std::unique_ptr<Transport> inner, int slow_rank, std::chrono::milliseconds delay)
      : inner_(std::move(inner)), slow_rank_(slow_rank), delay_(delay) {}
  int rank() const override { return inner_->rank(); }
  const Topology& topology() const override { return inner_->topology(); }
  std::string_view backend_name() const override { return "slow-link"; }
  Result<std::unique_ptr<PeerMemory>> map_peer_memory(std::size_t bytes, const Deadline& deadline) override {
    return inner_->map_peer_memory(bytes, deadline);
  }
  Result<Request> send_async(int peer, int tag, std::span<const std::byte> data) override {
    if (rank() == slow_rank_ && !topology().same_node(peer, rank())) std::this_thread::sleep_for(delay_);
    return inner_->send_async(peer, tag, data);
  }
  Result<std::size_t> recv(int peer, int tag, std::span<std::byte> out, const Deadline& deadline) override {
    return inner_->recv(peer, tag, out, deadline);
  }
  Status barrier(const Deadline& deadline) override { return inner_->barrier(deadline); }
  Status all_gather_bytes(std::span<const std::byte> in, std::span<std::byte> out, const Deadline& deadline) override {
    return inner_->all_gather_bytes(in, out, deadline);
  }
  Status all_to_all_bytes(std::span<const std::byte> in, std::span<std::byte> out, const Deadline& deadline) override {
    return inner_->all_to_all_bytes(in, out, deadline);
  }
  Status all_reduce_raw(void* data, std::size_t count, DType dtype, ReduceOp op, const Deadline& deadline) override {
    return inner_->all_reduce_raw(data, count, dtype, op, deadline);
  }
  void abort(const Status& reason) override { inner_->abort(reason); }
  TransportCounters counters() const override { return inner_->counters(); }
  void reset_counters() override { inner_->reset_counters(); }

 private:
  std::unique_ptr<Transport> inner_;
  int slow_rank_;
  std::chrono::milliseconds delay_;
};

// Every token goes to every rank (one expert per rank), so every rank waits
// on every other's rows.
struct Inputs {
  std::vector<float> x = std::vector<float>(kTokens * kHidden, 1.0f);
  std::vector<int32_t> idx;
  std::vector<float> weights;
  std::vector<float> y, out = std::vector<float>(kTokens * kHidden);
  Inputs() {
    for (int t = 0; t < kTokens; ++t)
      for (int e = 0; e < kRanks; ++e) {
        idx.push_back(e);
        weights.push_back(0.25f);
      }
  }
  DispatchInputs dispatch() {
    return {.x = TensorView::contiguous(x.data(), DType::kF32, {kTokens, kHidden}),
            .topk_idx = TensorView::contiguous(idx.data(), DType::kI32, {kTokens, kRanks}),
            .topk_weights = TensorView::contiguous(weights.data(), DType::kF32, {kTokens, kRanks})};
  }
};

BufferConfig config(DispatchAlgorithm algorithm = DispatchAlgorithm::kAuto, bool record = true) {
  return {.num_experts = kRanks, .hidden = kHidden, .dtype = DType::kF32, .max_topk = kRanks,
          .max_tokens_per_rank = kTokens, .algorithm = algorithm, .timeout = Milliseconds(20000),
          .record_waits = record};
}

double max_except(const std::vector<double>& v, int skip) {
  double m = 0;
  for (std::size_t s = 0; s < v.size(); ++s)
    if (static_cast<int>(s) != skip) m = std::max(m, v[s]);
  return m;
}

// One dispatch (its record checked by `check`) and one weighted combine.
Status dispatch_and_combine(Buffer& buffer, Inputs& in, DispatchResult* recv) {
  EPX_RETURN_IF_ERROR(buffer.dispatch(in.dispatch(), recv));
  const int64_t rows = recv->recv_x.size(0);
  in.y.assign(static_cast<std::size_t>(rows) * kHidden, 1.0f);
  return buffer.combine(TensorView::contiguous(in.y.data(), DType::kF32, {rows, kHidden}), recv->handle,
                        TensorView::contiguous(in.out.data(), DType::kF32, {kTokens, kHidden}));
}

TEST(Waits, ALateRankIsAnArrivalWaitOfEveryOther) {
  constexpr int kLate = 2, kRounds = 3;
  auto topology = Topology::create(kRanks, 1);
  ASSERT_TRUE(topology.is_ok());
  std::vector<WaitRecord> sums(kRanks);
  std::vector<std::vector<WaitRecord>> per_dispatch(kRanks);
  EXPECT_TRUE(first_error(run_ranks(*topology, [&](Transport& t) -> Status {
                EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config()));
                Inputs in;
                DispatchResult recv;
                for (int i = 0; i < kRounds; ++i) {
                  if (t.rank() == kLate) std::this_thread::sleep_for(kDelay);
                  EPX_RETURN_IF_ERROR(dispatch_and_combine(*buffer, in, &recv));
                  per_dispatch[t.rank()].push_back(recv.stats.waits);
                }
                buffer->take_waits(&sums[t.rank()]);
                return Status::ok();
              })).is_ok());
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(r);
    for (const WaitRecord& w : per_dispatch[r]) {
      ASSERT_EQ(w.arrival.size(), static_cast<std::size_t>(kRanks));
      EXPECT_EQ(w.num_ops, 1);
      EXPECT_EQ(w.arrival[r], 0.0);  // never itself
      if (r != kLate) EXPECT_GE(w.arrival[kLate], kAttributed);
      EXPECT_LT(max_except(w.arrival, kLate), kSmall);
      EXPECT_LT(max_except(w.data, -1), kSmall);
      for (int s = 0; s < kRanks; ++s) EXPECT_GE(w.blocked, (w.arrival[s] + w.data[s]) * (1 - 1e-12));
    }
    // The sum covers the dispatches and the combines.
    EXPECT_EQ(sums[r].num_ops, 2 * kRounds);
    if (r != kLate) EXPECT_GE(sums[r].arrival[kLate], kRounds * kAttributed);
    EXPECT_GE(sums[r].blocked, sums[r].arrival[kLate]);
  }
}

TEST(Waits, ASlowLinkIsADataWaitOfItsReceivers) {
  constexpr int kSlow = 1;  // node 0; its same-local-rank peer on node 1 is rank 3
  auto topology = Topology::create(kRanks, 2);
  ASSERT_TRUE(topology.is_ok());
  for (DispatchAlgorithm algorithm : {DispatchAlgorithm::kFlat, DispatchAlgorithm::kHierarchical}) {
    SCOPED_TRACE(algorithm == DispatchAlgorithm::kFlat ? "flat" : "two-hop");
    InprocWorld world(*topology);
    std::vector<WaitRecord> waits(kRanks);
    std::vector<Status> statuses(kRanks);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < kRanks; ++rank)
      threads.emplace_back([&, rank] {
        SlowLinkTransport t(world.connect(rank), kSlow, kDelay);
        statuses[rank] = [&]() -> Status {
          EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config(algorithm)));
          Inputs in;
          DispatchResult recv;
          EPX_RETURN_IF_ERROR(buffer->dispatch(in.dispatch(), &recv));
          waits[rank] = recv.stats.waits;
          return Status::ok();
        }();
        if (!statuses[rank].is_ok()) t.abort(statuses[rank]);
      });
    for (std::thread& th : threads) th.join();
    ASSERT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
    for (int r = 0; r < kRanks; ++r) {
      SCOPED_TRACE(r);
      EXPECT_LT(max_except(waits[r].arrival, -1), kSmall);
    }
    // Flat: both ranks of node 1 receive rank 1's rows themselves; two-hop:
    // rank 3 receives them and forwards them to rank 2.
    EXPECT_GE(waits[3].data[kSlow], kAttributed);
    if (algorithm == DispatchAlgorithm::kFlat) EXPECT_GE(waits[2].data[kSlow], kAttributed);
    else EXPECT_GE(std::max(waits[2].data[kSlow], waits[2].data[3]), kAttributed);
    // Rank 1's own node waited for it to finish in the closing sync.
    EXPECT_GE(waits[0].data[kSlow], kAttributed);
  }
}

TEST(Waits, OffRecordsNothing) {
  auto topology = Topology::create(2, 1);
  ASSERT_TRUE(topology.is_ok());
  EXPECT_TRUE(first_error(run_ranks(*topology, [&](Transport& t) -> Status {
                BufferConfig c = config(DispatchAlgorithm::kAuto, /*record=*/false);
                c.num_experts = 2;
                EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, c));
                std::vector<float> x(kHidden, 1.0f);
                std::vector<int32_t> idx = {0, 1};
                DispatchResult recv;
                EPX_RETURN_IF_ERROR(buffer->dispatch({.x = TensorView::contiguous(x.data(), DType::kF32, {1, kHidden}),
                                                      .topk_idx = TensorView::contiguous(idx.data(), DType::kI32, {1, 2})},
                                                     &recv));
                WaitRecord sum;
                buffer->take_waits(&sum);
                if (!recv.stats.waits.arrival.empty() || sum.num_ops != 0 || !sum.arrival.empty())
                  return internal_error("rank {} recorded waits with record_waits off", t.rank());
                return Status::ok();
              })).is_ok());
}

// Ranks that disagree about recording would exchange headers of different
// sizes: Buffer::create refuses, naming the field.
TEST(Waits, RanksMustAgreeOnRecording) {
  auto topology = Topology::create(2, 1);
  ASSERT_TRUE(topology.is_ok());
  const std::vector<Status> statuses = run_ranks(*topology, [&](Transport& t) -> Status {
    return Buffer::create(t, config(DispatchAlgorithm::kAuto, t.rank() == 0)).status();
  });
  ASSERT_FALSE(statuses[0].is_ok());
  EXPECT_NE(statuses[0].message().find("record_waits"), std::string::npos) << statuses[0].to_string();
}

}  // namespace
}  // namespace epx
