// AdamW with decoupled weight decay, global-norm gradient clipping over
// ranks, and a warmup + cosine learning-rate schedule.
//
// Every rank steps its own parameters: dense ones are replicated (their
// gradients must already be summed over ranks, so every rank applies the
// same update), expert ones are the rank's own. Norm weights ([1, n]
// parameters) take no weight decay.
//
//   epx::AdamW adam({.weight_decay = 0.01});
//   EPX_ASSIGN_OR_RETURN(double norm, epx::clip_grad_norm(params, 1.0, transport, deadline));
//   adam.step(params, epx::learning_rate(schedule, step));
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/layer/parameter.h"

namespace epx {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  [[nodiscard]] Status validate() const;
};

class AdamW {
 public:
  struct Moments {
    std::vector<float> m, v;
  };

  explicit AdamW(AdamWConfig config = {}) : config_(config) {}
  // One update of every parameter with learning rate `lr`.
  void step(std::span<Parameter* const> params, double lr);
  [[nodiscard]] int64_t num_steps() const { return num_steps_; }
  // State, by parameter name, for checkpoints.
  [[nodiscard]] std::map<std::string, Moments>& moments() { return moments_; }
  // `p`'s moments, sized to its values (zeros before its first step).
  [[nodiscard]] Moments& moments_of(const Parameter& p);
  void set_num_steps(int64_t n) { num_steps_ = n; }

 private:
  AdamWConfig config_;
  int64_t num_steps_ = 0;
  std::map<std::string, Moments> moments_;
};

// Scales every gradient so that the global norm (dense gradients once,
// expert gradients summed over ranks) is at most max_norm (0 = no clipping).
// `duplicate_sq`: this rank's squared norm of expert gradients that repeat
// another replica's (MoELayer::duplicate_grad_sq), left out of the norm so
// that each logical expert counts once. With several EP groups, pass one EP
// group's transport once the expert gradients are summed over the EDP group
// (every group then holds the same; the trainer does). Returns the norm
// before clipping. Collective.
[[nodiscard]] Result<double> clip_grad_norm(std::span<Parameter* const> params, double max_norm, Transport& transport,
                                            const Deadline& deadline, double duplicate_sq = 0.0);

struct LearningRateSchedule {
  double peak = 3e-3;
  int64_t warmup_steps = 10;   // linear from peak / warmup_steps
  int64_t total_steps = 100;   // cosine from peak at warmup to peak * min_ratio at total
  double min_ratio = 0.1;
  [[nodiscard]] Status validate() const;
};

// The learning rate of step `step` (0-based).
[[nodiscard]] double learning_rate(const LearningRateSchedule& schedule, int64_t step);

}  // namespace epx
