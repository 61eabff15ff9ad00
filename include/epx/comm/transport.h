// Transport: what the exchange needs from the machine, and nothing more.
//
// Three kinds of service, each with a deadline so nothing waits forever:
//  - peer-mapped memory: a region on every rank that the ranks of one node
//    can read and write directly (threads: plain pointers; MPI: shared
//    windows; CUDA: IPC handles);
//  - messages between any two ranks (used between nodes), sent
//    asynchronously and received into a caller's buffer;
//  - small collectives: barrier, all-gather, all-to-all, all-reduce.
//
// Collectives must be called by every rank in the same order. After a
// failure (a peer aborted, a deadline passed) the transport is poisoned:
// every later blocking call on every rank returns Aborted, naming the first
// failure. Backends: `inproc` (ranks are threads; see inproc.h), later `mpi`
// and `cuda`.
//
//   auto deadline = epx::Deadline::after(std::chrono::seconds(10));
//   std::vector<int64_t> counts(transport.num_ranks());
//   EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const int64_t>(&mine, 1),
//                                            std::span<int64_t>(counts), deadline));
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "epx/comm/topology.h"
#include "epx/core/clock.h"
#include "epx/core/dtype.h"
#include "epx/core/status.h"

namespace epx {

// Byte counts of what this rank sent. Writes into peer-mapped memory are the
// exchange's own copies and are counted by it, not here.
struct TransportCounters {
  uint64_t inter_node_bytes = 0;     // message bytes sent to ranks of other nodes
  uint64_t inter_node_messages = 0;
  uint64_t intra_node_bytes = 0;     // message bytes sent to ranks of this node (and to itself)
  uint64_t intra_node_messages = 0;
  uint64_t collective_calls = 0;     // barrier, all-gather, all-to-all, all-reduce
  uint64_t collective_bytes = 0;     // bytes this rank contributed to collectives

  TransportCounters& operator+=(const TransportCounters& other);
};

// A region of the same size on every rank, mapped into every rank of a node.
class PeerMemory {
 public:
  virtual ~PeerMemory() = default;
  [[nodiscard]] virtual std::size_t size() const = 0;
  // This rank's region (64-byte aligned, zero-filled at creation).
  [[nodiscard]] virtual std::byte* local() const = 0;
  // The region of `rank`, when it shares this rank's node; nullptr otherwise.
  [[nodiscard]] virtual std::byte* peer(int rank) const = 0;
};

// Completion of an asynchronous send.
class Request {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual Status wait(const Deadline& deadline) = 0;
  };
  Request() = default;
  explicit Request(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  // Returns when the send buffer may be reused (OK), or why it never will.
  Status wait(const Deadline& deadline) { return impl_ ? impl_->wait(deadline) : Status::ok(); }

 private:
  std::shared_ptr<Impl> impl_;
};

enum class ReduceOp : uint8_t { kSum, kMax, kMin };

// How the calling thread waits inside transport calls that poll (MPI).
// kEager (the default) spins, then yields for a while, then sleeps: the
// lowest latency for a thread with nothing else to do. kBackground sleeps
// almost at once: for threads that run beside compute on the same cores
// (the exchange's progress threads), so their waits leave the cores to it.
enum class WaitStyle : uint8_t { kEager, kBackground };
void set_thread_wait_style(WaitStyle style);
[[nodiscard]] WaitStyle thread_wait_style();

class Transport {
 public:
  virtual ~Transport() = default;

  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual const Topology& topology() const = 0;
  [[nodiscard]] virtual std::string_view backend_name() const = 0;
  [[nodiscard]] int num_ranks() const { return topology().num_ranks(); }
  [[nodiscard]] int node() const { return topology().node_of(rank()); }
  [[nodiscard]] int local_rank() const { return topology().local_rank_of(rank()); }

  // Collective: a zero-filled region of `bytes` on every rank, mapped into
  // the ranks of each node. Every rank must pass the same `bytes`
  // (InvalidArgument otherwise, on every rank). It lives as long as the
  // returned object and the transport both do. The ranks of a node must
  // destroy their PeerMemory objects in the same order (MPI frees a shared
  // window collectively; a mismatch is detected, leaks both and fails the
  // transport).
  virtual Result<std::unique_ptr<PeerMemory>> map_peer_memory(std::size_t bytes, const Deadline& deadline) = 0;

