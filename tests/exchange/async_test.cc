// The asynchronous and split forms of dispatch and combine: a rank that
// works (here: sleeps) between send and receive neither stalls its peers nor
// changes any bit; errors reach wait(); misuse of the split forms is refused.
// The conformance table runs every operation in all three forms (form= in
// its case names); these tests add what the table cannot show. They run
// in-process and, through epx_mpi_tests, under mpirun.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "epx/comm/topology.h"
#include "epx/core/clock.h"
#include "epx/exchange/buffer.h"
#include "exchange/harness.h"
#include "exchange/reference.h"
#include "exchange/world.h"

namespace epx::exchange_test {
namespace {

constexpr int kExperts = 16;
constexpr int kTopk = 4;
constexpr int kHidden = 64;
constexpr int kMaxTokens = 32;
constexpr DType kDType = DType::kBF16;

BufferConfig make_config(Milliseconds timeout = Milliseconds(20000)) {
  BufferConfig config;
  config.num_experts = kExperts;
  config.hidden = kHidden;
  config.dtype = kDType;
  config.max_topk = kTopk;
  config.max_tokens_per_rank = kMaxTokens;
  config.timeout = timeout;
  return config;
}

// 4 ranks as 2 nodes (in-process), or as many as this MPI job has.
Topology make_topology() {
  const int ranks = test_world().ranks_for(4), nodes = test_world().nodes_for(2);
  return *Topology::create(ranks, ranks % nodes == 0 ? nodes : 1);
}

std::vector<RankInputs> make_world_inputs(const Topology& topology, uint32_t seed) {
  const ExchangeSpec spec{topology, *ExpertPlacement::contiguous(kExperts, topology.num_ranks()), kDType, kHidden, 1};
  return make_inputs(spec, Routing::kUniform, kTopk, kMaxTokens, /*with_weights=*/true, seed);
}

struct Observed {
  Matrix recv_x, out;
  std::vector<int32_t> src_rank, src_idx;
  double recv_seconds = 0;     // from dispatch_send's return to dispatch_recv's
  double combine_seconds = 0;  // the same for the combine
};

// The sleeper sleeps `nap` between each send and its receive; everyone
// else receives at once (a barrier between dispatch and combine lines the
// ranks up again). Then the same dispatch + combine blocking.
Status split_round(Transport& t, const RankInputs& in, int sleeper, std::chrono::milliseconds nap, Observed* split,
                   Observed* blocking) {
  EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config()));
  const Deadline deadline = Deadline::after(std::chrono::seconds(60));
  Stopwatch watch;
  EPX_RETURN_IF_ERROR(buffer->dispatch_send(in.dispatch_inputs()));
  watch = Stopwatch();
  if (t.rank() == sleeper) std::this_thread::sleep_for(nap);
  DispatchResult d;
  EPX_RETURN_IF_ERROR(buffer->dispatch_recv(&d, deadline));
  split->recv_seconds = watch.seconds();
  split->recv_x = Matrix::copy_of(d.recv_x);
  split->src_rank = copy_i32(d.recv_src_rank);
  split->src_idx = copy_i32(d.recv_src_idx);
  const Matrix y = expert_output(split->recv_x, t.rank(), DType::kF32);
  split->out = Matrix::filled(DType::kF32, in.num_tokens(), kHidden, kUnwritten);
  // Line the ranks up again (the sleeper is 'nap' behind), so that the
  // combine's timing starts together.
  EPX_RETURN_IF_ERROR(t.barrier(deadline));
  EPX_RETURN_IF_ERROR(buffer->combine_send(y.view(), d.handle, split->out.view()));
  watch = Stopwatch();
  if (t.rank() == sleeper) std::this_thread::sleep_for(nap);
  EPX_RETURN_IF_ERROR(buffer->combine_recv(deadline));
  split->combine_seconds = watch.seconds();

  DispatchResult b;
  EPX_RETURN_IF_ERROR(buffer->dispatch(in.dispatch_inputs(), &b));
  blocking->recv_x = Matrix::copy_of(b.recv_x);
  blocking->src_rank = copy_i32(b.recv_src_rank);
  blocking->src_idx = copy_i32(b.recv_src_idx);
  blocking->out = Matrix::filled(DType::kF32, in.num_tokens(), kHidden, kUnwritten);
  return buffer->combine(y.view(), b.handle, blocking->out.view());
}

