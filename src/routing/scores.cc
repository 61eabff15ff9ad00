#include "routing/scores.h"

#include "core/fast_exp.h"
#include "core/simd_clones.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace epx::detail {

Status check_logits_shape(const TensorView& logits, int num_experts) {
  if (logits.ndim() != 2) return invalid_argument("logits must be 2-D [num_tokens, {}], got {}", num_experts,
                                                  logits.defined() ? logits.describe() : "an undefined view");
  return check_matrix(logits, "logits", DType::kF32, logits.size(0), num_experts);
}

Status check_logits(const TensorView& logits, int num_experts) {
  EPX_RETURN_IF_ERROR(check_logits_shape(logits, num_experts));
  for (int64_t t = 0; t < logits.size(0); ++t) {
    const float* row = logits.row<const float>(t);
    if (all_finite(row, num_experts)) continue;
    for (int e = 0; e < num_experts; ++e)
      if (!std::isfinite(row[e])) return invalid_argument("logits[{}][{}] = {} is not finite", t, e, row[e]);
  }
  return Status::ok();
}

namespace {

// exp(x) for a whole row (exp_in_range, vectorized). Below -87.3 the result
// is 0 and above 88.7 it is infinity, as exp's own underflow and overflow
// give (no subnormal outputs).
EPX_SIMD_CLONES void exp_row(const float* x, float* out, int n, float shift, float sign) {
  for (int i = 0; i < n; ++i) {
    const float v = sign * (x[i] - shift);
    const float e = exp_in_range(std::min(std::max(v, -87.3f), 88.7f));
    out[i] = v < -87.3f ? 0.0f : (v > 88.7f ? std::numeric_limits<float>::infinity() : e);
  }
}

EPX_SIMD_CLONES void sigmoid_from_exp(float* p, int n) {
  for (int i = 0; i < n; ++i) p[i] = 1.0f / (1.0f + p[i]);
}

// The largest of x[0, n) (finite values): 16 lanes at a time. The same value
// as std::max_element's, up to the sign of a zero, which exp_row's x - max
// does not see.
float row_max(const float* x, int n) {
  using Float4 = float __attribute__((vector_size(16)));
  if (n < 16) return *std::max_element(x, x + n);
  Float4 m[4];
  std::memcpy(m, x, sizeof(m));
  int i = 16;
  for (; i + 16 <= n; i += 16)
    for (int h = 0; h < 4; ++h) {
      Float4 v;
      std::memcpy(&v, x + i + 4 * h, sizeof(v));
      m[h] = m[h] > v ? m[h] : v;
    }
  float lanes[16];
  std::memcpy(lanes, m, sizeof(lanes));
  float best = *std::max_element(lanes, lanes + 16);
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

}  // namespace

void probabilities_row(ScoreFunction fn, const float* row, float* p, int num_experts) {
  if (fn == ScoreFunction::kSigmoid) {
    exp_row(row, p, num_experts, 0.0f, -1.0f);  // exp(-x)
    sigmoid_from_exp(p, num_experts);
    return;
  }
  const float max_logit = row_max(row, num_experts);
  exp_row(row, p, num_experts, max_logit, 1.0f);
  float sum = 0.0f;
  for (int e = 0; e < num_experts; ++e) sum += p[e];
  for (int e = 0; e < num_experts; ++e) p[e] /= sum;
}

std::vector<float> probabilities(ScoreFunction fn, const TensorView& logits, int num_experts) {
  const int64_t T = logits.size(0);
  std::vector<float> out(T * num_experts);
  for (int64_t t = 0; t < T; ++t) probabilities_row(fn, logits.row<const float>(t), out.data() + t * num_experts, num_experts);
  return out;
}

EPX_SIMD_CLONES void add_rows(const float* a, const float* b, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

EPX_SIMD_CLONES bool all_finite(const float* x, int n) {
  // Branch-free so that it vectorizes: an exponent of all ones is inf or NaN.
  uint32_t bad = 0;
  for (int i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

namespace {

// The group expert e belongs to (clamped into [0, groups)).
int group_index(const RouterConfig& config, int e, int groups) {
  const int per_group = config.num_experts / groups;
  const int g = config.expert_group.empty() ? e / std::max(1, per_group) : config.expert_group[e];
  return std::clamp(g, 0, groups - 1);
}

}  // namespace

std::vector<std::vector<int32_t>> group_members(const RouterConfig& config) {
  const int groups = std::max(1, config.num_groups);
  std::vector<std::vector<int32_t>> members(groups);
  for (int e = 0; e < config.num_experts; ++e) members[group_index(config, e, groups)].push_back(e);
  return members;
}

// Counted without building the member lists: validate runs on every route call.
std::vector<int> group_sizes(const RouterConfig& config) {
  const int groups = std::max(1, config.num_groups);
  std::vector<int> sizes(groups, 0);
  for (int e = 0; e < config.num_experts; ++e) ++sizes[group_index(config, e, groups)];
  return sizes;
}

}  // namespace epx::detail
