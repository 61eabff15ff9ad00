// combine_expanded_backward against the formula, per rank: the gradient of a
// received row's partial sum is grad_out of its source token, so every value
// can be checked from (source rank, source token) without gathering.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "epx/comm/inproc.h"
#include "epx/exchange/buffer.h"

namespace epx {
namespace {

constexpr int kExperts = 16, kHidden = 24, kTopk = 4, kTokens = 9;

float x_value(int rank, int token, int col) { return 0.25f * rank + 0.125f * token - 0.0625f * col; }
float grad_value(int rank, int token, int col) { return 1.0f + 0.5f * rank - 0.25f * token + 0.03125f * col; }

void run_case(int num_ranks, int num_nodes) {
  SCOPED_TRACE(testing::Message() << num_nodes << "x" << num_ranks / num_nodes);
  InprocWorld world(*Topology::create(num_ranks, num_nodes));
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int r = t.rank();
    BufferConfig config;
    config.num_experts = kExperts;
    config.hidden = kHidden;
    config.dtype = DType::kF32;
    config.max_topk = kTopk;
    config.max_tokens_per_rank = kTokens;
    config.expert_alignment = 4;
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config));
    std::mt19937 rng(17 + r);
    std::vector<float> x(kTokens * kHidden), grad_out(kTokens * kHidden), w(kTokens * kTopk);
    std::vector<int32_t> idx(kTokens * kTopk);
    for (int i = 0; i < kTokens; ++i) {
      std::vector<int32_t> experts(kExperts);
      for (int e = 0; e < kExperts; ++e) experts[e] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < kTopk; ++k) {
        idx[i * kTopk + k] = (i + k) % 5 == 0 ? -1 : experts[k];
        w[i * kTopk + k] = 0.125f * (k + 1);
      }
      for (int c = 0; c < kHidden; ++c) {
        x[i * kHidden + c] = x_value(r, i, c);
        grad_out[i * kHidden + c] = grad_value(r, i, c);
      }
    }
    DispatchResult d;
    EPX_RETURN_IF_ERROR(buffer->dispatch({TensorView::contiguous(x.data(), DType::kF32, {kTokens, kHidden}),
                                          TensorView::contiguous(idx.data(), DType::kI32, {kTokens, kTopk}),
                                          TensorView::contiguous(w.data(), DType::kF32, {kTokens, kTopk})},
                                         &d));
    const ExpandedLayout& layout = buffer->expanded_layout(d.handle);
    const int64_t rows = layout.num_rows(), num_recv = d.handle.num_recv_tokens();
    std::vector<float> y(rows * kHidden, 0.0f);
    EPX_RETURN_IF_ERROR(buffer->expand(d.recv_x, d.handle, TensorView::contiguous(y.data(), DType::kF32, {rows, kHidden})));
    for (float& v : y) v = v * 1.5f + 0.25f;  // the "experts"
    std::vector<float> grad_y(rows * kHidden, -7.0f), grad_w(num_recv * kTopk, -7.0f);
    const std::vector<int32_t> src_rank(d.recv_src_rank.data_as<int32_t>(), d.recv_src_rank.data_as<int32_t>() + num_recv);
    const std::vector<int32_t> src_idx(d.recv_src_idx.data_as<int32_t>(), d.recv_src_idx.data_as<int32_t>() + num_recv);
    const std::vector<float> recv_w(d.recv_topk_weights.data_as<float>(),
                                    d.recv_topk_weights.data_as<float>() + num_recv * kTopk);
    EPX_RETURN_IF_ERROR(buffer->combine_expanded_backward(
        TensorView::contiguous(grad_out.data(), DType::kF32, {kTokens, kHidden}), d.handle,
        TensorView::contiguous(y.data(), DType::kF32, {rows, kHidden}), TensorView(),
        TensorView::contiguous(grad_y.data(), DType::kF32, {rows, kHidden}),
        TensorView::contiguous(grad_w.data(), DType::kF32, {num_recv, kTopk})));
    int checked = 0;
    for (int64_t row = 0; row < rows; ++row) {
      if (layout.recv_row[row] >= 0) continue;
      for (int c = 0; c < kHidden; ++c) EXPECT_EQ(grad_y[row * kHidden + c], 0.0f) << "padding row " << row;
    }
    for (int64_t i = 0; i < num_recv; ++i) {
      for (int k = 0; k < kTopk; ++k) {
        const int64_t row = layout.row_of[i * kTopk + k];
        if (row < 0) {
          EXPECT_EQ(grad_w[i * kTopk + k], 0.0f) << "row " << i << " slot " << k;
          continue;
        }
        float dot = 0.0f;
        for (int c = 0; c < kHidden; ++c) {
          const float g = grad_value(src_rank[i], src_idx[i], c);
          EXPECT_EQ(grad_y[row * kHidden + c], recv_w[i * kTopk + k] * g) << "row " << i << " slot " << k << " col " << c;
          dot += g * y[row * kHidden + c];
        }
        EXPECT_EQ(grad_w[i * kTopk + k], dot) << "row " << i << " slot " << k;
        EXPECT_NE(dot, 0.0f);
        ++checked;
      }
    }
    if (t.num_ranks() > 1 && checked == 0) return internal_error("rank {} checked no slot", r);
    return Status::ok();
  });
  for (int r = 0; r < num_ranks; ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
}

TEST(CombineExpandedBackward, MatchesTheFormula) {
  run_case(1, 1);
  run_case(4, 1);
  run_case(4, 2);
  run_case(8, 2);
}

TEST(CombineExpandedBackward, NeedsWeights) {
  InprocWorld world(*Topology::create(2, 1));
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    BufferConfig config;
    config.num_experts = 4;
    config.hidden = 8;
    config.dtype = DType::kF32;
    config.max_topk = 2;
    config.max_tokens_per_rank = 2;
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config));
    std::vector<float> x(16, 1.0f);
    std::vector<int32_t> idx = {0, 3, 1, 2};
    DispatchResult d;
    DispatchInputs in;
    in.x = TensorView::contiguous(x.data(), DType::kF32, {2, 8});
    in.topk_idx = TensorView::contiguous(idx.data(), DType::kI32, {2, 2});
    EPX_RETURN_IF_ERROR(buffer->dispatch(in, &d));
    const int64_t rows = buffer->expanded_layout(d.handle).num_rows();
    std::vector<float> y(rows * 8), gy(rows * 8);
    return buffer->combine_expanded_backward(TensorView::contiguous(x.data(), DType::kF32, {2, 8}), d.handle,
                                             TensorView::contiguous(y.data(), DType::kF32, {rows, 8}), TensorView(),
                                             TensorView::contiguous(gy.data(), DType::kF32, {rows, 8}));
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("needs weights"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace epx
