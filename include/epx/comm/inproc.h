// The in-process backend: ranks are threads of one process.
//
// An InprocWorld is one job: a topology (which may emulate several nodes,
// e.g. 8 ranks as 2 nodes x 4), the shared state of its collectives and
// mailboxes, and the peer memory of its ranks. Peer memory is only mapped
// between ranks of one emulated node, so anything that crosses nodes has to
// go through messages, where it is counted: the two-hop paths can be tested
// and measured without MPI.
//
//   EPX_ASSIGN_OR_RETURN(auto topo, epx::Topology::create(8, 2));
//   epx::InprocWorld world(topo);
//   std::vector<epx::Status> statuses = world.run([&](epx::Transport& t) -> epx::Status {
//     return t.barrier(epx::Deadline::after(std::chrono::seconds(5)));
//   });
//
// When a rank's function returns an error, run() aborts the world so the
// other ranks return Aborted at once instead of waiting for their deadlines.
// Transport::split makes groups of a world's ranks (a view of them with
// collectives, messages and peer memory of its own; see transport.h).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "epx/comm/transport.h"

namespace epx {

namespace detail {
struct InprocState;
}

class InprocWorld {
 public:
  explicit InprocWorld(const Topology& topology);
  ~InprocWorld();
  InprocWorld(const InprocWorld&) = delete;
  InprocWorld& operator=(const InprocWorld&) = delete;

  [[nodiscard]] const Topology& topology() const;
  // The transport of `rank`; one per rank, used by that rank's thread.
  [[nodiscard]] std::unique_ptr<Transport> connect(int rank);
  // Runs `fn` on one thread per rank and returns every rank's status, in
  // rank order. A rank whose fn throws counts as Internal.
  std::vector<Status> run(const std::function<Status(Transport&)>& fn);
  // Counters summed over all ranks of the world's own transports (a group
  // split from them counts its traffic in its own counters()).
  [[nodiscard]] TransportCounters total_counters() const;

 private:
  std::shared_ptr<detail::InprocState> state_;
};

// One-shot: a fresh world of `topology`, run(fn), its statuses.
std::vector<Status> run_ranks(const Topology& topology, const std::function<Status(Transport&)>& fn);

// The first non-OK status of `statuses` prefixed with its rank, or OK.
Status first_error(const std::vector<Status>& statuses);

}  // namespace epx
