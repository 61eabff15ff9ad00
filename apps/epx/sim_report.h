// `epx sim run --report`: a simulated run as the run report's page (per-GPU
// timelines of the traced step, idle and exposed communication per GPU, the
// step time over steps, a summary).
#pragma once

#include <string>

#include "epx/core/status.h"
#include "epx/sim/simulator.h"

namespace epx::app {

// `result` must hold the trace (sim::SimOptions::keep_trace); `description`
// is the scenario's text as `epx sim run` prints it.
[[nodiscard]] Status write_sim_report(const sim::Scenario& scenario, const sim::SimResult& result,
                                      const std::string& description, const std::string& path);

}  // namespace epx::app