TEST(AsyncExchange, ASleepingRankDoesNotStallItsPeersNorChangeTheBits) {
  const Topology topology = make_topology();
  const int R = topology.num_ranks();
  const std::vector<RankInputs> inputs = make_world_inputs(topology, 41);
  const int sleeper = R - 1;
  // Far above what a dispatch of these few rows takes, even under the
  // sanitizers on a loaded machine: the others must be done long before.
  const auto nap = std::chrono::milliseconds(1500);
  std::vector<Observed> split(R), blocking(R);
  const std::vector<Status> status = test_world().run(topology, [&](Transport& t) {
    return split_round(t, inputs[t.rank()], sleeper, nap, &split[t.rank()], &blocking[t.rank()]);
  });
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    SCOPED_TRACE(fmt::format("rank {}", r));
    ASSERT_TRUE(status[r].is_ok()) << status[r].to_string();
    EXPECT_TRUE(same_matrix(split[r].recv_x, blocking[r].recv_x)) << "split dispatch vs blocking";
    EXPECT_TRUE(same_vector(split[r].src_rank, blocking[r].src_rank));
    EXPECT_TRUE(same_vector(split[r].src_idx, blocking[r].src_idx));
    EXPECT_TRUE(same_matrix(split[r].out, blocking[r].out)) << "split combine vs blocking";
    if (r != sleeper && R > 1) {
      // Received while the sleeper was still asleep: its progress thread,
      // not its caller, moved the rows.
      EXPECT_LT(split[r].recv_seconds, 0.75) << "dispatch_recv waited for the sleeping rank's caller";
      EXPECT_LT(split[r].combine_seconds, 0.75) << "combine_recv waited for the sleeping rank's caller";
    }
  }
}

// An asynchronous dispatch queued behind another, then a blocking one: the
// operations run in the order issued and each gives the reference's rows.
TEST(AsyncExchange, QueuedOperationsRunInOrderAndBlockingCallsWaitForThem) {
  const Topology topology = make_topology();
  const int R = topology.num_ranks();
  const std::vector<RankInputs> first = make_world_inputs(topology, 42);
  const std::vector<RankInputs> second = make_world_inputs(topology, 43);
  std::vector<Matrix> got_first(R), got_third(R);
  std::vector<std::vector<int32_t>> got_second(R);
  const std::vector<Status> status = test_world().run(topology, [&](Transport& t) -> Status {
    const int r = t.rank();
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config()));
    DispatchResult a, b;
    const PendingOp pa = buffer->dispatch_async(first[r].dispatch_inputs(), &a);
    EPX_RETURN_IF_ERROR(pa.wait());
    got_first[r] = Matrix::copy_of(a.recv_x);  // recv_x lives until the next dispatch
    const PendingOp pb = buffer->dispatch_async(second[r].dispatch_inputs(), &b);
    DispatchResult c;
    // Blocking: runs after pb, whose result is then complete.
    EPX_RETURN_IF_ERROR(buffer->dispatch(first[r].dispatch_inputs(), &c));
    if (!pb.done()) return internal_error("a blocking dispatch returned before the queued one finished");
    EPX_RETURN_IF_ERROR(pb.wait());
    got_second[r] = copy_i32(b.recv_src_idx);  // b's rows were overwritten by c's; its metadata stays
    got_third[r] = Matrix::copy_of(c.recv_x);
    if (b.handle.num_tokens() != second[r].num_tokens())
      return internal_error("the queued dispatch's handle has {} tokens, expected {}", b.handle.num_tokens(),
                            second[r].num_tokens());
    return Status::ok();
  });
  const ExchangeSpec spec{topology, *ExpertPlacement::contiguous(kExperts, R), kDType, kHidden, 1};
  const std::vector<Matrix> ref_first = gather_rows(xs_of(first), reference_dispatch(spec, first));
  const std::vector<RefRecv> ref_second = reference_dispatch(spec, second);
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    SCOPED_TRACE(fmt::format("rank {}", r));
    ASSERT_TRUE(status[r].is_ok()) << status[r].to_string();
    EXPECT_TRUE(same_matrix(got_first[r], ref_first[r]));
    EXPECT_TRUE(same_vector(got_second[r], ref_second[r].src_idx));
    EXPECT_TRUE(same_matrix(got_third[r], ref_first[r]));
  }
}

