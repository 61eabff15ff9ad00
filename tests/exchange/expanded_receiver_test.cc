// combine_expanded with CombineWeights::kReceiver: holders
// leave each expert's row unweighted in the combine region, and each token's
// own rank sums w[t, k] * y[t, k] in fp32 in top-k order. Checked exactly
// against that sum computed on the token's rank from its routing alone, so
// every flat topology gives the same bits; the backward's guard for y rows in
// the combine region is checked too.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "epx/comm/inproc.h"
#include "epx/core/dtype.h"
#include "epx/exchange/buffer.h"
#include "expanded_routing.h"

namespace epx {
namespace {

using expanded_test::kExperts;
using expanded_test::kHidden;
using expanded_test::kTokens;
using expanded_test::kTopk;
using expanded_test::Routing;
using expanded_test::y_value;

Routing make_routing(int rank) { return expanded_test::make_routing(rank, 41); }

// out[t] = 0 + sum over k of w * bf16(y), in k order, in fp32.
std::vector<float> reference(int rank, const Routing& r) {
  std::vector<float> out(kTokens * kHidden);
  for (int t = 0; t < kTokens; ++t)
    for (int c = 0; c < kHidden; ++c) {
      float acc = 0.0f;
      for (int k = 0; k < kTopk; ++k) {
        const int e = r.idx[t * kTopk + k];
        if (e >= 0) acc = acc + r.w[t * kTopk + k] * bf16_to_f32(f32_to_bf16(y_value(rank, t, e, c)));
      }
      out[t * kHidden + c] = acc;
    }
  return out;
}

// The expanded rows of 11 tokens x 4 slots, with padding to 4 for every expert: at most 108.
constexpr int64_t kExpandedRows = 128;

BufferConfig make_config(DispatchAlgorithm algorithm, int64_t max_expanded_rows = kExpandedRows) {
  BufferConfig config;
  config.max_expanded_rows = max_expanded_rows;
  config.num_experts = kExperts;
  config.hidden = kHidden;
  config.dtype = DType::kBF16;
  config.max_topk = kTopk;
  config.max_tokens_per_rank = kTokens;
  config.expert_alignment = 4;
  config.algorithm = algorithm;
  return config;
}

using expanded_test::dispatch;
using expanded_test::fill_y;

CombineOptions receiver() {
  CombineOptions options;
  options.weights_at = CombineWeights::kReceiver;
  return options;
}

// Zero copy (y written into combine_expanded_input), copied in from outside,
// and asynchronous: each exactly the reference.
void run_case(int num_ranks, int num_nodes) {
  SCOPED_TRACE(testing::Message() << num_nodes << "x" << num_ranks / num_nodes << " flat");
  InprocWorld world(*Topology::create(num_ranks, num_nodes));
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int r = t.rank();
    const Routing routing = make_routing(r);
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config(DispatchAlgorithm::kFlat)));
    DispatchResult d;
    EPX_RETURN_IF_ERROR(dispatch(*buffer, routing, &d));
    const int64_t rows = buffer->expanded_layout(d.handle).num_rows();
    std::vector<uint16_t> outside(std::max<int64_t>(rows, 1) * kHidden);
    const TensorView y_out = TensorView::contiguous(outside.data(), DType::kBF16, {rows, kHidden});
    fill_y(*buffer, d, r, y_out);
    std::vector<float> zero_copy(kTokens * kHidden, -7.0f), copied(zero_copy), async(zero_copy);
    auto view = [](std::vector<float>& v) { return TensorView::contiguous(v.data(), DType::kF32, {kTokens, kHidden}); };
    EPX_ASSIGN_OR_RETURN(TensorView y_in, buffer->combine_expanded_input(d.handle, DType::kBF16));
    fill_y(*buffer, d, r, y_in);
    EPX_RETURN_IF_ERROR(buffer->combine_expanded(y_in, d.handle, view(zero_copy), {}, receiver()));
    EPX_RETURN_IF_ERROR(buffer->combine_expanded(y_out, d.handle, view(copied), {}, receiver()));
    EPX_RETURN_IF_ERROR(buffer->combine_expanded_async(y_out, d.handle, view(async), {}, receiver()).wait());
    const std::vector<float> expected = reference(r, routing);
    for (int i = 0; i < kTokens * kHidden; ++i) {
      EXPECT_EQ(zero_copy[i], expected[i]) << "rank " << r << " token " << i / kHidden << " col " << i % kHidden;
      EXPECT_EQ(copied[i], expected[i]) << "copied in, rank " << r << " element " << i;
      EXPECT_EQ(async[i], expected[i]) << "async, rank " << r << " element " << i;
    }
    return Status::ok();
  });
  for (int r = 0; r < num_ranks; ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
}

TEST(CombineExpandedReceiver, SameBitsOnEveryFlatTopology) {
  run_case(1, 1);
  run_case(2, 1);
  run_case(4, 1);
  run_case(8, 1);
  run_case(4, 2);  // across nodes: the rows travel as messages
  run_case(8, 2);
}

TEST(CombineExpandedReceiver, TwoHopIsRefusedNamingTheOption) {
  InprocWorld world(*Topology::create(4, 2));
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config(DispatchAlgorithm::kHierarchical)));
    DispatchResult d;
    EPX_RETURN_IF_ERROR(dispatch(*buffer, make_routing(t.rank()), &d));
    const int64_t rows = buffer->expanded_layout(d.handle).num_rows();
    std::vector<float> y(std::max<int64_t>(rows, 1) * kHidden), out(kTokens * kHidden);
    return buffer->combine_expanded(TensorView::contiguous(y.data(), DType::kF32, {rows, kHidden}), d.handle,
                                    TensorView::contiguous(out.data(), DType::kF32, {kTokens, kHidden}), {}, receiver());
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("kReceiver"), std::string::npos) << s.to_string();
    EXPECT_NE(s.message().find("two-hop"), std::string::npos) << s.to_string();
  }
}

