// ExpertBias: aux-loss-free load balancing (DeepSeek-V3).
//
// A per-expert bias that `route` adds to the scores for selection only.
// After each step, `update` moves every bias by `rate` towards balance:
// bias_i += rate * sign(mean_load - load_i), where load is the number of
// tokens each expert received summed over all ranks (so every rank applies
// the same update and the biases stay identical). A frozen bias ignores
// updates (evaluation, or a fixed schedule).
//
//   epx::ExpertBias bias(num_experts);
//   EPX_ASSIGN_OR_RETURN(auto out, epx::route(config, logits, bias.view()));
//   std::vector<int64_t> load = out.tokens_per_expert;
//   EPX_RETURN_IF_ERROR(epx::sum_load_over_ranks(transport, load, deadline));
//   EPX_RETURN_IF_ERROR(bias.update(load));
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/core/status.h"
#include "epx/core/tensor.h"

namespace epx {

class ExpertBias {
 public:
  static constexpr float kDefaultRate = 1e-3f;

  explicit ExpertBias(int num_experts, float rate = kDefaultRate)
      : bias_(static_cast<std::size_t>(num_experts > 0 ? num_experts : 0), 0.0f), rate_(rate) {}

  // InvalidArgument when load.size() != num_experts or a load is negative.
  [[nodiscard]] Status update(std::span<const int64_t> load);

  void set_frozen(bool frozen) { frozen_ = frozen; }
  [[nodiscard]] bool frozen() const { return frozen_; }
  [[nodiscard]] float rate() const { return rate_; }
  void set_rate(float rate) { rate_ = rate; }
  [[nodiscard]] int num_experts() const { return static_cast<int>(bias_.size()); }
  [[nodiscard]] const std::vector<float>& values() const { return bias_; }
  // Restores saved values (a checkpoint); the size must match.
  void set_values(std::span<const float> values) { bias_.assign(values.begin(), values.end()); }
  // A host f32 [num_experts] view for route(); valid while this object lives.
  [[nodiscard]] TensorView view() const;

 private:
  std::vector<float> bias_;
  float rate_;
  bool frozen_ = false;
};

// Sums a per-expert load over every rank of `transport`, in place (collective).
[[nodiscard]] Status sum_load_over_ranks(Transport& transport, std::span<int64_t> load, const Deadline& deadline);

}  // namespace epx
