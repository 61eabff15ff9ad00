// The MPI backend's per-process state and transport (private).
//
// Communicators, all made by connect() from MPI_COMM_WORLD:
//  - comm: every rank, renumbered node-major; carries send_async/recv;
//  - coll: a duplicate of comm for the collectives, so they never match a
//    message of the exchange;
//  - ctrl: a duplicate for abort notices (tag kNoticeTag), polled by waits;
//  - node: the ranks of this (emulated) node; the shared windows live here.
// Every communicator returns errors (MPI_ERRORS_RETURN) instead of aborting.
//
// Waiting: every MPI request is polled with MPI_Test until it completes,
// the deadline passes, a notice arrives or a process of this host is found
// dead (kill(pid, 0) and /proc/PID/stat, every liveness_interval). Polling
// spins briefly, then yields, then sleeps 50 us between tests, so that
// oversubscribed ranks (8 processes on 2 cores) leave the cores to the ranks
// that have work.
//
// Arrivals: every rank writes the number of each collective round it enters,
// and the time of its latest poll, into its words of a small shared window
// of its host; a rank whose deadline passes reads its host's words and names
// the ranks that never arrived, telling them from ranks still polling an
// earlier round (held up by the same rank; libnbc's collectives complete on
// some ranks before others) and from stopped processes (state T). Ranks of
// other hosts: the notice from a rank of their host names them.
//
// Failures poison the state as in-process: the first failure is kept, later
// calls return Aborted naming it, and the failure is sent to every other
// rank as a notice (status code + message), so their waits end at once.
//
// Groups (split): a group is an MpiState of its own, made once every rank of
// the parent has arrived (the split's all-gather), so its blocking set-up
// cannot wait for an absent rank: MPI_Comm_split of the parent's `comm` by
// color (key: the group rank, so MPI ranks are group ranks), duplicates for
// `coll` and `ctrl`, a `node` communicator per group node (its shared
// windows), its own arrival words (a new window on each host, never freed),
// and the parent's pids, hosts and liveness for its ranks. Failures spread
// through the process's tree of states as in-process: a state that fails
// fails its parent ("in group ...") and its children, and each sends its
// notices, so every rank of the world hears of it on the world's `ctrl`;
// a waiting rank checks the `ctrl` of its state and of every ancestor, and a
// notice found poisons its whole tree here without sending more. Errors name
// a group's ranks by world rank: "rank 5 (rank 1 of the group)".
// After a failure no MPI object is freed and no request is cancelled whose
// cancellation did not complete: the state is leaked on purpose (MPI may
// still hold pointers into it: scratch, slots, notices). MpiSession then
// finalizes only if every process reaches its own end within 3 s.
//
// Collectives: each exchanges every rank's CollectiveDescriptor first, in a
// slot (collective_slot_bytes) that also carries the data when it fits (MPI_Iallgather; this
// round is also the barrier), and validates it as in-process; larger data
// then moves through MPI_Iallgather / MPI_Ialltoall into scratch owned by
// the state. All-reduce is an all-gather followed by the rank-order
// reduction of comm/collective.h: the same bits as the in-process backend.
//
// Peer memory: MPI_Win_allocate_shared on `node`, each rank's size padded to
// 64 bytes plus a spare line (a one-sided-write bug of some MPI builds
// depends on the padding; the region starts at the first 64-byte boundary),
// zero-filled, then a node barrier. Allocation and free are blocking
// collectives of the node, so each is entered only after a gate round
// (wait_gate) that every rank of the node finishes once any has; a
// PeerMemory's free gathers (window number, failed) from the node's ranks
// and frees only when all free the same window (the n-th made on each) and
// none has failed; otherwise every rank leaks it (and a mismatch fails the
// transport) rather than pair frees of different windows.
// Windows are held in a passive epoch (MPI_Win_lock_all) and every barrier
// runs MPI_Win_sync on each live window before and after, which is what the
// MPI memory model asks for direct loads and stores to be seen by peers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <mpi.h>

