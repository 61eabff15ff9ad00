// The socket backend: one rank per process, for processes started the way
// torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT), or by any launcher that gives each process its
// rank and a key-value store to meet through (Python: torch.distributed's
// TCPStore, see docs/python.md).
//
//   epx::SocketOptions options;
//   options.rank = rank; options.world_size = size; options.address = "10.0.0.5";
//   auto transport = epx::connect_sockets(store, options);  // collective over every process
//
// Rendezvous: every rank listens on a TCP port the kernel picks (all
// interfaces), writes "address port host pid" under PREFIX/rank/R in the
// store and reads every other rank's entry. Then every rank connects to each
// rank below it: one TCP connection per pair of ranks.
//
// Topology: a node is a host (ranks whose hostname is the same share POSIX
// shared memory under /dev/shm). Ranks are renumbered node-major (hosts in
// the order of their lowest launcher rank, then by launcher rank) and every
// host must hold the same number of ranks. ranks_per_node splits each host
// into emulated nodes, so the two-hop path runs over TCP on one machine.
//
// Peer memory: one POSIX shared-memory object per rank and region, mapped by
// the ranks of its node (unlinked once all have mapped it). Messages and
// collectives: frames on the TCP connections, moved by one I/O thread per
// process; collectives send every rank's part to every rank (with its
// descriptor, validated on every rank) and reduce in rank order, so every
// rank and every backend get the same bits. A peer's failure reaches the
// others as a notice; a process that dies closes its connections, which the
// others notice at once (Aborted naming it); every wait has its deadline.
// Groups (split) share the connections, on a channel of their own; any
// failure fails every transport of the process.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "epx/comm/transport.h"
#include "epx/core/clock.h"
#include "epx/core/status.h"

namespace epx {

// Where the ranks meet: a string map that every rank can reach.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual Status set(const std::string& key, const std::string& value) = 0;
  // The value of `key`, once some rank has set it (DeadlineExceeded naming
  // the key when none does in time).
  virtual Result<std::string> get(const std::string& key, const Deadline& deadline) = 0;
};

// A store for ranks that are threads of one process.
class MemoryStore final : public KeyValueStore {
 public:
  Status set(const std::string& key, const std::string& value) override;
  Result<std::string> get(const std::string& key, const Deadline& deadline) override;

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
};

struct SocketOptions {
  int rank = -1;        // the launcher's rank (RANK), 0 <= rank < world_size
  int world_size = 0;   // WORLD_SIZE
  // The IPv4 address (or name) the other ranks connect to, e.g. the address
  // of the interface that reaches MASTER_ADDR. Required.
  std::string address;
  // 0: nodes are the hosts; otherwise every host's ranks are split into
  // emulated nodes of this many ranks (it must divide the ranks per host).
  int ranks_per_node = 0;
  // Store keys start with this; a second transport of the same processes
  // needs another prefix.
  std::string prefix = "epx";
  // Bound on the rendezvous (every rank's entry, every connection).
  std::chrono::milliseconds setup_timeout{60000};
  // How long closing the transport waits for every peer to close too (so
  // nothing it sent is lost) before it closes its connections anyway.
  std::chrono::milliseconds close_timeout{10000};
};

// Collective over every process: a transport for this process's rank (its
// rank is the node-major renumbering of options.rank).
Result<std::unique_ptr<Transport>> connect_sockets(KeyValueStore& store, const SocketOptions& options);

}  // namespace epx
