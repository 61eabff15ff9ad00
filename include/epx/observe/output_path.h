// Preflight of an output file: can this process write `path`, checked
// before a run starts rather than found after its last step.
//
//   EPX_RETURN_IF_ERROR(epx::check_output_writable("out/metrics.jsonl", "--metrics"));
//
// An existing file is opened for writing and closed again (not truncated,
// not changed); a file that does not exist yet, or one that is
// `renamed_into_place` (written to a temporary file next to it, as traces
// are), is tried by creating and removing a probe file (".epx-probe-XXXXXX")
// in its folder, so nothing is left behind either way. "-" (stdout) is always writable. Errors name
// `what`, the path and the system's reason: NotFound for a missing folder
// (or a path under a regular file), InvalidArgument for a directory, no
// permission or a read-only file system, ResourceExhausted for a full disk.
#pragma once

#include <string>
#include <string_view>

#include "epx/core/status.h"

namespace epx {

[[nodiscard]] Status check_output_writable(const std::string& path, std::string_view what,
                                           bool renamed_into_place = false);

}  // namespace epx