// Bad input on one rank: its wait() says why, the others' say Aborted.
TEST(AsyncExchange, ErrorsReachWait) {
  const Topology topology = make_topology();
  const int R = topology.num_ranks();
  const std::vector<RankInputs> inputs = make_world_inputs(topology, 44);
  const int bad = R - 1;
  const std::vector<Status> status = test_world().run(topology, [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config()));
    std::vector<int32_t> idx = inputs[t.rank()].topk_idx;
    if (t.rank() == bad && !idx.empty()) idx[0] = kExperts + 3;
    DispatchInputs in = inputs[t.rank()].dispatch_inputs();
    in.topk_idx = TensorView::contiguous(idx.data(), DType::kI32, {inputs[t.rank()].num_tokens(), kTopk});
    DispatchResult d;
    return buffer->dispatch_async(in, &d).wait();
  });
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r) || inputs[bad].num_tokens() == 0) continue;
    SCOPED_TRACE(fmt::format("rank {}", r));
    EXPECT_EQ(status[r].code(), r == bad ? StatusCode::kInvalidArgument : StatusCode::kAborted) << status[r].to_string();
  }
}

TEST(AsyncExchange, SplitFormsRefuseMisuse) {
  const Topology topology = *Topology::create(1, 1);
  if (!test_world().cannot_run(topology).empty()) GTEST_SKIP() << "needs a 1-rank world";
  const std::vector<RankInputs> inputs = make_world_inputs(topology, 45);
  const std::vector<Status> status = test_world().run(topology, [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config()));
    const Deadline deadline = Deadline::after(std::chrono::seconds(30));
    DispatchResult d;
    Status s = buffer->dispatch_recv(&d, deadline);
    if (s.code() != StatusCode::kFailedPrecondition) return internal_error("recv before send: {}", s.to_string());
    s = buffer->combine_recv(deadline);
    if (s.code() != StatusCode::kFailedPrecondition) return internal_error("combine_recv first: {}", s.to_string());
    EPX_RETURN_IF_ERROR(buffer->dispatch_send(inputs[0].dispatch_inputs()));
    s = buffer->dispatch_send(inputs[0].dispatch_inputs());
    if (s.code() != StatusCode::kFailedPrecondition) return internal_error("second send: {}", s.to_string());
    EPX_RETURN_IF_ERROR(buffer->dispatch_recv(&d, deadline));
    s = buffer->dispatch_recv(&d, deadline);
    if (s.code() != StatusCode::kFailedPrecondition) return internal_error("second recv: {}", s.to_string());
    return Status::ok();
  });
  if (test_world().holds(0)) {
    EXPECT_TRUE(status[0].is_ok()) << status[0].to_string();
  }
}

// A peer that never issues the operation: wait() with a short deadline says
// the operation is still running; the operation itself ends with
// DeadlineExceeded after BufferConfig::timeout, and the Buffer goes away
// cleanly.
TEST(AsyncExchange, WaitTimesOutWhileTheOperationRunsAndTheOperationTimesOut) {
  // A timeout poisons the transport, which the MPI test binary shares between tests.
  if (test_world().name() != "inproc") GTEST_SKIP() << "in-process only (a timeout poisons the shared MPI transport)";
  const Topology topology = make_topology();
  const int R = topology.num_ranks();
  const std::vector<RankInputs> inputs = make_world_inputs(topology, 46);
  std::vector<Status> first_wait(R), final_wait(R);
  const std::vector<Status> status = test_world().run(topology, [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config(Milliseconds(400))));
    if (t.rank() == 0) return Status::ok();  // never dispatches
    DispatchResult d;
    const PendingOp op = buffer->dispatch_async(inputs[t.rank()].dispatch_inputs(), &d);
    first_wait[t.rank()] = op.wait(Deadline::after(std::chrono::milliseconds(1)));
    final_wait[t.rank()] = op.wait();
    return Status::ok();
  });
  for (int r = 1; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    SCOPED_TRACE(fmt::format("rank {}", r));
    EXPECT_EQ(first_wait[r].code(), StatusCode::kDeadlineExceeded) << first_wait[r].to_string();
    EXPECT_NE(first_wait[r].message().find("still running"), std::string::npos) << first_wait[r].to_string();
    EXPECT_EQ(final_wait[r].code(), StatusCode::kDeadlineExceeded) << final_wait[r].to_string();
  }
}

}  // namespace
}  // namespace epx::exchange_test
