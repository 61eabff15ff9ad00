// The tiny scenario at the top of the suite: every expected value below was
// worked out by hand from the inputs, not by the reference code.
//
// 4 ranks, 8 experts (rank r holds experts 2r and 2r+1: local ids 0 and 1),
// top-2, hidden 8, f32. x[s][t][c] = 100 s + 10 t + c, so every element says
// where it came from.
//
//   rank 0: t0 -> {1, 2}   t1 -> {7, 6}   t2 -> {0, -1}
//   rank 1: t0 -> {5, 0}   t1 -> {3, -1}
//   rank 2: t0 -> {4, 5}   t1 -> {-1, -1}
//   rank 3: t0 -> {6, 1}   t1 -> {2, 1}   t2 -> {0, 7}
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epx/comm/inproc.h"
#include "epx/comm/topology.h"
#include "epx/exchange/buffer.h"
#include "exchange/harness.h"
#include "exchange/reference.h"

namespace epx::exchange_test {
namespace {

constexpr int kRanks = 4;
constexpr int kExperts = 8;
constexpr int kTopk = 2;
constexpr int kHidden = 8;

const std::vector<std::vector<int32_t>> kTopkIdx = {
    {1, 2, 7, 6, 0, -1},
    {5, 0, 3, -1},
    {4, 5, -1, -1},
    {6, 1, 2, 1, 0, 7},
};
const std::vector<std::vector<float>> kTopkWeights = {
    {0.5f, 0.25f, 0.75f, 0.125f, 1.0f, 2.0f},
    {0.375f, 0.5f, 1.5f, 3.0f},
    {0.25f, 0.625f, 4.0f, 4.0f},
    {0.5f, 0.5f, 0.875f, 0.0625f, 2.0f, 0.25f},
};

float hand_x(int s, int t, int c) { return static_cast<float>(100 * s + 10 * t + c); }

// What each rank must receive, in (source rank, source token) order.
struct HandRecv {
  std::vector<int32_t> src_rank;
  std::vector<int32_t> src_idx;
  std::vector<int32_t> topk_idx;  // local ids
  std::vector<float> topk_weights;
  std::vector<int32_t> counts;  // per local expert, alignment 1
};
const std::vector<HandRecv> kRecv = {
    // rank 0 (experts 0, 1)
    {{0, 0, 1, 3, 3, 3},
     {0, 2, 0, 0, 1, 2},
     {1, -1, 0, -1, -1, 0, -1, 1, -1, 1, 0, -1},
     {0.5f, 0, 1.0f, 0, 0, 0.5f, 0, 0.5f, 0, 0.0625f, 2.0f, 0},
     {3, 3}},
    // rank 1 (experts 2, 3)
    {{0, 1, 3}, {0, 1, 1}, {-1, 0, 1, -1, 0, -1}, {0, 0.25f, 1.5f, 0, 0.875f, 0}, {2, 1}},
    // rank 2 (experts 4, 5)
    {{1, 2}, {0, 0}, {1, -1, 0, 1}, {0.375f, 0, 0.25f, 0.625f}, {1, 2}},
    // rank 3 (experts 6, 7)
    {{0, 3, 3}, {1, 0, 2}, {1, 0, 0, -1, -1, 1}, {0.75f, 0.125f, 0.5f, 0, 0, 0.25f}, {2, 2}},
};

// Layouts: tokens per rank, per expert, and is_token_in_rank.
const std::vector<std::vector<int32_t>> kTokensPerRank = {{2, 1, 0, 1}, {1, 1, 1, 0}, {0, 0, 1, 0}, {3, 1, 0, 2}};
const std::vector<std::vector<int32_t>> kTokensPerExpert = {
    {1, 1, 1, 0, 0, 0, 1, 1}, {1, 0, 0, 1, 0, 1, 0, 0}, {0, 0, 0, 0, 1, 1, 0, 0}, {1, 2, 1, 0, 0, 0, 1, 1}};
const std::vector<std::vector<uint8_t>> kInRank = {
    {1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0},
    {1, 0, 1, 0, 0, 1, 0, 0},
    {0, 0, 1, 0, 0, 0, 0, 0},
    {1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 0, 1},
};
const std::vector<std::vector<int32_t>> kTokensPerNode1x4 = {{3}, {2}, {1}, {3}};
const std::vector<std::vector<int32_t>> kTokensPerNode2x2 = {{2, 1}, {2, 1}, {0, 1}, {3, 2}};

// combine of y_r = (r + 1) * recv_x: out[s][t] = factor * x[s][t], factor =
// the sum of (r + 1) over the ranks holding t.
const std::vector<std::vector<float>> kCombineFactor = {{3, 4, 1}, {4, 2}, {3, 0}, {5, 3, 5}};
// combine_expanded of y = the expanded recv_x with the dispatched weights:
// out[s][t] = (sum of the weights of t's valid slots) * x[s][t].
const std::vector<std::vector<float>> kWeightSum = {{0.75f, 0.875f, 1.0f}, {0.875f, 1.5f}, {0.875f, 0}, {1.0f, 0.9375f, 2.25f}};
// dispatch_backward of the weights with grad_recv_w[r][i][k] = 100 + 10 r + i + 0.5 k.
const std::vector<std::vector<float>> kWeightGrad = {
    {100, 110.5f, 130, 130.5f, 101, 0},
    {120, 102.5f, 111, 0},
    {121, 121.5f, 0, 0},
    {131, 103.5f, 112, 104.5f, 105, 132.5f},
};
// Rank 0's expanded layout.
struct HandExpanded {
  std::vector<int64_t> offsets;
  std::vector<int64_t> row_of;
  std::vector<int64_t> recv_row;
};
const HandExpanded kRank0Expanded1 = {{0, 3, 6}, {3, -1, 0, -1, -1, 1, -1, 4, -1, 5, 2, -1}, {1, 2, 5, 0, 3, 4}};
const HandExpanded kRank0Expanded4 = {
    {0, 4, 8}, {4, -1, 0, -1, -1, 1, -1, 5, -1, 6, 2, -1}, {1, 2, 5, -1, 0, 3, 4, -1}};

// Across nodes (2 x 2: ranks {0, 1} and {2, 3}): 5 (token, remote node) pairs
// and 6 (token, remote rank) pairs (rank 3's t1 goes to both ranks of node 0).
constexpr int64_t kRemoteNodePairs = 5;
constexpr int64_t kRemoteRankPairs = 6;

struct HandOutputs {
  DispatchLayout layout;
  Matrix recv_x;
  std::vector<int32_t> recv_topk_idx, recv_src_rank, recv_src_idx, counts;
  std::vector<float> recv_topk_weights;
  Matrix combined;
  ExpandedLayout expanded;
  Matrix expanded_x;
  Matrix combined_expanded;
  Matrix grad_x;
  std::vector<float> grad_w;
  Matrix grad_y;
  uint64_t dispatch_inter_bytes = 0;
  uint64_t combine_inter_bytes = 0;
};

struct HandCase {
  int num_nodes;
  DispatchAlgorithm algorithm;
  int alignment;
};

std::string hand_case_name(const ::testing::TestParamInfo<HandCase>& info) {
  const char* algo = info.param.algorithm == DispatchAlgorithm::kFlat           ? "flat"
                     : info.param.algorithm == DispatchAlgorithm::kHierarchical ? "hierarchical"
                                                                                : "auto";
  return std::to_string(info.param.num_nodes) + "nodes_" + algo + "_align" + std::to_string(info.param.alignment);
}

class HandScenario : public ::testing::TestWithParam<HandCase> {};

Status run_rank(Transport& transport, const HandCase& param, HandOutputs* out) {
  const int r = transport.rank();
  BufferConfig config;
  config.num_experts = kExperts;
  config.hidden = kHidden;
  config.dtype = DType::kF32;
  config.max_topk = kTopk;
  config.max_tokens_per_rank = 4;
  config.expert_alignment = param.alignment;
  config.algorithm = param.algorithm;
  config.timeout = Milliseconds(20000);
  EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(transport, config));
  const int num_tokens = static_cast<int>(kTopkIdx[r].size()) / kTopk;
  Matrix x(DType::kF32, num_tokens, kHidden);
  for (int t = 0; t < num_tokens; ++t)
    for (int c = 0; c < kHidden; ++c) x.set(t, c, hand_x(r, t, c));
  const auto idx = TensorView::contiguous(kTopkIdx[r].data(), DType::kI32, {num_tokens, kTopk});
  const auto weights = TensorView::contiguous(kTopkWeights[r].data(), DType::kF32, {num_tokens, kTopk});

