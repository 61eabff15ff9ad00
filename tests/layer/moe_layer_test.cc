// MoELayer: gradients by finite differences (router, norm, shared and routed
// experts, aux and z losses included), EP over R ranks equals one rank
// holding every expert, and configuration errors.
#include "epx/layer/moe_layer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/core/random.h"

namespace epx {
namespace {

struct Scenario {
  int num_ranks = 2;
  int num_nodes = 1;
  std::vector<int> tokens;  // per rank
  MoELayerConfig layer;
  // Central-difference step. Routing is piecewise smooth: a step that moves
  // a token across a top-k or capacity boundary measures the jump, not the
  // slope, so scenarios with close boundaries use a smaller step.
  double eps = 1e-3;
};

MoELayerConfig small_layer() {
  MoELayerConfig c;
  c.hidden = 8;
  c.ffn_hidden = 6;
  c.router = {.num_experts = 4, .topk = 2, .normalize_weights = true};
  c.num_shared_experts = 1;
  c.aux_loss_coeff = 0.05;
  c.z_loss_coeff = 0.01;
  c.seed = 7;
  c.init_std = 0.5f;  // large enough that the experts matter in the loss
  return c;
}

// room_in_place: the combine region has room for the expanded f32 rows, so
// the layer's experts write them there and the combine reads them in place.
Result<std::unique_ptr<Buffer>> make_buffer(Transport& t, const MoELayerConfig& c, int max_tokens,
                                            bool room_in_place = false) {
  BufferConfig bc{.num_experts = c.router.num_experts, .hidden = c.hidden, .dtype = c.dtype,
                  .max_topk = c.router.topk, .max_tokens_per_rank = max_tokens, .placement = {}};
  if (c.combine_weights == CombineWeights::kReceiver)
    bc.max_expanded_rows = Buffer::expanded_rows_bound(bc, t.num_ranks(), c.dtype);
  if (room_in_place) bc.max_expanded_rows = Buffer::expanded_rows_bound(bc, t.num_ranks(), DType::kF32);
  return Buffer::create(t, bc);
}

// Token t of the global batch (rank-independent values).
std::vector<float> global_inputs(int total_tokens, int hidden, uint64_t stream) {
  std::vector<float> x(static_cast<std::size_t>(total_tokens) * hidden);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(standard_normal(99, stream, i));
  return x;
}

int first_token(const std::vector<int>& tokens, int rank) {
  int s = 0;
  for (int r = 0; r < rank; ++r) s += tokens[r];
  return s;
}

// L = sum over ranks of <c, out> + aux losses.
Result<double> global_loss(MoELayer& layer, Transport& t, std::vector<float>& x, const std::vector<float>& c, int T,
                           int H) {
  std::vector<float> out(static_cast<std::size_t>(std::max(T, 1)) * H);
  EPX_RETURN_IF_ERROR(layer.forward(TensorView::contiguous(x.data(), DType::kF32, {T, H}),
                                    TensorView::contiguous(out.data(), DType::kF32, {T, H})));
  double local = layer.aux_loss();
  for (int i = 0; i < T * H; ++i) local += static_cast<double>(c[i]) * out[i];
  EPX_RETURN_IF_ERROR(t.all_reduce(std::span<double>(&local, 1), ReduceOp::kSum, Deadline::after(Milliseconds(20000))));
  return local;
}

void check_gradients(const Scenario& s) {
  const int H = s.layer.hidden;
  int total = 0;
  for (int n : s.tokens) total += n;
  const std::vector<float> all_x = global_inputs(total, H, 1);
  const std::vector<float> all_c = global_inputs(total, H, 2);
  std::mutex mu;
  int checked = 0;
  std::vector<std::string> failures;
  auto topo = Topology::create(s.num_ranks, s.num_nodes);
  ASSERT_TRUE(topo.is_ok()) << topo.status().to_string();
  auto statuses = run_ranks(topo.value(), [&](Transport& t) -> Status {
    const int rank = t.rank(), T = s.tokens[rank];
    const auto first = static_cast<std::ptrdiff_t>(first_token(s.tokens, rank)) * H;
    std::vector<float> x(all_x.begin() + first, all_x.begin() + first + T * H);
    std::vector<float> c(all_c.begin() + first, all_c.begin() + first + T * H);
    EPX_ASSIGN_OR_RETURN(auto buffer, make_buffer(t, s.layer, 16));
    EPX_ASSIGN_OR_RETURN(auto layer, MoELayer::create(s.layer, t, *buffer, 0));
    // Analytic gradients.
    std::vector<float> out(static_cast<std::size_t>(std::max(T, 1)) * H), grad_x(out.size());
    EPX_RETURN_IF_ERROR(layer->forward(TensorView::contiguous(x.data(), DType::kF32, {T, H}),
                                       TensorView::contiguous(out.data(), DType::kF32, {T, H})));
    EPX_RETURN_IF_ERROR(layer->backward(TensorView::contiguous(c.data(), DType::kF32, {T, H}),
                                        TensorView::contiguous(grad_x.data(), DType::kF32, {T, H})));
    const auto deadline = Deadline::after(Milliseconds(20000));
    for (Parameter* p : layer->parameters())
      if (p->kind == ParamKind::kDense) EPX_RETURN_IF_ERROR(t.all_reduce(std::span<float>(p->grad), ReduceOp::kSum, deadline));

    const double eps = s.eps;
    auto compare = [&](const std::string& what, double analytic, float* value, bool perturb_here) -> Status {
      const float saved = perturb_here ? *value : 0.0f;
      if (perturb_here) *value = saved + static_cast<float>(eps);
      EPX_ASSIGN_OR_RETURN(double plus, global_loss(*layer, t, x, c, T, H));
      if (perturb_here) *value = saved - static_cast<float>(eps);
      EPX_ASSIGN_OR_RETURN(double minus, global_loss(*layer, t, x, c, T, H));
      if (perturb_here) *value = saved;
      const double numeric = (plus - minus) / (2 * eps);
      if (rank == 0) {
        std::lock_guard lock(mu);
        ++checked;
        if (std::abs(numeric - analytic) > 3e-3 + 2e-2 * std::abs(analytic))
          failures.push_back(fmt::format("{}: analytic {} numeric {}", what, analytic, numeric));
      }
      return Status::ok();
    };
    // Every rank walks the same list of (parameter, index) so the collectives line up.
    for (Parameter* p : layer->parameters()) {
      for (int j = 0; j < 5; ++j) {
        const auto i = static_cast<std::size_t>(random_bits(3, j, p->numel()) % static_cast<uint64_t>(p->numel()));
        if (p->kind == ParamKind::kDense) {
          EPX_RETURN_IF_ERROR(compare(fmt::format("{}[{}]", p->name, i), p->grad[i], &p->value[i], true));
        } else {
          // Expert parameters: rank o perturbs its own; the others join the collectives.
          for (int o = 0; o < t.num_ranks(); ++o) {
            double analytic = o == rank ? p->grad[i] : 0.0;
            EPX_RETURN_IF_ERROR(t.all_reduce(std::span<double>(&analytic, 1), ReduceOp::kSum, deadline));
            EPX_RETURN_IF_ERROR(compare(fmt::format("{}[{}]@rank{}", p->name, i, o), analytic, &p->value[i], o == rank));
          }
        }
      }
    }
    for (int o = 0; o < t.num_ranks(); ++o) {
      for (int j = 0; j < 3; ++j) {
        const int n = s.tokens[o] * H;
        if (n == 0) continue;
        const auto i = static_cast<std::size_t>(random_bits(4, j, o) % static_cast<uint64_t>(n));
        double analytic = o == rank ? grad_x[i] : 0.0;
        EPX_RETURN_IF_ERROR(t.all_reduce(std::span<double>(&analytic, 1), ReduceOp::kSum, deadline));
        EPX_RETURN_IF_ERROR(compare(fmt::format("x[{}]@rank{}", i, o), analytic, o == rank ? &x[i] : nullptr, o == rank));
      }
    }
    return Status::ok();
  });
  ASSERT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
  EXPECT_GT(checked, 20);
  for (const auto& f : failures) ADD_FAILURE() << f;
}

TEST(MoELayerGradients, OneRankSoftmaxSharedAuxZ) {
  Scenario s{.num_ranks = 1, .tokens = {7}, .layer = small_layer()};
  check_gradients(s);
}

TEST(MoELayerGradients, TwoRanksUnevenTokens) {
  Scenario s{.num_ranks = 2, .tokens = {5, 3}, .layer = small_layer()};
  check_gradients(s);
}

TEST(MoELayerGradients, FourRanksTwoNodesSigmoidGroupedOneRankEmpty) {
  Scenario s{.num_ranks = 4, .num_nodes = 2, .tokens = {4, 0, 3, 5}, .layer = small_layer()};
  s.layer.router = {.num_experts = 8, .topk = 2, .score_function = ScoreFunction::kSigmoid,
                    .normalize_weights = true, .scaling_factor = 2.0f, .num_groups = 4, .topk_groups = 2};
  s.layer.num_shared_experts = 0;
  s.layer.aux_loss = AuxLossKind::kGlobalBatch;
  check_gradients(s);
}

TEST(MoELayerGradients, CapacityDropsKeepGradientsExact) {
  Scenario s{.num_ranks = 2, .tokens = {8, 6}, .layer = small_layer()};
  s.layer.router.capacity_factor = 0.5;  // drops about half of the (token, slot) pairs
  // Position drops: the kept set changes only where the top-k does (the score
  // policy's kept set also flips when two close weights swap under eps).
  s.layer.router.drop_policy = DropPolicy::kPosition;
  s.eps = 2e-4;  // with 1e-3, perturbing norm[1] moves one token across the capacity boundary
  check_gradients(s);
}

// One forward + backward of the global batch split over `num_ranks`; returns
// out, grad_x (global token order) and every parameter's gradient keyed by
// name and global expert (dense gradients summed over ranks). With a
// slot -> expert map (redundant experts, rank-major slots) the expert
// gradients are summed over replicas and keyed by logical expert; `replicas`
// holds every replica's copy.
struct RunResult {
  std::vector<float> out, grad_x;
  std::map<std::string, std::vector<float>> grads;
  std::map<std::string, std::vector<std::vector<float>>> replicas;
  std::vector<int64_t> tokens_per_expert, work_per_rank;
};

RunResult run_layer(int num_ranks, int total, const MoELayerConfig& config, std::vector<int32_t> slot_expert = {},
                    bool room_in_place = false) {
  const int H = config.hidden, E = config.router.num_experts;
  const std::vector<float> all_x = global_inputs(total, H, 5), all_c = global_inputs(total, H, 6);
  RunResult result;
  result.out.resize(all_x.size());
  result.grad_x.resize(all_x.size());
  std::mutex mu;
  auto statuses = run_ranks(Topology::create(num_ranks, 1).value(), [&](Transport& t) -> Status {
    const int rank = t.rank(), T = total / num_ranks;
    const auto first = static_cast<std::ptrdiff_t>(rank) * T * H;
    std::vector<float> x(all_x.begin() + first, all_x.begin() + first + T * H);
    std::vector<float> c(all_c.begin() + first, all_c.begin() + first + T * H);
    std::unique_ptr<Buffer> buffer;
    if (slot_expert.empty()) {
      EPX_ASSIGN_OR_RETURN(buffer, make_buffer(t, config, total, room_in_place));
    } else {
      const int S = static_cast<int>(slot_expert.size());
      EPX_ASSIGN_OR_RETURN(auto placement, ExpertPlacement::contiguous(S, num_ranks));
      EPX_ASSIGN_OR_RETURN(buffer, Buffer::create(t, {.num_experts = S, .hidden = H, .dtype = config.dtype,
                                                      .max_topk = config.router.topk, .max_tokens_per_rank = total,
                                                      .placement = placement}));
    }
    EPX_ASSIGN_OR_RETURN(auto layer, MoELayer::create(config, t, *buffer, 3, slot_expert));
    EPX_RETURN_IF_ERROR(layer->forward(TensorView::contiguous(x.data(), DType::kF32, {T, H}),
                                       TensorView::contiguous(result.out.data() + first, DType::kF32, {T, H})));
    EPX_RETURN_IF_ERROR(layer->backward(TensorView::contiguous(c.data(), DType::kF32, {T, H}),
                                        TensorView::contiguous(result.grad_x.data() + first, DType::kF32, {T, H})));
    for (Parameter* p : layer->parameters()) {
      if (p->kind == ParamKind::kDense)
        EPX_RETURN_IF_ERROR(t.all_reduce(std::span<float>(p->grad), ReduceOp::kSum, Deadline::after(Milliseconds(20000))));
    }
    EPX_RETURN_IF_ERROR(layer->sum_replica_gradients());
    std::lock_guard lock(mu);
    if (rank == 0) result.tokens_per_expert = layer->load_stats().tokens_per_expert;
    if (rank == 0) result.work_per_rank = layer->load_stats().work_per_rank;
    for (Parameter* p : layer->parameters()) {
      if (p->kind == ParamKind::kDense) {
        if (rank == 0) result.grads[p->name] = p->grad;
        continue;
      }
      const int64_t per_expert = p->numel() / layer->num_local_experts();
      for (int l = 0; l < layer->num_local_experts(); ++l) {
        const int g = slot_expert.empty() ? buffer->placement().global_id(rank, l) : layer->local_logical_expert(l);
        if (g < 0) continue;
        const std::string key = fmt::format("{}#{}", p->name, g);
        result.grads[key].assign(p->grad.begin() + l * per_expert, p->grad.begin() + (l + 1) * per_expert);
        result.replicas[key].push_back(result.grads[key]);
      }
    }
    (void)E;
    return Status::ok();
  });
  EXPECT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
  return result;
}

void expect_close(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double max_abs = 0, max_diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    max_abs = std::max(max_abs, static_cast<double>(std::abs(a[i])));
    max_diff = std::max(max_diff, static_cast<double>(std::abs(a[i] - b[i])));
  }
  EXPECT_GT(max_abs, 0.0) << what << " is all zero";
  EXPECT_LE(max_diff, 1e-5 * std::max(1.0, max_abs)) << what;
}

TEST(MoELayerExpertParallel, FourRanksEqualOneRankHoldingEveryExpert) {
  MoELayerConfig config = small_layer();
  config.router = {.num_experts = 8, .topk = 2, .normalize_weights = true};
  config.aux_loss = AuxLossKind::kGlobalBatch;  // the micro-batch loss depends on the split
  config.z_loss_coeff = 0.0;
  const RunResult one = run_layer(1, 48, config);
  const RunResult four = run_layer(4, 48, config);
  // Every expert gets tokens, so every compared gradient is non-zero.
  for (int64_t n : one.tokens_per_expert) ASSERT_GT(n, 0);
  expect_close(one.out, four.out, "out");
  expect_close(one.grad_x, four.grad_x, "grad_x");
  EXPECT_EQ(one.tokens_per_expert, four.tokens_per_expert);
  ASSERT_EQ(one.grads.size(), four.grads.size());
  for (const auto& [name, grad] : one.grads) {
    ASSERT_TRUE(four.grads.contains(name)) << name;
    expect_close(grad, four.grads.at(name), name);
  }
}

// max |a - b| / max |a|.
double max_rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::abs(a[i])));
  }
  return diff / scale;
}

