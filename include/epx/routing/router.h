// Router: gate scores, (group-limited) top-k, expert bias and capacity.
//
// `route` turns router logits [num_tokens, num_experts] (f32, fp32 maths)
// into the experts each token goes to and the weights its outputs are combined
// with; `route_backward` takes the gradient of those weights back to the
// logits. Both are deterministic: `route` splits large batches (2^17 or more
// (token, expert) pairs per thread, at most 8 threads) over the machine's
// cores, and no bit depends on the split.
//
// Promises:
// - top-k picks the highest selection scores; ties go to the lower expert id,
//   and the K slots of a token are in that order (best first);
// - the expert bias is added to the scores for selection only; it never
//   changes a returned weight (DeepSeek-V3 aux-loss-free balancing);
// - group-limited routing scores a group by the sum of its best
//   max(1, topk / topk_groups) selection scores, keeps the best topk_groups
//   groups (ties: lower group id) and picks top-k inside them;
// - with capacity_factor > 0 each expert keeps at most
//   capacity = align_up(ceil(capacity_factor * num_tokens * topk / num_experts));
//   a dropped (token, slot) has topk_idx -1 and weight 0, and the other slots
//   of that token are not renormalized;
// - bad configurations and inputs return InvalidArgument naming the value and
//   the limit; nothing throws.
//
//   epx::RouterConfig config{.num_experts = 8, .topk = 2};
//   EPX_ASSIGN_OR_RETURN(epx::RouterOutput out, epx::route(config, logits));
//   // out.topk_idx[t * 2 + j], out.topk_weights[t * 2 + j]
//   EPX_ASSIGN_OR_RETURN(std::vector<float> grad_logits,
//                        epx::route_backward(config, out, grad_weights));
#pragma once

#include <cstdint>
#include <vector>

#include "epx/core/status.h"
#include "epx/core/tensor.h"

namespace epx {

enum class ScoreFunction : uint8_t { kSoftmax, kSigmoid };

// Which tokens an over-full expert keeps.
enum class DropPolicy : uint8_t {
  kPosition,  // the first tokens in token order, then slot order
  kScore,     // the highest pre-drop weights; ties: lower token index, then lower slot
};

struct RouterConfig {
  int num_experts = 0;
  int topk = 0;
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  // Softmax only: select on logits (+ bias), then the weights are the softmax
  // over the selected logits (Mixtral). Otherwise the softmax is over all
  // experts and the selected probabilities are the weights.
  bool softmax_after_topk = false;
  // Divide the selected probabilities of a token by their sum.
  bool normalize_weights = false;
  // Multiplies every weight (after normalization).
  float scaling_factor = 1.0f;
  // Group-limited routing; 1 = none. Without expert_group the groups are
  // contiguous blocks of num_experts / num_groups experts.
  int num_groups = 1;
  int topk_groups = 1;
  // Optional expert -> group map (node-limited routing: the group of an
  // expert is the node that holds it). Empty = contiguous groups.
  std::vector<int32_t> expert_group = {};
  // 0 = dropless.
  double capacity_factor = 0.0;
  DropPolicy drop_policy = DropPolicy::kPosition;
  // Capacity is rounded up to a multiple of this.
  int capacity_alignment = 1;
  // Every expert's row count becomes the capacity (rows_per_expert).
  bool pad_to_capacity = false;

  // InvalidArgument naming the first bad field and its limit.
  [[nodiscard]] Status validate() const;
};

struct RouterOutput {
  int64_t num_tokens = 0;
  int num_experts = 0;
  int topk = 0;
  // [num_tokens, topk]: the expert of each slot, -1 where dropped.
  std::vector<int32_t> topk_idx;
  // [num_tokens, topk]: combine weights, 0 where dropped.
  std::vector<float> topk_weights;
  // [num_tokens, num_experts]: softmax or sigmoid of the logits, no bias.
  std::vector<float> scores;
  // What route_backward needs: the experts selected before dropping and
  // their probabilities before normalization and scaling ([num_tokens, topk]).
  std::vector<int32_t> selected_idx;
  std::vector<float> selected_probs;
  // 0 when dropless.
  int64_t capacity = 0;
  int64_t num_dropped = 0;
  // Kept (token, slot) pairs per expert.
  std::vector<int64_t> tokens_per_expert;
  // Rows each expert processes: tokens_per_expert, or capacity for every
  // expert with pad_to_capacity.
  std::vector<int64_t> rows_per_expert;
};

// logits: f32 [num_tokens, num_experts], host, unit column stride.
// expert_bias: optional f32 [num_experts], added for selection only.
Result<RouterOutput> route(const RouterConfig& config, const TensorView& logits,
                           const TensorView& expert_bias = {});

// As route, into *out, whose vectors keep their capacity: no allocation once
// they are large enough (for callers that route many batches, the simulator).
// Every field is written; on an error *out holds no result.
Status route_into(const RouterConfig& config, const TensorView& logits, const TensorView& expert_bias,
                  RouterOutput* out);

// grad_topk_weights: f32 [num_tokens, topk] (dropped slots are ignored).
// Returns the gradient w.r.t. the logits, [num_tokens, num_experts].
Result<std::vector<float>> route_backward(const RouterConfig& config, const RouterOutput& forward,
                                          const TensorView& grad_topk_weights);

// capacity_factor * num_tokens * topk / num_experts, rounded up, then up to a
// multiple of the alignment; 0 when capacity_factor is 0.
int64_t expert_capacity(const RouterConfig& config, int64_t num_tokens);

}  // namespace epx
