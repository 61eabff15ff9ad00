// LowLatencyBuffer against a plain reference, on every rank, in-process and
// (through test_world()) under MPI: world sizes {1, 2, 4, 8}, one node and
// two (emulated) nodes, f32 and bf16 payloads, top-k {1, 2, 8}, the routing
// shapes of harness.h (a rank with no tokens among them), the worst-case
// capacity and the tightest capacity that fits; then overflow, bad inputs
// and stale handles, each followed by a call that must work.
//
// Reference: local expert e of rank d receives, for s ascending, t ascending,
// one row x_s[t] per slot k with topk_idx_s[t][k] == global(e); combine gives
// out_s[t] = sum over k ascending (expert != -1) of w[t][k] * y(t, k) in fp32,
// y(t, k) = expert_value(x_s[t], global expert, col) stored in y's dtype. All
// compared bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "epx/comm/topology.h"
#include "epx/exchange/low_latency.h"
#include "exchange/harness.h"
#include "exchange/reference.h"
#include "exchange/world.h"

namespace epx::exchange_test {
namespace {

constexpr int kMaxTokens = 24;
constexpr float kGarbage = 1.0e4f;  // y rows past the counts; must never reach an output

struct LLCase {
  int num_ranks = 1;
  int num_nodes = 1;
  DType dtype = DType::kF32;
  DType y_dtype = DType::kF32;
  DType out_dtype = DType::kF32;
  int num_experts = 8;
  int topk = 1;
  Routing routing = Routing::kUniform;
  bool with_weights = true;
  bool tight_capacity = false;  // capacity = the largest (source, expert) count, else the worst case
  uint32_t seed = 1;
  int hidden = 16;
  std::vector<int32_t> expert_map;  // expert -> rank; empty: contiguous blocks
  // dispatch_async / combine_async, waited for after a pause on one rank
  // (which changes with the seed), instead of the blocking calls.
  bool async = false;
  bool per_rank = false;  // LowLatencyConfig::combine_per_rank
  bool last_rank_bf16_y = false;  // the last rank's experts give bf16 y, the others y_dtype

  // The dtype of the y rows `rank`'s experts give.
  [[nodiscard]] DType y_dtype_of(int rank) const {
    return last_rank_bf16_y && rank == num_ranks - 1 ? DType::kBF16 : y_dtype;
  }