// bf16 payload and expert GEMMs (fp32 accumulation) against the f32 layer:
// the residual and the router are f32 either way, so the outputs differ by
// bf16 rounding of the expert path only.
TEST(MoELayerPrecision, Bf16FollowsF32WithinBf16Rounding) {
  MoELayerConfig config = small_layer();
  config.router = {.num_experts = 8, .topk = 2, .normalize_weights = true};
  const RunResult f32 = run_layer(2, 32, config);
  config.dtype = DType::kBF16;
  const RunResult bf16 = run_layer(2, 32, config);
  EXPECT_EQ(f32.tokens_per_expert, bf16.tokens_per_expert);  // routing is fp32 in both
  const double out_err = max_rel_error(f32.out, bf16.out), grad_err = max_rel_error(f32.grad_x, bf16.grad_x);
  EXPECT_GT(out_err, 0.0) << "bf16 should round somewhere";
  EXPECT_LT(out_err, 2e-2);
  EXPECT_LT(grad_err, 3e-2);
  // A bf16 payload into f32 GEMMs rounds only the dispatched rows.
  config.compute_dtype = DType::kF32;
  const RunResult payload_only = run_layer(2, 32, config);
  EXPECT_EQ(f32.tokens_per_expert, payload_only.tokens_per_expert);
  const double payload_err = max_rel_error(f32.out, payload_only.out);
  EXPECT_GT(payload_err, 0.0) << "the bf16 payload should round somewhere";
  EXPECT_LT(payload_err, 2e-2);
  EXPECT_LT(max_rel_error(f32.grad_x, payload_only.grad_x), 3e-2);
  EXPECT_NE(payload_only.out, bf16.out) << "compute_dtype f32 should change the expert GEMMs";
}

