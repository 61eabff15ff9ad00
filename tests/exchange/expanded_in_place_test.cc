// combine_expanded weighted by the holders with y_expanded written into the
// combine region (combine_expanded_input): the readers weigh and sum each
// holder's rows where they lie. The same bits as y kept outside the region
// (whose bits the conformance table checks against the reference), on flat
// and two-hop topologies, for f32 and bf16 rows, with a bias, with some ranks
// in place and the others not, asynchronously; rows wider than one slice of
// the row kernels; the backward finds y in the region; bf16 partials and
// weight gradients refuse y there.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "epx/comm/inproc.h"
#include "epx/core/dtype.h"
#include "epx/exchange/buffer.h"
#include "expanded_routing.h"

namespace epx {
namespace {

using expanded_test::kExperts;
using expanded_test::kTokens;
using expanded_test::kTopk;
using expanded_test::Routing;
using expanded_test::y_value;

constexpr int kHidden = 1100;  // three slices of 512 columns, the last partial

BufferConfig make_config(DispatchAlgorithm algorithm) {
  BufferConfig config;
  config.num_experts = kExperts;
  config.hidden = kHidden;
  config.dtype = DType::kBF16;
  config.max_topk = kTopk;
  config.max_tokens_per_rank = kTokens;
  config.expert_alignment = 4;
  config.algorithm = algorithm;
  config.max_expanded_rows = 2 * kTokens * kTopk * 4 + kExperts * 3;  // every rank's expanded rows, padded
  return config;
}

using expanded_test::dispatch;
using expanded_test::fill_y;

TensorView matrix(std::vector<float>& v) { return TensorView::contiguous(v.data(), DType::kF32, {kTokens, kHidden}); }

struct Outputs {
  std::vector<float> outside, in_place, mixed, async;
};

// One rank: the combine with y outside, y in place, y in place on even ranks
// only, and y in place asynchronously.
Status run_rank(Transport& t, DispatchAlgorithm algorithm, DType y_dtype, bool with_bias, Outputs* o) {
  const int r = t.rank();
  EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config(algorithm)));
  DispatchResult d;
  EPX_RETURN_IF_ERROR(dispatch(*buffer, expanded_test::make_routing(r, 53), &d));
  const int64_t rows = buffer->expanded_layout(d.handle).num_rows();
  std::vector<float> outside_rows(std::max<int64_t>(rows, 1) * kHidden);
  const TensorView y_out = TensorView::contiguous(outside_rows.data(), y_dtype, {rows, kHidden});
  fill_y(*buffer, d, r, y_out);
  std::vector<float> bias(kTokens * kHidden);
  for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = 0.001f * static_cast<float>(i % 29) - 0.01f;
  CombineOptions options;
  if (with_bias) options.bias = matrix(bias);
  for (auto* v : {&o->outside, &o->in_place, &o->mixed, &o->async}) v->assign(kTokens * kHidden, -7.0f);
  EPX_RETURN_IF_ERROR(buffer->combine_expanded(y_out, d.handle, matrix(o->outside), {}, options));
  auto in_place = [&]() -> Result<TensorView> {
    EPX_ASSIGN_OR_RETURN(TensorView y_in, buffer->combine_expanded_input(d.handle, y_dtype));
    fill_y(*buffer, d, r, y_in);
    return y_in;
  };
  EPX_ASSIGN_OR_RETURN(TensorView y_in, in_place());
  EPX_RETURN_IF_ERROR(buffer->combine_expanded(y_in, d.handle, matrix(o->in_place), {}, options));
  if (r % 2 == 0) {
    EPX_ASSIGN_OR_RETURN(y_in, in_place());
  }
  EPX_RETURN_IF_ERROR(buffer->combine_expanded(r % 2 == 0 ? y_in : y_out, d.handle, matrix(o->mixed), {}, options));
  EPX_ASSIGN_OR_RETURN(y_in, in_place());
  return buffer->combine_expanded_async(y_in, d.handle, matrix(o->async), {}, options).wait();
}

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what, int rank) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      ADD_FAILURE() << what << ", rank " << rank << " token " << i / kHidden << " col " << i % kHidden << ": "
                    << b[i] << " vs " << a[i] << " with y outside";
      return;
    }
}

void run_case(int num_ranks, int num_nodes, DispatchAlgorithm algorithm, DType y_dtype, bool with_bias) {
  SCOPED_TRACE(testing::Message() << num_nodes << "x" << num_ranks / num_nodes
                                  << (algorithm == DispatchAlgorithm::kFlat ? " flat " : " two-hop ")
                                  << dtype_name(y_dtype) << (with_bias ? " with bias" : ""));
  InprocWorld world(*Topology::create(num_ranks, num_nodes));
  std::vector<Outputs> outputs(num_ranks);
  const std::vector<Status> statuses = world.run(
      [&](Transport& t) { return run_rank(t, algorithm, y_dtype, with_bias, &outputs[t.rank()]); });
  for (int r = 0; r < num_ranks; ++r) {
    ASSERT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
    const Outputs& o = outputs[r];
    expect_same_bits(o.outside, o.in_place, "in place", r);
    expect_same_bits(o.outside, o.mixed, "in place on even ranks", r);
    expect_same_bits(o.outside, o.async, "in place, asynchronous", r);
  }
}

