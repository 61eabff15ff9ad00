// combine_expanded with bf16 partials (CombineOptions::partial_dtype):
// each (token, holder rank) partial is the fp32 sum of its weighted slots in
// top-k order, rounded once to bf16; the partials are then summed in fp32 in
// the fixed order (flat: holders ascending; two-hop: one group per node,
// nodes ascending, holders ascending inside). Every value is checked exactly
// against that formula, computed on the token's own rank from its routing.
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

Routing make_routing(int rank) { return expanded_test::make_routing(rank, 23); }

// The formula: out[t] = 0 + sum over groups (0 + sum over holders of the
// group of bf16(0 + sum_k w_k * y_k)), groups = holders (flat) or nodes.
std::vector<float> reference(int rank, const Routing& r, const Topology& topo, bool two_hop) {
  const int R = topo.num_ranks(), per_rank = kExperts / R;
  std::vector<float> out(kTokens * kHidden);
  for (int t = 0; t < kTokens; ++t)
    for (int c = 0; c < kHidden; ++c) {
      std::vector<float> group(two_hop ? topo.num_nodes() : R, 0.0f);
      std::vector<bool> used(group.size(), false);
      for (int d = 0; d < R; ++d) {
        float p = 0.0f;
        bool any = false;
        for (int k = 0; k < kTopk; ++k) {
          const int e = r.idx[t * kTopk + k];
          if (e < 0 || e / per_rank != d) continue;
          p = p + r.w[t * kTopk + k] * y_value(rank, t, e, c);
          any = true;
        }
        if (!any) continue;
        const std::size_t g = two_hop ? static_cast<std::size_t>(topo.node_of(d)) : static_cast<std::size_t>(d);
        group[g] = group[g] + bf16_to_f32(f32_to_bf16(p));
        used[g] = true;
      }
      float acc = 0.0f;
      for (std::size_t g = 0; g < group.size(); ++g)
        if (used[g]) acc = acc + group[g];
      out[t * kHidden + c] = acc;
    }
  return out;
}

// One rank: dispatch, fill y_expanded from the layout, combine_expanded with
// partials of `partial_dtype` on a Buffer whose max_combine_dtype is
// `region_dtype`; *out gets the result.
Status combine_once(Transport& t, DispatchAlgorithm algorithm, DType partial_dtype, DType region_dtype,
                    const Routing& routing, std::vector<float>* out) {
  BufferConfig config;
  config.num_experts = kExperts;
  config.hidden = kHidden;
  config.dtype = DType::kBF16;
  config.max_topk = kTopk;
  config.max_tokens_per_rank = kTokens;
  config.expert_alignment = 4;
  config.max_combine_dtype = region_dtype;
  config.algorithm = algorithm;
  EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, config));
  std::vector<uint16_t> x(kTokens * kHidden, f32_to_bf16(1.0f));
  DispatchResult d;
  EPX_RETURN_IF_ERROR(buffer->dispatch({TensorView::contiguous(x.data(), DType::kBF16, {kTokens, kHidden}),
                                        TensorView::contiguous(routing.idx.data(), DType::kI32, {kTokens, kTopk}),
                                        TensorView::contiguous(routing.w.data(), DType::kF32, {kTokens, kTopk})},
                                       &d));
  const ExpandedLayout& layout = buffer->expanded_layout(d.handle);
  const int64_t rows = layout.num_rows();
  const int per_rank = kExperts / t.num_ranks();
  std::vector<float> y(std::max<int64_t>(rows, 1) * kHidden, 0.0f);
  for (int e = 0; e + 1 < static_cast<int>(layout.expert_offsets.size()); ++e)
    for (int64_t row = layout.expert_offsets[e]; row < layout.expert_offsets[e + 1]; ++row) {
      const int64_t i = layout.recv_row[row];
      if (i < 0) continue;
      const int src = d.recv_src_rank.data_as<int32_t>()[i], tok = d.recv_src_idx.data_as<int32_t>()[i];
      for (int c = 0; c < kHidden; ++c) y[row * kHidden + c] = y_value(src, tok, t.rank() * per_rank + e, c);
    }
  out->assign(kTokens * kHidden, -7.0f);
  CombineOptions options;
  options.partial_dtype = partial_dtype;
  return buffer->combine_expanded(TensorView::contiguous(y.data(), DType::kF32, {rows, kHidden}), d.handle,
                                  TensorView::contiguous(out->data(), DType::kF32, {kTokens, kHidden}), {}, options);
}