// combine_dtype bf16: the combine sends each
// (token, rank) partial rounded once to bf16, so the output differs from the
// f32 partials' by bf16 rounding of those partials only, the same bits on
// every run; the backward treats the rounding as the identity, so grad_x and
// every gradient keep the f32 partials' bits.
TEST(MoELayerPrecision, Bf16PartialsFollowF32PartialsWithinBf16Rounding) {
  MoELayerConfig config = small_layer();
  config.router = {.num_experts = 8, .topk = 4, .normalize_weights = true};
  config.dtype = DType::kBF16;
  const RunResult f32 = run_layer(4, 48, config);
  config.combine_dtype = DType::kBF16;
  const RunResult bf16 = run_layer(4, 48, config);
  const RunResult again = run_layer(4, 48, config);
  EXPECT_GT(max_rel_error(f32.out, bf16.out), 0.0) << "bf16 partials should round somewhere";
  EXPECT_LT(max_rel_error(f32.out, bf16.out), 1e-2);
  EXPECT_EQ(bf16.out, again.out) << "bf16 partials: not the same bits twice";
  EXPECT_EQ(f32.grad_x, bf16.grad_x);
  ASSERT_EQ(f32.grads.size(), bf16.grads.size());
  for (const auto& [name, grad] : f32.grads) EXPECT_EQ(grad, bf16.grads.at(name)) << name;
}

