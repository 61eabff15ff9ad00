#include "epx/routing/aux_loss.h"

#include <algorithm>
#include <cmath>

#include "routing/scores.h"

namespace epx {
namespace {

Status check_inputs(const TensorView& logits, const TensorView& topk_idx) {
  if (logits.ndim() != 2) return invalid_argument("logits must be 2-D, got {}",
                                                  logits.defined() ? logits.describe() : "an undefined view");
  const int64_t E = logits.size(1);
  if (E < 1) return invalid_argument("logits has {} experts; at least 1 is needed", E);
  EPX_RETURN_IF_ERROR(detail::check_logits(logits, static_cast<int>(E)));
  if (topk_idx.ndim() != 2) return invalid_argument("topk_idx must be 2-D, got {}",
                                                    topk_idx.defined() ? topk_idx.describe() : "an undefined view");
  EPX_RETURN_IF_ERROR(check_matrix(topk_idx, "topk_idx", DType::kI32, logits.size(0), topk_idx.size(1)));
  for (int64_t t = 0; t < topk_idx.size(0); ++t) {
    const int32_t* row = topk_idx.row<const int32_t>(t);
    for (int64_t j = 0; j < topk_idx.size(1); ++j)
      if (row[j] < -1 || row[j] >= E)
        return invalid_argument("topk_idx[{}][{}] = {} is outside [-1, {})", t, j, row[j], E);
  }
  return Status::ok();
}

// Per-expert assignment counts of tokens [t0, t1).
std::vector<double> count_assignments(const TensorView& topk_idx, int64_t t0, int64_t t1, int64_t E) {
  std::vector<double> counts(E, 0.0);
  for (int64_t t = t0; t < t1; ++t) {
    const int32_t* row = topk_idx.row<const int32_t>(t);
    for (int64_t j = 0; j < topk_idx.size(1); ++j)
      if (row[j] >= 0) counts[row[j]] += 1.0;
  }
  return counts;
}

// The balancing probabilities of one token (softmax, or normalized sigmoid)
// and d P / d logits contracted with f: writes scale * sum_i f_i dP_i/dl_e.
void token_terms(ScoreFunction fn, const float* logits, int64_t E, const std::vector<double>& f, double scale,
                 double* prob_sum, float* grad) {
  std::vector<double> s(E);
  double total = 0.0;
  if (fn == ScoreFunction::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) total += (s[e] = 1.0 / (1.0 + std::exp(-double(logits[e]))));
  } else {
    const double m = *std::max_element(logits, logits + E);
    for (int64_t e = 0; e < E; ++e) total += (s[e] = std::exp(double(logits[e]) - m));
  }
  double fq = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    const double q = s[e] / total;
    prob_sum[e] += q;
    fq += f[e] * q;
  }
  for (int64_t e = 0; e < E; ++e) {
    // softmax: dq_i/dl_e = q_i (d_ie - q_e); normalized sigmoid: (d_ie - q_i) s_e (1 - s_e) / S.
    const double q = s[e] / total;
    const double jac = fn == ScoreFunction::kSigmoid ? s[e] * (1.0 - s[e]) / total : q;
    grad[e] = static_cast<float>(scale * jac * (f[e] - fq));
  }
}

// Loss and gradient for tokens [t0, t1), f and P taken over those tokens.
double local_loss(ScoreFunction fn, const TensorView& logits, const TensorView& topk_idx, int64_t t0, int64_t t1,
                  float* grad) {
  const int64_t E = logits.size(1);
  const int64_t n = t1 - t0;
  if (n == 0) return 0.0;
  std::vector<double> f = count_assignments(topk_idx, t0, t1, E);
  for (double& x : f) x /= static_cast<double>(n * topk_idx.size(1));
  std::vector<double> prob_sum(E, 0.0);
  for (int64_t t = t0; t < t1; ++t)
    token_terms(fn, logits.row<const float>(t), E, f, double(E) / n, prob_sum.data(), grad + t * E);
  double loss = 0.0;
  for (int64_t e = 0; e < E; ++e) loss += f[e] * prob_sum[e] / n;
  return double(E) * loss;
}

}  // namespace

