// fp8 dispatch against the reference: every rank receives exactly the rows
// quantize_fp8 makes of its sources' x (codes and scales, bit for bit), in the
// order and with the metadata the bf16 dispatch delivers; the byte counters
// count the scales; the cached dispatch re-quantises; combine stays bf16/f32;
// the backward passes carry gradient_dtype rows, or without it fail clearly,
// as bad inputs do. Swept over world sizes,
// node shapes (two-hop and flat across nodes), both scale formats and both
// input dtypes; runs in-process and under MPI (mpi_main.cc).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "epx/core/fp8.h"
#include "epx/exchange/buffer.h"
#include "exchange/harness.h"
#include "exchange/reference.h"
#include "exchange/world.h"

namespace epx::exchange_test {
namespace {

constexpr int kMaxTokens = 24;

struct Fp8Shape {
  int num_ranks;
  int num_nodes;
  DispatchAlgorithm algorithm;
  Fp8ScaleFormat scales;
  DType input_dtype;
};

std::string fp8_shape_name(const ::testing::TestParamInfo<Fp8Shape>& info) {
  const Fp8Shape& s = info.param;
  const char* a = s.algorithm == DispatchAlgorithm::kFlat ? "flat" : "auto";
  return fmt::format("{}ranks_{}nodes_{}_{}scales_{}in", s.num_ranks, s.num_nodes, a, scale_format_name(s.scales),
                     dtype_name(s.input_dtype));
}

// Rows whose blocks span many magnitudes (2^-20 .. 2^20), with an all-zero
// block in every fifth token, so the scales differ block by block.
void spread_blocks(Matrix& x, int rank) {
  for (int64_t t = 0; t < x.rows(); ++t)
    for (int64_t c = 0; c < x.cols(); ++c) {
      const int64_t b = c / kFp8BlockSize;
      const float m = std::ldexp(1.0f, static_cast<int>((t * 7 + b * 3 + rank) % 41) - 20);
      x.set(t, c, (t % 5 == 4 && b == 0) ? 0.0f : x.get(t, c) * m);
    }
}

// quantize_fp8 of one rank's x: codes [T, H] and scales [T, H / 128].
struct Quantised {
  Matrix q, scales;
};

Quantised quantise(const Matrix& x, Fp8ScaleFormat format) {
  Quantised out{Matrix(DType::kFP8E4M3, x.rows(), x.cols()),
                Matrix(scale_dtype(format), x.rows(), x.cols() / kFp8BlockSize)};
  const Status s = quantize_fp8(x.view(), format, out.q.view(), out.scales.view());
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

Matrix dequantise(const Matrix& q, const Matrix& scales, DType dtype) {
  Matrix out(dtype, q.rows(), q.cols());
  const Status s = dequantize_fp8(q.view(), scales.view(), out.view());
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

// Scale of block b of row i, f32 or ue8m0.
float block_scale(const Matrix& scales, int64_t i, int64_t b) {
  if (scales.dtype() == DType::kF32) return scales.get(i, b);
  return ue8m0_to_f32(static_cast<uint8_t>(scales.row(i)[b]));
}

std::size_t fp8_row_bytes(int hidden, Fp8ScaleFormat format) {
  const std::size_t used = static_cast<std::size_t>(hidden) +
                           static_cast<std::size_t>(hidden / kFp8BlockSize) * dtype_size(scale_dtype(format));
  return (used + 7) / 8 * 8;
}

struct RankResult {
  Matrix recv_q, recv_scales, recv_deq, out, cached_q, cached_scales;
  Matrix grad_y, cached_q_after;  // the Buffer with gradient_dtype: combine_backward, then a cached dispatch
  std::vector<int32_t> recv_idx, recv_src_rank, recv_src_idx, counts;
  int64_t recv_row_stride = 0;
  ExchangeStats stats;
  TransportCounters counters;
  Status backward = Status::ok();
  Status expanded_backward = Status::ok();
};

class Fp8Dispatch : public ::testing::TestWithParam<Fp8Shape> {};

TEST_P(Fp8Dispatch, DeliversTheQuantisedRowsLikeTheBf16Dispatch) {
  const Fp8Shape& shape = GetParam();
  const int R = shape.num_ranks;
  const std::string why = test_world().cannot_run(*Topology::create(R, shape.num_nodes));
  if (!why.empty()) GTEST_SKIP() << "the " << test_world().name() << " world cannot run " << why;
  uint32_t index = 0;
  int64_t nonzero = 0;
  for (Routing routing : {Routing::kUniform, Routing::kSkewed, Routing::kHoles, Routing::kEmptyRank}) {
    for (int hidden : {128, 384}) {
      const int E = 4 * R, K = std::min(4, E);
      const uint32_t seed = 9001u + 97u * index++ + 13u * static_cast<uint32_t>(R * 8 + shape.num_nodes);
      SCOPED_TRACE(fmt::format("routing={} hidden={} seed={}", routing_name(routing), hidden, seed));
      const Topology topology = *Topology::create(R, shape.num_nodes);
      const ExchangeSpec spec{topology, *ExpertPlacement::contiguous(E, R), shape.input_dtype, hidden, 1};
      std::vector<RankInputs> inputs = make_inputs(spec, routing, K, kMaxTokens, true, seed);
      std::vector<Matrix> xs2;
      for (int r = 0; r < R; ++r) {
        spread_blocks(inputs[r].x, r);
        xs2.push_back(make_payload(5, r, inputs[r].num_tokens(), hidden, shape.input_dtype));
        spread_blocks(xs2.back(), r + 1);
      }
      BufferConfig config;
      config.num_experts = E;
      config.hidden = hidden;
      config.dtype = DType::kFP8E4M3;
      config.fp8_scales = shape.scales;
      config.max_topk = K;
      config.max_tokens_per_rank = kMaxTokens;
      config.algorithm = shape.algorithm;
      config.timeout = Milliseconds(20000);

      std::vector<RankResult> results(R);
      const std::vector<Status> statuses = test_world().run(topology, [&](Transport& t) -> Status {
        const int r = t.rank();
        RankResult& res = results[r];
        EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config));
        const TransportCounters before = t.counters();
        DispatchResult d;
        EPX_RETURN_IF_ERROR(buffer->dispatch(inputs[r].dispatch_inputs(), &d));
        res.counters = counters_delta(before, t.counters());
        res.stats = d.stats;
        res.recv_row_stride = d.recv_x.stride(0);
        res.recv_q = Matrix::copy_of(d.recv_x);
        res.recv_scales = Matrix::copy_of(d.recv_scales);
        res.recv_idx = copy_i32(d.recv_topk_idx);
        res.recv_src_rank = copy_i32(d.recv_src_rank);
        res.recv_src_idx = copy_i32(d.recv_src_idx);
        res.counts = d.num_recv_tokens_per_expert;
        // Dequantised on receive into bf16, then a bf16 combine of it.
        res.recv_deq = Matrix(DType::kBF16, d.handle.num_recv_tokens(), hidden);
        EPX_RETURN_IF_ERROR(dequantize_fp8(d.recv_x, d.recv_scales, res.recv_deq.view()));
        res.out = Matrix::filled(DType::kBF16, inputs[r].num_tokens(), hidden, kUnwritten);
        EPX_RETURN_IF_ERROR(buffer->combine(res.recv_deq.view(), d.handle, res.out.view()));
        // A cached dispatch of other rows re-quantises them.
        TensorView cached;
        EPX_RETURN_IF_ERROR(buffer->dispatch_cached(xs2[r].view(), d.handle, &cached));
        res.cached_q = Matrix::copy_of(cached);
        EPX_ASSIGN_OR_RETURN(TensorView cached_scales, buffer->recv_scales(d.handle));
        res.cached_scales = Matrix::copy_of(cached_scales);
        // The backward passes need a bf16 / f32 Buffer: every rank says so.
        TensorView grad_y;
        res.backward = buffer->combine_backward(xs2[r].view(), d.handle, &grad_y);
        const ExpandedLayout& layout = buffer->expanded_layout(d.handle);
        Matrix y(DType::kF32, layout.num_rows(), hidden), gy(DType::kF32, layout.num_rows(), hidden);
        res.expanded_backward = buffer->combine_expanded_backward(xs2[r].view(), d.handle, y.view(), {}, gy.view());
        // With gradient_dtype, combine_backward carries the gradient rows
        // unquantised, and the next cached dispatch is fp8 again.
        BufferConfig with_gradients = config;
        with_gradients.gradient_dtype = shape.input_dtype;
        EPX_ASSIGN_OR_RETURN(auto gbuffer, Buffer::create(t, with_gradients));
        DispatchResult gd;
        EPX_RETURN_IF_ERROR(gbuffer->dispatch(inputs[r].dispatch_inputs(), &gd));
        EPX_RETURN_IF_ERROR(gbuffer->combine_backward(xs2[r].view(), gd.handle, &grad_y));
        res.grad_y = Matrix::copy_of(grad_y);
        EPX_RETURN_IF_ERROR(gbuffer->dispatch_cached(xs2[r].view(), gd.handle, &cached));
        res.cached_q_after = Matrix::copy_of(cached);
        return Status::ok();
      });

      const std::vector<RefRecv> recv = reference_dispatch(spec, inputs);
      std::vector<Matrix> qs, scales, qs2, scales2, deq;
      for (int r = 0; r < R; ++r) {
        Quantised a = quantise(inputs[r].x, shape.scales), b = quantise(xs2[r], shape.scales);
        deq.push_back(dequantise(a.q, a.scales, DType::kBF16));
        qs.push_back(std::move(a.q));
        scales.push_back(std::move(a.scales));
        qs2.push_back(std::move(b.q));
        scales2.push_back(std::move(b.scales));
      }
      const std::vector<Matrix> want_q = gather_rows(qs, recv), want_scales = gather_rows(scales, recv),
                                want_q2 = gather_rows(qs2, recv), want_scales2 = gather_rows(scales2, recv),
                                want_deq = gather_rows(deq, recv), want_grad = gather_rows(xs2, recv);
      const std::vector<Matrix> want_out = reference_combine(
          spec, inputs, recv, want_deq, {}, DType::kBF16, expected_combine_order(topology, shape.algorithm));
      const std::size_t row_bytes = fp8_row_bytes(hidden, shape.scales);
      enum : int { kFailed, kPayloadBytes, kWireBytes, kIntraBytes, kRowsSent, kNonzero, kNumTotals };
      std::vector<int64_t> totals(kNumTotals, 0);
      for (int r = 0; r < R; ++r) {
        if (!test_world().holds(r)) continue;
        SCOPED_TRACE(fmt::format("rank {}", r));
        EXPECT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
        if (!statuses[r].is_ok()) {
          ++totals[kFailed];
          continue;
        }
        const RankResult& res = results[r];
        EXPECT_EQ(res.recv_row_stride, static_cast<int64_t>(row_bytes));
        EXPECT_TRUE(same_matrix(res.recv_q, want_q[r]));
        EXPECT_TRUE(same_matrix(res.recv_scales, want_scales[r]));
        EXPECT_TRUE(same_matrix(res.recv_deq, want_deq[r]));
        EXPECT_TRUE(same_matrix(res.out, want_out[r]));
        EXPECT_TRUE(same_matrix(res.cached_q, want_q2[r]));
        EXPECT_TRUE(same_matrix(res.cached_scales, want_scales2[r]));
        EXPECT_TRUE(same_vector(res.recv_src_rank, recv[r].src_rank));
        EXPECT_TRUE(same_vector(res.recv_src_idx, recv[r].src_idx));
        EXPECT_TRUE(same_vector(res.recv_idx, recv[r].topk_idx, K));
        EXPECT_TRUE(same_vector(res.counts, recv[r].num_recv_tokens_per_expert));
        EXPECT_EQ(res.backward.code(), StatusCode::kFailedPrecondition) << res.backward.to_string();
        EXPECT_EQ(res.expanded_backward.code(), StatusCode::kFailedPrecondition) << res.expanded_backward.to_string();
        EXPECT_TRUE(same_matrix(res.grad_y, want_grad[r]));
        EXPECT_TRUE(same_matrix(res.cached_q_after, want_q2[r]));
        totals[kPayloadBytes] += res.stats.inter_node_payload_bytes;
        totals[kWireBytes] += static_cast<int64_t>(res.counters.inter_node_bytes);
        totals[kIntraBytes] += res.stats.intra_node_payload_bytes;
        totals[kRowsSent] += res.stats.rows_sent;
        totals[kNonzero] += any_nonzero({res.recv_q});
        // What the caller gets back is within the stated bound of what was sent.
        for (int64_t i = 0; i < res.recv_deq.rows(); ++i) {
          const Matrix& src = inputs[recv[r].src_rank[i]].x;
          for (int64_t c = 0; c < hidden; ++c) {
            const float x = src.get(recv[r].src_idx[i], c);
            const float scale = block_scale(want_scales[r], i, c / kFp8BlockSize);
            ASSERT_LE(std::fabs(res.recv_deq.get(i, c) - x),
                      (0x1p-4f + 0x1p-8f) * std::fabs(x) + 0x1p-10f * scale)  // + one bf16 rounding
                << "row " << i << " col " << c;
          }
        }
      }
      test_world().sum(totals);
      if (totals[kFailed] > 0) {
        if (!HasFailure()) ADD_FAILURE() << totals[kFailed] << " rank(s) of another process failed";
        return;
      }
      // The counters count whole rows: codes, scales and padding.
      const RefTraffic traffic = reference_traffic(spec, inputs);
      const bool two_hop = expected_combine_order(topology, shape.algorithm) == CombineOrder::kHierarchical;
      const int64_t pairs = two_hop ? traffic.remote_node_pairs : traffic.remote_rank_pairs;
      EXPECT_EQ(totals[kPayloadBytes], pairs * static_cast<int64_t>(row_bytes));
      EXPECT_EQ(totals[kWireBytes], pairs * (static_cast<int64_t>(row_bytes) + dispatch_meta_bytes(K, true)));
      int64_t rows = 0;
      for (const RefRecv& rr : recv) rows += rr.num_recv();
      EXPECT_EQ(totals[kRowsSent], rows);
      if (!two_hop) {
        EXPECT_EQ(totals[kIntraBytes] + totals[kPayloadBytes], rows * static_cast<int64_t>(row_bytes));
      }
      nonzero += totals[kNonzero];
      if (test_world().any(HasFailure())) return;
    }
  }
  EXPECT_GT(nonzero, 0) << "every received row was zero";
}

std::vector<Fp8Shape> fp8_shapes() {
  std::vector<Fp8Shape> shapes;
  const struct {
    int ranks, nodes;
    DispatchAlgorithm algorithm;
  } grid[] = {{1, 1, DispatchAlgorithm::kAuto}, {2, 1, DispatchAlgorithm::kAuto}, {2, 2, DispatchAlgorithm::kFlat},
              {2, 2, DispatchAlgorithm::kAuto}, {3, 1, DispatchAlgorithm::kAuto}, {4, 2, DispatchAlgorithm::kAuto},
              {8, 2, DispatchAlgorithm::kFlat}, {8, 4, DispatchAlgorithm::kAuto}};
  for (const auto& g : grid)
    for (Fp8ScaleFormat f : {Fp8ScaleFormat::kF32, Fp8ScaleFormat::kUE8M0})
      for (DType in : {DType::kBF16, DType::kF32}) shapes.push_back({g.ranks, g.nodes, g.algorithm, f, in});
  return shapes;
}

INSTANTIATE_TEST_SUITE_P(Exchange, Fp8Dispatch, ::testing::ValuesIn(fp8_shapes()), fp8_shape_name);

// Bad fp8 configs and inputs: a clear error, nothing sent.
TEST(Fp8DispatchErrors, RejectsBadConfigsAndInputs) {
  const int R = test_world().ranks_for(2);
  const Topology topology = *Topology::create(R, 1);
  const std::string why = test_world().cannot_run(topology);
  if (!why.empty()) GTEST_SKIP() << why;
  std::vector<Status> create_status(R), inf_status(R), dtype_status(R), scales_status(R), gradient_status(R);
  const std::vector<Status> statuses = test_world().run(topology, [&](Transport& t) -> Status {
    const int r = t.rank();
    BufferConfig config;
    config.num_experts = 2 * R;
    config.hidden = 192;
    config.dtype = DType::kFP8E4M3;
    config.max_topk = 2;
    config.max_tokens_per_rank = 4;
    create_status[r] = Buffer::create(t, config).status();
    config.hidden = 256;
    BufferConfig bf16_with_gradients = config;  // gradient_dtype is for fp8 Buffers
    bf16_with_gradients.dtype = DType::kBF16;
    bf16_with_gradients.gradient_dtype = DType::kF32;
    gradient_status[r] = Buffer::create(t, bf16_with_gradients).status();
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config));
    Matrix x(DType::kBF16, 4, 256);
    for (int64_t c = 0; c < 256; ++c) x.set(0, c, 1.0f);
    std::vector<int32_t> idx = {0, -1, 1, -1, 0, 1, -1, -1};
    const TensorView idx_view = TensorView::contiguous(idx.data(), DType::kI32, {4, 2});
    if (r == R - 1) x.set(2, 131, std::numeric_limits<float>::infinity());
    DispatchResult d;
    DispatchInputs in;
    in.x = x.view();
    in.topk_idx = idx_view;
    inf_status[r] = buffer->dispatch(in, &d);
    Matrix q(DType::kFP8E4M3, 4, 256);
    in.x = q.view();
    dtype_status[r] = buffer->dispatch(in, &d);
    scales_status[r] = buffer->recv_scales(Handle()).status();
    return Status::ok();
  });
  for (int r = 0; r < R; ++r) {
    if (!test_world().holds(r)) continue;
    SCOPED_TRACE(fmt::format("rank {}", r));
    ASSERT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
    EXPECT_EQ(create_status[r].code(), StatusCode::kInvalidArgument);
    EXPECT_NE(create_status[r].message().find("hidden = 192"), std::string::npos) << create_status[r].to_string();
    EXPECT_NE(gradient_status[r].message().find("gradient_dtype = f32 with dtype = bf16"), std::string::npos)
        << gradient_status[r].to_string();
    if (r == R - 1) {
      EXPECT_EQ(inf_status[r].code(), StatusCode::kInvalidArgument);
      EXPECT_NE(inf_status[r].message().find("x[2][131] = inf"), std::string::npos) << inf_status[r].to_string();
    } else {
      EXPECT_EQ(inf_status[r].code(), StatusCode::kAborted) << inf_status[r].to_string();
    }
    EXPECT_EQ(dtype_status[r].code(), StatusCode::kInvalidArgument);
    EXPECT_NE(dtype_status[r].message().find("bf16 or f32"), std::string::npos) << dtype_status[r].to_string();
    EXPECT_EQ(scales_status[r].code(), StatusCode::kInvalidArgument) << scales_status[r].to_string();
  }
}

}  // namespace
}  // namespace epx::exchange_test
