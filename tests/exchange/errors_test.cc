// Errors of the exchange: bad input is rejected on the calling rank before
// anything is sent (InvalidArgument there, Aborted on every other rank, no
// message bytes, the Buffers still usable); bad configs are rejected at
// create; a rank that never arrives or fails makes the others return within
// the timeout instead of hanging.
//
// The world is 2 nodes x 2 ranks so that a half-sent exchange would show in
// both the inter-node and the intra-node counters.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/comm/topology.h"
#include "epx/exchange/buffer.h"
#include "exchange/harness.h"
#include "exchange/reference.h"

namespace epx::exchange_test {
namespace {

constexpr int kRanks = 4;
constexpr int kNodes = 2;
constexpr int kExperts = 8;
constexpr int kTopk = 2;
constexpr int kHidden = 16;
constexpr int kMaxTokens = 12;
constexpr int kBadRank = 2;
constexpr DType kDType = DType::kBF16;
// A "no hang" bound, far above what any rank should need and far below the
// 20 s timeout the Buffers are configured with. Not a speed test.
constexpr double kNoHangSeconds = 10.0;

Topology make_topology() { return *Topology::create(kRanks, kNodes); }

BufferConfig make_config() {
  BufferConfig config;
  config.num_experts = kExperts;
  config.hidden = kHidden;
  config.dtype = kDType;
  config.max_topk = kTopk;
  config.max_tokens_per_rank = kMaxTokens;
  config.timeout = Milliseconds(20000);
  return config;
}

ExchangeSpec make_spec() {
  return ExchangeSpec{make_topology(), *ExpertPlacement::contiguous(kExperts, kRanks), kDType, kHidden, 1};
}

// Valid inputs with fixed token counts (the bad rank has 6 tokens).
std::vector<RankInputs> valid_inputs(const ExchangeSpec& spec, uint32_t seed) {
  const int counts[kRanks] = {5, 7, 6, 4};
  std::mt19937 rng(seed);
  std::vector<RankInputs> inputs(kRanks);
  for (int s = 0; s < kRanks; ++s) {
    inputs[s].x = make_payload(0, s, counts[s], kHidden, kDType);
    inputs[s].topk = kTopk;
    inputs[s].topk_idx = make_routing(Routing::kUniform, spec.placement, counts[s], kTopk, rng);
    inputs[s].with_weights = true;
    inputs[s].topk_weights = make_random_floats(seed + s, inputs[s].topk_idx.size());
  }
  return inputs;
}

// Bad dispatch input of one rank, with the storage it points into.
struct BadInput {
  Matrix x;
  std::vector<int32_t> idx;
  std::vector<int64_t> idx64;
  std::vector<float> weights;
  DispatchInputs inputs;
};
using MakeBad = std::function<void(const RankInputs& good, BadInput* bad)>;

// The valid dispatch and combine every rank runs after a rejected call.
struct AfterResult {
  Matrix recv_x;
  std::vector<int32_t> src_rank, src_idx, recv_idx, counts;
  std::vector<float> recv_w;
  Matrix out;
};

struct CallResult {
  Status status;
  double seconds = 0;
  TransportCounters delta;
};

Status valid_round(Buffer& buffer, const RankInputs& in, int rank, AfterResult* after) {
  DispatchResult d;
  EPX_RETURN_IF_ERROR(buffer.dispatch(in.dispatch_inputs(), &d));
  after->recv_x = Matrix::copy_of(d.recv_x);
  after->src_rank = copy_i32(d.recv_src_rank);
  after->src_idx = copy_i32(d.recv_src_idx);
  after->recv_idx = copy_i32(d.recv_topk_idx);
  after->recv_w = copy_f32(d.recv_topk_weights);
  after->counts = d.num_recv_tokens_per_expert;
  const Matrix y = expert_output(after->recv_x, rank, DType::kF32);
  after->out = Matrix::filled(DType::kF32, in.num_tokens(), kHidden, kUnwritten);
  return buffer.combine(y.view(), d.handle, after->out.view());
}

// Checks the valid round against the reference.
void expect_valid_round(const ExchangeSpec& spec, const std::vector<RankInputs>& inputs,
                        const std::vector<AfterResult>& after) {
  const std::vector<RefRecv> recv = reference_dispatch(spec, inputs);
  const std::vector<Matrix> xs = xs_of(inputs);
  const std::vector<Matrix> recv_x = gather_rows(xs, recv);
  std::vector<Matrix> y;
  for (int r = 0; r < kRanks; ++r) y.push_back(expert_output(recv_x[r], r, DType::kF32));
  const std::vector<Matrix> out =
      reference_combine(spec, inputs, recv, y, {}, DType::kF32, CombineOrder::kHierarchical);
  std::vector<Matrix> got;
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(fmt::format("valid round, rank {}", r));
    EXPECT_TRUE(same_vector(after[r].src_rank, recv[r].src_rank)) << "recv_src_rank";
    EXPECT_TRUE(same_vector(after[r].src_idx, recv[r].src_idx)) << "recv_src_idx";
    EXPECT_TRUE(same_vector(after[r].recv_idx, recv[r].topk_idx, kTopk)) << "recv_topk_idx";
    EXPECT_TRUE(same_vector(after[r].recv_w, recv[r].topk_weights, kTopk)) << "recv_topk_weights";
    EXPECT_TRUE(same_vector(after[r].counts, recv[r].num_recv_tokens_per_expert)) << "counts";
    EXPECT_TRUE(same_matrix(after[r].recv_x, recv_x[r], &xs)) << "recv_x";
    EXPECT_TRUE(same_matrix(after[r].out, out[r])) << "combine";
    got.push_back(after[r].out);
  }
  EXPECT_TRUE(any_nonzero(got));
}

// The bad rank gets InvalidArgument naming `substrings`, the others Aborted
// well before the timeout, nobody sends a message byte, and the same Buffers
// then run a valid dispatch + combine correctly.
void expect_rejected_everywhere(const std::vector<CallResult>& calls, const std::vector<std::string>& substrings) {
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const CallResult& c = calls[r];
    if (r == kBadRank) {
      EXPECT_EQ(c.status.code(), StatusCode::kInvalidArgument) << c.status.to_string();
      for (const std::string& s : substrings)
        EXPECT_NE(c.status.message().find(s), std::string::npos) << "message lacks \"" << s << "\": " << c.status.to_string();
    } else {
      EXPECT_EQ(c.status.code(), StatusCode::kAborted) << c.status.to_string();
    }
    EXPECT_LT(c.seconds, kNoHangSeconds);
    EXPECT_EQ(c.delta.inter_node_bytes, 0u) << "a rejected call sent bytes across nodes";
    EXPECT_EQ(c.delta.inter_node_messages, 0u);
    EXPECT_EQ(c.delta.intra_node_bytes, 0u) << "a rejected call sent message bytes inside a node";
    EXPECT_EQ(c.delta.intra_node_messages, 0u);
  }
}

