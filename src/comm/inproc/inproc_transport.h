// The in-process backend's shared state and per-rank transport (private).
//
// One InprocState per world, shared by the world, its transports and their
// send requests. One mutex guards it; every rank waits on its
// own condition variable, which is notified when something that rank may be
// waiting for changes (a collective it joined completed, a message arrived
// for it, a message it sent was taken, the world was aborted).
//
// Collectives: rank r numbers its collectives 1, 2, ... and collective n uses
// slot n % 2. A rank copies its contribution into its own entry of the slot,
// then arrives under the lock; once all ranks have arrived, each reads every
// entry outside the lock. Rank r can only start collective n + 2 (and so
// overwrite its entry of slot n % 2) after collective n + 1 completed, that is
// after every rank finished reading collective n: two slots are enough.
//
// Messages are rendezvous: send_async queues a descriptor of the caller's
// buffer in the (source, destination, tag) FIFO and recv copies from it
// straight into the receiver's buffer, outside the lock; the sender's wait()
// does not return while that copy runs. A send that fails (deadline, abort)
// takes its descriptor out of the FIFO first. A Request dropped without
// wait() leaves its descriptor queued: the buffer must outlive the receive.
//
// Failures: the first one (abort(), a rank's failure under run(), or a
// deadline that passed) poisons the world. Calls made afterwards return
// Aborted naming it. Calls blocked at that moment return Aborted too, except
// when the first failure was a deadline: then they were stalled by the same
// absent peer and return DeadlineExceeded (so every rank waiting for a rank
// that never comes reports a timeout, whichever deadline passed first). A
// rank that saw a failure never touches the collective slots again.
//
// Groups: split() makes a new InprocState for each group, with its own
// topology, slots, mailboxes and failure, whose `parent` is the state it was
// split from; the parent keeps weak_ptrs to its children. The first member to
// arrive creates the group's state and parks it in the parent's
// `forming_groups` under (split number, color); the others pick it up there.
// A state's failure spreads to its parent (named "in group ...") and to its
// children, and from them on, so the whole tree is poisoned and every blocked
// call in it wakes: no rank waits on a group, or on the world, that can
// never complete. The DeadlineExceeded rule above holds across the tree (the
// code of the first failure travels with it). Errors name a group's ranks by
// world rank: "rank 5 (rank 1 of the group)". A group and its parent share no
// lock, so each may be used from its own thread.
//
// Peer memory: each rank's region is an AlignedBuffer held by shared_ptr, by
// the PeerMemory of every rank of its node (and by its owner's slot entry
// until the owner's next collective on that slot or the world's end). It is
// freed when the last holder goes, so it outlives the world if a PeerMemory
// does.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <tuple>
#include <vector>

#include "comm/collective.h"
#include "comm/group.h"
#include "epx/comm/inproc.h"
#include "epx/comm/transport.h"
#include "epx/core/buffer.h"

namespace epx {
namespace detail {

// What one rank put into one collective.
struct CollectiveEntry {
  uint64_t seq = 0;  // the collective this entry belongs to (0: none yet)
  CollectiveDescriptor desc;
  std::vector<std::byte> staged;           // a copy of `in` (grows, never shrinks)
  std::shared_ptr<AlignedBuffer> region;   // map_peer_memory: this rank's region
};

struct CollectiveSlot {
  uint64_t seq = 0;      // the collective being gathered in this slot
  int num_arrived = 0;   // ranks that arrived at `seq`
  std::vector<CollectiveEntry> entries;  // one per rank
};

// A message waiting in a FIFO or being copied by its receiver.
struct SendOp {
  enum class Stage : uint8_t { kQueued, kCopying, kDone };
  const std::byte* data = nullptr;
  std::size_t size = 0;
  int src = 0;
  int dst = 0;
  int tag = 0;
  Stage stage = Stage::kQueued;
  Status status;  // valid when kDone
};

// Per-rank state. `next_seq` is touched only by the rank's own thread;
// counters may be read from any thread.
struct RankState {
  std::condition_variable cv;
  uint64_t next_seq = 1;
  uint64_t next_split = 1;
  AtomicCounters counters;
};

struct InprocState;

// A group's state between its first member's arrival and its last's.
struct FormingGroup {
  std::shared_ptr<InprocState> state;
  int num_joined = 0;
};

struct InprocState : std::enable_shared_from_this<InprocState> {
  // A world: `world_ranks` empty, no parent. A group: the world rank of each
  // of its ranks, the state it was split from, and its name for errors.
  explicit InprocState(const Topology& topology, std::vector<int> world_ranks = {},
                       std::shared_ptr<InprocState> parent = nullptr, std::string label = "the world");

