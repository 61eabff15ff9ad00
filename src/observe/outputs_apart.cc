// check_outputs_apart: every output against every input and every other
// output, by identity, before anything is written.
#include <sys/stat.h>

#include <filesystem>
#include <vector>

#include "epx/observe/output_path.h"

namespace epx {
namespace {

namespace fs = std::filesystem;

// What a path names: the file (device, inode) when it exists, and its
// absolute path with the existing part's symbolic links resolved.
struct Identity {
  bool exists = false;
  dev_t dev = 0;
  ino_t ino = 0;
  fs::path normal;
};

Identity identify(const std::string& path) {
  Identity id;
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec);
  id.normal = fs::weakly_canonical(absolute, ec);
  if (ec) id.normal = absolute.lexically_normal();
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    id.exists = true;
    id.dev = st.st_dev;
    id.ino = st.st_ino;
  }
  return id;
}

bool same(const Identity& a, const Identity& b) {
  if (a.exists && b.exists) return a.dev == b.dev && a.ino == b.ino;
  return a.normal == b.normal;
}

// `inner` lies in `folder` (or is it), by their resolved paths.
bool inside(const Identity& inner, const Identity& folder) {
  if (same(inner, folder)) return true;
  auto f = folder.normal.begin(), i = inner.normal.begin();
  for (; f != folder.normal.end(); ++f, ++i) {
    if (f->empty() && std::next(f) == folder.normal.end()) break;  // a trailing separator
    if (i == inner.normal.end() || *f != *i) return false;
  }
  return true;
}

bool takes_part(const CommandPath& p) { return !p.path.empty() && p.path != "-"; }

// A file output in (or at) a checkpoint folder.
Status in_folder(const CommandPath& file, const Identity& file_id, const CommandPath& folder, const Identity& folder_id) {
  return invalid_argument("{} '{}' {} the {} folder '{}': a checkpoint folder holds only epx's checkpoints; name a {} "
                          "outside it (nothing was written)",
                          file.option, file.path, same(file_id, folder_id) ? "is" : "lies inside", folder.option,
                          folder.path, file.option);
}

// An output against one other path (an input, or an output listed before it).
Status check_pair(const CommandPath& out, const Identity& out_id, const CommandPath& other, const Identity& other_id,
                  bool other_is_input) {
  if (other.folder && !out.folder && inside(out_id, other_id)) return in_folder(out, out_id, other, other_id);
  if (out.folder && other.folder) return Status::ok();  // --save DIR --resume DIR continues the run
  if (out.folder && !other_is_input && inside(other_id, out_id)) return in_folder(other, other_id, out, out_id);
  if (!same(out_id, other_id)) return Status::ok();
  if (other_is_input)
    return invalid_argument("{} '{}' and {} '{}' are the same file: the output would overwrite what this command "
                            "reads; name another {} (nothing was written)",
                            out.option, out.path, other.option, other.path, out.option);
  return invalid_argument("{} '{}' and {} '{}' are the same file: one output would overwrite the other; name "
                          "another {} (nothing was written)",
                          other.option, other.path, out.option, out.path, out.option);
}

}  // namespace

Status check_outputs_apart(std::span<const CommandPath> inputs, std::span<const CommandPath> outputs) {
  std::vector<Identity> input_ids, output_ids;
  for (const CommandPath& p : inputs) input_ids.push_back(takes_part(p) ? identify(p.path) : Identity{});
  for (const CommandPath& p : outputs) output_ids.push_back(takes_part(p) ? identify(p.path) : Identity{});
  for (std::size_t o = 0; o < outputs.size(); ++o) {
    if (!takes_part(outputs[o])) continue;
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (takes_part(inputs[i]))
        EPX_RETURN_IF_ERROR(check_pair(outputs[o], output_ids[o], inputs[i], input_ids[i], /*other_is_input=*/true));
    for (std::size_t e = 0; e < o; ++e)
      if (takes_part(outputs[e]))
        EPX_RETURN_IF_ERROR(check_pair(outputs[o], output_ids[o], outputs[e], output_ids[e], /*other_is_input=*/false));
  }
  return Status::ok();
}

}  // namespace epx