void run_bad_dispatch(const MakeBad& make_bad, const std::vector<std::string>& substrings) {
  const ExchangeSpec spec = make_spec();
  const std::vector<RankInputs> inputs = valid_inputs(spec, 42);
  std::vector<CallResult> calls(kRanks);
  std::vector<AfterResult> before(kRanks), after(kRanks);
  InprocWorld world(spec.topology);
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int r = t.rank();
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config()));
    EPX_RETURN_IF_ERROR(valid_round(*buffer, inputs[r], r, &before[r]));
    BadInput bad;
    if (r == kBadRank) make_bad(inputs[r], &bad);
    const TransportCounters c0 = t.counters();
    Stopwatch watch;
    DispatchResult d;
    calls[r].status = buffer->dispatch(r == kBadRank ? bad.inputs : inputs[r].dispatch_inputs(), &d);
    calls[r].seconds = watch.seconds();
    calls[r].delta = counters_delta(c0, t.counters());
    return valid_round(*buffer, inputs[r], r, &after[r]);
  });
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
  expect_rejected_everywhere(calls, substrings);
  expect_valid_round(spec, inputs, before);
  expect_valid_round(spec, inputs, after);
}

// Copies `good` into `bad` (which then points at its own storage).
void copy_good(const RankInputs& good, BadInput* bad) {
  bad->x = good.x;
  bad->idx = good.topk_idx;
  bad->weights = good.topk_weights;
  bad->inputs.x = bad->x.view();
  bad->inputs.topk_idx = TensorView::contiguous(bad->idx.data(), DType::kI32, {good.num_tokens(), kTopk});
  bad->inputs.topk_weights = TensorView::contiguous(bad->weights.data(), DType::kF32, {good.num_tokens(), kTopk});
}

