// Auxiliary router losses and their gradients w.r.t. the logits.
//
// Load-balancing loss (Switch / GShard): E * sum_i f_i * P_i, where f_i is the
// fraction of the num_tokens * topk (token, slot) assignments that went to
// expert i (dropped -1 slots count in the denominator only; no gradient
// flows through f) and P_i is the mean router probability of expert i: the
// softmax, or for sigmoid routers the sigmoid scores divided by their sum
// over experts (DeepSeek-V3). Three variants: the micro-batch, per sequence
// (the mean over sequences of seq_len tokens) and the global batch (f and P
// over the tokens of every rank, summed through Transport::all_reduce; every
// rank gets the same loss and the gradient for its own logits).
// Router z-loss: mean over tokens of logsumexp(logits)^2.
// The losses are unweighted: multiply loss and gradient by your coefficient.
//
//   EPX_ASSIGN_OR_RETURN(epx::LossAndGrad aux,
//                        epx::load_balancing_loss(epx::ScoreFunction::kSoftmax, logits, topk_idx));
//   EPX_ASSIGN_OR_RETURN(epx::LossAndGrad z, epx::router_z_loss(logits));
#pragma once

#include <cstdint>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/core/status.h"
#include "epx/core/tensor.h"
#include "epx/routing/router.h"

namespace epx {

struct LossAndGrad {
  double loss = 0.0;
  // d loss / d logits, [num_tokens, num_experts].
  std::vector<float> grad_logits;
};

// logits: f32 [num_tokens, num_experts]; topk_idx: i32 [num_tokens, topk]
// with values in [-1, num_experts).
Result<LossAndGrad> load_balancing_loss(ScoreFunction fn, const TensorView& logits, const TensorView& topk_idx);

// num_tokens must be a multiple of seq_len.
Result<LossAndGrad> sequence_load_balancing_loss(ScoreFunction fn, const TensorView& logits,
                                                 const TensorView& topk_idx, int64_t seq_len);

// Collective: every rank of `transport` calls it with its own tokens (the
// counts may differ; num_experts and topk must agree).
Result<LossAndGrad> global_load_balancing_loss(ScoreFunction fn, const TensorView& logits,
                                               const TensorView& topk_idx, Transport& transport,
                                               const Deadline& deadline);

Result<LossAndGrad> router_z_loss(const TensorView& logits);

}  // namespace epx
