// MoELayer's overlap modes give the bits of the plain layer: forward output,
// input gradient, every parameter's gradient, the auxiliary loss and the
// load statistics, on uneven token counts (a rank with none), one and two
// nodes, f32 and bf16, with and without padded expert groups.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/core/random.h"
#include "epx/layer/moe_layer.h"
#include "experts/gemm.h"

namespace epx {
namespace {

struct LayerWorld {
  int num_ranks = 4;
  int num_nodes = 2;
  std::vector<int> tokens = {37, 0, 50, 23};
  DType dtype = DType::kF32;
  std::optional<DType> compute_dtype;  // the expert GEMMs' (unset = dtype)
  int alignment = 1;
  int shared = 1;
  int steps = 2;  // forward + backward twice: buffers reused across calls
  int hidden = 64;
  std::optional<DType> dispatch_dtype;  // MoELayerConfig::dispatch_dtype
  bool pack = false;                    // MoELayerConfig::pack_expert_weights
};

struct RankOutcome {
  std::vector<float> out, grad_x;
  std::map<std::string, std::vector<float>> grads;
  double aux_loss = 0;
  std::vector<int64_t> tokens_per_expert;
};

MoELayerConfig layer_config(const LayerWorld& s, OverlapMode mode, int chunks) {
  MoELayerConfig c;
  c.hidden = s.hidden;
  c.dispatch_dtype = s.dispatch_dtype;
  c.ffn_hidden = 32;
  c.router = {.num_experts = 16, .topk = 4, .normalize_weights = true};
  c.num_shared_experts = s.shared;
  c.dtype = s.dtype;
  c.compute_dtype = s.compute_dtype;
  c.aux_loss_coeff = 0.01;
  c.aux_loss = AuxLossKind::kGlobalBatch;  // an all-reduce inside forward, too
  c.z_loss_coeff = 0.001;
  c.seed = 11;
  c.overlap = mode;
  c.overlap_chunks = chunks;
  c.pack_expert_weights = s.pack;
  return c;
}

std::vector<RankOutcome> run(const LayerWorld& s, OverlapMode mode, int chunks) {
  std::vector<RankOutcome> outcome(s.num_ranks);
  const MoELayerConfig config = layer_config(s, mode, chunks);
  const int H = config.hidden;
  auto statuses = run_ranks(Topology::create(s.num_ranks, s.num_nodes).value(), [&](Transport& t) -> Status {
    const int r = t.rank(), T = s.tokens[r];
    BufferConfig bc;
    bc.num_experts = config.router.num_experts;
    bc.hidden = H;
    bc.dtype = config.dispatch_dtype.value_or(config.dtype);
    if (bc.dtype == DType::kFP8E4M3) bc.gradient_dtype = config.dtype;
    bc.max_topk = config.router.topk;
    bc.max_tokens_per_rank = 64;
    bc.expert_alignment = s.alignment;
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, bc));
    EPX_ASSIGN_OR_RETURN(auto layer, MoELayer::create(config, t, *buffer, 0));
    RankOutcome& o = outcome[r];
    for (int step = 0; step < s.steps; ++step) {
      std::vector<float> x(static_cast<std::size_t>(std::max(T, 1)) * H), g(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        x[i] = static_cast<float>(standard_normal(5 + step, static_cast<uint64_t>(r), i));
        g[i] = static_cast<float>(standard_normal(6 + step, static_cast<uint64_t>(r), i));
      }
      o.out.assign(x.size(), -1.0f);
      o.grad_x.assign(x.size(), -1.0f);
      for (Parameter* p : layer->parameters()) std::fill(p->grad.begin(), p->grad.end(), 0.0f);
      EPX_RETURN_IF_ERROR(layer->forward(TensorView::contiguous(x.data(), DType::kF32, {T, H}),
                                         TensorView::contiguous(o.out.data(), DType::kF32, {T, H})));
      EPX_RETURN_IF_ERROR(layer->backward(TensorView::contiguous(g.data(), DType::kF32, {T, H}),
                                          TensorView::contiguous(o.grad_x.data(), DType::kF32, {T, H})));
    }
    for (Parameter* p : layer->parameters()) o.grads[p->name] = p->grad;
    o.aux_loss = layer->aux_loss();
    o.tokens_per_expert = layer->load_stats().tokens_per_expert;
    return Status::ok();
  });
  EXPECT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
  return outcome;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b, std::string* where) {
  if (a.size() != b.size()) {
    *where = fmt::format("sizes {} and {}", a.size(), b.size());
    return false;
  }
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      *where = fmt::format("element {}: {} vs {}", i, a[i], b[i]);
      return false;
    }
  return true;
}