  // Records the first failure (later ones are ignored), wakes every rank and
  // spreads it to the parent and the children.
  void abort(const Status& reason);
  // Records the first failure with the mutex held; true when it is the first.
  // The caller unlocks, then calls spread_failure.
  bool poison_locked(const Status& reason);
  // Wakes every rank and poisons the parent and the children (call without the mutex).
  void spread_failure(const Status& reason);
  void notify_all_ranks();
  // The group state of (split number, color), created by its first member,
  // or Aborted when this state failed.
  Result<std::shared_ptr<InprocState>> join_group(uint64_t split, const GroupPlan& plan, int rank);
  // "rank 5 (rank 1 of the group)" in a group, "rank 5" in a world.
  [[nodiscard]] std::string rank_name(int rank) const { return detail::rank_name(rank, world_ranks); }
  // Aborted: `what` on `rank` could not complete because of the first failure.
  [[nodiscard]] Status aborted_locked(std::string_view what, int rank) const;
  // For a call that was already blocked when the world failed: when the
  // first failure is a deadline that passed, this call was stalled by the
  // same missing peer, so it is DeadlineExceeded too (every rank waiting for
  // an absent rank reports DeadlineExceeded, whichever deadline passed
  // first); otherwise Aborted. Calls made after the failure get Aborted.
  [[nodiscard]] Status interrupted_locked(std::string_view what, int rank, int64_t waited_ms,
                                          std::string_view waiting_for) const;
  [[nodiscard]] TransportCounters counters_of(int rank) const { return ranks[rank].counters.snapshot(); }

  using MailboxKey = std::tuple<int, int, int>;  // (src, dst, tag)

  const Topology topology;
  const std::vector<int> world_ranks;             // empty in a world
  const std::shared_ptr<InprocState> parent;      // null in a world
  const std::string label;
  std::mutex mutex;
  Status failure;                        // guarded by mutex; non-OK once poisoned
  std::atomic<bool> poisoned{false};     // failure is non-OK (for lock-free checks)
  std::array<CollectiveSlot, 2> slots;   // guarded as explained at the top
  std::map<MailboxKey, std::deque<std::shared_ptr<SendOp>>> mailboxes;  // guarded by mutex
  std::unique_ptr<RankState[]> ranks;
  std::vector<std::weak_ptr<InprocState>> children;                     // guarded by mutex
  std::map<std::pair<uint64_t, int>, FormingGroup> forming_groups;      // guarded by mutex
};

}  // namespace detail

// The transport of one rank of an InprocWorld or of a group split from it.
// Used by one thread at a time; a group may be used by another thread than
// its parent.
class InprocTransport final : public Transport {
 public:
  InprocTransport(std::shared_ptr<detail::InprocState> state, int rank);

  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] const Topology& topology() const override { return state_->topology; }
  [[nodiscard]] std::string_view backend_name() const override { return "inproc"; }

  Result<std::unique_ptr<PeerMemory>> map_peer_memory(std::size_t bytes, const Deadline& deadline) override;
  Result<Request> send_async(int peer, int tag, std::span<const std::byte> data) override;
  Result<std::size_t> recv(int peer, int tag, std::span<std::byte> out, const Deadline& deadline) override;
  Status barrier(const Deadline& deadline) override;
  Status all_gather_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                          const Deadline& deadline) override;
  Status all_to_all_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                          const Deadline& deadline) override;
  Status all_reduce_raw(void* data, std::size_t count, DType dtype, ReduceOp op,
                        const Deadline& deadline) override;
  void abort(const Status& reason) override { state_->abort(reason); }
  Result<std::unique_ptr<Transport>> split(int color, int key, const Deadline& deadline) override;
  [[nodiscard]] int world_rank(int rank) const override {
    return state_->world_ranks.empty() ? rank : state_->world_ranks[rank];
  }
  [[nodiscard]] TransportCounters counters() const override { return state_->counters_of(rank_); }
  void reset_counters() override { state_->ranks[rank_].counters.reset(); }

 private:
  // This rank's part of one collective.
  struct Contribution {
    detail::CollectiveOp op = detail::CollectiveOp::kBarrier;
    std::span<const std::byte> stage;  // copied into this rank's entry
    std::size_t in_bytes = 0;
    std::size_t out_bytes = 0;
    std::size_t count = 0;
    DType dtype = DType::kF32;
    ReduceOp reduce_op = ReduceOp::kSum;
    std::shared_ptr<AlignedBuffer> region;
  };

  // Publishes `mine` as this rank's entry of its next collective and waits
  // until every rank has arrived. On OK, *slot holds every rank's entry,
  // unchanged until this rank starts another collective; the entries agree
  // on op and sizes (InvalidArgument on every rank otherwise).
  Status rendezvous(const Contribution& mine, const Deadline& deadline, const detail::CollectiveSlot** slot,
                    uint64_t* seq);
  // Counts `in` and publishes it for a byte collective (all-gather, all-to-all).
  Status stage_bytes(detail::CollectiveOp op, std::span<const std::byte> in, std::size_t out_bytes,
                     const Deadline& deadline, const detail::CollectiveSlot** slot);

  std::shared_ptr<detail::InprocState> state_;
  int rank_;
};

}  // namespace epx
