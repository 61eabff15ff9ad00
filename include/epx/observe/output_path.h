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
//
// Outputs apart from inputs: before a command writes anything, every output
// path is compared with every input and every other output
// (check_outputs_apart), so an output never replaces what the command reads,
// another of its outputs, or a checkpoint folder's content.
//
//   const epx::CommandPath inputs[] = {{"metrics", "m.jsonl"}};
//   const epx::CommandPath outputs[] = {{"--output", "report.html"}};
//   EPX_RETURN_IF_ERROR(epx::check_outputs_apart(inputs, outputs));
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "epx/core/status.h"

namespace epx {

[[nodiscard]] Status check_output_writable(const std::string& path, std::string_view what,
                                           bool renamed_into_place = false);

// A path a command reads or writes, with the option (or key) that names it.
struct CommandPath {
  std::string option;   // "--metrics", "scenario", "routing.trace"
  std::string path;     // as the user gave it; "" (none) and "-" (stdin, stdout) take no part
  bool folder = false;  // a checkpoint folder (--save, --resume): no other output may lie inside it
};

// InvalidArgument, naming both options and the path, when an output is an
// input or another output, or lies inside a folder input or output. Two paths
// are the same when both exist and share device and inode (hard links,
// symbolic links, "./m.jsonl" and "m.jsonl" all count), or, when one does
// not exist yet, when their absolute paths agree once the existing part is
// resolved. A folder output may be a folder input (--save DIR --resume DIR is
// a resume). Reads file metadata only (stat); writes nothing.
[[nodiscard]] Status check_outputs_apart(std::span<const CommandPath> inputs, std::span<const CommandPath> outputs);

}  // namespace epx
