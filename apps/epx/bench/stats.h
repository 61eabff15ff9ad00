// Summaries of benchmark repetitions, one helper per job, for the `epx bench`
// libraries here and bench/'s programs. Header-only (target epx_bench_timing):
// programs that do not link epx_bench (moe_layer_bench, expert_ffn_bench, ...)
// use it too.
#pragma once

#include <algorithm>
#include <vector>

namespace epx::bench {

// The median of `v`: the middle value, the mean of the middle two for an
// even count, 0 when empty. Every benchmark's summary of its repetitions.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace epx::bench
