#include "epx/sim/traffic.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>

#include "epx/core/random.h"
#include "epx/exchange/layout.h"
#include "epx/routing/replicas.h"
#include "core/guard.h"
#include "core/simd_clones.h"
#include "core/thread_shares.h"

namespace epx::sim {
namespace {

// Gumbel(0, 1) at 2^16 evenly spaced quantiles: a draw is one table lookup
// per 16 random bits.
const std::array<float, 65536>& gumbel_table() {
  static const std::array<float, 65536> table = [] {
    std::array<float, 65536> t{};
    for (std::size_t i = 0; i < t.size(); ++i)
      t[i] = static_cast<float>(-std::log(-std::log((static_cast<double>(i) + 0.5) / 65536.0)));
    return t;
  }();
  return table;
}

// What one GPU's routing adds to the group's traffic. A batch of GPUs routed
// in one call puts its expert loads and drops on its first GPU.
struct RankResult {
  std::vector<int32_t> per_rank;
  std::vector<int32_t> per_node;
  std::vector<int32_t> per_slot;
  std::vector<int64_t> per_expert;
  int64_t dropped = 0;
};

// A routing thread's buffers, reused from call to call.
struct Scratch {
  std::vector<float> popularity;  // [experts]: log-popularity as the logits add it
  std::vector<uint64_t> words;    // [experts / 4]: one token's random words
  std::vector<uint16_t> draws;    // the same bits as 16-bit draws
  std::vector<float> logits;      // [GPUs of the batch x tokens, experts]
  RouterOutput routed;
  DispatchLayout layout;
};

// route keeps a batch of fewer than 2 x 2^17 (token, expert) pairs on the
// caller's thread (router.h): batches stay at or under 2^17 so that the
// simulator's own threads are the only ones.
constexpr int64_t kScoresPerCall = int64_t{1} << 17;

Status layout_into(std::span<const int32_t> topk_idx, int num_tokens, int topk, const ExpertPlacement& placement,
                   const Topology& topology, DispatchLayout* layout, RankResult* out) {
  const TensorView view = TensorView::contiguous(topk_idx.data(), DType::kI32, {num_tokens, topk});
  EPX_RETURN_IF_ERROR(compute_layout(view, placement, topology, layout));
  out->per_rank = layout->num_tokens_per_rank;
  out->per_node = layout->num_tokens_per_node;
  out->per_slot = layout->num_tokens_per_expert;
  return Status::ok();
}

// SplitMix64 outputs i = 0..n-1 of the sequence that starts after `state`:
// mix64(state + (i + 1) * gamma), independent, so the loop vectorizes.
EPX_SIMD_CLONES void splitmix_words(uint64_t state, int n, uint64_t* words) {
  for (int i = 0; i < n; ++i) words[i] = mix64(state + static_cast<uint64_t>(i + 1) * kGoldenGamma);
}

// GPU `rank`'s router logits [num_tokens, E] into `row0`: log-popularity plus
// Gumbel(0, 1) noise from the GPU's own stream, draw e of a token being bits
// [16 (e % 4), 16 (e % 4) + 16) of the token's word e / 4.
void draw_logits(const RouteRequest& q, int rank, int num_tokens, Scratch& scratch, float* row0) {
  static_assert(std::endian::native == std::endian::little, "draw e is the e-th 16-bit half-word of the words");
  const int E = q.router->num_experts;
  const int num_words = (E + 3) / 4;
  const float* table = gumbel_table().data();
  const float* popularity = scratch.popularity.data();
  scratch.words.resize(num_words);
  scratch.draws.resize(static_cast<std::size_t>(num_words) * 4);
  const uint64_t stream = q.stream * 1000003ull + static_cast<uint64_t>(rank);
  for (int t = 0; t < num_tokens; ++t) {
    splitmix_words(random_bits(q.seed, stream, static_cast<uint64_t>(t)), num_words, scratch.words.data());
    std::memcpy(scratch.draws.data(), scratch.words.data(), scratch.draws.size() * sizeof(uint16_t));
    float* row = row0 + static_cast<std::size_t>(t) * E;
    for (int e = 0; e < E; ++e) row[e] = popularity[e] + table[scratch.draws[e]];
  }
}

// GPUs [first, first + count) of the group in one route call: their tokens
// are rows of one batch (a token's route depends on its row alone), then each
// GPU's rows through compute_layout. With a capacity, count is 1 (capacity is
// per GPU).
Status route_batch(const RouteRequest& q, int first, int count, int num_tokens, Scratch& scratch,
                   std::span<RankResult> ranks) {
  const int E = q.router->num_experts;
  const std::size_t per_gpu = static_cast<std::size_t>(num_tokens) * E;
  scratch.logits.resize(per_gpu * count);
  for (int i = 0; i < count; ++i)
    draw_logits(q, first + i, num_tokens, scratch, scratch.logits.data() + per_gpu * i);
  const TensorView logits_view = TensorView::contiguous(scratch.logits.data(), DType::kF32,
                                                        {int64_t{num_tokens} * count, E});
  const TensorView bias_view =
      q.expert_bias.empty() ? TensorView{} : TensorView::contiguous(q.expert_bias.data(), DType::kF32, {E});
  const RouterOutput& routed = scratch.routed;
  EPX_RETURN_IF_ERROR(route_into(*q.router, logits_view, bias_view, &scratch.routed));
  ranks[first].per_expert = routed.tokens_per_expert;
  ranks[first].dropped = routed.num_dropped;
  const int K = q.router->topk;
  const std::size_t pairs = static_cast<std::size_t>(num_tokens) * K;
  for (int i = 0; i < count; ++i) {
    const std::span<const int32_t> idx(routed.topk_idx.data() + pairs * i, pairs);
    RankResult* out = &ranks[first + i];
    if (q.replicas.empty()) {
      EPX_RETURN_IF_ERROR(layout_into(idx, num_tokens, K, *q.placement, *q.topology, &scratch.layout, out));
      continue;
    }
    EPX_ASSIGN_OR_RETURN(std::vector<int32_t> slots,
                         map_to_replicas(q.replicas, idx, K, ReplicaChoice::kTokenModulo));
    EPX_RETURN_IF_ERROR(layout_into(slots, num_tokens, K, *q.placement, *q.topology, &scratch.layout, out));
  }
  return Status::ok();
}

void accumulate(const std::vector<RankResult>& ranks, double scale, GroupTraffic* out) {
  const int R = out->num_ranks;
  for (int s = 0; s < R; ++s) {
    const RankResult& r = ranks[s];
    for (int d = 0; d < R; ++d) out->pairs[static_cast<std::size_t>(s) * R + d] = r.per_rank[d] * scale;
    for (int n = 0; n < out->num_nodes; ++n)
      out->node_pairs[static_cast<std::size_t>(s) * out->num_nodes + n] = r.per_node[n] * scale;
    for (std::size_t e = 0; e < r.per_slot.size(); ++e) out->slot_rows[e] += r.per_slot[e] * scale;
    for (std::size_t e = 0; e < r.per_expert.size(); ++e) out->expert_load[e] += r.per_expert[e];
    out->num_dropped += r.dropped;
  }
}

void reset(GroupTraffic* out, int R, int N, int slots, int experts) {
  out->num_ranks = R;
  out->num_nodes = N;
  out->pairs.assign(static_cast<std::size_t>(R) * R, 0.0);
  out->node_pairs.assign(static_cast<std::size_t>(R) * N, 0.0);
  out->slot_rows.assign(slots, 0.0);
  out->expert_load.assign(experts, 0);
  out->num_dropped = 0;
}

}  // namespace

RouterConfig make_router_config(const ModelConfig& m) {
  RouterConfig router;
  router.num_experts = m.experts;
  router.topk = m.topk;
  router.score_function = m.score == "softmax" ? ScoreFunction::kSoftmax : ScoreFunction::kSigmoid;
  router.normalize_weights = true;
  router.num_groups = m.groups;
  router.topk_groups = m.groups > 1 ? m.topk_groups : 1;
  router.capacity_factor = m.capacity_factor;
  return router;
}

Status route_group(const RouteRequest& q, GroupTraffic* out) {
  if (q.router == nullptr || q.placement == nullptr || q.topology == nullptr)
    return invalid_argument("route_group needs a router config, a placement and a topology");
  const int E = q.router->num_experts;
  if (static_cast<int>(q.log_popularity.size()) != E)
    return invalid_argument("log_popularity has {} entries; the router has {} experts", q.log_popularity.size(), E);
  if (!q.expert_bias.empty() && static_cast<int>(q.expert_bias.size()) != E)
    return invalid_argument("expert_bias has {} entries; the router has {} experts", q.expert_bias.size(), E);
  if (q.tokens_per_gpu < 1 || q.sample_tokens < 1)
    return invalid_argument("tokens_per_gpu = {} and sample_tokens = {} must be at least 1", q.tokens_per_gpu,
                            q.sample_tokens);
  const int R = q.topology->num_ranks();
  const int num_tokens = static_cast<int>(std::min<int64_t>(q.tokens_per_gpu, q.sample_tokens));
  // Batches of GPUs, each one route call; a capacity is per GPU, so then one GPU a batch.
  const int64_t per_gpu = static_cast<int64_t>(num_tokens) * E;
  const int batch = q.router->capacity_factor > 0
                        ? 1
                        : static_cast<int>(std::clamp<int64_t>(kScoresPerCall / per_gpu, 1, R));
  const int num_batches = (R + batch - 1) / batch;
  std::vector<RankResult> ranks(R);
  std::vector<Status> status(num_batches, Status::ok());
  // A thread per call costs tens of microseconds: worth it only for big groups.
  const int64_t scores = static_cast<int64_t>(R) * per_gpu;
  const int threads = std::max(1, std::min({q.threads, num_batches, static_cast<int>(scores >> 20)}));
  auto work = [&](int first) {
    // Kept by the thread from call to call: a fresh ~1 MB of buffers a call
    // costs page faults and zeroing (a quarter of a run on two threads).
    thread_local Scratch scratch;
    scratch.popularity.assign(q.log_popularity.begin(), q.log_popularity.end());
    for (int b = first; b < num_batches; b += threads)
      status[b] = route_batch(q, b * batch, std::min(batch, R - b * batch), num_tokens, scratch, ranks);
  };
  detail::run_shares(threads, "a simulator routing thread", work);
  for (const Status& s : status) EPX_RETURN_IF_ERROR(s);
  reset(out, R, q.topology->num_nodes(), q.placement->num_experts(), E);
  out->tokens_per_gpu = q.tokens_per_gpu;
  out->scale = static_cast<double>(q.tokens_per_gpu) / num_tokens;
  accumulate(ranks, out->scale, out);
  return Status::ok();
}

Result<GroupTraffic> traffic_from_routing(std::span<const std::vector<int32_t>> topk_idx, int topk,
                                          const ExpertPlacement& placement, const Topology& topology) {
  const int R = topology.num_ranks();
  if (static_cast<int>(topk_idx.size()) != R)
    return invalid_argument("{} routings given for {} ranks", topk_idx.size(), R);
  if (topk < 1) return invalid_argument("topk = {} is below 1", topk);
  std::vector<RankResult> ranks(R);
  DispatchLayout layout;
  for (int r = 0; r < R; ++r) {
    if (topk_idx[r].size() % topk != 0)
      return invalid_argument("rank {}: topk_idx has {} entries, not a multiple of topk = {}", r, topk_idx[r].size(),
                              topk);
    const int num_tokens = static_cast<int>(topk_idx[r].size() / topk);
    EPX_RETURN_IF_ERROR(layout_into(topk_idx[r], num_tokens, topk, placement, topology, &layout, &ranks[r]));
  }
  GroupTraffic out;
  reset(&out, R, topology.num_nodes(), placement.num_experts(), placement.num_experts());
  out.scale = 1.0;
  for (RankResult& r : ranks) r.per_expert.assign(r.per_slot.begin(), r.per_slot.end());
  accumulate(ranks, 1.0, &out);
  return out;
}

}  // namespace epx::sim