  // Sends `data` to `peer`. Messages between one pair with one tag arrive in
  // order. `data` must stay valid until the request's wait returns OK.
  virtual Result<Request> send_async(int peer, int tag, std::span<const std::byte> data) = 0;
  // Receives the next message from `peer` with `tag` into `out` and returns
  // its size; ResourceExhausted (and the message is dropped) if it is larger.
  // After any other error `out` may still be written (MPI: a receive that
  // had matched and could not be cancelled) until the transport is
  // destroyed: keep it alive, or end the process.
  virtual Result<std::size_t> recv(int peer, int tag, std::span<std::byte> out, const Deadline& deadline) = 0;

  virtual Status barrier(const Deadline& deadline) = 0;
  // `out` gets every rank's `in` (all the same size) in rank order.
  virtual Status all_gather_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                                  const Deadline& deadline) = 0;
  // `in` holds num_ranks equal blocks, block d for rank d; `out` gets block s from rank s.
  virtual Status all_to_all_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                                  const Deadline& deadline) = 0;
  // Element-wise reduction of `count` elements of `dtype` (kF32, kF64, kI32 or
  // kI64), in place, combined in rank order so every rank and every run gets
  // the same bits.
  virtual Status all_reduce_raw(void* data, std::size_t count, DType dtype, ReduceOp op,
                                const Deadline& deadline) = 0;

  // Marks the world failed: blocked and later calls on every rank return
  // Aborted with `reason`.
  virtual void abort(const Status& reason) = 0;

  // Groups inside the world. Collective over every rank of this transport:
  // the ranks passing the same `color` (>= 0) form one group, numbered by
  // (key, rank); each gets a transport of its group, with every service
  // above (peer memory, messages, collectives) over the group's ranks only.
  // A group's ranks must be node-major with the same count on each of their
  // nodes (InvalidArgument naming the group otherwise); its topology has the
  // nodes its ranks live on. A failure on a group fails the transport it was
  // split from and every group split from that, so no rank of the world waits
  // on a group that can never complete; a failure of this transport fails its
  // groups too. The group has its own collectives, message tags, peer memory
  // and counters, and may be used from another thread at the same time as
  // this transport: split(0, rank()) is a duplicate, e.g. for a thread of its
  // own. Errors from a group name its ranks by world rank first ("rank 5
  // (rank 1 of the group)"). The group must be destroyed before this
  // transport. Unimplemented on backends without groups.
  virtual Result<std::unique_ptr<Transport>> split(int color, int key, const Deadline& deadline);
  // The rank of the root world (the transport nothing was split from) that
  // rank `rank` of this transport is; for a world, `rank` itself. Errors
  // name ranks by it.
  [[nodiscard]] virtual int world_rank(int rank) const { return rank; }

  [[nodiscard]] virtual TransportCounters counters() const = 0;
  virtual void reset_counters() = 0;

  // Typed conveniences over the byte collectives.
  template <typename T>
  Status all_gather(std::span<const T> in, std::span<T> out, const Deadline& deadline) {
    return all_gather_bytes(std::as_bytes(in), std::as_writable_bytes(out), deadline);
  }
  template <typename T>
  Status all_to_all(std::span<const T> in, std::span<T> out, const Deadline& deadline) {
    return all_to_all_bytes(std::as_bytes(in), std::as_writable_bytes(out), deadline);
  }
  template <typename T>
  Status all_reduce(std::span<T> data, ReduceOp op, const Deadline& deadline) {
    return all_reduce_raw(data.data(), data.size(), dtype_of<T>(), op, deadline);
  }
  Status send(int peer, int tag, std::span<const std::byte> data, const Deadline& deadline) {
    EPX_ASSIGN_OR_RETURN(Request request, send_async(peer, tag, data));
    return request.wait(deadline);
  }
};

}  // namespace epx