TEST(CombineExpandedReceiver, TooSmallRegionNamesRowsAndCapacity) {
  InprocWorld world(*Topology::create(2, 1));
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    BufferConfig config = make_config(DispatchAlgorithm::kFlat, 0);
    config.max_combine_dtype = DType::kBF16;  // room for 2 x 11 bf16 rows; the expanded rows need more
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config));
    DispatchResult d;
    EPX_RETURN_IF_ERROR(dispatch(*buffer, make_routing(t.rank()), &d));
    Result<TensorView> small = buffer->combine_expanded_input(d.handle, DType::kBF16);
    EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(small.status().message().find("max_expanded_rows"), std::string::npos) << small.status().to_string();
    EXPECT_NE(small.status().message().find("holds 22 such rows"), std::string::npos) << small.status().to_string();
    config.max_expanded_rows = 2 * kTokens * kTopk + kExperts * 3;
    EPX_ASSIGN_OR_RETURN(auto roomy, Buffer::create(t, config));
    EPX_RETURN_IF_ERROR(dispatch(*roomy, make_routing(t.rank()), &d));
    return roomy->combine_expanded_input(d.handle, DType::kBF16).status();
  });
  for (const Status& s : statuses) EXPECT_TRUE(s.is_ok()) << s.to_string();
}

// grad_weights of one backward with y = `y`; `*gw` [num_recv, K].
Status backward(Buffer& buffer, const DispatchResult& d, const TensorView& y, std::vector<float>* gw) {
  std::vector<uint16_t> grad_out(kTokens * kHidden);
  for (std::size_t i = 0; i < grad_out.size(); ++i) grad_out[i] = f32_to_bf16(0.01f * static_cast<float>(i % 37) - 0.2f);
  const int64_t rows = y.size(0), num_recv = d.handle.num_recv_tokens();
  std::vector<float> grad_y(std::max<int64_t>(rows, 1) * kHidden);
  gw->assign(std::max<int64_t>(num_recv, 1) * kTopk, -3.0f);
  return buffer.combine_expanded_backward(
      TensorView::contiguous(grad_out.data(), DType::kBF16, {kTokens, kHidden}), d.handle, y, {},
      TensorView::contiguous(grad_y.data(), DType::kF32, {rows, kHidden}),
      TensorView::contiguous(gw->data(), DType::kF32, {num_recv, kTopk}));
}

// y written into the combine region survives for the backward: read there
// while nothing overwrote it, from the copy the Buffer kept with the handle
// after a later combine did. After the backward (the rows' last reader), or
// for rows no receiver combine of the handle read, the view is refused.
TEST(CombineExpandedReceiver, BackwardFindsYInTheRegionOrItsKeptCopy) {
  InprocWorld world(*Topology::create(4, 1));
  std::vector<Status> second(4), unread(4);
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int r = t.rank();
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, make_config(DispatchAlgorithm::kFlat)));
    DispatchResult d;
    EPX_RETURN_IF_ERROR(dispatch(*buffer, make_routing(r), &d));
    const int64_t rows = buffer->expanded_layout(d.handle).num_rows();
    std::vector<uint16_t> outside(std::max<int64_t>(rows, 1) * kHidden);
    const TensorView y_out = TensorView::contiguous(outside.data(), DType::kBF16, {rows, kHidden});
    fill_y(*buffer, d, r, y_out);
    std::vector<float> out(kTokens * kHidden), expected, kept, live, refused;
    const TensorView out_view = TensorView::contiguous(out.data(), DType::kF32, {kTokens, kHidden});
    EPX_RETURN_IF_ERROR(backward(*buffer, d, y_out, &expected));
    EPX_ASSIGN_OR_RETURN(TensorView y_in, buffer->combine_expanded_input(d.handle, DType::kBF16));
    fill_y(*buffer, d, r, y_in);
    EPX_RETURN_IF_ERROR(buffer->combine_expanded(y_in, d.handle, out_view, {}, receiver()));
    // A holder-weighted combine overwrites the region with its partials.
    EPX_RETURN_IF_ERROR(buffer->combine_expanded(y_out, d.handle, out_view));
    EPX_RETURN_IF_ERROR(backward(*buffer, d, y_in, &kept));
    // Zero copy again; the backward reads the region itself.
    fill_y(*buffer, d, r, *buffer->combine_expanded_input(d.handle, DType::kBF16));
    EPX_RETURN_IF_ERROR(buffer->combine_expanded(y_in, d.handle, out_view, {}, receiver()));
    EPX_RETURN_IF_ERROR(backward(*buffer, d, y_in, &live));
    EXPECT_EQ(kept, expected) << "rank " << r;
    EXPECT_EQ(live, expected) << "rank " << r;
    second[r] = backward(*buffer, d, y_in, &refused);
    // A second dispatch's view, written but never combined.
    DispatchResult d2;
    EPX_RETURN_IF_ERROR(dispatch(*buffer, make_routing(r + 5), &d2));
    EPX_ASSIGN_OR_RETURN(TensorView y2, buffer->combine_expanded_input(d2.handle, DType::kBF16));
    unread[r] = backward(*buffer, d2, y2, &refused);
    return Status::ok();
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
    for (const Status& s : {second[r], unread[r]}) {
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
      EXPECT_NE(s.message().find("combine region"), std::string::npos) << s.to_string();
    }
  }
}

}  // namespace
}  // namespace epx