  EPX_ASSIGN_OR_RETURN(out->layout, buffer->get_layout(idx));
  const TransportCounters c0 = transport.counters();
  DispatchResult recv;
  EPX_RETURN_IF_ERROR(buffer->dispatch({.x = x.view(), .topk_idx = idx, .topk_weights = weights}, &recv));
  const TransportCounters c1 = transport.counters();
  out->dispatch_inter_bytes = c1.inter_node_bytes - c0.inter_node_bytes;
  out->recv_x = Matrix::copy_of(recv.recv_x);
  out->recv_topk_idx = copy_i32(recv.recv_topk_idx);
  out->recv_topk_weights = copy_f32(recv.recv_topk_weights);
  out->recv_src_rank = copy_i32(recv.recv_src_rank);
  out->recv_src_idx = copy_i32(recv.recv_src_idx);
  out->counts = recv.num_recv_tokens_per_expert;

  const int64_t n = out->recv_x.rows();
  Matrix y(DType::kF32, n, kHidden);
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < kHidden; ++c) y.set(i, c, out->recv_x.get(i, c) * static_cast<float>(r + 1));
  out->combined = Matrix::filled(DType::kF32, num_tokens, kHidden, kUnwritten);
  const TransportCounters c2 = transport.counters();
  EPX_RETURN_IF_ERROR(buffer->combine(y.view(), recv.handle, out->combined.view()));
  out->combine_inter_bytes = transport.counters().inter_node_bytes - c2.inter_node_bytes;