void run_case(int num_ranks, int num_nodes, DispatchAlgorithm algorithm) {
  SCOPED_TRACE(testing::Message() << num_nodes << "x" << num_ranks / num_nodes
                                  << (algorithm == DispatchAlgorithm::kFlat ? " flat" : " two-hop"));
  const Topology topo = *Topology::create(num_ranks, num_nodes);
  const bool two_hop = num_nodes > 1 && algorithm != DispatchAlgorithm::kFlat;
  InprocWorld world(topo);
  std::vector<int> differs(num_ranks, 0);  // columns where f32 partials give other bits
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int r = t.rank();
    const Routing routing = make_routing(r);
    std::vector<float> bf16_out, again, f32_out;
    EPX_RETURN_IF_ERROR(combine_once(t, algorithm, DType::kBF16, DType::kF32, routing, &bf16_out));
    // Again, on a Buffer with a bf16 combine region: the same bits.
    EPX_RETURN_IF_ERROR(combine_once(t, algorithm, DType::kBF16, DType::kBF16, routing, &again));
    EPX_RETURN_IF_ERROR(combine_once(t, algorithm, DType::kF32, DType::kF32, routing, &f32_out));
    const std::vector<float> expected = reference(r, routing, topo, two_hop);
    int nonzero = 0;
    for (int i = 0; i < kTokens * kHidden; ++i) {
      EXPECT_EQ(bf16_out[i], expected[i]) << "rank " << r << " token " << i / kHidden << " col " << i % kHidden;
      EXPECT_EQ(again[i], bf16_out[i]) << "second call (bf16 region), rank " << r << " element " << i;
      EXPECT_NEAR(f32_out[i], bf16_out[i], 0.02f) << "f32 partials, rank " << r << " element " << i;
      nonzero += bf16_out[i] != 0.0f;
      differs[r] += f32_out[i] != bf16_out[i];
    }
    EXPECT_GT(nonzero, 0) << "rank " << r << ": every output is zero";
    return Status::ok();
  });
  for (int r = 0; r < num_ranks; ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
  int total_differs = 0;
  for (int n : differs) total_differs += n;
  EXPECT_GT(total_differs, 0) << "bf16 partials gave the f32 partials' bits everywhere: the rounding did not happen";
}

// f32 partials need an f32 region: every rank fails before anything is sent.
TEST(CombineExpandedBf16Partials, F32PartialsNeedAnF32Region) {
  InprocWorld world(*Topology::create(2, 1));
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    std::vector<float> out;
    return combine_once(t, DispatchAlgorithm::kAuto, DType::kF32, DType::kBF16, make_routing(t.rank()), &out);
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("partial_dtype = f32 must be bf16 or f32 and no wider than max_combine_dtype = bf16"),
              std::string::npos)
        << s.message();
  }
}

TEST(CombineExpandedBf16Partials, MatchesTheFormula) {
  run_case(1, 1, DispatchAlgorithm::kAuto);
  run_case(4, 1, DispatchAlgorithm::kAuto);
  run_case(4, 2, DispatchAlgorithm::kFlat);
  run_case(4, 2, DispatchAlgorithm::kHierarchical);
  run_case(8, 2, DispatchAlgorithm::kHierarchical);
  run_case(8, 4, DispatchAlgorithm::kFlat);
}

}  // namespace
}  // namespace epx
