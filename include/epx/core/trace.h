// Tracing: named time spans recorded per rank, the raw material of Chrome
// traces (one track per rank) and of per-phase timings.
//
//   epx::Tracer tracer;
//   {
//     epx::ScopedSpan span(&tracer, rank, "dispatch");
//     ...
//   }
//   for (const epx::TraceSpan& s : tracer.spans()) ...
//
// A null Tracer pointer turns recording off at the cost of one branch.
// Recording is thread-safe; ranks that are threads share one Tracer.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "epx/core/clock.h"

namespace epx {

struct TraceSpan {
  std::string name;
  int rank = 0;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
};

class Tracer {
 public:
  void record(TraceSpan span);
  // All spans so far, ordered by (rank, begin).
  [[nodiscard]] std::vector<TraceSpan> spans() const;
  // Total time per span name for one rank, in seconds.
  [[nodiscard]] double total_seconds(int rank, std::string_view name) const;
  void clear();

 private:
  mutable std::mutex mutex_;
  std::vector<TraceSpan> spans_;
};

class ScopedSpan {
 public:
  ScopedSpan(Tracer* tracer, int rank, std::string name)
      : tracer_(tracer), rank_(rank), name_(std::move(name)), begin_ns_(tracer ? now_ns() : 0) {}
  ~ScopedSpan() {
    if (tracer_) tracer_->record({std::move(name_), rank_, begin_ns_, now_ns()});
  }
  ScopedSpan(const ScopedSpan&) = delete;
  ScopedSpan& operator=(const ScopedSpan&) = delete;

 private:
  Tracer* tracer_;
  int rank_;
  std::string name_;
  int64_t begin_ns_;
};

}  // namespace epx
