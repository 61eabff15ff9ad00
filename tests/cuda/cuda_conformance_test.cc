// The exchange conformance table (tests/exchange/conformance_table.h: the
// same shapes, sub-cases and BufferConfig the in-process backend runs) on
// the CUDA backend: R emulated ranks on one GPU (CudaGroup), every operation
// against the reference of tests/exchange/reference.h, which the in-process
// backend matches bit for bit. Dispatch, layouts, the expanded layout and the
// backward passes are compared exactly; combines exactly in the contract's
// order (the kernels sum in fp32 without FMA, so there is no tolerance to
// state). CudaGroup has blocking forms only, so a case's form is not
// exercised here, nor its pass_layout and combine_input knobs (CudaGroup has
// neither; CudaBuffer's dispatch_async and combine_async are checked in
// cuda_buffer_test.cc). Skipped, with the reason, where no GPU is; like every
// CUDA test it has been compiled but not yet run on a GPU (docs/design.md,
// The CUDA backend).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "device_memory.h"
#include "epx/exchange/cuda_group.h"
#include "exchange/conformance_table.h"
#include "exchange/harness.h"
#include "exchange/reference.h"

namespace epx::cuda_test {
namespace {

using exchange_test::Matrix;
using exchange_test::RankInputs;
using exchange_test::RefExpanded;
using exchange_test::RefRecv;
using exchange_test::Routing;

using exchange_test::Case;
using exchange_test::Shape;

template <typename F>
auto per_rank(int R, F f) {
  std::vector<decltype(f(0))> out;
  for (int r = 0; r < R; ++r) out.push_back(f(r));
  return out;
}

std::vector<TensorView> views_of(const std::vector<DeviceMatrix>& ms) {
  std::vector<TensorView> v;
  for (const DeviceMatrix& m : ms) v.push_back(m.view);
  return v;
}

// 4 experts, hidden 8, f32, top-2, 4 tokens per rank.
BufferConfig tiny_config() {
  BufferConfig config;
  config.num_experts = 4;
  config.hidden = 8;
  config.dtype = DType::kF32;
  config.max_topk = 2;
  config.max_tokens_per_rank = 4;
  return config;
}

class CudaConformance : public ::testing::TestWithParam<Shape> {};

void run_case(const Shape& shape, const Case& c) {
  const int R = shape.num_ranks, H = c.hidden, K = c.topk;
  const exchange_test::ExchangeSpec spec{*Topology::create(R, shape.num_nodes),
                                         *ExpertPlacement::contiguous(c.num_experts, R), shape.dtype, H, c.alignment};
  const std::vector<RankInputs> inputs = exchange_test::make_inputs(
      spec, c.routing, K, exchange_test::kConformanceMaxTokens, c.with_weights, c.seed);
  auto group_or = CudaGroup::create(spec.topology, exchange_test::make_config(c));
  ASSERT_TRUE(group_or.is_ok()) << group_or.status().message();
  CudaGroup& group = **group_or;
  const exchange_test::CombineOrder order = exchange_test::expected_combine_order(spec.topology, shape.algorithm);

  // Inputs on the device.
  std::vector<DeviceMatrix> x, idx, w;
  std::vector<DispatchInputs> in(R);
  for (int r = 0; r < R; ++r) {
    const int T = inputs[r].num_tokens();
    x.push_back(upload(inputs[r].x));
    idx.push_back(upload(inputs[r].topk_idx, DType::kI32, T, K));
    w.push_back(upload(inputs[r].topk_weights, DType::kF32, T, K));
    in[r] = {x[r].view, idx[r].view, c.with_weights ? w[r].view : TensorView()};
  }

  // Layout.
  std::vector<DispatchLayout> layouts;
  ASSERT_TRUE(group.get_layouts(views_of(idx), &layouts).is_ok());
  for (int r = 0; r < R; ++r) {
    const DispatchLayout ref = exchange_test::reference_layout(spec, inputs[r]);
    EXPECT_EQ(layouts[r].num_tokens_per_rank, ref.num_tokens_per_rank) << "rank " << r;
    EXPECT_EQ(layouts[r].num_tokens_per_node, ref.num_tokens_per_node) << "rank " << r;
    EXPECT_EQ(layouts[r].num_tokens_per_expert, ref.num_tokens_per_expert) << "rank " << r;
    EXPECT_EQ(layouts[r].is_token_in_rank, ref.is_token_in_rank) << "rank " << r;
  }

  // Dispatch.
  std::vector<DispatchResult> res;
  const Status dispatched = group.dispatch(in, &res);
  ASSERT_TRUE(dispatched.is_ok()) << dispatched.message();
  const std::vector<RefRecv> recv = exchange_test::reference_dispatch(spec, inputs);
  const std::vector<Matrix> xs = exchange_test::xs_of(inputs);
  const std::vector<Matrix> recv_x = exchange_test::gather_rows(xs, recv);
  const std::vector<Handle> handles = handles_of(res);
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    EXPECT_TRUE(exchange_test::same_matrix(download(res[r].recv_x), recv_x[r], &xs)) << "recv_x";
    EXPECT_TRUE(exchange_test::same_vector(download_vector<int32_t>(res[r].recv_src_rank), recv[r].src_rank));
    EXPECT_TRUE(exchange_test::same_vector(download_vector<int32_t>(res[r].recv_src_idx), recv[r].src_idx));
    EXPECT_TRUE(exchange_test::same_vector(download_vector<int32_t>(res[r].recv_topk_idx), recv[r].topk_idx, K));
    EXPECT_EQ(res[r].recv_topk_weights.defined(), c.with_weights);
    if (c.with_weights) {
      EXPECT_TRUE(exchange_test::same_vector(download_vector<float>(res[r].recv_topk_weights), recv[r].topk_weights, K));
    }
    EXPECT_EQ(res[r].num_recv_tokens_per_expert, recv[r].num_recv_tokens_per_expert);
  }

