// StepRecords built in memory for the alert, snapshot and Prometheus tests:
// a plain healthy step that each test bends where it needs.
#pragma once

#include <cstdint>
#include <vector>

#include "epx/observe/run_log.h"

namespace epx::testing {

// `num_layers` layers of `num_experts` experts with an even load (MaxVio 0,
// idle_fraction 0) and `num_ranks` ranks that each spent 1 s, none waiting.
inline StepRecord healthy_step(int64_t step, int num_layers = 2, int num_experts = 8, int num_ranks = 4) {
  StepRecord s;
  s.step = step;
  s.loss = 2.0;
  s.main_loss = 1.9;
  s.seconds = 1.0;
  s.tokens_per_s = 1000;
  for (int l = 0; l < num_layers; ++l) {
    LayerRecord layer;
    layer.layer = l;
    layer.tokens_per_expert.assign(num_experts, 10);
    layer.tokens_per_rank.assign(num_ranks, 10 * num_experts / num_ranks);
    s.layers.push_back(layer);
  }
  for (int r = 0; r < num_ranks; ++r) {
    RankRecord rank;
    rank.rank = r;
    rank.total = 1.0;
    rank.experts = 0.5;
    s.ranks.push_back(rank);
  }
  return s;
}

// Makes `slow` the rank everyone waits for: it arrives late by `seconds` at
// every exchange and the others wait that long for it.
inline void make_straggler(StepRecord& s, int slow, double seconds) {
  const int num_ranks = static_cast<int>(s.ranks.size());
  WaitMatrix m;
  m.num_ranks = num_ranks;
  m.arrival.assign(static_cast<std::size_t>(num_ranks) * num_ranks, 0.0);
  m.data.assign(m.arrival.size(), 0.0);
  for (RankRecord& r : s.ranks) {
    if (r.rank == slow) {
      r.late = seconds * (num_ranks - 1);
      continue;
    }
    r.exchange_wait = seconds;
    r.waited_for = slow;
    m.arrival[static_cast<std::size_t>(r.rank) * num_ranks + slow] = seconds;
  }
  s.wait_matrix = m;
}

}  // namespace epx::testing