// Holder weights with room in the combine region: the experts write y in
// f32 there and the combine weighs each holder's rows where they lie. The
// output and every gradient keep the bits of y kept outside the Buffer.
TEST(MoELayerPrecision, RowsInPlaceKeepTheBitsOfRowsOutside) {
  MoELayerConfig config = small_layer();
  config.router = {.num_experts = 8, .topk = 4, .normalize_weights = true};
  for (const int ranks : {1, 4}) {
    const RunResult outside = run_layer(ranks, 48, config);
    const RunResult in_place = run_layer(ranks, 48, config, {}, /*room_in_place=*/true);
    EXPECT_EQ(outside.out, in_place.out) << ranks << " ranks";
    EXPECT_EQ(outside.grad_x, in_place.grad_x) << ranks << " ranks";
    ASSERT_EQ(outside.grads.size(), in_place.grads.size());
    for (const auto& [name, grad] : outside.grads) EXPECT_EQ(grad, in_place.grads.at(name)) << name;
  }
}

// combine_weights receiver: the experts write y in bf16 into the
// combine region and each token's rank sums w * y in top-k order. The output
// follows the holder partials' within bf16 rounding of y, with the same bits
// on every run and on any number of ranks (the sum order is the token's);
// the gradients follow the holder mode's (grad_weights reads the bf16 y).
TEST(MoELayerPrecision, ReceiverWeightsFollowHolderPartialsWithinBf16Rounding) {
  MoELayerConfig config = small_layer();
  config.router = {.num_experts = 8, .topk = 4, .normalize_weights = true};
  config.dtype = DType::kBF16;
  const RunResult holder = run_layer(4, 48, config);
  config.combine_weights = CombineWeights::kReceiver;
  const RunResult receiver = run_layer(4, 48, config);
  const RunResult again = run_layer(4, 48, config);
  const RunResult two_ranks = run_layer(2, 48, config);
  EXPECT_GT(max_rel_error(holder.out, receiver.out), 0.0) << "the bf16 y should round somewhere";
  EXPECT_LT(max_rel_error(holder.out, receiver.out), 1e-2);
  EXPECT_LT(max_rel_error(holder.grad_x, receiver.grad_x), 3e-2);
  EXPECT_EQ(receiver.out, again.out) << "not the same bits twice";
  EXPECT_EQ(receiver.grad_x, again.grad_x);
  EXPECT_EQ(receiver.out, two_ranks.out) << "receiver weights: other bits on 2 ranks than on 4";
  ASSERT_EQ(holder.grads.size(), receiver.grads.size());
  for (const auto& [name, grad] : holder.grads) {
    EXPECT_LT(max_rel_error(grad, receiver.grads.at(name)), 3e-2) << name;
    EXPECT_EQ(receiver.grads.at(name), again.grads.at(name)) << name;
  }
}