  // Combine A: f32 y -> payload-dtype out (+ bias of that dtype); combine B:
  // bf16 y -> f32 out (+ f32 bias) with the weight gradients.
  const auto y_a = per_rank(R, [&](int r) { return exchange_test::expert_output(recv_x[r], r, DType::kF32); });
  const auto y_b = per_rank(R, [&](int r) { return exchange_test::expert_output(recv_x[r], r, DType::kBF16); });
  const auto bias_a = per_rank(R, [&](int r) {
    return c.with_bias ? exchange_test::make_random_matrix(c.seed + 11u * r, inputs[r].num_tokens(), H, shape.dtype)
                       : Matrix();
  });
  const auto bias_b = per_rank(R, [&](int r) {
    return c.with_bias ? exchange_test::make_random_matrix(c.seed + 13u * r, inputs[r].num_tokens(), H, DType::kF32)
                       : Matrix();
  });
  const auto grad_recv_w = per_rank(R, [&](int r) {
    return exchange_test::make_random_floats(c.seed + 17u * r, static_cast<std::size_t>(recv[r].num_recv() * K));
  });
  std::vector<DeviceMatrix> dy_a, dy_b, dout_a, dout_b, dbias_a, dbias_b, dgrw, dgw;
  std::vector<CombineOptions> opt_a(R), opt_b(R);
  for (int r = 0; r < R; ++r) {
    const int T = inputs[r].num_tokens();
    dy_a.push_back(upload(y_a[r]));
    dy_b.push_back(upload(y_b[r]));
    dout_a.push_back(filled(shape.dtype, T, H, exchange_test::kUnwritten));
    dout_b.push_back(filled(DType::kF32, T, H, exchange_test::kUnwritten));
    dbias_a.push_back(upload(c.with_bias ? bias_a[r] : Matrix(shape.dtype, T, H)));
    dbias_b.push_back(upload(c.with_bias ? bias_b[r] : Matrix(DType::kF32, T, H)));
    dgrw.push_back(upload(grad_recv_w[r], DType::kF32, recv[r].num_recv(), K));
    dgw.push_back(filled(DType::kF32, T, K, exchange_test::kUnwritten));
    if (c.with_bias) {
      opt_a[r].bias = dbias_a[r].view;
      opt_b[r].bias = dbias_b[r].view;
    }
    opt_b[r].grad_recv_topk_weights = dgrw[r].view;
    opt_b[r].grad_topk_weights = dgw[r].view;
  }
  std::vector<Matrix> no_bias;
  const auto ref_a = exchange_test::reference_combine(spec, inputs, recv, y_a, c.with_bias ? bias_a : no_bias,
                                                      shape.dtype, order);
  const auto ref_b = exchange_test::reference_combine(spec, inputs, recv, y_b, c.with_bias ? bias_b : no_bias,
                                                      DType::kF32, order);
  ASSERT_TRUE(group.combine(views_of(dy_a), handles, views_of(dout_a), opt_a).is_ok());
  ASSERT_TRUE(group.combine(views_of(dy_b), handles, views_of(dout_b), opt_b).is_ok());
  const auto grad_w = exchange_test::reference_weight_grads(spec, inputs, recv, grad_recv_w);
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    EXPECT_TRUE(exchange_test::same_combine(download(dout_a[r].view), ref_a[r], nullptr)) << "combine f32 y";
    EXPECT_TRUE(exchange_test::same_combine(download(dout_b[r].view), ref_b[r], nullptr)) << "combine bf16 y";
    EXPECT_TRUE(exchange_test::same_vector(download_vector<float>(dgw[r].view), grad_w[r], K)) << "weight gradients";
  }
  EXPECT_TRUE(exchange_test::any_nonzero(ref_a)) << "the compared combines are all zero";

