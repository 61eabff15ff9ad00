#include "launch.h"

#include <fmt/format.h>

#include "commands.h"

namespace epx::app {

int open_mpi_rank(int num_ranks, int num_nodes, std::string_view command, std::unique_ptr<MpiSession>* session,
                  std::unique_ptr<Transport>* transport) {
  auto opened = MpiSession::init(nullptr, nullptr);
  if (!opened.is_ok()) {
    fmt::print(stderr, "{}: {}\n", command, opened.status().to_string());
    return kExitFailed;
  }
  *session = std::move(opened).value();
  MpiSession& s = **session;
  if (s.world_size() != num_ranks) {
    if (s.world_rank() == 0)
      fmt::print(stderr,
                 "{}: --ranks {} but {} MPI processes were started; under MPI each process is one rank, so they must "
                 "be equal (e.g. mpirun -n {} or --ranks {})\n",
                 command, num_ranks, s.world_size(), num_ranks, s.world_size());
    return kExitUsage;
  }
  MpiOptions options;
  options.ranks_per_node = num_nodes > 1 ? num_ranks / num_nodes : 0;
  auto connected = s.connect(options);
  if (!connected.is_ok()) {
    fmt::print(stderr, "{}: process {}: {}\n", command, s.world_rank(), connected.status().to_string());
    return connected.status().code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailed;
  }
  *transport = std::move(connected).value();
  return kExitOk;
}

}  // namespace epx::app
