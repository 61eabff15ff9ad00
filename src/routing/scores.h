// Private helpers shared by the router and the losses: input checks, score
// functions and expert groups.
#pragma once

#include <cstdint>
#include <vector>

#include "epx/core/status.h"
#include "epx/core/tensor.h"
#include "epx/routing/router.h"

namespace epx::detail {

// logits must be a host f32 [num_tokens, num_experts] with finite values.
Status check_logits(const TensorView& logits, int num_experts);
// The same without looking at the values.
Status check_logits_shape(const TensorView& logits, int num_experts);

// Softmax or sigmoid of every row, [num_tokens, num_experts], fp32.
std::vector<float> probabilities(ScoreFunction fn, const TensorView& logits, int num_experts);
// The same for one row: p[0, num_experts) from row[0, num_experts), the same bits.
void probabilities_row(ScoreFunction fn, const float* row, float* p, int num_experts);

// Whether none of x[0, n) is inf or NaN (vectorized; no early exit).
bool all_finite(const float* x, int n);

// out[i] = a[i] + b[i] (the selection scores: probabilities plus the bias).
void add_rows(const float* a, const float* b, float* out, int n);

// Experts per group, and the experts of each group in id order.
std::vector<int> group_sizes(const RouterConfig& config);
std::vector<std::vector<int32_t>> group_members(const RouterConfig& config);

}  // namespace epx::detail