  [[nodiscard]] std::string name() const {
    return fmt::format("{} ranks as {} nodes, x {} y {} out {}, E={} K={} routing={} weights={} tight={} async={} "
                       "per_rank={} seed={}{}{}",
                       num_ranks, num_nodes, dtype_name(dtype), dtype_name(y_dtype), dtype_name(out_dtype),
                       num_experts, topk, routing_name(routing), with_weights, tight_capacity, async, per_rank, seed,
                       expert_map.empty() ? "" : " uneven map, last rank holds no expert",
                       last_rank_bf16_y ? " last rank's y bf16" : "");
  }
  [[nodiscard]] Result<ExpertPlacement> placement() const {
    return expert_map.empty() ? ExpertPlacement::contiguous(num_experts, num_ranks)
                              : ExpertPlacement::from_map(expert_map, num_ranks);
  }
};

// The y row the test experts give expert `global` for input row `x`.
void expert_row(const std::byte* x, DType x_dtype, int global, int hidden, std::byte* y, DType y_dtype) {
  for (int c = 0; c < hidden; ++c) store_from_f32(y, y_dtype, c, expert_value(load_as_f32(x, x_dtype, c), global, c));
}

// The largest number of rows one source sends one expert.
int max_rows_per_source_expert(const std::vector<RankInputs>& inputs, int num_experts) {
  int most = 0;
  for (const RankInputs& in : inputs) {
    std::vector<int> n(num_experts, 0);
    for (int32_t e : in.topk_idx)
      if (e >= 0) most = std::max(most, ++n[e]);
  }
  return most;
}

// sum over k ascending of w[t][k] * y(t, k) in fp32, over the slots whose
// expert sits on rank `only` (all slots when -1).
std::vector<float> top_k_sum(const LLCase& c, const ExpertPlacement& placement, const RankInputs& in, int t,
                             int only) {
  const int H = c.hidden;
  std::vector<float> acc(H, 0.0f);
  for (int k = 0; k < c.topk; ++k) {
    const int g = in.expert(t, k);
    if (g < 0) continue;
    const int owner = placement.rank_of(g);
    if (only >= 0 && owner != only) continue;
    const float w = in.has_weights() ? in.topk_weights[static_cast<std::size_t>(t) * c.topk + k] : 1.0f;
    Matrix y(c.y_dtype_of(owner), 1, H);
    expert_row(in.x.row(t), c.dtype, g, H, y.row(0), c.y_dtype_of(owner));
    for (int col = 0; col < H; ++col) acc[col] += w * y.get(0, col);
  }
  return acc;
}

// combine_per_rank: each owner rank's top_k_sum rounded to its y's dtype,
// added in fp32 in the order of the owners' first slots k.
std::vector<float> per_rank_sum(const LLCase& c, const ExpertPlacement& placement, const RankInputs& in, int t) {
  const int H = c.hidden;
  std::vector<float> acc(H, 0.0f);
  std::vector<int> owners;
  for (int k = 0; k < c.topk; ++k) {
    const int g = in.expert(t, k);
    if (g < 0 || std::find(owners.begin(), owners.end(), placement.rank_of(g)) != owners.end()) continue;
    owners.push_back(placement.rank_of(g));
    Matrix partial(c.y_dtype_of(owners.back()), 1, H);
    const std::vector<float> p = top_k_sum(c, placement, in, t, owners.back());
    for (int col = 0; col < H; ++col) partial.set(0, col, p[col]);
    for (int col = 0; col < H; ++col) acc[col] += partial.get(0, col);
  }
  return acc;
}

struct Expected {
  std::vector<Matrix> recv;                // per local expert: [count, H]
  std::vector<std::vector<int32_t>> src;   // per local expert: (rank, token, k) triples
  Matrix out;                              // [T, H]
};

Expected reference(const LLCase& c, const ExpertPlacement& placement, const std::vector<RankInputs>& inputs, int d) {
  Expected ex;
  const int H = c.hidden;
  for (int e = 0; e < placement.num_local_experts(d); ++e) {
    const int g = placement.global_id(d, e);
    std::vector<const std::byte*> rows;
    std::vector<int32_t> src;
    for (int s = 0; s < c.num_ranks; ++s)
      for (int t = 0; t < inputs[s].num_tokens(); ++t)
        for (int k = 0; k < c.topk; ++k)
          if (inputs[s].expert(t, k) == g) {
            rows.push_back(inputs[s].x.row(t));
            src.insert(src.end(), {s, t, k});
          }
    Matrix m(c.dtype, static_cast<int64_t>(rows.size()), H);
    for (std::size_t i = 0; i < rows.size(); ++i) std::memcpy(m.row(static_cast<int64_t>(i)), rows[i], m.row_bytes());
    ex.recv.push_back(std::move(m));
    ex.src.push_back(std::move(src));
  }
  const RankInputs& in = inputs[d];
  ex.out = Matrix(c.out_dtype, in.num_tokens(), H);
  for (int t = 0; t < in.num_tokens(); ++t) {
    const std::vector<float> acc = c.per_rank ? per_rank_sum(c, placement, in, t) : top_k_sum(c, placement, in, t, -1);
    for (int col = 0; col < H; ++col) ex.out.set(t, col, acc[col]);
  }
  return ex;
}

struct Got {
  std::vector<Matrix> recv;
  std::vector<std::vector<int32_t>> src;
  Matrix out;
  // The same dispatch and combine again (y = recv_x itself when the dtypes
  // allow): the same bits, the same memory.
  std::vector<Matrix> recv_again;
  Matrix out_again;
  bool same_memory = false;
};

LowLatencyConfig make_config(const LLCase& c, int capacity) {
  LowLatencyConfig config;
  config.num_experts = c.num_experts;
  config.hidden = c.hidden;
  config.dtype = c.dtype;
  config.max_tokens_per_rank = kMaxTokens;
  config.max_topk = std::min(8, c.num_experts);
  config.capacity = capacity;
  config.timeout = Milliseconds(20000);
  config.combine_per_rank = c.per_rank;
  if (!c.expert_map.empty()) config.placement = *c.placement();
  return config;
}

LowLatencyDispatchInputs inputs_of(const RankInputs& in) {
  return {.x = in.x.view(), .topk_idx = in.idx_view(), .topk_weights = in.weights_view()};
}

Status with_context(const char* what, Status status) {
  if (status.is_ok()) return status;
  return Status(status.code(), std::string(what) + ": " + status.message());
}

// Copies what dispatch returned, computes y (in place in recv_x when
// `y_is_recv_x`, else in a matrix with garbage past the counts), and combines.
Status dispatch_and_combine(LowLatencyBuffer& ll, const LLCase& c, int rank, const RankInputs& in, bool y_is_recv_x,
                            std::vector<Matrix>* recv, std::vector<std::vector<int32_t>>* src, Matrix* out,
                            const void** recv_data) {
  // The asynchronous forms: one rank works (sleeps) between issuing and waiting.
  const bool pauses = c.async && static_cast<int>(c.seed % c.num_ranks) == rank;
  auto finish = [&](const PendingOp& op) {
    if (pauses) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return op.wait();
  };
  LowLatencyDispatchResult d;
  EPX_RETURN_IF_ERROR(with_context(
      "dispatch", c.async ? finish(ll.dispatch_async(inputs_of(in), &d)) : ll.dispatch(inputs_of(in), &d)));
  *recv_data = d.recv_x.data();
  const int EL = ll.num_local_experts();
  const int64_t rows = ll.rows_per_expert();
  const int H = c.hidden;
  if (d.recv_x.ndim() != 3 || d.recv_x.size(0) != EL || d.recv_x.size(1) != rows || d.recv_x.size(2) != H)
    return internal_error("recv_x is {}", d.recv_x.describe());
  const auto* counts = d.num_recv_tokens_per_expert.data_as<const int32_t>();
  const auto* src_rank = d.recv_src_rank.data_as<const int32_t>();
  const auto* src_idx = d.recv_src_idx.data_as<const int32_t>();
  const auto* src_slot = d.recv_src_slot.data_as<const int32_t>();
  recv->clear();
  src->clear();
  const std::size_t row_bytes = static_cast<std::size_t>(H) * dtype_size(c.dtype);
  auto x_row = [&](int e, int64_t j) { return d.recv_x.data_as<std::byte>() + (e * rows + j) * row_bytes; };
  for (int e = 0; e < EL; ++e) {
    Matrix m(c.dtype, counts[e], H);
    std::vector<int32_t> s;
    for (int j = 0; j < counts[e]; ++j) {
      std::memcpy(m.row(j), x_row(e, j), row_bytes);
      const std::size_t i = static_cast<std::size_t>(e) * rows + j;
      s.insert(s.end(), {src_rank[i], src_idx[i], src_slot[i]});
    }
    for (int64_t j = counts[e]; j < rows; ++j)
      if (src_rank[e * rows + j] != -1) return internal_error("recv_src_rank[{}][{}] past the count is not -1", e, j);
    recv->push_back(std::move(m));
    src->push_back(std::move(s));
  }
  Matrix y_own;
  TensorView y;
  if (y_is_recv_x) {
    std::vector<std::byte> tmp(row_bytes);
    for (int e = 0; e < EL; ++e)
      for (int j = 0; j < counts[e]; ++j) {
        std::memcpy(tmp.data(), x_row(e, j), row_bytes);
        expert_row(tmp.data(), c.dtype, ll.placement().global_id(rank, e), H, x_row(e, j), c.dtype);
      }
    y = d.recv_x;
  } else {
    const DType y_dtype = c.y_dtype_of(rank);
    y_own = Matrix::filled(y_dtype, EL * rows, H, kGarbage);
    for (int e = 0; e < EL; ++e)
      for (int j = 0; j < counts[e]; ++j)
        expert_row(x_row(e, j), c.dtype, ll.placement().global_id(rank, e), H, y_own.row(e * rows + j), y_dtype);
    y = TensorView::contiguous(y_own.row(0), y_dtype, {EL, rows, H});
  }
  *out = Matrix::filled(c.out_dtype, in.num_tokens(), H, kUnwritten);
  return with_context("combine", c.async ? finish(ll.combine_async(y, d.handle, out->view()))
                                         : ll.combine(y, d.handle, out->view()));
}

Status run_rank(Transport& transport, const LLCase& c, int capacity, const RankInputs& in, Got* got) {
  const int r = transport.rank();
  EPX_ASSIGN_OR_RETURN(auto ll, LowLatencyBuffer::create(transport, make_config(c, capacity)));
  const std::size_t staging = ll->staging_bytes();
  const void* first = nullptr;
  const void* second = nullptr;
  EPX_RETURN_IF_ERROR(dispatch_and_combine(*ll, c, r, in, false, &got->recv, &got->src, &got->out, &first));
  std::vector<std::vector<int32_t>> src_again;
  EPX_RETURN_IF_ERROR(dispatch_and_combine(*ll, c, r, in, c.y_dtype_of(r) == c.dtype, &got->recv_again, &src_again,
                                           &got->out_again, &second));
  got->same_memory = first == second && staging == ll->staging_bytes() && src_again == got->src;
  return Status::ok();
}

// Adds to *nonzero the compared tensors that were not all zero (summed over processes).
void check_case(const LLCase& c, int64_t* nonzero_total) {
  SCOPED_TRACE(c.name());
  const int R = c.num_ranks;
  auto topology = Topology::create(R, c.num_nodes);
  ASSERT_TRUE(topology.is_ok()) << topology.status().to_string();
  auto placement = c.placement();
  ASSERT_TRUE(placement.is_ok()) << placement.status().to_string();
  const ExchangeSpec spec{*topology, *placement, c.dtype, c.hidden, 1};
  const std::vector<RankInputs> inputs = make_inputs(spec, c.routing, c.topk, kMaxTokens, c.with_weights, c.seed);
  const int capacity = c.tight_capacity ? std::max(1, max_rows_per_source_expert(inputs, c.num_experts)) : 0;

  TestWorld& world = test_world();
  std::vector<Got> got(R);
  const std::vector<Status> statuses =
      world.run(*topology, [&](Transport& t) { return run_rank(t, c, capacity, inputs[t.rank()], &got[t.rank()]); });
  int64_t nonzero = 0;
  for (int r = 0; r < R; ++r) {
    if (!world.holds(r)) continue;
    EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
    if (!statuses[r].is_ok()) continue;
    const Expected ex = reference(c, *placement, inputs, r);
    const Got& g = got[r];
    ASSERT_EQ(g.recv.size(), ex.recv.size()) << "rank " << r;
    for (std::size_t e = 0; e < ex.recv.size(); ++e) {
      EXPECT_TRUE(same_matrix(g.recv[e], ex.recv[e])) << "rank " << r << " local expert " << e;
      EXPECT_TRUE(same_vector(g.src[e], ex.src[e], 3)) << "rank " << r << " local expert " << e << " sources";
      EXPECT_TRUE(same_matrix(g.recv_again[e], ex.recv[e])) << "rank " << r << " local expert " << e << ", replayed";
      if (!ex.recv[e].all_zero()) ++nonzero;
    }
    EXPECT_TRUE(same_matrix(g.out, ex.out)) << "rank " << r << " combine";
    EXPECT_TRUE(same_matrix(g.out_again, ex.out)) << "rank " << r << " combine, replayed";
    EXPECT_TRUE(g.same_memory) << "rank " << r << ": the replay moved recv_x or grew the staging";
    if (!ex.out.all_zero()) ++nonzero;
  }
  world.sum(std::span<int64_t>(&nonzero, 1));
  *nonzero_total += nonzero;
}

struct Shape {
  int num_ranks;
  int num_nodes;
};

class LowLatency : public ::testing::TestWithParam<Shape> {};

// A case on `shape`'s world; the tests vary the rest.
LLCase case_on(const Shape& shape, DType dtype, int experts, int topk, Routing routing, uint32_t seed) {
  LLCase c;
  c.num_ranks = shape.num_ranks;
  c.num_nodes = shape.num_nodes;
  c.dtype = dtype;
  c.y_dtype = dtype;
  c.num_experts = experts;
  c.topk = topk;
  c.routing = routing;
  c.seed = seed;
  return c;
}

// The options the big tests cycle through with a case's index.
void vary_with_index(uint32_t index, LLCase* c) {
  c->out_dtype = index % 2 == 0 ? DType::kBF16 : DType::kF32;
  c->with_weights = index % 4 != 1;
  c->tight_capacity = index % 2 == 1;
  c->hidden = index % 2 == 0 ? 16 : 36;
  c->async = index % 3 == 2;
  // Every fifth case: experts dealt over all ranks but the last, which holds none.
  if (index % 5 == 0 && c->num_ranks > 1)
    for (int e = 0; e < c->num_experts; ++e) c->expert_map.push_back(e % (c->num_ranks - 1));
}


TEST_P(LowLatency, MatchesTheReference) {
  const Shape shape = GetParam();
  EPX_SKIP_UNLESS_RUNNABLE(shape.num_ranks, shape.num_nodes);
  uint32_t index = 0;
  int64_t nonzero = 0;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int experts : {shape.num_ranks, 4 * shape.num_ranks}) {
      for (int topk : {1, 2, 8}) {
        if (topk > experts) continue;
        for (Routing routing : kAllRoutings) {
          LLCase c = case_on(shape, dtype, experts, topk, routing,
                             1000u * static_cast<uint32_t>(shape.num_ranks * 4 + shape.num_nodes) + ++index);
          c.y_dtype = index % 3 == 0 ? DType::kBF16 : dtype;
          vary_with_index(index, &c);
          check_case(c, &nonzero);
          if (test_world().any(::testing::Test::HasFailure())) return;
        }
      }
    }
  }
  EXPECT_GT(nonzero, 0) << "every compared tensor was zero";
}