  // Expanded layout, expand, combine_expanded.
  std::vector<DeviceMatrix> dy_e, dout_e, dwe;
  std::vector<Matrix> partials;
  std::vector<std::vector<float>> weights_e(R);
  std::vector<RefExpanded> expanded(R);
  std::vector<Matrix> y_e(R);
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    expanded[r] = exchange_test::reference_expanded(recv[r], spec.placement.num_local_experts(r), c.alignment);
    auto layout = group.expanded_layout(r, handles[r]);
    ASSERT_TRUE(layout.is_ok()) << layout.status().message();
    EXPECT_EQ((*layout)->expert_offsets, expanded[r].expert_offsets);
    EXPECT_EQ((*layout)->row_of, expanded[r].row_of);
    EXPECT_EQ((*layout)->recv_row, expanded[r].recv_row);
    const Matrix expanded_x = exchange_test::reference_expand(recv_x[r], expanded[r]);
    DeviceMatrix dex = filled(shape.dtype, expanded[r].num_rows(), H, exchange_test::kUnwritten);
    ASSERT_TRUE(group.expand(r, res[r].recv_x, handles[r], dex.view).is_ok());
    EXPECT_TRUE(exchange_test::same_matrix(download(dex.view), expanded_x, &xs)) << "expand()";
    y_e[r] = exchange_test::expert_output(expanded_x, r, c.expanded_dtype);
    for (int64_t j = 0; j < y_e[r].rows(); ++j)
      if (expanded[r].recv_row[j] < 0)
        for (int64_t col = 0; col < H; ++col) y_e[r].set(j, col, exchange_test::kPaddingGarbage);
    weights_e[r] = c.explicit_expand_weights
                       ? exchange_test::make_random_floats(c.seed + 19u * r, static_cast<std::size_t>(recv[r].num_recv() * K))
                       : recv[r].topk_weights;
    partials.push_back(exchange_test::reference_expert_partial(y_e[r], expanded[r], weights_e[r], K));
    dy_e.push_back(upload(y_e[r]));
    dout_e.push_back(filled(DType::kF32, inputs[r].num_tokens(), H, exchange_test::kUnwritten));
    dwe.push_back(upload(weights_e[r], DType::kF32, recv[r].num_recv(), K));
  }
  std::vector<TensorView> we_views;
  if (c.explicit_expand_weights) we_views = views_of(dwe);
  ASSERT_TRUE(group.combine_expanded(views_of(dy_e), handles, views_of(dout_e), we_views).is_ok());
  const auto ref_e = exchange_test::reference_combine(spec, inputs, recv, partials, {}, DType::kF32, order);
  for (int r = 0; r < R; ++r)
    EXPECT_TRUE(exchange_test::same_combine(download(dout_e[r].view), ref_e[r], nullptr)) << "combine_expanded, rank " << r;

  // Backward of combine_expanded: grad_out goes back along the routes (a
  // cached dispatch), then grad_y = w * grad and grad_w = <grad, y>.
  const auto grad_out = per_rank(R, [&](int r) { return exchange_test::make_payload(7, r, inputs[r].num_tokens(), H, shape.dtype); });
  const std::vector<Matrix> grad_recv = exchange_test::gather_rows(grad_out, recv);
  std::vector<DeviceMatrix> dgo, dgy, dgwe;
  for (int r = 0; r < R; ++r) {
    dgo.push_back(upload(grad_out[r]));
    dgy.push_back(filled(DType::kF32, expanded[r].num_rows(), H, exchange_test::kUnwritten));
    dgwe.push_back(filled(DType::kF32, recv[r].num_recv(), K, exchange_test::kUnwritten));
  }
  ASSERT_TRUE(group.combine_expanded_backward(views_of(dgo), handles, views_of(dy_e), we_views, views_of(dgy), views_of(dgwe))
                  .is_ok());
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    Matrix gy(DType::kF32, expanded[r].num_rows(), H);
    std::vector<float> gw(static_cast<std::size_t>(recv[r].num_recv() * K), 0.0f);
    for (int64_t i = 0; i < recv[r].num_recv(); ++i)
      for (int k = 0; k < K; ++k) {
        const int64_t row = expanded[r].row_of[i * K + k];
        if (row < 0) continue;
        float dot = 0.0f;
        for (int col = 0; col < H; ++col) dot += grad_recv[r].get(i, col) * y_e[r].get(row, col);
        gw[i * K + k] = dot;
        for (int col = 0; col < H; ++col) gy.set(row, col, weights_e[r][i * K + k] * grad_recv[r].get(i, col));
      }
    EXPECT_TRUE(exchange_test::same_matrix(download(dgy[r].view), gy)) << "grad_y_expanded";
    EXPECT_TRUE(exchange_test::same_vector(download_vector<float>(dgwe[r].view), gw, K)) << "grad_weights";
  }

  // dispatch_cached of a new payload follows the same routes.
  std::vector<TensorView> recv_again;
  ASSERT_TRUE(group.dispatch_cached(views_of(dgo), handles, &recv_again).is_ok());
  for (int r = 0; r < R; ++r)
    EXPECT_TRUE(exchange_test::same_matrix(download(recv_again[r]), grad_recv[r], &grad_out)) << "dispatch_cached, rank " << r;
}

