// The metrics line parser behind read_metrics and MetricsFollower: simdjson's
// On Demand API over lines in a caller's buffer, one parser per thread.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <simdjson.h>

#include "epx/observe/run_log.h"

namespace epx::observe_detail {

// A parser and its scratch buffer; reused line after line (not thread-safe).
struct LineParser {
  simdjson::ondemand::parser parser;
  std::string scratch;  // a padded copy of a line that its buffer cannot pad
};

// One line, with `capacity` readable bytes from line.data() (at least
// line.size() + SIMDJSON_PADDING; what follows the line is not read as JSON).
Status parse_padded_line(LineParser& parser, std::string_view line, std::size_t capacity, StepRecord& step);
// One line anywhere (copied into the scratch buffer first).
Status parse_line(LineParser& parser, std::string_view line, StepRecord& step);

// The whole lines of `text` (each ended by '\n'; blank ones skipped), in order,
// up to the first malformed one. `capacity` readable bytes start at text.data().
// The records `out` holds from an earlier call are parsed into again, their
// memory kept: a reader that hands records on and gets them back (moved from
// or not) allocates nothing per line once warm.
struct ParsedLines {
  std::vector<StepRecord> records;  // the first num_records are this call's; the rest spares
  std::size_t num_records = 0;
  int64_t num_lines = 0;   // lines read, blank ones and a malformed one included
  std::size_t consumed = 0;  // bytes of the lines read well: where to go on
  Status error;            // the malformed line's, without its number
  int64_t error_line = 0;  // 1-based within `text` when !error.is_ok()
};
void parse_lines(LineParser& parser, std::string_view text, std::size_t capacity, ParsedLines& out);

}  // namespace epx::observe_detail
