// CPU time for the benchmarks, one helper per clock: the calling thread's
// (a rank thread's work in one operation) and the whole process's (every
// thread's, user + system). Header-only, like stats.h (target
// epx_bench_timing): programs that do not link epx_bench (expert_ffn_bench,
// moe_overlap_bench) use it too.
#pragma once

#include <time.h>

#include <cstdint>

namespace epx::bench {

// Nanoseconds on CPU clock `clock` (CLOCK_THREAD_CPUTIME_ID, CLOCK_PROCESS_CPUTIME_ID).
inline int64_t cpu_clock_ns(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// CPU time of the calling thread, in nanoseconds.
inline int64_t thread_cpu_ns() { return cpu_clock_ns(CLOCK_THREAD_CPUTIME_ID); }

// CPU time of every thread of this process, in seconds.
inline double process_cpu_seconds() { return static_cast<double>(cpu_clock_ns(CLOCK_PROCESS_CPUTIME_ID)) * 1e-9; }

}  // namespace epx::bench
