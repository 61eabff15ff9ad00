// How a command runs its ranks under MPI: one rank per process.
#pragma once

#include <memory>
#include <string_view>

#include "epx/comm/mpi.h"
#include "epx/comm/transport.h"

namespace epx::app {

// Initialises MPI and connects this process's rank of a job of `num_ranks`
// ranks on `num_nodes` nodes (1: the real hosts; more: each host split into
// emulated nodes). Returns kExitOk, or prints why not (prefixed with
// `command`) and returns kExitUsage (the sizes do not match the processes)
// or kExitFailed. `*transport` must be destroyed before `*session`.
int open_mpi_rank(int num_ranks, int num_nodes, std::string_view command, std::unique_ptr<MpiSession>* session,
                  std::unique_ptr<Transport>* transport);

}  // namespace epx::app