  out->expanded = buffer->expanded_layout(recv.handle);
  out->expanded_x = Matrix::filled(DType::kF32, out->expanded.num_rows(), kHidden, kUnwritten);
  EPX_RETURN_IF_ERROR(buffer->expand(out->recv_x.view(), recv.handle, out->expanded_x.view()));
  out->combined_expanded = Matrix::filled(DType::kF32, num_tokens, kHidden, kUnwritten);
  EPX_RETURN_IF_ERROR(buffer->combine_expanded(out->expanded_x.view(), recv.handle, out->combined_expanded.view()));

  std::vector<float> grad_recv_w(n * kTopk);
  for (int64_t i = 0; i < n; ++i)
    for (int k = 0; k < kTopk; ++k) grad_recv_w[i * kTopk + k] = 100.0f + 10.0f * r + i + 0.5f * k;
  out->grad_w.assign(num_tokens * kTopk, -1.0f);
  out->grad_x = Matrix::filled(DType::kF32, num_tokens, kHidden, kUnwritten);
  CombineOptions options;
  options.grad_recv_topk_weights = TensorView::contiguous(grad_recv_w.data(), DType::kF32, {n, kTopk});
  options.grad_topk_weights = TensorView::contiguous(out->grad_w.data(), DType::kF32, {num_tokens, kTopk});
  EPX_RETURN_IF_ERROR(buffer->dispatch_backward(y.view(), recv.handle, out->grad_x.view(), options));

  Matrix grad_out(DType::kF32, num_tokens, kHidden);
  for (int t = 0; t < num_tokens; ++t)
    for (int c = 0; c < kHidden; ++c) grad_out.set(t, c, -hand_x(r, t, c) - 0.5f);
  TensorView grad_y;
  EPX_RETURN_IF_ERROR(buffer->combine_backward(grad_out.view(), recv.handle, &grad_y));
  out->grad_y = Matrix::copy_of(grad_y);
  return Status::ok();
}

