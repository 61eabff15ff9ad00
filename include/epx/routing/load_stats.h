// LoadStats: how evenly one step's routing spreads the work.
//
// From topk_idx [num_tokens, topk] (i32, -1 = dropped) and an expert -> rank
// map, `compute_load_stats` counts tokens per expert, tokens per rank (a
// token that sends several slots to one rank counts once there) and the
// summary numbers below. `LoadTracker` keeps exponential moving averages of
// them across steps. Deterministic; compute_load_stats has no collectives
// (sum_load_stats_over_ranks gives the global picture).
//
//   EPX_ASSIGN_OR_RETURN(epx::LoadStats stats, epx::compute_load_stats(topk_idx, expert_rank));
//   tracker.add(stats);
//   fmt::print("{}\n", stats.to_json());
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/core/status.h"
#include "epx/core/tensor.h"

namespace epx {

struct LoadStats {
  std::vector<int64_t> tokens_per_expert;  // kept (token, slot) pairs
  std::vector<int64_t> tokens_per_rank;    // distinct tokens per rank
  std::vector<int64_t> work_per_rank;      // (token, slot) pairs on the rank's experts
  int64_t num_dropped = 0;                 // -1 slots
  double max_load = 0.0;                   // over experts
  double mean_load = 0.0;
  double max_vio = 0.0;                    // max_load / mean_load - 1 (0 when nothing routed)
  double cv = 0.0;                         // population std / mean of tokens_per_expert
  int worst_rank = 0;                      // the rank with the most work (lowest id on ties)
  double worst_rank_share = 0.0;           // its work / total work
  double idle_fraction = 0.0;              // 1 - mean work / max work over ranks

  // Recomputes the summary numbers (max_load .. idle_fraction) from the counts.
  void summarize();
  // One JSON object on one line.
  [[nodiscard]] std::string to_json() const;
};

// expert_rank[e] is the rank holding expert e, in [0, num_ranks); num_ranks =
// max + 1. InvalidArgument on an index outside [-1, num_experts) or a
// negative rank.
Result<LoadStats> compute_load_stats(const TensorView& topk_idx, std::span<const int32_t> expert_rank);

// Sums the counts of every rank's stats (same expert and rank counts on
// all ranks) and recomputes the summary: the global picture of one step
// (collective).
[[nodiscard]] Status sum_load_stats_over_ranks(Transport& transport, LoadStats* stats, const Deadline& deadline);

// Exponential moving averages: ema = decay * ema + (1 - decay) * value; the
// first step sets them.
class LoadTracker {
 public:
  explicit LoadTracker(double decay = 0.9) : decay_(decay) {}
  void add(const LoadStats& stats);
  [[nodiscard]] int64_t num_steps() const { return num_steps_; }
  [[nodiscard]] double ema_max_vio() const { return max_vio_; }
  [[nodiscard]] double ema_cv() const { return cv_; }
  [[nodiscard]] double ema_idle_fraction() const { return idle_; }
  [[nodiscard]] double ema_dropped() const { return dropped_; }
  [[nodiscard]] std::string to_json() const;

 private:
  double decay_;
  int64_t num_steps_ = 0;
  double max_vio_ = 0.0, cv_ = 0.0, idle_ = 0.0, dropped_ = 0.0;
};

}  // namespace epx