TEST(ExchangeErrors, ExpertIdAtOrAboveNumExperts) {
  run_bad_dispatch(
      [](const RankInputs& good, BadInput* bad) {
        copy_good(good, bad);
        bad->idx[1 * kTopk + 0] = kExperts;
      },
      {"topk_idx[1][0] = 8", "[0, 8)"});
}

TEST(ExchangeErrors, NegativeExpertIdOtherThanMinusOne) {
  run_bad_dispatch(
      [](const RankInputs& good, BadInput* bad) {
        copy_good(good, bad);
        bad->idx[2 * kTopk + 1] = -2;
      },
      {"topk_idx[2][1] = -2", "[0, 8)"});
}

TEST(ExchangeErrors, ExpertListedTwiceInARow) {
  run_bad_dispatch(
      [](const RankInputs& good, BadInput* bad) {
        copy_good(good, bad);
        bad->idx[3 * kTopk + 0] = 5;
        bad->idx[3 * kTopk + 1] = 5;
      },
      {"topk_idx[3]", "5"});
}

TEST(ExchangeErrors, XRowsDifferFromTopkIdxRows) {
  run_bad_dispatch(
      [](const RankInputs& good, BadInput* bad) {
        copy_good(good, bad);
        bad->inputs.x = TensorView::contiguous(bad->x.row(0), kDType, {good.num_tokens() - 1, kHidden});
      },
      {});
}

TEST(ExchangeErrors, XColsDifferFromHidden) {
  run_bad_dispatch(
      [](const RankInputs& good, BadInput* bad) {
        copy_good(good, bad);
        bad->x = make_payload(0, kBadRank, good.num_tokens(), kHidden / 2, kDType);
        bad->inputs.x = bad->x.view();
      },
      {});
}

TEST(ExchangeErrors, XOfTheWrongDtype) {
  run_bad_dispatch(
      [](const RankInputs& good, BadInput* bad) {
        copy_good(good, bad);
        bad->x = make_payload(0, kBadRank, good.num_tokens(), kHidden, DType::kF32);
        bad->inputs.x = bad->x.view();
      },
      {});
}

TEST(ExchangeErrors, TopkIdxOfTheWrongDtype) {
  run_bad_dispatch(
      [](const RankInputs& good, BadInput* bad) {
        copy_good(good, bad);
        bad->idx64.assign(good.topk_idx.begin(), good.topk_idx.end());
        bad->inputs.topk_idx = TensorView::contiguous(bad->idx64.data(), DType::kI64, {good.num_tokens(), kTopk});
      },
      {"topk_idx"});
}

TEST(ExchangeErrors, TopkWeightsOfTheWrongShape) {
  run_bad_dispatch(
      [](const RankInputs& good, BadInput* bad) {
        copy_good(good, bad);
        bad->inputs.topk_weights =
            TensorView::contiguous(bad->weights.data(), DType::kF32, {good.num_tokens() - 1, kTopk});
      },
      {"topk_weights"});
}

