// `epx train`: a step's report as the metrics reader's record, in memory.
#pragma once

#include "epx/observe/run_log.h"
#include "epx/train/trainer.h"

namespace epx::app {

// The record parse_step_record makes of report.to_json(), without the text
// in between: the summary's windows (straggler) take it from here; the JSON
// is written only to the metrics file. A non-finite number the line writes
// as null is NaN here too.
[[nodiscard]] StepRecord step_record(const StepReport& report);

}  // namespace epx::app
