// The `epx` command: thin over the public API. Its commands are one table
// (commands.cc); `epx --help` lists them.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "commands.h"
#include "epx/core/status.h"

namespace {

int run(int argc, char** argv);

// Output that could not be written (a full disk, /dev/full) is a failure:
// a message on stderr and exit 1 (a usage error keeps its 2), never 0.
int finish_output(int code) {
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && std::ferror(stdout) == 0) return code;
  fmt::print(stderr, "epx: cannot write the output to stdout: {}\n", err != 0 ? std::strerror(err) : "a write failed");
  return code == epx::app::kExitOk ? epx::app::kExitFailed : code;
}

// The command's name for a message: the first word that is not an option.
std::string command_name(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-') return fmt::format("epx {}", argv[i]);
  return "epx";
}

}  // namespace

// The last resorts: output that cannot be written, and an allocation that
// fails where no check foresaw it, end the command with a message and exit 1,
// never with exit 0 or an uncaught exception (abort).
int main(int argc, char** argv) {
  int code = epx::app::kExitFailed;
  try {
    code = run(argc, argv);
  } catch (const std::system_error& e) {  // fmt::print when the output cannot be written
    std::clearerr(stdout);
    fmt::print(stderr, "epx: cannot write the output: {}\n", e.what());
    return epx::app::kExitFailed;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "{}: out of memory while running the command (an allocation failed); stopped\n",
               command_name(argc, argv));
    return epx::app::kExitFailed;
  } catch (const std::length_error& e) {
    fmt::print(stderr, "{}: out of memory while running the command (a size above the maximum: {}); stopped\n",
               command_name(argc, argv), e.what());
    return epx::app::kExitFailed;
  }
  return finish_output(code);
}

namespace {

// A word where a command belongs that is not one: kExitUsage after saying
// so plainly. For a command, its `before_parse` (train reads --config there).
int check_command_word(int argc, char** argv, std::span<const epx::app::AddedCommand> added) {
  const auto table = epx::app::commands();
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.empty() || arg[0] == '-') continue;
    for (std::size_t c = 0; c < table.size(); ++c)
      if (table[c].name == arg) return added[c].before_parse ? added[c].before_parse(argc, argv) : 0;
    fmt::print(stderr, "epx: '{}' is not a command; the commands are {} (see epx --help)\n", epx::printable(arg),
               epx::app::command_names());
    return epx::app::kExitUsage;
  }
  return 0;
}

int run(int argc, char** argv) {
  CLI::App app{"epx: expert parallelism for Mixture-of-Experts models (dispatch, combine, load balance).\n"
               "Ranks run as threads of this process (--nodes emulates several machines) or, started by mpirun or srun, "
               "one rank per process.",
               "epx"};
  app.set_version_flag("--version", std::string("epx ") + EPX_VERSION);
  app.require_subcommand(1);
  app.fallthrough();
  epx::app::GlobalOptions global;
  app.add_flag("-q,--quiet", global.quiet, "No progress lines on stderr");
  std::vector<epx::app::AddedCommand> added;
  for (const epx::app::Command& command : epx::app::commands()) added.push_back(command.add(app));

  if (int code = check_command_word(argc, argv, added); code != 0) return code;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version: on stdout
    // The error quotes the user's words: escaped, so raw bytes never reach the terminal.
    fmt::print(stderr, "{}\nRun with --help for more information.\n", epx::printable(e.what()));
    return epx::app::kExitUsage;
  }

  auto logger = spdlog::stderr_color_mt("epx");
  logger->set_pattern("[%H:%M:%S.%e] %v");
  logger->set_level(global.quiet ? spdlog::level::warn : spdlog::level::info);
  spdlog::set_default_logger(logger);

  for (const epx::app::AddedCommand& command : added)
    if (*command.node) return command.run(global);
  fmt::print(stderr, "epx: no command given; see epx --help\n");
  return epx::app::kExitUsage;
}

}  // namespace
