// `epx report`: a training run's metrics as one self-contained HTML page.
#pragma once

#include <CLI/CLI.hpp>

#include "commands.h"

namespace epx::app {

// Adds `report` bound to `options`; the subcommand, to test whether it was given.
CLI::App* add_report_command(CLI::App& app, ReportOptions& options);

}  // namespace epx::app
