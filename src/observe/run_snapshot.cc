#include "epx/observe/run_snapshot.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace epx {
namespace {

// The `k` busiest experts of a layer's step, busiest first (ties: lower id first).
std::vector<HotExpert> hot_experts(const LayerRecord& layer, int k) {
  const std::vector<int64_t>& tokens = layer.tokens_per_expert;
  const int n = std::min<int>(k, static_cast<int>(tokens.size()));
  if (n <= 0) return {};
  std::vector<int> idx(tokens.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + n, idx.end(),
                    [&](int a, int b) { return tokens[a] != tokens[b] ? tokens[a] > tokens[b] : a < b; });
  const double sum = static_cast<double>(std::accumulate(tokens.begin(), tokens.end(), int64_t{0}));
  std::vector<HotExpert> hot;
  for (int i = 0; i < n; ++i)
    hot.push_back({idx[i], tokens[idx[i]], sum > 0 ? static_cast<double>(tokens[idx[i]]) / sum : 0.0});
  return hot;
}

LayerSnapshot layer_snapshot(const LayerRecord& layer, int64_t dropped_total, int k) {
  LayerSnapshot s;
  s.layer = layer.layer;
  s.max_vio = layer.max_vio;
  s.balancedness = layer.balancedness();
  s.dropped = layer.dropped;
  s.dropped_total = dropped_total;
  s.hot = hot_experts(layer, k);
  return s;
}

RankSnapshot rank_snapshot(const RankRecord& rank) {
  return {rank.rank, rank_idle_fraction(rank), rank.exchange_wait, rank.waited_for, rank.total};
}

}  // namespace

double rank_idle_fraction(const RankRecord& rank) {
  if (!(rank.total > 0)) return 0;
  return std::clamp((rank.wait + rank.exchange_wait) / rank.total, 0.0, 1.0);
}

RunTracker::RunTracker(RunTrackerOptions options)
    : options_(options), window_(static_cast<std::size_t>(std::max(1, options.window))) {}

void RunTracker::add(const StepRecord& record) {
  ++records_;
  if (dropped_total_.size() < record.layers.size()) dropped_total_.resize(record.layers.size(), 0);
  for (std::size_t l = 0; l < record.layers.size(); ++l) dropped_total_[l] += record.layers[l].dropped;
  last_ = record;
  window_.add(record);
}

RunSnapshot RunTracker::snapshot() const {
  RunSnapshot s;
  s.records = records_;
  if (records_ == 0) return s;
  const StepRecord& last = last_;
  s.step = last.step;
  s.loss = last.loss;
  s.main_loss = last.main_loss;
  s.tokens_per_s = last.tokens_per_s;
  s.seconds = last.seconds;
  s.balancedness = last.balancedness();
  s.max_vio = last.max_vio();
  for (std::size_t l = 0; l < last.layers.size(); ++l)
    s.layers.push_back(layer_snapshot(last.layers[l], dropped_total_[l], options_.hot_experts));
  for (int64_t d : dropped_total_) s.dropped_total += d;
  for (const RankRecord& r : last.ranks) s.ranks.push_back(rank_snapshot(r));
  s.stragglers = window_.diagnose();
  s.window_steps = static_cast<int>(window_.size());
  return s;
}

}  // namespace epx
