// `epx train`'s efficiency line: how far the run's steps are from their
// limit on this machine (epx/train/step_limit.h).
#pragma once

#include <cstddef>
#include <cstdio>
#include <deque>
#include <vector>

#include "epx/train/run_plan.h"
#include "epx/train/step_limit.h"
#include "epx/train/trainer.h"

namespace epx::app {

// The last `window` steps' times and per-rank work (the first step left out:
// every rank's first GEMMs are slow); then, once, the rates measured and the
// limit of the median step.
class StepLimitWindow {
 public:
  // The run's settings and resolved model are the plan's.
  StepLimitWindow(const RunPlan& plan, std::size_t window);
  // Called on rank 0 for every step's report; a report that cannot be
  // counted is kept as measure()'s error (the run goes on).
  void add(const StepReport& report);
  [[nodiscard]] std::size_t size() const { return seconds_.size(); }
  // Measures the GEMM and memcpy rates (one thread per rank of this machine
  // at once, then one alone: about 0.2 s) and returns the limit for the median step
  // time and the window's mean work per rank. FailedPrecondition without steps;
  // the first error of add().
  [[nodiscard]] Result<StepLimit> measure() const;

 private:
  [[nodiscard]] Status count(const StepReport& report);

  RunPlan plan_;
  std::size_t window_;
  std::deque<double> seconds_;
  std::deque<std::vector<StepWork>> work_;
  Status error_;
};

// The summary's "efficiency: ..." line (or why there is none) on `out`.
void print_step_limit(std::FILE* out, const StepLimitWindow& window);

}  // namespace epx::app