INSTANTIATE_TEST_SUITE_P(Exchange, LowLatency,
                         ::testing::Values(Shape{1, 1}, Shape{2, 1}, Shape{2, 2}, Shape{4, 1}, Shape{4, 2},
                                           Shape{8, 1}, Shape{8, 2}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return fmt::format("{}ranks_{}nodes", info.param.num_ranks, info.param.num_nodes);
                         });

// A token that goes to several experts of one rank crosses to that rank as one
// row with its list of (local expert, k); the owner copies it into each of
// those experts' rows. Every token here names every expert (top-k = E, the
// slots in a random order per token; with holes some are -1), so each rank
// holds 2 or 3 of a token's experts: a row copied into the wrong expert, or
// left out of one, changes that expert's rows, sources or the combine's sum
// (y depends on the expert) and fails the bit-for-bit comparison.
TEST_P(LowLatency, TokenToSeveralExpertsOfOneRank) {
  const Shape shape = GetParam();
  EPX_SKIP_UNLESS_RUNNABLE(shape.num_ranks, shape.num_nodes);
  if (shape.num_ranks > 4) GTEST_SKIP() << "top-k = E needs E <= 8: at most 4 ranks of 2 experts";
  uint32_t index = 0;
  int64_t nonzero = 0;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int per_rank : {2, 3}) {
      const int experts = per_rank * shape.num_ranks;
      if (experts > 8) continue;
      for (Routing routing : {Routing::kUniform, Routing::kHoles}) {
        LLCase c = case_on(shape, dtype, experts, experts, routing,
                           7000u + 16u * static_cast<uint32_t>(shape.num_ranks * 4 + shape.num_nodes) + ++index);
        c.tight_capacity = index % 2 == 0;
        for (bool per_rank : {false, true}) {
          c.per_rank = per_rank;
          check_case(c, &nonzero);
        }
        if (test_world().any(::testing::Test::HasFailure())) return;
      }
    }
  }
  EXPECT_GT(nonzero, 0) << "every compared tensor was zero";
}

