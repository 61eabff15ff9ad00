#include "epx/sim/optimizer.h"

#include <algorithm>

namespace epx::sim {
namespace {

double bytes_per_param(const Scenario& s) {
  const OptimizerConfig& o = s.optimizer;
  const double master = dtype_bytes(o.master_dtype), moment = dtype_bytes(o.moment_dtype);
  const double grad = dtype_bytes(s.model.grad_dtype), copy = dtype_bytes(o.weight_copy_dtype);
  return (master + grad + 2 * moment) + (master + 2 * moment + copy);  // read, then written
}

// Seconds of `traffic` bytes of memory traffic on every GPU at once.
double update_seconds(double traffic, const Scenario& s) {
  const HardwareProfile& h = s.hardware;
  double t = traffic / (h.optimizer_bandwidth > 0 ? h.optimizer_bandwidth : h.hbm_bandwidth);
  if (h.host_cores > 0) t *= std::max(1.0, static_cast<double>(s.num_gpus()) / h.host_cores);
  if (h.host_copy_bandwidth > 0) t = std::max(t, s.num_gpus() * traffic / (2 * h.host_copy_bandwidth));
  return t;
}

}  // namespace

OptimizerCost optimizer_cost(const Scenario& s, const GradientBytes& params, const GroupShape& edp,
                             const GroupShape& world) {
  OptimizerCost c;
  c.gather_expert = c.gather_dense = {"none", 0, 0, 0};
  if (s.optimizer.kind == "none" || s.parallelism.mode != "train") return c;
  const bool zero = s.optimizer.zero;
  const double expert = params.expert(), dense = params.dense();
  c.params = zero ? expert / edp.num_ranks + dense / world.num_ranks : expert + dense;
  c.bytes_per_param = bytes_per_param(s);
  c.update_s = update_seconds(c.params * c.bytes_per_param, s);
  if (zero) {
    const std::string& copy = s.optimizer.weight_copy_dtype;
    const double weight = copy == "none" ? dtype_bytes(s.optimizer.master_dtype) : dtype_bytes(copy);
    const std::string& algorithm = s.parallelism.allreduce;
    c.gather_expert = half_all_reduce_cost(expert * weight, edp, s.hardware, algorithm, "all-gather");
    c.gather_dense = half_all_reduce_cost(dense * weight, world, s.hardware, algorithm, "all-gather");
    c.gather_s = c.gather_expert.seconds + c.gather_dense.seconds;
  }
  return c;
}

}  // namespace epx::sim