void expect_same(const LayerWorld& s, OverlapMode mode, int chunks) {
  SCOPED_TRACE(fmt::format("{} ranks / {} nodes, {}, alignment {}, overlap {} ({} chunks)", s.num_ranks, s.num_nodes,
                           dtype_name(s.dtype), s.alignment, overlap_mode_name(mode), chunks));
  const std::vector<RankOutcome> plain = run(s, OverlapMode::kNone, 1);
  const std::vector<RankOutcome> overlapped = run(s, mode, chunks);
  ASSERT_EQ(plain.size(), overlapped.size());
  bool any_grad = false;
  for (int r = 0; r < s.num_ranks; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    std::string where;
    EXPECT_TRUE(same_bits(overlapped[r].out, plain[r].out, &where)) << "forward output: " << where;
    EXPECT_TRUE(same_bits(overlapped[r].grad_x, plain[r].grad_x, &where)) << "grad_x: " << where;
    for (const auto& [name, grad] : plain[r].grads) {
      ASSERT_TRUE(overlapped[r].grads.count(name)) << name;
      EXPECT_TRUE(same_bits(overlapped[r].grads.at(name), grad, &where)) << name << " gradient: " << where;
      for (float v : grad) any_grad = any_grad || v != 0.0f;
    }
    EXPECT_EQ(overlapped[r].aux_loss, plain[r].aux_loss);
    EXPECT_EQ(overlapped[r].tokens_per_expert, plain[r].tokens_per_expert);
  }
  EXPECT_TRUE(any_grad) << "every gradient is zero: the comparison would prove nothing";
}

TEST(MoELayerOverlap, SharedExpertsUnderTheDispatch) { expect_same(LayerWorld{}, OverlapMode::kSharedExperts, 1); }

TEST(MoELayerOverlap, ChunkedPipelining) {
  expect_same(LayerWorld{}, OverlapMode::kChunked, 3);
  LayerWorld bf16;
  bf16.dtype = DType::kBF16;
  bf16.alignment = 4;
  expect_same(bf16, OverlapMode::kChunked, 4);
  LayerWorld bf16_into_f32 = bf16;  // a bf16 payload, f32 expert GEMMs
  bf16_into_f32.compute_dtype = DType::kF32;
  expect_same(bf16_into_f32, OverlapMode::kChunked, 4);
  LayerWorld one_node;
  one_node.num_nodes = 1;
  one_node.shared = 0;
  one_node.tokens = {5, 64, 1, 0};  // more chunks than some ranks have tokens
  expect_same(one_node, OverlapMode::kChunked, 8);
}

TEST(MoELayerOverlap, TwoMicroBatches) {
  expect_same(LayerWorld{}, OverlapMode::kTwoMicroBatches, 2);
  LayerWorld bf16;
  bf16.dtype = DType::kBF16;
  bf16.alignment = 4;
  bf16.num_ranks = 2;
  bf16.num_nodes = 2;
  bf16.tokens = {33, 64};
  expect_same(bf16, OverlapMode::kTwoMicroBatches, 2);
}

// Packed expert weights (bf16 GEMMs): the plain packed layer's bits in every
// mode, two steps (the second reuses the packing).
TEST(MoELayerOverlap, PackedExpertWeightsInEveryMode) {
  LayerWorld packed;
  packed.dtype = DType::kBF16;
  packed.hidden = 128;
  packed.pack = true;
  const int64_t calls = detail::packed_gemm_calls();
  expect_same(packed, OverlapMode::kSharedExperts, 1);
  expect_same(packed, OverlapMode::kChunked, 3);
  expect_same(packed, OverlapMode::kTwoMicroBatches, 2);
  EXPECT_GT(detail::packed_gemm_calls(), calls) << "no call read the packed weights";
  LayerWorld f32;
  f32.pack = true;
  EXPECT_EQ(layer_config(f32, OverlapMode::kNone, 1).validate().code(), StatusCode::kInvalidArgument);
}

// fp8 dispatch: each row is quantised on its own, so every mode still gives
// the plain fp8 layer's bits (forward and backward, which stays bf16).
TEST(MoELayerOverlap, Fp8DispatchInEveryMode) {
  LayerWorld fp8;
  fp8.dtype = DType::kBF16;
  fp8.hidden = 128;
  fp8.dispatch_dtype = DType::kFP8E4M3;
  expect_same(fp8, OverlapMode::kSharedExperts, 1);
  expect_same(fp8, OverlapMode::kChunked, 3);
  expect_same(fp8, OverlapMode::kTwoMicroBatches, 2);
}

TEST(MoELayerOverlap, ConfigErrorsNameTheValue) {
  MoELayerConfig c = layer_config(LayerWorld{}, OverlapMode::kChunked, 0);
  Status s = c.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlap_chunks = 0"), std::string::npos) << s.to_string();
  c = layer_config(LayerWorld{}, OverlapMode::kTwoMicroBatches, 2);
  c.router.capacity_factor = 1.25;
  s = c.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("capacity_factor = 1.25"), std::string::npos) << s.to_string();
  EXPECT_EQ(parse_overlap_mode("chunked").value(), OverlapMode::kChunked);
  EXPECT_EQ(parse_overlap_mode("interleaved").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace epx
