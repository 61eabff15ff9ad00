// What failures cost a long training run, and the checkpoint interval that
// loses least. Failures arrive as a Poisson process over the job's GPUs; each
// one loses the work since the last checkpoint and the time to restart
// (detect, stop the ranks, start again, load the checkpoint). Saves cost the
// time they stop training (for an asynchronous save, only its snapshot).
//
//   epx::sim::FailureModel m{.gpus = 1024, .failures_per_gpu_hour = 2e-5,
//                            .save_blocking_s = 30, .restart_s = 600};
//   EPX_ASSIGN_OR_RETURN(epx::sim::GoodputPoint best, epx::sim::best_checkpoint_interval(m));
//
// The expected wall time of one interval of work is Daly's model for
// exponential failures (J. T. Daly, "A higher order estimate of the optimum
// checkpoint interval for restart dumps", Future Generation Computer Systems
// 22, 2006), which counts failures during saves and restarts too:
//   E[interval] = M e^(R/M) (e^((tau + delta)/M) - 1)
// with M the job's mean time between failures, R the restart time, delta the
// save's blocking time and tau the work per interval; goodput = tau / E.
#pragma once

#include <cstdint>

#include "epx/core/status.h"

namespace epx::sim {

struct FailureModel {
  int64_t gpus = 1024;
  double failures_per_gpu_hour = 0;  // > 0
  double save_blocking_s = 0;        // >= 0: training stopped per save
  double restart_s = 0;              // >= 0: from a failure to training again
};

struct GoodputPoint {
  double interval_s = 0;  // training time between two saves
  double goodput = 0;     // expected fraction of wall time spent on steps that are kept, in (0, 1]
};

// The job's mean time between failures, seconds.
[[nodiscard]] double job_mtbf_s(const FailureModel& model);
// Checks the model's values (each named with its limit).
[[nodiscard]] Status check_failure_model(const FailureModel& model);
// Expected goodput with a save every `interval_s` seconds of training (> 0).
[[nodiscard]] Result<GoodputPoint> expected_goodput(const FailureModel& model, double interval_s);
// The interval that maximises expected goodput (golden-section search on the
// logarithm of the interval; the goodput is unimodal in it).
[[nodiscard]] Result<GoodputPoint> best_checkpoint_interval(const FailureModel& model);
// Young's first-order optimum sqrt(2 delta M) (J. W. Young, "A first order
// approximation to the optimum checkpoint interval", CACM 17, 1974), for comparison.
[[nodiscard]] double young_interval_s(const FailureModel& model);

}  // namespace epx::sim
