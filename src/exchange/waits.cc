#include "exchange/waits.h"

#include <algorithm>
#include <chrono>

#include "epx/core/status.h"

namespace epx {

void WaitRecord::clear(int num_ranks) {
  arrival.assign(static_cast<std::size_t>(num_ranks), 0.0);
  data.assign(static_cast<std::size_t>(num_ranks), 0.0);
  blocked = 0;
  num_ops = 0;
}

WaitRecord& WaitRecord::operator+=(const WaitRecord& other) {
  if (arrival.empty()) {
    arrival.assign(other.arrival.size(), 0.0);
    data.assign(other.data.size(), 0.0);
  }
  EPX_CHECK_EQ(arrival.size(), other.arrival.size());
  EPX_CHECK_EQ(data.size(), other.data.size());
  for (std::size_t s = 0; s < arrival.size(); ++s) {
    arrival[s] += other.arrival[s];
    data[s] += other.data[s];
  }
  blocked += other.blocked;
  num_ops += other.num_ops;
  return *this;
}

namespace detail {

int64_t system_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void OpWaits::start(bool on, int num_ranks, int rank) {
  on_ = on;
  rank_ = rank;
  if (!on_) return;
  record_.clear(num_ranks);  // keeps the vectors' capacity
  record_.num_ops = 1;
}

double OpWaits::attribute(std::span<const int64_t> stamps, double seconds, std::vector<double>* into) const {
  const int64_t mine = stamps[static_cast<std::size_t>(rank_)];
  double longest = 0;
  for (std::size_t s = 0; s < stamps.size(); ++s) {
    if (static_cast<int>(s) == rank_ || stamps[s] <= mine) continue;
    const double wait = std::min(static_cast<double>(stamps[s] - mine) * 1e-9, seconds);
    (*into)[s] += wait;
    longest = std::max(longest, wait);
  }
  return longest;
}

void OpWaits::header_done(std::span<const int64_t> stamps, double seconds) {
  if (on_) record_.blocked += attribute(stamps, seconds, &record_.arrival);
}

void OpWaits::received(int peer, Clock::time_point since) {
  if (!on_) return;
  const double seconds = std::chrono::duration<double>(Clock::now() - since).count();
  record_.data[static_cast<std::size_t>(peer)] += seconds;
  record_.blocked += seconds;
}

void OpWaits::sync_done(std::span<const int64_t> stamps, double seconds) {
  if (on_) record_.blocked += attribute(stamps, seconds, &record_.data);
}

}  // namespace detail
}  // namespace epx
