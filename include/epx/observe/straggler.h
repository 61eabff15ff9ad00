// Which rank makes the others wait, and why, from the who-waited-for-whom
// data a run writes per step (RankRecord::late / slow_data, and WaitMatrix
// when present).
//
//   std::vector<epx::StepRecord> window = ...;  // the last steps of a run
//   for (const epx::Straggler& s : epx::diagnose_stragglers(window))
//     fmt::print("rank {}: {} ({})\n", s.rank, epx::cause_name(s.cause), s.explanation);
//
// Causes:
// - kCompute: the rank arrives late at dispatches and combines (its work
//   before them is slower: a slow or paused process, a busy core);
// - kLink: it arrives on time but its data reaches the others late (a slow
//   or capped link out of its node);
// - kHotExpert: it arrives late and receives far more rows than the mean (a
//   hot expert swamps it: a balancing problem, not a hardware one).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "epx/observe/run_log.h"

namespace epx {

enum class StragglerCause { kCompute, kLink, kHotExpert };

struct Straggler {
  int rank = -1;
  StragglerCause cause = StragglerCause::kCompute;
  double share = 0;             // of all the wait in the window that this rank caused, in (0, 1]
  double seconds_per_step = 0;  // the others' wait it caused, per step
  std::string explanation;      // one line with the figures behind the cause
};

// The ranks that caused a clear share of the window's waiting, worst first;
// empty when nobody waited noticeably (documented thresholds in
// docs/operations.md).
[[nodiscard]] std::vector<Straggler> diagnose_stragglers(std::span<const StepRecord> window);

[[nodiscard]] std::string_view cause_name(StragglerCause cause);  // "compute", "link", "hot expert"

// The last `capacity` steps of a run, for a diagnosis that follows it
// (epx train's summary; a monitor's current straggler).
class StragglerWindow {
 public:
  explicit StragglerWindow(std::size_t capacity) : capacity_(capacity) {}
  void add(StepRecord step);  // drops the oldest beyond capacity
  [[nodiscard]] std::vector<Straggler> diagnose() const { return diagnose_stragglers(steps_); }
  [[nodiscard]] std::size_t size() const { return steps_.size(); }

 private:
  std::size_t capacity_;
  std::vector<StepRecord> steps_;  // oldest first
};

// The line epx prints for a straggler: "rank 2 (compute): the others waited ...".
[[nodiscard]] std::string describe(const Straggler& straggler);

// The stragglers of the last `last_steps` (>= 1) steps of a metrics file
// (read_metrics' errors). `epx train` prints the same diagnosis at the end of
// a run, from its last steps.
[[nodiscard]] Result<std::vector<Straggler>> diagnose_metrics_file(const std::string& path, int64_t last_steps);

}  // namespace epx
