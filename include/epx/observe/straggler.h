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

}  // namespace epx