#include "comm/collective.h"
#include "comm/group.h"
#include "epx/comm/mpi.h"
#include "epx/comm/transport.h"

namespace epx {
namespace detail {

inline constexpr int kNoticeTag = 1;

// What every rank contributes to the first round of every collective: a
// slot holding its descriptor, then its data when that fits (every valid
// call of a collective passes the same size on every rank, so all ranks
// agree on whether it fits): small collectives take one round. The slot
// shrinks as ranks grow (4 KiB up to 16 ranks, 64 KiB / R above, at least
// 512 bytes), so a barrier moves at most 64 KiB per rank; every rank
// computes the same size from R.
std::size_t collective_slot_bytes(int num_ranks);

struct MpiState {
  MpiState(const Topology& topology, int rank, MpiOptions options)
      : topology(topology), rank(rank), options(options) {}
  ~MpiState();

  // Polls `request` until it completes (OK; *status, when given, filled) or
  // fails: an MPI error, the deadline, a notice, a dead process on this host.
  // `what` names the call for messages; `peer` (or -1) is the rank it waits
  // for. A receive is cancelled on failure (`cancel`).
  // `round` (or 0): the collective round waited for (enter_round), whose
  // missing ranks a DeadlineExceeded names (arrival_report).
  Status wait(MPI_Request* request, const Deadline& deadline, const std::function<std::string()>& what, int peer,
              MPI_Status* status = nullptr, bool cancel = false, uint64_t round = 0);
  // Numbers the next round of a collective over every rank (the descriptor
  // round of each collective, and its data round when the data does not fit
  // the slot: every rank makes the same rounds) and records in this rank's
  // arrival word that it entered it.
  uint64_t enter_round();
  // Records in this rank's arrival words that it is polling a wait now.
  void beat();
  // "rank 2 did not arrive (ranks 0, 1, 3 waited)" for round `round`, from
  // the arrival words of this host's ranks.
  [[nodiscard]] std::string arrival_report(uint64_t round) const;
  // The other ranks of this host whose process is stopped (state T), and
  // "; rank 2 stopped (...)" naming them ("" when none).
  [[nodiscard]] std::vector<int> stopped_host_ranks() const;
  [[nodiscard]] std::string stopped_note(const std::vector<int>& stopped) const;
  // Polls a request of a "gate" round: the polled round that lets a blocking
  // MPI call (window allocation or free) start only once every rank of the
  // node has arrived. Unlike wait() it ignores notices and an earlier
  // failure: once a rank sees the gate complete it goes into the blocking
  // call, so every other rank must finish the gate too. It gives up only when
  // a process of this host is gone or `setup_timeout` passes.
  Status wait_gate(MPI_Request* request, std::string_view what);
  // Records the first failure and sends it to every other rank, then fails
  // the parent and the children (each sending its own notices).
  void fail(const Status& reason) { fail_tree(reason, /*notify=*/true); }
  // The same; `notify` false for a failure heard as a notice (the failed rank
  // sent notices on every state of its tree: none need be sent again).
  void fail_tree(const Status& reason, bool notify);
  // Sends `failure` to every other rank of this state as a notice.
  void send_notices(const Status& failure);
  // Receives one notice on this state's ctrl: true and *code, *message set.
  bool take_notice(int32_t* code, std::string* message);
  // "rank 5 (rank 1 of the group)" in a group, "rank 5" in a world.
  [[nodiscard]] std::string rank_name(int r) const { return detail::rank_name(r, world_ranks); }
  [[nodiscard]] bool failed() const { return poisoned.load(std::memory_order_acquire); }
  // Aborted: `what` on this rank could not run because of the first failure.
  [[nodiscard]] Status aborted_now(std::string_view what) const;
  // Checks for notices and dead processes of this host; non-OK (and the
  // state poisoned) when the world failed. `waited_ms` and `what` go into
  // the message.
  Status check_world(std::string_view what, int64_t waited_ms, bool force_liveness);
  // The liveness part alone (at most every liveness_interval unless `force`):
  // Aborted naming the first process of this host found gone, and the state failed.
  Status check_host_peers(std::string_view what, int64_t waited_ms, bool force);
  // MPI_Win_sync on every live window.
  void sync_windows();
  void add_window(MPI_Win win);
  void remove_window(MPI_Win win);

