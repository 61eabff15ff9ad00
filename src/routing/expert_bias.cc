#include "epx/routing/expert_bias.h"

namespace epx {

Status ExpertBias::update(std::span<const int64_t> load) {
  if (load.size() != bias_.size())
    return invalid_argument("load has {} entries, num_experts = {}", load.size(), bias_.size());
  double total = 0.0;
  for (std::size_t e = 0; e < load.size(); ++e) {
    if (load[e] < 0) return invalid_argument("load[{}] = {} is below 0", e, load[e]);
    total += static_cast<double>(load[e]);
  }
  if (frozen_ || load.empty()) return Status::ok();
  const double mean = total / static_cast<double>(load.size());
  for (std::size_t e = 0; e < load.size(); ++e) {
    const double diff = mean - static_cast<double>(load[e]);
    bias_[e] += diff > 0 ? rate_ : (diff < 0 ? -rate_ : 0.0f);
  }
  return Status::ok();
}

TensorView ExpertBias::view() const {
  return TensorView::contiguous(bias_.data(), DType::kF32, {static_cast<int64_t>(bias_.size())});
}

Status sum_load_over_ranks(Transport& transport, std::span<int64_t> load, const Deadline& deadline) {
  return transport.all_reduce(load, ReduceOp::kSum, deadline);
}

}  // namespace epx
