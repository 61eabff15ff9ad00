// The state of a run as `epx monitor` shows it: built from the StepRecords
// read so far, rendered as the terminal view, the plain log line and the
// Prometheus text (prometheus.h) from this one structure.
//
//   epx::RunTracker tracker({.window = 20, .hot_experts = 4});
//   for (const epx::StepRecord& s : records) tracker.add(s);
//   epx::RunSnapshot now = tracker.snapshot();
//
// The tracker keeps the last `window` records (for the straggler diagnosis)
// and running totals (dropped tokens per layer), never the whole run, so its
// memory stays bounded however long the run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/observe/run_log.h"
#include "epx/observe/straggler.h"

namespace epx {

// A rank's share of its step spent waiting for other ranks: (wait in the
// barrier + exchange_wait in dispatches and combines) / total, in [0, 1];
// 0 when the step has no time.
[[nodiscard]] double rank_idle_fraction(const RankRecord& rank);

struct HotExpert {
  int expert = 0;
  int64_t tokens = 0;
  double share = 0;  // of the layer's routed tokens in the step
};

struct LayerSnapshot {
  int layer = 0;
  double max_vio = 0;
  double balancedness = 1;     // mean / max work across ranks
  int64_t dropped = 0;         // in the last step
  int64_t dropped_total = 0;   // over every step read
  std::vector<HotExpert> hot;  // the busiest experts of the last step, busiest first
};

struct RankSnapshot {
  int rank = 0;
  double idle_fraction = 0;  // rank_idle_fraction
  double exchange_wait = 0;  // seconds
  int waited_for = -1;
  double total = 0;          // the step's seconds on this rank
};

struct RunSnapshot {
  int64_t records = 0;  // steps read so far (0: nothing yet; the rest is then empty)
  int64_t step = 0;     // the last step read
  double loss = 0, main_loss = 0, tokens_per_s = 0, seconds = 0;
  double balancedness = 1, max_vio = 0;  // means over layers
  int64_t dropped_total = 0;             // every layer, every step read
  std::vector<LayerSnapshot> layers;
  std::vector<RankSnapshot> ranks;
  std::vector<Straggler> stragglers;  // diagnose_stragglers over the last `window` steps
  int window_steps = 0;               // steps in that window
};

struct RunTrackerOptions {
  int window = 20;      // steps of the straggler diagnosis
  int hot_experts = 4;  // per layer
};

class RunTracker {
 public:
  explicit RunTracker(RunTrackerOptions options = {});
  void add(const StepRecord& record);
  // The state after the last record (runs the straggler diagnosis).
  [[nodiscard]] RunSnapshot snapshot() const;
  [[nodiscard]] int64_t records() const { return records_; }

 private:
  RunTrackerOptions options_;
  StepRecord last_;
  StragglerWindow window_;
  std::vector<int64_t> dropped_total_;  // per layer
  int64_t records_ = 0;
};

}  // namespace epx
