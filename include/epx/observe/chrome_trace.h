// Chrome traces: a Tracer's spans as a file that Perfetto (ui.perfetto.dev)
// and chrome://tracing open, one track per rank.
//
//   epx::Tracer tracer;
//   ... ScopedSpan(&tracer, rank, "dispatch") on every rank ...
//   EPX_RETURN_IF_ERROR(epx::write_chrome_trace(tracer.spans(), "trace.json"));
//
// The file is the Chrome trace event format: {"traceEvents": [...]}, one
// complete ("X") event per span with ts and dur in microseconds (fractions
// keep the nanoseconds) counted from the earliest span's begin, pid 0 and
// tid = rank, plus metadata ("M") events naming the process "epx" and each
// rank's track "rank N". Events come in the order of `spans`.
//
// The file is written to a temporary file in the same folder and renamed over
// `path`, so a reader never sees half a trace and a failure leaves `path` as
// it was. Errors: InvalidArgument for a span that ends before it begins
// (nothing written); NotFound when the folder does not exist; otherwise the
// path and the system's reason (errno text).
#pragma once

#include <span>
#include <string>

#include "epx/core/status.h"
#include "epx/core/trace.h"

namespace epx {

[[nodiscard]] Status write_chrome_trace(std::span<const TraceSpan> spans, const std::string& path);

}  // namespace epx