TEST(ExchangeErrors, TopkWiderThanMaxTopk) {
  run_bad_dispatch(
      [](const RankInputs& good, BadInput* bad) {
        copy_good(good, bad);
        bad->idx.clear();
        for (int t = 0; t < good.num_tokens(); ++t) bad->idx.insert(bad->idx.end(), {0, 3, 6});
        bad->weights.assign(static_cast<std::size_t>(good.num_tokens()) * 3, 0.5f);
        bad->inputs.topk_idx = TensorView::contiguous(bad->idx.data(), DType::kI32, {good.num_tokens(), 3});
        bad->inputs.topk_weights = TensorView::contiguous(bad->weights.data(), DType::kF32, {good.num_tokens(), 3});
      },
      {"3"});
}

TEST(ExchangeErrors, MoreTokensThanMaxTokensPerRank) {
  run_bad_dispatch(
      [](const RankInputs&, BadInput* bad) {
        const int num_tokens = kMaxTokens + 1;
        bad->x = make_payload(0, kBadRank, num_tokens, kHidden, kDType);
        bad->idx.clear();
        for (int t = 0; t < num_tokens; ++t) bad->idx.insert(bad->idx.end(), {t % kExperts, (t + 1) % kExperts});
        bad->weights.assign(static_cast<std::size_t>(num_tokens) * kTopk, 0.5f);
        bad->inputs.x = bad->x.view();
        bad->inputs.topk_idx = TensorView::contiguous(bad->idx.data(), DType::kI32, {num_tokens, kTopk});
        bad->inputs.topk_weights = TensorView::contiguous(bad->weights.data(), DType::kF32, {num_tokens, kTopk});
      },
      {"13", "12"});
}

// Combine with a handle another Buffer made, or with y / out of stale shapes,
// on one rank: InvalidArgument there, Aborted elsewhere, nothing changed.
TEST(ExchangeErrors, CombineWithAForeignHandleOrStaleShapes) {
  const ExchangeSpec spec = make_spec();
  const std::vector<RankInputs> inputs = valid_inputs(spec, 7);
  struct Bad {
    const char* name;
    int kind;
  };
  const Bad kinds[] = {{"handle of another Buffer", 0}, {"y with one row too many", 1}, {"out with one row too few", 2}};
  for (const Bad& kind : kinds) {
    SCOPED_TRACE(kind.name);
    std::vector<CallResult> calls(kRanks);
    std::vector<AfterResult> after(kRanks);
    InprocWorld world(spec.topology);
    const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
      const int r = t.rank();
      const RankInputs& in = inputs[r];
      EPX_ASSIGN_OR_RETURN(auto a, Buffer::create(t, make_config()));
      EPX_ASSIGN_OR_RETURN(auto b, Buffer::create(t, make_config()));
      DispatchResult da, db;
      EPX_RETURN_IF_ERROR(a->dispatch(in.dispatch_inputs(), &da));
      EPX_RETURN_IF_ERROR(b->dispatch(in.dispatch_inputs(), &db));
      const Matrix recv_b = Matrix::copy_of(db.recv_x);
      const int64_t n = recv_b.rows();
      Matrix y = expert_output(recv_b, r, DType::kF32);
      Matrix long_y(DType::kF32, n + 1, kHidden);
      Matrix out(DType::kF32, in.num_tokens(), kHidden);
      TensorView y_view = y.view();
      TensorView out_view = out.view();
      Handle handle = db.handle;
      if (r == kBadRank && kind.kind == 0) handle = da.handle;
      if (r == kBadRank && kind.kind == 1) y_view = long_y.view();
      if (r == kBadRank && kind.kind == 2) out_view = TensorView::contiguous(out.row(0), DType::kF32, {in.num_tokens() - 1, kHidden});
      const TransportCounters c0 = t.counters();
      Stopwatch watch;
      calls[r].status = b->combine(y_view, handle, out_view);
      calls[r].seconds = watch.seconds();
      calls[r].delta = counters_delta(c0, t.counters());
      // The same Buffer, its handle and y still work.
      after[r].recv_x = recv_b;
      after[r].src_rank = copy_i32(db.recv_src_rank);
      after[r].src_idx = copy_i32(db.recv_src_idx);
      after[r].recv_idx = copy_i32(db.recv_topk_idx);
      after[r].recv_w = copy_f32(db.recv_topk_weights);
      after[r].counts = db.num_recv_tokens_per_expert;
      after[r].out = Matrix::filled(DType::kF32, in.num_tokens(), kHidden, kUnwritten);
      return b->combine(y.view(), db.handle, after[r].out.view());
    });
    for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
    expect_rejected_everywhere(calls, {});
    expect_valid_round(spec, inputs, after);
  }
}

