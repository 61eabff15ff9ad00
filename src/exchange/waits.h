// Private: one rank's wait recording for one exchange operation (who it
// waited for: WaitRecord in epx/exchange/buffer.h).
//
// An operation calls start(), then stamps its arrival into the header every
// rank exchanges (stamp()), hands the gathered stamps to header_done(), times
// each blocking receive with received(), and ends with a sync that exchanges
// "done" stamps (sync_done()). Off (BufferConfig::record_waits = false), every
// call is a no-op and stamp() is 0.
#pragma once

#include <cstdint>
#include <span>

#include "epx/core/clock.h"
#include "epx/exchange/buffer.h"

namespace epx::detail {

// Nanoseconds on the system clock: the one clock that processes (and,
// through NTP/PTP, hosts) share, unlike the monotonic clock of now_ns().
[[nodiscard]] int64_t system_now_ns();

class OpWaits {
 public:
  void start(bool on, int num_ranks, int rank);
  [[nodiscard]] bool on() const { return on_; }
  // This rank's stamp for a header or a closing sync (0 when off).
  [[nodiscard]] int64_t stamp() const { return on_ ? system_now_ns() : 0; }
  // stamps[s]: rank s's arrival; seconds: what this rank spent in the
  // header exchange, the bound of every arrival wait.
  void header_done(std::span<const int64_t> stamps, double seconds);
  // A blocking receive of `peer`'s rows, begun at `since`.
  void received(int peer, Clock::time_point since);
  // The closing sync: stamps[s] is when rank s finished its part (writing
  // into this node's regions, forwarding, reading them); seconds: the time
  // this rank spent in the sync.
  void sync_done(std::span<const int64_t> stamps, double seconds);
  [[nodiscard]] const WaitRecord& record() const { return record_; }

 private:
  // Waits for each rank from stamps later than this rank's, clamped to
  // `seconds`; returns the longest.
  double attribute(std::span<const int64_t> stamps, double seconds, std::vector<double>* into) const;

  bool on_ = false;
  int rank_ = 0;
  WaitRecord record_;
};

}  // namespace epx::detail