TEST(CombineExpandedInPlace, SameBitsAsRowsOutsideOnEveryTopology) {
  for (const DType y_dtype : {DType::kF32, DType::kBF16}) {
    run_case(1, 1, DispatchAlgorithm::kFlat, y_dtype, false);
    run_case(2, 1, DispatchAlgorithm::kFlat, y_dtype, true);
    run_case(4, 1, DispatchAlgorithm::kFlat, y_dtype, false);
    run_case(4, 2, DispatchAlgorithm::kFlat, y_dtype, true);  // partials for the other node travel as messages
    run_case(8, 2, DispatchAlgorithm::kFlat, y_dtype, false);
    run_case(4, 2, DispatchAlgorithm::kHierarchical, y_dtype, false);  // node sums from the rows in place
    run_case(8, 2, DispatchAlgorithm::kHierarchical, y_dtype, true);
    run_case(8, 4, DispatchAlgorithm::kHierarchical, y_dtype, false);
  }
}

// grad_weights and grad_y of the backward after a combine with y in place
// equal those after a combine with y outside.
TEST(CombineExpandedInPlace, BackwardReadsYInTheRegion) {
  InprocWorld world(*Topology::create(4, 2));
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int r = t.rank();
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config(DispatchAlgorithm::kHierarchical)));
    DispatchResult d;
    EPX_RETURN_IF_ERROR(dispatch(*buffer, expanded_test::make_routing(r, 53), &d));
    const int64_t rows = buffer->expanded_layout(d.handle).num_rows(), num_recv = d.handle.num_recv_tokens();
    std::vector<float> outside(std::max<int64_t>(rows, 1) * kHidden), out(kTokens * kHidden);
    std::vector<uint16_t> grad_out(kTokens * kHidden);
    for (std::size_t i = 0; i < grad_out.size(); ++i) grad_out[i] = f32_to_bf16(0.01f * static_cast<float>(i % 37) - 0.2f);
    const TensorView y_out = TensorView::contiguous(outside.data(), DType::kF32, {rows, kHidden});
    fill_y(*buffer, d, r, y_out);
    std::vector<std::vector<float>> gw(2, std::vector<float>(std::max<int64_t>(num_recv, 1) * kTopk));
    std::vector<std::vector<float>> gy(2, std::vector<float>(std::max<int64_t>(rows, 1) * kHidden));
    for (int pass = 0; pass < 2; ++pass) {
      TensorView y = y_out;
      if (pass == 1) {
        EPX_ASSIGN_OR_RETURN(y, buffer->combine_expanded_input(d.handle, DType::kF32));
        fill_y(*buffer, d, r, y);
      }
      EPX_RETURN_IF_ERROR(buffer->combine_expanded(y, d.handle, matrix(out), {}, {}));
      EPX_RETURN_IF_ERROR(buffer->combine_expanded_backward(
          TensorView::contiguous(grad_out.data(), DType::kBF16, {kTokens, kHidden}), d.handle, y, {},
          TensorView::contiguous(gy[pass].data(), DType::kF32, {rows, kHidden}),
          TensorView::contiguous(gw[pass].data(), DType::kF32, {num_recv, kTopk})));
    }
    EXPECT_EQ(gw[0], gw[1]) << "grad_weights, rank " << r;
    EXPECT_EQ(gy[0], gy[1]) << "grad_y_expanded, rank " << r;
    return Status::ok();
  });
  for (const Status& s : statuses) EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST(CombineExpandedInPlace, Bf16PartialsRefuseYInTheRegion) {
  InprocWorld world(*Topology::create(2, 1));
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config(DispatchAlgorithm::kFlat)));
    DispatchResult d;
    EPX_RETURN_IF_ERROR(dispatch(*buffer, expanded_test::make_routing(t.rank(), 53), &d));
    EPX_ASSIGN_OR_RETURN(TensorView y, buffer->combine_expanded_input(d.handle, DType::kF32));
    std::vector<float> out(kTokens * kHidden);
    CombineOptions options;
    options.partial_dtype = DType::kBF16;
    return buffer->combine_expanded(y, d.handle, matrix(out), {}, options);
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("partial_dtype"), std::string::npos) << s.to_string();
  }
}

}  // namespace
}  // namespace epx