TEST(MoELayerPrecision, ReceiverWeightsRefuseOverlapAndBf16Partials) {
  MoELayerConfig config = small_layer();
  config.combine_weights = CombineWeights::kReceiver;
  config.overlap = OverlapMode::kChunked;
  Status s = config.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlap chunked"), std::string::npos) << s.to_string();
  config.overlap = OverlapMode::kNone;
  config.combine_dtype = DType::kBF16;
  s = config.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("combine_dtype bf16"), std::string::npos) << s.to_string();
}

// Redundant experts: 4 logical experts in 6 slots over 2 ranks (experts 0
// and 1 twice, on different ranks). The layer computes the same function as
// the plain one, tokens_per_expert stays logical, the work moves with the
// replicas, and after sum_replica_gradients both replicas hold the logical
// expert's whole gradient, bit for bit.
TEST(MoELayerExpertParallel, ReplicatedExpertsComputeTheLogicalLayer) {
  MoELayerConfig config = small_layer();
  config.aux_loss = AuxLossKind::kGlobalBatch;
  const RunResult plain = run_layer(2, 32, config);
  const RunResult replicated = run_layer(2, 32, config, {0, 1, 2, /*rank 1:*/ 3, 0, 1});
  for (int64_t n : plain.tokens_per_expert) ASSERT_GT(n, 0);
  expect_close(plain.out, replicated.out, "out");
  expect_close(plain.grad_x, replicated.grad_x, "grad_x");
  EXPECT_EQ(plain.tokens_per_expert, replicated.tokens_per_expert);
  ASSERT_EQ(replicated.work_per_rank.size(), 2u);
  // Rank 1 holds expert 3 and the second replicas (odd tokens of each rank) of 0 and 1.
  EXPECT_EQ(replicated.work_per_rank[0] + replicated.work_per_rank[1], plain.work_per_rank[0] + plain.work_per_rank[1]);
  EXPECT_NE(replicated.work_per_rank, plain.work_per_rank);
  ASSERT_EQ(plain.grads.size(), replicated.grads.size());
  for (const auto& [name, grad] : plain.grads) {
    ASSERT_TRUE(replicated.grads.contains(name)) << name;
    expect_close(grad, replicated.grads.at(name), name);
  }
  for (const char* w : {"w1", "w3", "w2"}) {
    for (int e = 0; e < 4; ++e) {
      const auto& copies = replicated.replicas.at(fmt::format("layer3.experts.{}#{}", w, e));
      ASSERT_EQ(copies.size(), e < 2 ? 2u : 1u) << w << " expert " << e;
      for (const auto& copy : copies) EXPECT_EQ(copy, copies[0]) << w << " expert " << e << ": replicas differ";
    }
  }
}