// Configs every rank rejects at create with InvalidArgument.
TEST(ExchangeErrors, ExpandedRowsInsideTheCombineRegion) {
  // combine_expanded writes its partial sums into the combine region, so an
  // expanded y stored there is refused unless it is the view
  // combine_expanded_input hands out (then the rows are read in place); here
  // it starts one row into the region.
  const ExchangeSpec spec = make_spec();
  const std::vector<RankInputs> inputs = valid_inputs(spec, 11);
  std::vector<CallResult> calls(kRanks);
  InprocWorld world(spec.topology);
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int r = t.rank();
    BufferConfig config = make_config();
    config.max_recv_tokens = 4 * kRanks * kMaxTokens;  // room for the expanded rows
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config));
    DispatchResult d;
    EPX_RETURN_IF_ERROR(buffer->dispatch(inputs[r].dispatch_inputs(), &d));
    const int64_t rows = buffer->expanded_layout(d.handle).num_rows();
    Matrix y(DType::kF32, rows, kHidden);
    TensorView y_view = y.view();
    if (r == kBadRank) {
      EPX_ASSIGN_OR_RETURN(TensorView region, buffer->combine_input(d.handle, DType::kF32));
      y_view = TensorView::contiguous(region.row<float>(1), DType::kF32, {rows, kHidden});
    }
    Matrix out(DType::kF32, inputs[r].num_tokens(), kHidden);
    const TransportCounters c0 = t.counters();
    Stopwatch watch;
    calls[r].status = buffer->combine_expanded(y_view, d.handle, out.view());
    calls[r].seconds = watch.seconds();
    calls[r].delta = counters_delta(c0, t.counters());
    return Status::ok();
  });
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
  expect_rejected_everywhere(calls, {"combine region"});
}

