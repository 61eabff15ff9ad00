#include "epx/sim/goodput.h"

#include <cmath>

namespace epx::sim {
namespace {

constexpr double kSecondsPerHour = 3600;
// The search range: one second up to a thousand of the job's MTBF.
constexpr double kMinInterval = 1;
constexpr double kMaxIntervalInMtbf = 1000;
constexpr int kSearchSteps = 200;

double goodput_at(const FailureModel& m, double mtbf, double interval) {
  const double expected = mtbf * std::exp(m.restart_s / mtbf) * std::expm1((interval + m.save_blocking_s) / mtbf);
  return interval / expected;
}

}  // namespace

double job_mtbf_s(const FailureModel& m) {
  return kSecondsPerHour / (m.failures_per_gpu_hour * static_cast<double>(m.gpus));
}

Status check_failure_model(const FailureModel& m) {
  if (m.gpus < 1 || m.gpus > (int64_t{1} << 24))
    return invalid_argument("gpus = {} is outside [1, {}]", m.gpus, int64_t{1} << 24);
  if (!(m.failures_per_gpu_hour >= 1e-12) || m.failures_per_gpu_hour > 1)
    return invalid_argument("failures per GPU-hour = {} is outside [1e-12, 1]", m.failures_per_gpu_hour);
  if (!(m.save_blocking_s >= 0) || m.save_blocking_s > 1e6)
    return invalid_argument("save time = {} s is outside [0, 1e6]", m.save_blocking_s);
  if (!(m.restart_s >= 0) || m.restart_s > 1e6)
    return invalid_argument("restart time = {} s is outside [0, 1e6]", m.restart_s);
  return Status::ok();
}

Result<GoodputPoint> expected_goodput(const FailureModel& m, double interval_s) {
  EPX_RETURN_IF_ERROR(check_failure_model(m));
  if (!(interval_s > 0) || !std::isfinite(interval_s))
    return invalid_argument("checkpoint interval = {} s must be a positive number", interval_s);
  return GoodputPoint{interval_s, goodput_at(m, job_mtbf_s(m), interval_s)};
}

Result<GoodputPoint> best_checkpoint_interval(const FailureModel& m) {
  EPX_RETURN_IF_ERROR(check_failure_model(m));
  const double mtbf = job_mtbf_s(m);
  const double inv_phi = (std::sqrt(5.0) - 1) / 2;
  double lo = std::log(kMinInterval);
  double hi = std::log(std::max(kMinInterval * 2, kMaxIntervalInMtbf * mtbf));
  for (int i = 0; i < kSearchSteps && hi - lo > 1e-9; ++i) {
    const double a = hi - inv_phi * (hi - lo);
    const double b = lo + inv_phi * (hi - lo);
    if (goodput_at(m, mtbf, std::exp(a)) < goodput_at(m, mtbf, std::exp(b)))
      lo = a;
    else
      hi = b;
  }
  const double best = std::exp((lo + hi) / 2);
  return GoodputPoint{best, goodput_at(m, mtbf, best)};
}

double young_interval_s(const FailureModel& m) { return std::sqrt(2 * m.save_blocking_s * job_mtbf_s(m)); }

}  // namespace epx::sim