TEST(MoELayerConfigErrors, BadSlotMapNamesTheEntry) {
  auto statuses = run_ranks(Topology::create(1, 1).value(), [&](Transport& t) -> Status {
    MoELayerConfig config = small_layer();
    EPX_ASSIGN_OR_RETURN(auto buffer, make_buffer(t, config, 4));
    auto layer = MoELayer::create(config, t, *buffer, 0, {0, 1, 2, 7});
    EXPECT_NE(layer.status().message().find("slot_expert[3] = 7 is outside [-1, 4)"), std::string::npos)
        << layer.status().to_string();
    layer = MoELayer::create(config, t, *buffer, 0, {0, 1, 2, 2});
    EXPECT_NE(layer.status().message().find("logical expert 3 has no slot"), std::string::npos)
        << layer.status().to_string();
    layer = MoELayer::create(config, t, *buffer, 0, {0, 1, 2});
    EXPECT_NE(layer.status().message().find("slot_expert has 3 entries; the Buffer has 4 slots"), std::string::npos)
        << layer.status().to_string();
    return Status::ok();
  });
  EXPECT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
}

TEST(MoELayerConfigErrors, BufferMismatchNamesBothValues) {
  auto statuses = run_ranks(Topology::create(1, 1).value(), [&](Transport& t) -> Status {
    MoELayerConfig config = small_layer();
    EPX_ASSIGN_OR_RETURN(auto buffer, make_buffer(t, config, 4));
    config.hidden = 16;
    auto layer = MoELayer::create(config, t, *buffer, 0);
    EXPECT_FALSE(layer.is_ok());
    EXPECT_NE(layer.status().message().find("hidden = 8 differs from the layer's hidden = 16"), std::string::npos)
        << layer.status().to_string();
    config = small_layer();
    config.router.topk = 5;
    layer = MoELayer::create(config, t, *buffer, 0);
    EXPECT_FALSE(layer.is_ok());
    EXPECT_NE(layer.status().message().find("topk"), std::string::npos) << layer.status().to_string();
    config = small_layer();
    config.aux_loss_coeff = -1;
    layer = MoELayer::create(config, t, *buffer, 0);
    EXPECT_NE(layer.status().message().find("aux_loss_coeff = -1"), std::string::npos) << layer.status().to_string();
    return Status::ok();
  });
  EXPECT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
}

TEST(MoELayerConfigErrors, BackwardBeforeForwardIsAPreconditionError) {
  auto statuses = run_ranks(Topology::create(1, 1).value(), [&](Transport& t) -> Status {
    MoELayerConfig config = small_layer();
    EPX_ASSIGN_OR_RETURN(auto buffer, make_buffer(t, config, 4));
    EPX_ASSIGN_OR_RETURN(auto layer, MoELayer::create(config, t, *buffer, 0));
    std::vector<float> g(8);
    Status s = layer->backward(TensorView::contiguous(g.data(), DType::kF32, {1, 8}),
                               TensorView::contiguous(g.data(), DType::kF32, {1, 8}));
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
    return Status::ok();
  });
  EXPECT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
}

}  // namespace
}  // namespace epx