  const Topology topology;
  const int rank;
  const MpiOptions options;
  // Groups: set once, before the state is shared. Empty / null / "the world" in a world.
  std::vector<int> world_ranks;     // by rank: its rank in the root world
  std::shared_ptr<MpiState> parent;
  std::string label = "the world";
  std::vector<std::weak_ptr<MpiState>> children;  // guarded by mutex
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm coll = MPI_COMM_NULL;
  MPI_Comm ctrl = MPI_COMM_NULL;
  MPI_Comm node = MPI_COMM_NULL;
  int tag_ub = 32767;
  std::vector<int> host_ranks;     // the other ranks of this host whose pid is visible here (their deaths are seen)
  std::vector<int64_t> pids;       // by rank
  std::vector<uint64_t> start_ticks;  // by rank: /proc/PID/stat start time (same host; 0 unknown), against pid reuse
  std::vector<std::string> hosts;  // by rank
  // By rank: two words in a shared window of this host (null for ranks of
  // other hosts): the last collective round the rank entered, and when it
  // last polled a wait (ms on the host's monotonic clock). The window is
  // never freed: freeing blocks until every rank of the host frees it.
  std::vector<uint64_t*> arrivals;  // read and written through std::atomic_ref

  mutable std::mutex mutex;
  Status failure;                     // guarded by mutex
  std::atomic<bool> poisoned{false};  // failure is non-OK
  Clock::time_point last_liveness = Clock::now();
  // Notices this rank sent (kept until the state goes; it never goes after a failure).
  std::vector<std::string> notice_buffers;
  std::vector<MPI_Request> notice_requests;

  std::mutex windows_mutex;
  std::vector<MPI_Win> windows;

  uint64_t next_seq = 1;
  uint64_t next_round = 1;                        // enter_round
  std::size_t slot_bytes = 0;                     // collective_slot_bytes(R)
  std::vector<std::byte> send_slot;               // this rank's slot (outlives a failed wait)
  std::vector<std::byte> slots;                   // every rank's slot: the first round
  std::vector<CollectiveDescriptor> descriptors;  // copied out of the slots for validation
  uint64_t windows_made = 0;                      // PeerMemory objects made, the id of the next
  std::vector<std::byte> scratch;                 // collective data too large for a slot

  AtomicCounters counters;
};

}  // namespace detail

// The transport of this process's rank in a world or a group. Used by one
// thread at a time; a group may be used by another thread than its parent.
class MpiTransport final : public Transport {
 public:
  explicit MpiTransport(std::shared_ptr<detail::MpiState> state) : state_(std::move(state)) {}
  ~MpiTransport() override;

  [[nodiscard]] int rank() const override { return state_->rank; }
  [[nodiscard]] const Topology& topology() const override { return state_->topology; }
  [[nodiscard]] std::string_view backend_name() const override { return "mpi"; }

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
  void abort(const Status& reason) override { state_->fail(reason); }
  Result<std::unique_ptr<Transport>> split(int color, int key, const Deadline& deadline) override;
  [[nodiscard]] int world_rank(int rank) const override {
    return state_->world_ranks.empty() ? rank : state_->world_ranks[rank];
  }
  [[nodiscard]] TransportCounters counters() const override { return state_->counters.snapshot(); }
  void reset_counters() override { state_->counters.reset(); }

 private:
  // Exchanges and validates every rank's descriptor of a collective, with
  // `data` inline when it fits a slot (the first round of every collective,
  // and all of a barrier). On OK the collective's number is *seq and, when
  // *inlined, rank r's data is at state_->slots + r * slot_bytes + sizeof(CollectiveDescriptor).
  Status agree(detail::CollectiveDescriptor mine, std::span<const std::byte> data, const Deadline& deadline,
               uint64_t* seq, bool* inlined);

  std::shared_ptr<detail::MpiState> state_;
};

}  // namespace epx