TEST(ExchangeErrors, BadConfigOnOneRankOrDifferentPlacements) {
  // One rank's config fails its own checks: it says why, the others are told
  // at once (Aborted) instead of waiting for it until the timeout.
  const Topology topology = make_topology();
  {
    std::vector<Status> created(kRanks);
    std::vector<double> seconds(kRanks);
    InprocWorld world(topology);
    world.run([&](Transport& t) -> Status {
      BufferConfig config = make_config();
      if (t.rank() == kBadRank) config.hidden = 0;
      Stopwatch watch;
      created[t.rank()] = Buffer::create(t, config).status();
      seconds[t.rank()] = watch.seconds();
      return Status::ok();
    });
    for (int r = 0; r < kRanks; ++r) {
      SCOPED_TRACE(fmt::format("rank {}", r));
      EXPECT_EQ(created[r].code(), r == kBadRank ? StatusCode::kInvalidArgument : StatusCode::kAborted)
          << created[r].to_string();
      EXPECT_LT(seconds[r], kNoHangSeconds);
    }
    EXPECT_NE(created[kBadRank].message().find("hidden = 0"), std::string::npos) << created[kBadRank].message();
  }
  // Placements that differ between ranks (a stale map after a rebalance) are refused everywhere.
  {
    std::vector<Status> created(kRanks);
    InprocWorld world(topology);
    world.run([&](Transport& t) -> Status {
      BufferConfig config = make_config();
      std::vector<int32_t> map(kExperts);
      for (int e = 0; e < kExperts; ++e) map[e] = e % kRanks;
      if (t.rank() == kBadRank) std::swap(map[0], map[1]);
      config.placement = *ExpertPlacement::from_map(map, kRanks);
      created[t.rank()] = Buffer::create(t, config).status();
      return Status::ok();
    });
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_EQ(created[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << created[r].to_string();
      EXPECT_NE(created[r].message().find("placement"), std::string::npos) << created[r].message();
    }
  }
}

TEST(ExchangeErrors, HandlesOfDifferentDispatchesOrAStaleLayout) {
  const ExchangeSpec spec = make_spec();
  const std::vector<RankInputs> inputs = valid_inputs(spec, 13);
  std::vector<Status> combined(kRanks), cached(kRanks), stale_layout(kRanks), after(kRanks);
  InprocWorld world(spec.topology);
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int r = t.rank();
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config()));
    DispatchResult first, second;
    EPX_RETURN_IF_ERROR(buffer->dispatch(inputs[r].dispatch_inputs(), &first));
    const Handle old_handle = first.handle;
    EPX_RETURN_IF_ERROR(buffer->dispatch(inputs[r].dispatch_inputs(), &second));
    // The bad rank passes the older handle; the shapes may even agree.
    const Handle& mine = r == kBadRank ? old_handle : second.handle;
    Matrix y = expert_output(Matrix::copy_of(second.recv_x), r, DType::kF32);
    Matrix out(DType::kF32, inputs[r].num_tokens(), kHidden);
    combined[r] = buffer->combine(y.view(), mine, out.view());
    TensorView recv;
    cached[r] = buffer->dispatch_cached(inputs[r].dispatch_inputs().x, mine, &recv);
    // A layout of other routing passed with this topk_idx.
    EPX_ASSIGN_OR_RETURN(DispatchLayout layout, buffer->get_layout(inputs[r].dispatch_inputs().topk_idx));
    if (r == kBadRank && !layout.num_tokens_per_rank.empty()) {
      layout.num_tokens_per_rank[0] += 1;
    }
    DispatchResult third;
    stale_layout[r] = buffer->dispatch(inputs[r].dispatch_inputs(), &third, &layout);
    // Nothing was half-done: the Buffer still works with a fresh dispatch.
    after[r] = buffer->dispatch(inputs[r].dispatch_inputs(), &third);
    if (after[r].is_ok()) after[r] = buffer->combine(Matrix::copy_of(third.recv_x).view(), third.handle, out.view());
    return Status::ok();
  });
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    ASSERT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
    EXPECT_EQ(combined[r].code(), StatusCode::kInvalidArgument) << combined[r].to_string();
    EXPECT_NE(combined[r].message().find("different dispatches"), std::string::npos) << combined[r].message();
    EXPECT_EQ(cached[r].code(), StatusCode::kInvalidArgument) << cached[r].to_string();
    EXPECT_EQ(stale_layout[r].code(), r == kBadRank ? StatusCode::kInvalidArgument : StatusCode::kAborted)
        << stale_layout[r].to_string();
    EXPECT_TRUE(after[r].is_ok()) << after[r].to_string();
  }
  EXPECT_NE(stale_layout[kBadRank].message().find("not the layout of its topk_idx"), std::string::npos);
}