// combine_per_rank: the owners' per-(token, rank) sums, exactly against their
// formula (per_rank_sum), on every shape, with bf16 y (a rounding per (token,
// rank)) and f32 y (only the order changes), holes, uneven maps.
TEST_P(LowLatency, CombinePerRankMatchesItsFormula) {
  const Shape shape = GetParam();
  EPX_SKIP_UNLESS_RUNNABLE(shape.num_ranks, shape.num_nodes);
  uint32_t index = 0;
  int64_t nonzero = 0;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int topk : {2, 8}) {
      const int experts = 4 * shape.num_ranks;
      if (topk > experts) continue;
      for (Routing routing : {Routing::kUniform, Routing::kHoles, Routing::kOneRankPerToken, Routing::kEmptyRank}) {
        LLCase c = case_on(shape, dtype, experts, topk, routing,
                           9000u + 64u * static_cast<uint32_t>(shape.num_ranks * 4 + shape.num_nodes) + ++index);
        c.per_rank = true;
        c.y_dtype = index % 3 != 1 ? DType::kBF16 : DType::kF32;
        vary_with_index(index, &c);
        check_case(c, &nonzero);
        if (test_world().any(::testing::Test::HasFailure())) return;
      }
    }
  }
  EXPECT_GT(nonzero, 0) << "every compared tensor was zero";
}