TEST_P(HandScenario, EveryRankGetsTheHandWrittenResult) {
  const HandCase param = GetParam();
  auto topology = Topology::create(kRanks, param.num_nodes);
  ASSERT_TRUE(topology.is_ok());
  InprocWorld world(*topology);
  std::vector<HandOutputs> outs(kRanks);
  const std::vector<Status> statuses =
      world.run([&](Transport& t) { return run_rank(t, param, &outs[t.rank()]); });
  const Status first = first_error(statuses);
  ASSERT_TRUE(first.is_ok()) << first.to_string();

  uint64_t dispatch_bytes = 0;
  uint64_t combine_bytes = 0;
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const HandOutputs& o = outs[r];
    const HandRecv& want = kRecv[r];
    const int num_tokens = static_cast<int>(kTopkIdx[r].size()) / kTopk;
    dispatch_bytes += o.dispatch_inter_bytes;
    combine_bytes += o.combine_inter_bytes;

    EXPECT_EQ(o.layout.num_tokens, num_tokens);
    EXPECT_EQ(o.layout.num_tokens_per_rank, kTokensPerRank[r]);
    EXPECT_EQ(o.layout.num_tokens_per_expert, kTokensPerExpert[r]);
    EXPECT_EQ(o.layout.is_token_in_rank, kInRank[r]);
    EXPECT_EQ(o.layout.num_tokens_per_node, param.num_nodes == 1 ? kTokensPerNode1x4[r] : kTokensPerNode2x2[r]);

    EXPECT_EQ(o.recv_src_rank, want.src_rank);
    EXPECT_EQ(o.recv_src_idx, want.src_idx);
    EXPECT_EQ(o.recv_topk_idx, want.topk_idx);
    EXPECT_EQ(o.recv_topk_weights, want.topk_weights);
    std::vector<int32_t> counts = want.counts;
    if (param.alignment == 4) counts = {4, 4};
    EXPECT_EQ(o.counts, counts);
    ASSERT_EQ(o.recv_x.rows(), static_cast<int64_t>(want.src_rank.size()));
    ASSERT_EQ(o.recv_x.cols(), kHidden);
    for (std::size_t i = 0; i < want.src_rank.size(); ++i)
      for (int c = 0; c < kHidden; ++c)
        EXPECT_EQ(o.recv_x.get(i, c), hand_x(want.src_rank[i], want.src_idx[i], c)) << "row " << i << " col " << c;

    ASSERT_EQ(o.combined.rows(), num_tokens);
    for (int t = 0; t < num_tokens; ++t)
      for (int c = 0; c < kHidden; ++c) {
        EXPECT_EQ(o.combined.get(t, c), kCombineFactor[r][t] * hand_x(r, t, c)) << "combine token " << t << " col " << c;
        EXPECT_EQ(o.grad_x.get(t, c), kCombineFactor[r][t] * hand_x(r, t, c)) << "grad_x token " << t << " col " << c;
        EXPECT_EQ(o.combined_expanded.get(t, c), kWeightSum[r][t] * hand_x(r, t, c))
            << "combine_expanded token " << t << " col " << c;
      }
    EXPECT_EQ(o.grad_w, kWeightGrad[r]);
    ASSERT_EQ(o.grad_y.rows(), static_cast<int64_t>(want.src_rank.size()));
    for (std::size_t i = 0; i < want.src_rank.size(); ++i)
      for (int c = 0; c < kHidden; ++c)
        EXPECT_EQ(o.grad_y.get(i, c), -hand_x(want.src_rank[i], want.src_idx[i], c) - 0.5f) << "grad_y row " << i;

    if (r == 0) {
      const HandExpanded& ex = param.alignment == 1 ? kRank0Expanded1 : kRank0Expanded4;
      EXPECT_EQ(o.expanded.expert_offsets, ex.offsets);
      EXPECT_EQ(o.expanded.num_tokens_per_expert, (std::vector<int32_t>{3, 3}));
      EXPECT_EQ(o.expanded.row_of, ex.row_of);
      EXPECT_EQ(o.expanded.recv_row, ex.recv_row);
      ASSERT_EQ(o.expanded_x.rows(), static_cast<int64_t>(ex.recv_row.size()));
      for (std::size_t j = 0; j < ex.recv_row.size(); ++j)
        for (int c = 0; c < kHidden; ++c) {
          const int64_t i = ex.recv_row[j];
          EXPECT_EQ(o.expanded_x.get(j, c), i < 0 ? 0.0f : hand_x(want.src_rank[i], want.src_idx[i], c))
              << "expanded row " << j;
        }
    }
  }

  // Across nodes: one row (32 bytes) plus metadata (4 + 2 * 4 ids + 2 * 4
  // weights = 20 bytes) per pair for dispatch, one fp32 row per pair for combine.
  const bool two_hop = param.num_nodes > 1 && param.algorithm != DispatchAlgorithm::kFlat;
  const int64_t pairs = param.num_nodes == 1 ? 0 : two_hop ? kRemoteNodePairs : kRemoteRankPairs;
  EXPECT_EQ(dispatch_bytes, static_cast<uint64_t>(pairs * (32 + 20)));
  EXPECT_EQ(combine_bytes, static_cast<uint64_t>(pairs * 32));
}

INSTANTIATE_TEST_SUITE_P(Exchange, HandScenario,
                         ::testing::Values(HandCase{1, DispatchAlgorithm::kAuto, 1},
                                           HandCase{2, DispatchAlgorithm::kFlat, 1},
                                           HandCase{2, DispatchAlgorithm::kHierarchical, 4},
                                           HandCase{2, DispatchAlgorithm::kAuto, 4}),
                         hand_case_name);

}  // namespace
}  // namespace epx::exchange_test