TEST(ExchangeErrors, CreateRejectsBadConfigs) {
  struct BadConfig {
    const char* name;
    std::function<void(BufferConfig*)> change;
  };
  const BadConfig bad[] = {
      {"10 experts on 4 ranks without a placement", [](BufferConfig* c) { c->num_experts = 10; c->max_topk = 2; }},
      {"bf16 rows of 6 * 2 = 12 bytes", [](BufferConfig* c) { c->hidden = 6; }},
      {"f32 rows of 3 * 4 = 12 bytes",
       [](BufferConfig* c) {
         c->hidden = 3;
         c->dtype = DType::kF32;
       }},
  };
  const Topology topology = make_topology();
  for (const BadConfig& b : bad) {
    SCOPED_TRACE(b.name);
    BufferConfig config = make_config();
    b.change(&config);
    std::vector<Status> created(kRanks);
    InprocWorld world(topology);
    const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
      created[t.rank()] = Buffer::create(t, config).status();
      return Status::ok();
    });
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_TRUE(statuses[r].is_ok());
      EXPECT_EQ(created[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << created[r].to_string();
    }
  }
  // The same world accepts the smallest legal rows (4 bf16 = 8 bytes) and 10
  // experts when a placement says where they go.
  BufferConfig ok = make_config();
  ok.hidden = 4;
  std::vector<int32_t> map = {0, 0, 1, 1, 1, 2, 2, 3, 3, 3};
  BufferConfig placed = make_config();
  placed.num_experts = 10;
  placed.placement = *ExpertPlacement::from_map(map, kRanks);
  InprocWorld world(topology);
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto a, Buffer::create(t, ok));
    EPX_ASSIGN_OR_RETURN(auto b, Buffer::create(t, placed));
    const int expected_local[kRanks] = {2, 3, 2, 3};
    if (b->num_local_experts() != expected_local[t.rank()])
      return internal_error("rank {} holds {} experts", t.rank(), b->num_local_experts());
    return Status::ok();
  });
  const Status first = first_error(statuses);
  EXPECT_TRUE(first.is_ok()) << first.to_string();
}

// A rank that never calls dispatch: the others return DeadlineExceeded after
// the configured timeout (300 ms) instead of waiting forever.
TEST(ExchangeErrors, MissingRankMakesTheOthersTimeOut) {
  const ExchangeSpec spec = make_spec();
  const std::vector<RankInputs> inputs = valid_inputs(spec, 3);
  constexpr int kAbsent = 3;
  std::vector<CallResult> calls(kRanks);
  InprocWorld world(spec.topology);
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int r = t.rank();
    BufferConfig config = make_config();
    config.timeout = Milliseconds(300);
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config));
    if (r == kAbsent) return Status::ok();
    Stopwatch watch;
    DispatchResult d;
    calls[r].status = buffer->dispatch(inputs[r].dispatch_inputs(), &d);
    calls[r].seconds = watch.seconds();
    return Status::ok();
  });
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
  for (int r = 0; r < kRanks; ++r) {
    if (r == kAbsent) continue;
    SCOPED_TRACE(fmt::format("rank {}", r));
    EXPECT_EQ(calls[r].status.code(), StatusCode::kDeadlineExceeded) << calls[r].status.to_string();
    EXPECT_LT(calls[r].seconds, kNoHangSeconds);
  }
}

// A rank that fails before the collective (its function returns an error):
// run() aborts the world and the others return Aborted, not a timeout.
TEST(ExchangeErrors, FailedRankMakesTheOthersAbort) {
  const ExchangeSpec spec = make_spec();
  const std::vector<RankInputs> inputs = valid_inputs(spec, 5);
  constexpr int kFailing = 1;
  std::vector<CallResult> calls(kRanks);
  InprocWorld world(spec.topology);
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int r = t.rank();
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config()));
    if (r == kFailing) return internal_error("rank {} gives up", r);
    Stopwatch watch;
    DispatchResult d;
    calls[r].status = buffer->dispatch(inputs[r].dispatch_inputs(), &d);
    calls[r].seconds = watch.seconds();
    return Status::ok();
  });
  EXPECT_EQ(statuses[kFailing].code(), StatusCode::kInternal);
  for (int r = 0; r < kRanks; ++r) {
    if (r == kFailing) continue;
    SCOPED_TRACE(fmt::format("rank {}", r));
    EXPECT_EQ(calls[r].status.code(), StatusCode::kAborted) << calls[r].status.to_string();
    EXPECT_LT(calls[r].seconds, kNoHangSeconds);
  }
}

}  // namespace
}  // namespace epx::exchange_test