// Owners may give y of different dtypes (each up to max_combine_dtype): here
// the last rank's experts give bf16 rows and the others f32, so a token's
// rows differ in dtype where it reaches the last rank and the others. The
// combine sums each token's rows in its fixed order whatever their dtypes:
// exactly the formula, with and without combine_per_rank. Hidden 80 takes a
// 64-column block in registers and a tail; bf16 out rounds once.
TEST_P(LowLatency, OwnersMayGiveYOfDifferentDtypes) {
  const Shape shape = GetParam();
  EPX_SKIP_UNLESS_RUNNABLE(shape.num_ranks, shape.num_nodes);
  if (shape.num_ranks < 2) GTEST_SKIP() << "one rank: one dtype";
  uint32_t index = 0;
  int64_t nonzero = 0;
  for (int topk : {2, 8}) {
    const int experts = 4 * shape.num_ranks;
    for (Routing routing : {Routing::kUniform, Routing::kHoles}) {
      LLCase c = case_on(shape, DType::kF32, experts, topk, routing,
                         11000u + 64u * static_cast<uint32_t>(shape.num_ranks * 4 + shape.num_nodes) + ++index);
      c.last_rank_bf16_y = true;
      c.hidden = routing == Routing::kUniform ? 80 : 16;
      c.out_dtype = topk == 8 ? DType::kBF16 : DType::kF32;
      for (bool per_rank : {false, true}) {
        c.per_rank = per_rank;
        check_case(c, &nonzero);
      }
      if (test_world().any(::testing::Test::HasFailure())) return;
    }
  }
  EXPECT_GT(nonzero, 0) << "every compared tensor was zero";
}

