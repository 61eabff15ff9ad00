#include "epx/core/trace.h"

#include <algorithm>

namespace epx {

void Tracer::record(TraceSpan span) {
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.push_back(std::move(span));
}

std::vector<TraceSpan> Tracer::spans() const {
  std::vector<TraceSpan> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    out = spans_;
  }
  std::stable_sort(out.begin(), out.end(), [](const TraceSpan& a, const TraceSpan& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.begin_ns < b.begin_ns;
  });
  return out;
}

double Tracer::total_seconds(int rank, std::string_view name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t total = 0;
  for (const TraceSpan& s : spans_)
    if (s.rank == rank && s.name == name) total += s.end_ns - s.begin_ns;
  return static_cast<double>(total) * 1e-9;
}

void Tracer::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.clear();
}

}  // namespace epx
