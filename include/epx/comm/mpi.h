// The MPI backend: one rank per process, started by mpirun or Slurm's srun.
//
//   int main(int argc, char** argv) {
//     auto session = epx::MpiSession::init(&argc, &argv);    // MPI_Init_thread(MULTIPLE)
//     if (!session.is_ok()) { ... }
//     auto transport = (*session)->connect(epx::MpiOptions{});  // collective over MPI_COMM_WORLD
//     epx::Transport& t = **transport;  // this process's rank
//     ... Buffer::create(t, config), dispatch, combine ...
//   }   // transports first, then the session (MPI_Finalize)
//
// Topology: a node is a shared-memory domain (MPI_COMM_TYPE_SHARED: a host).
// Ranks are renumbered node-major (the Topology's numbering, whatever order
// the launcher used) and every node must hold the same number of ranks.
// MpiOptions::ranks_per_node splits each host into emulated nodes, so the
// two-hop path can be run and tested with real processes on one machine.
//
// Inside a node, peer memory is an MPI-3 shared window (MPI_Win_allocate_shared),
// so the exchange writes straight into its peers' regions, as in-process.
// Between nodes: MPI_Isend/MPI_Irecv. Collectives: non-blocking MPI
// collectives. Every wait polls, with its deadline; a peer's abort() and the
// death of a process on the same host are noticed while polling, so the
// other ranks return an error (naming the rank) instead of waiting forever.
// See docs/design.md ("The MPI backend") for the details.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "epx/comm/transport.h"
#include "epx/core/status.h"

namespace epx {

struct MpiOptions {
  // 0: nodes are the hosts. Otherwise every host's ranks are split into
  // emulated nodes of this many ranks (it must divide the ranks per host);
  // peer memory is then shared only inside an emulated node.
  int ranks_per_node = 0;
  // Bound on the blocking MPI steps that cannot be polled: connect()'s
  // communicator set-up waits (polled) until every rank arrived, and a
  // PeerMemory's destructor waits this long for its node before it frees
  // the window (and leaks it instead of hanging when a peer never comes).
  std::chrono::milliseconds setup_timeout{60000};
  // How often a waiting rank checks that the processes of its host are alive.
  std::chrono::milliseconds liveness_interval{100};
};

class MpiSession {
 public:
  // MPI_Init_thread with MPI_THREAD_MULTIPLE (FailedPrecondition when the
  // library gives less). One per process; Unimplemented when epx was built
  // without MPI (EPX_WITH_MPI=OFF).
  static Result<std::unique_ptr<MpiSession>> init(int* argc, char*** argv);
  // MPI_Finalize once every process has reached its own session end (two
  // polled barriers: 120 s, or 3 s after a failure of this process, then
  // 3 s). When one
  // never does (it died), finalizing would hang, so it is skipped and the
  // process exits without it (the launcher reports that).
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  [[nodiscard]] int world_rank() const { return world_rank_; }
  [[nodiscard]] int world_size() const { return world_size_; }
  // "Open MPI v4.1.4, ..." (MPI_Get_library_version, first line).
  [[nodiscard]] std::string library_version() const;

  // Collective over every process: a transport for this process's rank. Its
  // rank is the node-major renumbering of the world rank. It must be
  // destroyed before the session.
  Result<std::unique_ptr<Transport>> connect(const MpiOptions& options);

 private:
  MpiSession(int world_rank, int world_size) : world_rank_(world_rank), world_size_(world_size) {}
  int world_rank_;
  int world_size_;
};

// True when this process looks started by an MPI launcher (mpirun / mpiexec /
// srun --mpi=pmix): OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK or PMI_SIZE is set.
bool launched_by_mpi();

// True when epx was built with the MPI backend.
bool mpi_available();

}  // namespace epx