// Errors: a first call that fails in a stated way on every rank, then a good
// dispatch + combine that must match the reference (the buffer is still usable).
struct ErrorRun {
  std::vector<Status> first;  // per rank
  std::vector<Status> recover;
  std::vector<Got> got;
};

enum class Fault { kOverflow, kBadExpert, kTooManyTokens, kStaleHandle, kCombineTwice };

ErrorRun run_fault(const Shape& shape, Fault fault, const LLCase& c, const std::vector<RankInputs>& good) {
  ErrorRun run;
  run.first.assign(shape.num_ranks, Status::ok());
  run.recover.assign(shape.num_ranks, Status::ok());
  run.got.resize(shape.num_ranks);
  // Overflow: the tightest capacity the good inputs fit, which rank 1 exceeds by one.
  const int capacity = fault == Fault::kOverflow ? max_rows_per_source_expert(good, c.num_experts) : 0;
  const std::vector<Status> statuses = test_world().run(*Topology::create(shape.num_ranks, shape.num_nodes), [&](Transport& t) {
    const int r = t.rank();
    EPX_ASSIGN_OR_RETURN(auto ll, LowLatencyBuffer::create(t, make_config(c, capacity)));
    RankInputs in = good[r];
    const void* data = nullptr;
    Got& g = run.got[r];
    switch (fault) {
      case Fault::kOverflow:
      case Fault::kBadExpert:
      case Fault::kTooManyTokens: {
        // Rank 1 sends capacity + 1 tokens to expert 3, names expert 99, or passes 30 tokens.
        if (r == 1) {
          const int T = fault == Fault::kTooManyTokens ? kMaxTokens + 6 : fault == Fault::kOverflow ? capacity + 1 : 5;
          in.x = make_payload(7, r, T, c.hidden, c.dtype);
          in.topk_idx.assign(static_cast<std::size_t>(T) * c.topk, -1);
          for (int tok = 0; tok < T; ++tok) in.topk_idx[static_cast<std::size_t>(tok) * c.topk] = 3;
          if (fault == Fault::kBadExpert) in.topk_idx[static_cast<std::size_t>(2) * c.topk] = 99;
          in.with_weights = false;
          in.topk_weights.clear();
        }
        LowLatencyDispatchResult d;
        run.first[r] = ll->dispatch(inputs_of(in), &d);
        break;
      }
      case Fault::kStaleHandle:
      case Fault::kCombineTwice: {
        // Two dispatches; rank 2 combines with the first's handle. Or a
        // dispatch combined twice by everyone.
        EPX_RETURN_IF_ERROR(dispatch_and_combine(*ll, c, r, good[r], false, &g.recv, &g.src, &g.out, &data));
        LowLatencyDispatchResult d;
        EPX_RETURN_IF_ERROR(ll->dispatch(inputs_of(good[r]), &d));
        LowLatencyHandle handle = d.handle;
        if (fault == Fault::kStaleHandle && r == 2) handle.seq -= 1;
        Matrix y = Matrix::filled(c.y_dtype, ll->num_local_experts() * ll->rows_per_expert(), c.hidden, 0.0f);
        const TensorView yv =
            TensorView::contiguous(y.row(0), c.y_dtype, {ll->num_local_experts(), ll->rows_per_expert(), c.hidden});
        Matrix out = Matrix::filled(c.out_dtype, good[r].num_tokens(), c.hidden, kUnwritten);
        if (fault == Fault::kCombineTwice) EPX_RETURN_IF_ERROR(ll->combine(yv, handle, out.view()));
        run.first[r] = ll->combine(yv, handle, out.view());
        break;
      }
    }
    run.recover[r] = dispatch_and_combine(*ll, c, r, good[r], false, &g.recv, &g.src, &g.out, &data);
    return Status::ok();
  });
  for (int r = 0; r < shape.num_ranks; ++r)
    if (test_world().holds(r)) {
      EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
    }
  return run;
}

