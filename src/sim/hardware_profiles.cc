// Hardware profiles by name: hardware.profile = "h800" (or `epx sim fit
// --profile h800`) is <folder>/h800.toml in the first folder of
// hardware_profile_dirs() that has it; anything with a '/' or ending in
// ".toml" is a path, relative to the scenario's folder.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <set>

#include <fmt/format.h>

#include "epx/sim/scenario.h"

#ifndef EPX_SOURCE_HARDWARE_DIR
#define EPX_SOURCE_HARDWARE_DIR ""
#endif
#ifndef EPX_INSTALL_HARDWARE_DIR
#define EPX_INSTALL_HARDWARE_DIR ""
#endif

namespace epx::sim {
namespace {

namespace fs = std::filesystem;

bool is_bare_name(const std::string& text) {
  return !text.empty() && text.find('/') == std::string::npos && !text.ends_with(".toml") && text != "." &&
         text != "..";
}

// share/epx/hardware next to the running program's bin/ folder (an install
// moved after it was built).
std::string beside_program() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec || exe.empty()) return "";
  return (exe.parent_path().parent_path() / "share" / "epx" / "hardware").string();
}

// The profile names (file stems) of one folder; none when it is absent.
std::vector<std::string> profiles_in(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec))
    if (entry.path().extension() == ".toml") names.push_back(entry.path().stem().string());
  return names;
}

}  // namespace

std::vector<std::string> hardware_profile_dirs() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("EPX_HARDWARE_PATH"); env != nullptr) {
    const std::string list = env;
    for (std::size_t start = 0; start <= list.size();) {
      const std::size_t colon = std::min(list.find(':', start), list.size());
      if (colon > start) dirs.push_back(list.substr(start, colon - start));
      start = colon + 1;
    }
  }
  for (const std::string& dir : {std::string(EPX_SOURCE_HARDWARE_DIR), beside_program(),
                                 std::string(EPX_INSTALL_HARDWARE_DIR)})
    if (!dir.empty() && std::find(dirs.begin(), dirs.end(), dir) == dirs.end()) dirs.push_back(dir);
  return dirs;
}

Result<std::string> find_hardware_profile(const std::string& name_or_path, const std::string& relative_to) {
  if (!is_bare_name(name_or_path)) {
    const fs::path path = fs::path(name_or_path).is_relative() && !relative_to.empty()
                              ? fs::path(relative_to) / name_or_path
                              : fs::path(name_or_path);
    return path.string();
  }
  const std::vector<std::string> dirs = hardware_profile_dirs();
  std::set<std::string> known;
  std::vector<std::string> looked;
  for (const std::string& dir : dirs) {
    const fs::path candidate = fs::path(dir) / (name_or_path + ".toml");
    std::error_code ec;
    if (fs::is_regular_file(candidate, ec)) return candidate.string();
    const std::vector<std::string> here = profiles_in(dir);
    known.insert(here.begin(), here.end());
    looked.push_back(fs::is_directory(dir, ec) ? dir : dir + " (absent)");
  }
  return not_found(
      "no hardware profile named '{}'; the known profiles are {} (looked in {}; EPX_HARDWARE_PATH adds folders); "
      "or give a path to a .toml file",
      name_or_path, known.empty() ? std::string("none") : fmt::format("{}", fmt::join(known, ", ")),
      fmt::join(looked, ", "));
}

}  // namespace epx::sim
