// What recording who waited for whom adds to one exchange operation, measured
// in parts, so the figure does not drown in the noise of a whole step
// (docs/performance.md, Observability):
//  1. the bookkeeping on the calling rank (detail::OpWaits: the stamps, the
//     attribution over the ranks, a timed receive per remote peer, the sum
//     take_waits hands out), per operation, for several rank counts;
//  2. the closing sync: an all-gather of one stamp per rank against the
//     barrier it replaces, on in-process ranks (threads).
// Prints medians and minimums over repetitions.
//
//   build/bin/epx_wait_record_bench
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/core/clock.h"
#include "exchange/waits.h"
#include "stats.h"

namespace {

using epx::bench::median;

// Nanoseconds of one operation's bookkeeping on `num_ranks` ranks, with one
// timed receive from every other rank (the flat worst case).
void bookkeeping(int num_ranks) {
  constexpr int kOps = 20000, kReps = 9;
  epx::detail::OpWaits waits;
  epx::WaitRecord sum;
  sum.clear(num_ranks);
  std::vector<int64_t> stamps(static_cast<std::size_t>(num_ranks));
  std::vector<double> per_op;
  for (int rep = 0; rep < kReps; ++rep) {
    epx::Stopwatch watch;
    for (int op = 0; op < kOps; ++op) {
      waits.start(true, num_ranks, 0);
      // One stamp of this rank's; the others' as the header would bring them.
      const int64_t now = waits.stamp();
      for (int s = 0; s < num_ranks; ++s) stamps[static_cast<std::size_t>(s)] = now + 1000 * s;
      waits.header_done(stamps, 1e-3);
      for (int s = 1; s < num_ranks; ++s) waits.received(s, epx::Clock::now());
      stamps[0] = waits.stamp();
      waits.sync_done(stamps, 1e-3);
      sum += waits.record();
    }
    per_op.push_back(watch.seconds() / kOps * 1e9);
  }
  fmt::print("| bookkeeping, {} ranks ({} receives) | {:.0f} ns | {:.0f} ns |\n", num_ranks, num_ranks - 1,
             median(per_op), *std::min_element(per_op.begin(), per_op.end()));
}

// Nanoseconds per read of the monotonic and the system clock (each operation
// reads them a few times, and twice per receive).
void clock_reads() {
  constexpr int kReads = 200000, kReps = 9;
  std::vector<double> steady, system;
  int64_t sink = 0;
  for (int rep = 0; rep < kReps; ++rep) {
    epx::Stopwatch watch;
    for (int i = 0; i < kReads; ++i) sink += epx::Clock::now().time_since_epoch().count() & 1;
    steady.push_back(watch.seconds() / kReads * 1e9);
    watch.reset();
    for (int i = 0; i < kReads; ++i) sink += epx::detail::system_now_ns() & 1;
    system.push_back(watch.seconds() / kReads * 1e9);
  }
  fmt::print("| one read of the monotonic clock | {:.0f} ns | {:.0f} ns |\n", median(steady),
             *std::min_element(steady.begin(), steady.end()));
  fmt::print("| one read of the system clock | {:.0f} ns | {:.0f} ns |\n", median(system),
             *std::min_element(system.begin(), system.end()));
  if (sink < 0) fmt::print("{}\n", sink);  // keeps the reads
}

// Microseconds per call of `num_ranks` threads doing a barrier, then an
// all-gather of one int64, in alternating blocks.
void closing_sync(int num_ranks) {
  constexpr int kBlock = 200, kBlocks = 15;
  auto topology = epx::Topology::create(num_ranks, 1);
  if (!topology.is_ok()) return;
  std::vector<double> barrier_us, gather_us;
  epx::InprocWorld world(*topology);
  const std::vector<epx::Status> statuses = world.run([&](epx::Transport& t) -> epx::Status {
    const auto deadline = epx::Deadline::after(std::chrono::seconds(120));
    std::vector<int64_t> all(static_cast<std::size_t>(num_ranks));
    const int64_t mine = t.rank();
    for (int b = 0; b < kBlocks; ++b) {
      EPX_RETURN_IF_ERROR(t.barrier(deadline));
      epx::Stopwatch watch;
      for (int i = 0; i < kBlock; ++i) EPX_RETURN_IF_ERROR(t.barrier(deadline));
      const double barrier = watch.seconds();
      EPX_RETURN_IF_ERROR(t.barrier(deadline));
      watch.reset();
      for (int i = 0; i < kBlock; ++i)
        EPX_RETURN_IF_ERROR(t.all_gather(std::span<const int64_t>(&mine, 1), std::span<int64_t>(all), deadline));
      const double gather = watch.seconds();
      if (t.rank() == 0) {
        barrier_us.push_back(barrier / kBlock * 1e6);
        gather_us.push_back(gather / kBlock * 1e6);
      }
    }
    return epx::Status::ok();
  });
  if (!epx::first_error(statuses).is_ok()) {
    fmt::print("closing sync on {} ranks failed: {}\n", num_ranks, epx::first_error(statuses).to_string());
    return;
  }
  fmt::print("| closing sync, {} in-process ranks: barrier | {:.2f} us | {:.2f} us |\n", num_ranks, median(barrier_us),
             *std::min_element(barrier_us.begin(), barrier_us.end()));
  fmt::print("| closing sync, {} in-process ranks: all-gather of one stamp | {:.2f} us | {:.2f} us |\n", num_ranks,
             median(gather_us), *std::min_element(gather_us.begin(), gather_us.end()));
}

}  // namespace

int main() {
  fmt::print("| part | median | fastest |\n|---|---|---|\n");
  clock_reads();
  for (int ranks : {4, 8, 64, 256}) bookkeeping(ranks);
  for (int ranks : {4, 8}) closing_sync(ranks);
  return 0;
}