class LowLatencyErrors : public ::testing::TestWithParam<Shape> {};

TEST_P(LowLatencyErrors, FailOnEveryRankThenWork) {
  const Shape shape = GetParam();
  EPX_SKIP_UNLESS_RUNNABLE(shape.num_ranks, shape.num_nodes);
  LLCase c;
  c.num_ranks = shape.num_ranks;
  c.num_nodes = shape.num_nodes;
  c.dtype = DType::kBF16;
  c.y_dtype = DType::kF32;
  c.out_dtype = DType::kBF16;
  c.num_experts = 4 * shape.num_ranks;
  c.topk = 2;
  c.routing = Routing::kEmptyRank;
  const ExchangeSpec spec{*Topology::create(shape.num_ranks, shape.num_nodes),
                          *ExpertPlacement::contiguous(c.num_experts, shape.num_ranks), c.dtype, c.hidden, 1};
  const std::vector<RankInputs> good = make_inputs(spec, c.routing, c.topk, kMaxTokens, true, 77);
  const struct {
    Fault fault;
    const char* name;
    StatusCode at_culprit;   // on the rank at fault
    StatusCode elsewhere;    // on the others
    const char* says;        // in every message (culprit and others)
  } kFaults[] = {
      {Fault::kOverflow, "overflow", StatusCode::kResourceExhausted, StatusCode::kResourceExhausted, ""},
      {Fault::kBadExpert, "bad expert", StatusCode::kInvalidArgument, StatusCode::kAborted, ""},
      {Fault::kTooManyTokens, "too many tokens", StatusCode::kInvalidArgument, StatusCode::kAborted, ""},
      {Fault::kStaleHandle, "stale handle", StatusCode::kInvalidArgument, StatusCode::kAborted, ""},
      {Fault::kCombineTwice, "combine twice", StatusCode::kFailedPrecondition, StatusCode::kFailedPrecondition,
       "was combined already"},
  };
  for (const auto& f : kFaults) {
    SCOPED_TRACE(f.name);
    const int culprit = f.fault == Fault::kStaleHandle ? 2 % shape.num_ranks : 1;
    const int capacity = max_rows_per_source_expert(good, c.num_experts);
    const std::string says = f.fault == Fault::kOverflow
                                 ? fmt::format("expert 3 would receive {} rows from rank 1 but the low-latency capacity "
                                               "is {} rows per (expert, source rank)",
                                               capacity + 1, capacity)
                                 : f.says;
    const ErrorRun run = run_fault(shape, f.fault, c, good);
    for (int r = 0; r < shape.num_ranks; ++r) {
      if (!test_world().holds(r)) continue;
      const bool is_culprit = r == culprit;
      const Status& st = run.first[r];
      EXPECT_EQ(st.code(), is_culprit ? f.at_culprit : f.elsewhere) << "rank " << r << ": " << st.to_string();
      EXPECT_NE(st.message().find(says), std::string::npos) << "rank " << r << ": " << st.to_string();
      std::string detail;
      if (f.fault == Fault::kBadExpert && is_culprit) detail = "topk_idx[2][0] = 99 is outside [0, 16)";
      if (f.fault == Fault::kTooManyTokens && is_culprit) detail = "num_tokens = 30 is above max_tokens_per_rank = 24";
      if (f.elsewhere == StatusCode::kAborted && !is_culprit) detail = fmt::format("rank {} rejected", culprit);
      EXPECT_NE(st.message().find(detail), std::string::npos) << "rank " << r << ": " << st.to_string();
      // The next call works and matches the reference.
      ASSERT_TRUE(run.recover[r].is_ok()) << "rank " << r << " afterwards: " << run.recover[r].to_string();
      const Expected ex = reference(c, spec.placement, good, r);
      for (std::size_t e = 0; e < ex.recv.size(); ++e)
        EXPECT_TRUE(same_matrix(run.got[r].recv[e], ex.recv[e])) << "rank " << r << " expert " << e;
      EXPECT_TRUE(same_matrix(run.got[r].out, ex.out)) << "rank " << r;
    }
    if (test_world().any(::testing::Test::HasFailure())) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Exchange, LowLatencyErrors, ::testing::Values(Shape{4, 1}, Shape{4, 2}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return fmt::format("{}ranks_{}nodes", info.param.num_ranks, info.param.num_nodes);
                         });

// A rank that never arrives: the others give up within the timeout, and the
// buffer is poisoned (every later call Aborted) instead of hanging.
TEST(LowLatencyTimeout, MissingRankFailsTheOthersAndPoisons) {
  EPX_SKIP_UNLESS_RUNNABLE(4, 2);
  // The poisoned transport would outlive the test in the MPI world's cache.
  if (test_world().name() != "inproc") GTEST_SKIP() << "runs in-process only";
  LLCase c;
  c.num_ranks = 4;
  c.num_nodes = 2;
  c.num_experts = 8;
  const ExchangeSpec spec{*Topology::create(4, 2), *ExpertPlacement::contiguous(8, 4), c.dtype, c.hidden, 1};
  const std::vector<RankInputs> good = make_inputs(spec, Routing::kUniform, 1, kMaxTokens, true, 5);
  std::vector<Status> first(4), later(4);
  test_world().run(*Topology::create(4, 2), [&](Transport& t) {
    LowLatencyConfig config = make_config(c, 0);
    config.timeout = Milliseconds(500);
    EPX_ASSIGN_OR_RETURN(auto ll, LowLatencyBuffer::create(t, config));
    if (t.rank() == 3) return Status::ok();  // skips the dispatch
    LowLatencyDispatchResult d;
    first[t.rank()] = ll->dispatch(inputs_of(good[t.rank()]), &d);
    later[t.rank()] = ll->dispatch(inputs_of(good[t.rank()]), &d);
    return Status::ok();
  });
  for (int r = 0; r < 3; ++r) {
    if (!test_world().holds(r)) continue;
    EXPECT_TRUE(first[r].code() == StatusCode::kDeadlineExceeded || first[r].code() == StatusCode::kAborted)
        << "rank " << r << ": " << first[r].to_string();
    EXPECT_EQ(later[r].code(), StatusCode::kAborted) << "rank " << r << ": " << later[r].to_string();
  }
}

TEST(LowLatencyConfigTest, RejectsBadAndMismatchedConfigs) {
  EPX_SKIP_UNLESS_RUNNABLE(2, 1);
  std::vector<Status> statuses(2);
  test_world().run(*Topology::create(2, 1), [&](Transport& t) {
    LowLatencyConfig config;
    config.num_experts = 8;
    config.hidden = 16;
    config.max_tokens_per_rank = 4;
    config.capacity = t.rank() == 1 ? 3 : 2;
    statuses[t.rank()] = LowLatencyBuffer::create(t, config).status();
    return Status::ok();
  });
  for (int r = 0; r < 2; ++r) {
    if (test_world().holds(r)) {
      EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << statuses[r].to_string();
      EXPECT_NE(statuses[r].message().find("capacity is 2 on rank 0 but 3 on rank 1"), std::string::npos)
          << statuses[r].to_string();
    }
  }
  test_world().run(*Topology::create(2, 1), [&](Transport& t) {
    LowLatencyConfig config;
    config.num_experts = 8;
    config.hidden = 16;
    config.max_tokens_per_rank = 4;
    config.capacity = 5;
    statuses[t.rank()] = LowLatencyBuffer::create(t, config).status();
    return Status::ok();
  });
  for (int r = 0; r < 2; ++r) {
    if (!test_world().holds(r)) continue;
    EXPECT_NE(statuses[r].message().find("capacity = 5 is outside [0 (the worst case), max_tokens_per_rank = 4]"),
              std::string::npos)
        << statuses[r].to_string();
  }
}

}  // namespace
}  // namespace epx::exchange_test