TEST_P(CudaConformance, EveryOperationMatchesTheReference) {
  EPX_SKIP_WITHOUT_GPU();
  for (const Case& c : exchange_test::make_cases(GetParam())) {
    SCOPED_TRACE(c.name());
    run_case(GetParam(), c);
    if (HasFatalFailure() || ::testing::Test::HasFailure()) return;  // the first failing case is enough
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaConformance, ::testing::ValuesIn(exchange_test::all_shapes()),
                         exchange_test::shape_name);

// One hand-checkable scenario first: 2 ranks, 4 experts, hidden 8 (f32).
TEST(CudaHand, TwoRanksFourExperts) {
  EPX_SKIP_WITHOUT_GPU();
  auto group = CudaGroup::create(*Topology::create(2), tiny_config());
  ASSERT_TRUE(group.is_ok()) << group.status().message();
  // Rank 0: token 0 -> experts 0, 3 (ranks 0 and 1); token 1 -> expert 1 (rank 0).
  // Rank 1: token 0 -> expert 2 (rank 1).
  Matrix x0(DType::kF32, 2, 8), x1(DType::kF32, 1, 8);
  for (int col = 0; col < 8; ++col) {
    x0.set(0, col, 1.0f + col);
    x0.set(1, col, 10.0f + col);
    x1.set(0, col, 100.0f + col);
  }
  std::vector<DeviceMatrix> x, idx;
  x.push_back(upload(x0));
  x.push_back(upload(x1));
  idx.push_back(upload(std::vector<int32_t>{0, 3, 1, -1}, DType::kI32, 2, 2));
  idx.push_back(upload(std::vector<int32_t>{2, -1}, DType::kI32, 1, 2));
  std::vector<DispatchInputs> in = {{x[0].view, idx[0].view, {}}, {x[1].view, idx[1].view, {}}};
  std::vector<DispatchResult> res;
  ASSERT_TRUE((*group)->dispatch(in, &res).is_ok());
  // Rank 0 gets its tokens 0 and 1; rank 1 gets rank 0's token 0, then its own token 0.
  EXPECT_EQ(download_vector<int32_t>(res[0].recv_src_idx), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(download_vector<int32_t>(res[1].recv_src_rank), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(download_vector<int32_t>(res[1].recv_topk_idx), (std::vector<int32_t>{-1, 1, 0, -1}));
  EXPECT_EQ(download(res[1].recv_x).get(1, 3), 103.0f);
  // Combine with y = recv_x: rank 0's token 0 comes back twice (1 + col) * 2.
  std::vector<DeviceMatrix> out;
  out.push_back(filled(DType::kF32, 2, 8, -1.0f));
  out.push_back(filled(DType::kF32, 1, 8, -1.0f));
  std::vector<TensorView> y = {res[0].recv_x, res[1].recv_x};
  ASSERT_TRUE((*group)->combine(y, handles_of(res), std::vector<TensorView>{out[0].view, out[1].view}).is_ok());
  const Matrix out0 = download(out[0].view);
  EXPECT_EQ(out0.get(0, 2), 6.0f);
  EXPECT_EQ(out0.get(1, 2), 12.0f);
  EXPECT_EQ(download(out[1].view).get(0, 7), 107.0f);
}

TEST(CudaErrors, BadExpertIdIsNamedAndNothingMoves) {
  EPX_SKIP_WITHOUT_GPU();
  auto group = CudaGroup::create(*Topology::create(2), tiny_config());
  ASSERT_TRUE(group.is_ok()) << group.status().message();
  std::vector<DeviceMatrix> x, idx;
  x.push_back(upload(Matrix(DType::kF32, 2, 8)));
  x.push_back(upload(Matrix(DType::kF32, 1, 8)));
  idx.push_back(upload(std::vector<int32_t>{0, 1, 2, 2}, DType::kI32, 2, 2));
  idx.push_back(upload(std::vector<int32_t>{7, -1}, DType::kI32, 1, 2));
  std::vector<DispatchInputs> in = {{x[0].view, idx[0].view, {}}, {x[1].view, idx[1].view, {}}};
  std::vector<DispatchResult> res;
  Status s = (*group)->dispatch(in, &res);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "rank 0: topk_idx[1] lists expert 2 twice (slots 0 and 1)");
  idx[0] = upload(std::vector<int32_t>{0, 1, 2, 3}, DType::kI32, 2, 2);
  in[0].topk_idx = idx[0].view;
  s = (*group)->dispatch(in, &res);
  EXPECT_EQ(s.message(), "rank 1: topk_idx[0][0] = 7 is outside [0, 4) and is not -1");
}

}  // namespace
}  // namespace epx::cuda_test
