#include "epx/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace epx {

Status AdamWConfig::validate() const {
  if (!(beta1 >= 0 && beta1 < 1)) return invalid_argument("beta1 = {} is outside [0, 1)", beta1);
  if (!(beta2 >= 0 && beta2 < 1)) return invalid_argument("beta2 = {} is outside [0, 1)", beta2);
  if (!(eps > 0)) return invalid_argument("eps = {} must be above 0", eps);
  if (!(weight_decay >= 0) || !std::isfinite(weight_decay))
    return invalid_argument("weight_decay = {} must be finite and >= 0", weight_decay);
  return Status::ok();
}

AdamW::Moments& AdamW::moments_of(const Parameter& p) {
  Moments& s = moments_[p.name];
  s.m.resize(p.value.size(), 0.0f);
  s.v.resize(p.value.size(), 0.0f);
  return s;
}

void AdamW::step(std::span<Parameter* const> params, double lr) {
  ++num_steps_;
  const double c1 = 1.0 - std::pow(config_.beta1, static_cast<double>(num_steps_));
  const double c2 = 1.0 - std::pow(config_.beta2, static_cast<double>(num_steps_));
  const auto b1 = static_cast<float>(config_.beta1), b2 = static_cast<float>(config_.beta2);
  for (Parameter* p : params) {
    Moments& s = moments_of(*p);
    const double decay = p->rows == 1 ? 0.0 : config_.weight_decay;
    const auto shrink = static_cast<float>(1.0 - lr * decay);
    const auto step_size = static_cast<float>(lr / c1);
    const auto inv_c2 = static_cast<float>(1.0 / c2);
    const auto eps = static_cast<float>(config_.eps);
    for (std::size_t i = 0; i < p->value.size(); ++i) {
      const float g = p->grad[i];
      s.m[i] = b1 * s.m[i] + (1.0f - b1) * g;
      s.v[i] = b2 * s.v[i] + (1.0f - b2) * g * g;
      p->value[i] = p->value[i] * shrink - step_size * s.m[i] / (std::sqrt(s.v[i] * inv_c2) + eps);
    }
    p->mark_written();
  }
}

Result<double> clip_grad_norm(std::span<Parameter* const> params, double max_norm, Transport& transport,
                              const Deadline& deadline, double duplicate_sq) {
  double sums[2] = {0.0, 0.0};  // dense (identical on every rank), expert (this rank's)
  for (const Parameter* p : params) {
    double s = 0.0;
    for (float g : p->grad) s += static_cast<double>(g) * g;
    sums[p->kind == ParamKind::kDense ? 0 : 1] += s;
  }
  sums[1] -= duplicate_sq;
  EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<double>(&sums[1], 1), ReduceOp::kSum, deadline));
  const double norm = std::sqrt(sums[0] + std::max(sums[1], 0.0));
  if (max_norm > 0 && norm > max_norm) {
    const auto scale = static_cast<float>(max_norm / norm);
    for (Parameter* p : params)
      for (float& g : p->grad) g *= scale;
  }
  return norm;
}

Status LearningRateSchedule::validate() const {
  if (!(peak > 0) || !std::isfinite(peak)) return invalid_argument("learning rate {} must be finite and above 0", peak);
  if (warmup_steps < 0) return invalid_argument("warmup_steps = {} is below 0", warmup_steps);
  if (!(min_ratio >= 0 && min_ratio <= 1)) return invalid_argument("min_lr_ratio = {} is outside [0, 1]", min_ratio);
  return Status::ok();
}

double learning_rate(const LearningRateSchedule& s, int64_t step) {
  if (step < s.warmup_steps) return s.peak * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  const int64_t span = std::max<int64_t>(1, s.total_steps - s.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) / static_cast<double>(span));
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return s.peak * (s.min_ratio + (1.0 - s.min_ratio) * cosine);
}

}  // namespace epx