Result<LossAndGrad> load_balancing_loss(ScoreFunction fn, const TensorView& logits, const TensorView& topk_idx) {
  EPX_RETURN_IF_ERROR(check_inputs(logits, topk_idx));
  LossAndGrad out;
  out.grad_logits.assign(logits.size(0) * logits.size(1), 0.0f);
  out.loss = local_loss(fn, logits, topk_idx, 0, logits.size(0), out.grad_logits.data());
  return out;
}

Result<LossAndGrad> sequence_load_balancing_loss(ScoreFunction fn, const TensorView& logits,
                                                 const TensorView& topk_idx, int64_t seq_len) {
  EPX_RETURN_IF_ERROR(check_inputs(logits, topk_idx));
  const int64_t T = logits.size(0);
  if (seq_len < 1 || T % seq_len != 0)
    return invalid_argument("num_tokens = {} is not a multiple of seq_len = {}", T, seq_len);
  const int64_t num_seqs = T / seq_len;
  LossAndGrad out;
  out.grad_logits.assign(T * logits.size(1), 0.0f);
  for (int64_t s = 0; s < num_seqs; ++s)
    out.loss += local_loss(fn, logits, topk_idx, s * seq_len, (s + 1) * seq_len, out.grad_logits.data());
  if (num_seqs > 0) {
    out.loss /= static_cast<double>(num_seqs);
    for (float& g : out.grad_logits) g /= static_cast<float>(num_seqs);
  }
  return out;
}

Result<LossAndGrad> global_load_balancing_loss(ScoreFunction fn, const TensorView& logits,
                                               const TensorView& topk_idx, Transport& transport,
                                               const Deadline& deadline) {
  EPX_RETURN_IF_ERROR(check_inputs(logits, topk_idx));
  const int64_t T = logits.size(0);
  const int64_t E = logits.size(1);
  const int64_t K = topk_idx.size(1);
  // One reduction: counts [E], then the token count.
  std::vector<double> counts = count_assignments(topk_idx, 0, T, E);
  counts.push_back(static_cast<double>(T));
  EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<double>(counts), ReduceOp::kSum, deadline));
  const double global_tokens = counts[E];
  counts.pop_back();
  LossAndGrad out;
  out.grad_logits.assign(T * E, 0.0f);
  if (global_tokens == 0) return out;
  std::vector<double> f = counts;
  for (double& x : f) x /= global_tokens * static_cast<double>(K);
  std::vector<double> prob_sum(E, 0.0);
  for (int64_t t = 0; t < T; ++t)
    token_terms(fn, logits.row<const float>(t), E, f, double(E) / global_tokens, prob_sum.data(),
                out.grad_logits.data() + t * E);
  EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<double>(prob_sum), ReduceOp::kSum, deadline));
  for (int64_t e = 0; e < E; ++e) out.loss += f[e] * prob_sum[e] / global_tokens;
  out.loss *= static_cast<double>(E);
  return out;
}

Result<LossAndGrad> router_z_loss(const TensorView& logits) {
  if (logits.ndim() != 2) return invalid_argument("logits must be 2-D, got {}",
                                                  logits.defined() ? logits.describe() : "an undefined view");
  const int64_t T = logits.size(0);
  const int64_t E = logits.size(1);
  if (E < 1) return invalid_argument("logits has {} experts; at least 1 is needed", E);
  EPX_RETURN_IF_ERROR(detail::check_logits(logits, static_cast<int>(E)));
  LossAndGrad out;
  out.grad_logits.assign(T * E, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits.row<const float>(t);
    const double m = *std::max_element(row, row + E);
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(double(row[e]) - m);
    const double lse = m + std::log(sum);
    out.loss += lse * lse / T;
    // d lse^2 / d l_e = 2 lse softmax_e.
    for (int64_t e = 0; e < E; ++e)
      out.grad_logits[t * E + e] = static_cast<float>(2.0 * lse * std::exp(double(row[e]) - lse) / T);
  }
  return out;
}

}  // namespace epx
