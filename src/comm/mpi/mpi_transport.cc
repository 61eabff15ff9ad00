#include "comm/mpi/mpi_transport.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <thread>

#include <fmt/format.h>

namespace epx {
namespace {

using detail::CollectiveDescriptor;
using detail::CollectiveOp;
using detail::MpiState;

// Set by the first failure of any transport of this process: MpiSession then
// waits only 3 s for the other processes before it finalizes (or exits without).
std::atomic<bool> g_failed{false};

constexpr std::size_t kWindowAlignment = 64;

int64_t elapsed_ms(Clock::time_point start) {
  return std::chrono::duration_cast<Milliseconds>(Clock::now() - start).count();
}

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<std::size_t>(length));
}

int error_class(int code) {
  int cls = code;
  MPI_Error_class(code, &cls);
  return cls;
}

// What /proc/PID/stat says of a process: its state letter and its start
// time (field 22, clock ticks since boot; with the pid it names one process
// even if the pid is reused). False when unreadable (gone, or no /proc).
bool read_proc_stat(int64_t pid, char* state, uint64_t* ticks) {
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (!std::getline(stat, line)) return false;
  const std::size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  *state = line[paren + 2];  // field 3
  std::size_t at = paren + 2;
  for (int field = 3; field < 22 && at < line.size(); ++field) {
    at = line.find(' ', at);
    if (at == std::string::npos) return false;
    ++at;
  }
  *ticks = std::strtoull(line.c_str() + at, nullptr, 10);
  return true;
}

// Process `pid`'s start time, or 0 when unreadable.
uint64_t start_ticks(int64_t pid) {
  char state = 0;
  uint64_t ticks = 0;
  return read_proc_stat(pid, &state, &ticks) ? ticks : 0;
}

// True when process `pid` of this host, started at `ticks` (0: unknown), has
// exited, is a zombie, or the pid now names another process.
bool process_gone(int64_t pid, uint64_t ticks) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  char state = 0;
  uint64_t now_ticks = 0;
  if (!read_proc_stat(pid, &state, &now_ticks)) return false;  // no /proc: trust kill()
  return state == 'Z' || state == 'X' || (ticks != 0 && now_ticks != ticks);
}

// Spins, then yields, then sleeps: the caller waits for a peer that may need
// this core (ranks are often more than cores on a test machine).
void back_off(uint64_t polls, Clock::time_point start) {
  if (thread_wait_style() == WaitStyle::kBackground) {
    // 20 us doubling every 4 polls up to 500 us: a long transfer wakes the
    // thread a few thousand times a second, not fifty thousand.
    if (polls < 16) return;
    const int64_t us = std::min<int64_t>(500, int64_t{20} << std::min<uint64_t>(5, (polls - 16) / 4));
    std::this_thread::sleep_for(std::chrono::microseconds(us));
    return;
  }
  if (polls < 256) return;
  if (Clock::now() - start < std::chrono::milliseconds(2)) {
    sched_yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(50));
}

Status mpi_call(int rc, std::string_view what) {
  if (rc == MPI_SUCCESS) return Status::ok();
  return internal_error("{} failed: {}", what, mpi_error_string(rc));
}

}  // namespace
namespace detail {
struct MpiState;
}
namespace {

// An MPI error inside a collective or a peer-memory step: the other ranks
// are in it too, so the transport fails and they hear of it.
Status fail_on_error(detail::MpiState& state, int rc, std::string_view what);

}  // namespace

namespace detail {

std::size_t collective_slot_bytes(int num_ranks) {
  if (num_ranks <= 16) return 4096;
  const std::size_t share = 65536 / static_cast<std::size_t>(num_ranks) / 64 * 64;
  return std::max<std::size_t>(512, share);
}

MpiState::~MpiState() {
  // Reached when the transport and every PeerMemory are gone without a
  // failure before the transport went (a failed transport leaks its state).
  for (MPI_Request& r : notice_requests)
    if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
  for (MPI_Comm* c : {&node, &ctrl, &coll, &comm})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

Status MpiState::aborted_now(std::string_view what) const {
  std::lock_guard lock(mutex);
  const std::string cause = failure.code() == StatusCode::kAborted ? failure.message() : failure.to_string();
  return aborted("{} on {} aborted: {}", what, rank_name(rank), cause);
}

void MpiState::fail_tree(const Status& reason, bool notify) {
  const Status first = reason.is_ok() ? internal_error("abort() was called with an OK status") : reason;
  std::vector<std::shared_ptr<MpiState>> relatives;
  {
    std::lock_guard lock(mutex);
    if (!failure.is_ok()) return;  // this state, and so its tree, failed already
    failure = first;
    poisoned.store(true, std::memory_order_release);
    for (const std::weak_ptr<MpiState>& child : children) {
      if (std::shared_ptr<MpiState> alive = child.lock()) relatives.push_back(std::move(alive));
    }
  }
  g_failed.store(true, std::memory_order_release);
  if (notify) send_notices(first);
  if (parent) parent->fail_tree(Status(first.code(), fmt::format("in {}: {}", label, first.message())), notify);
  for (const std::shared_ptr<MpiState>& child : relatives) child->fail_tree(first, notify);
}

void MpiState::send_notices(const Status& first) {
  // Tell every other rank: code (4 bytes) + message. Small, so sent eagerly;
  // the requests are never waited for (a peer may be gone).
  if (ctrl == MPI_COMM_NULL) return;
  const int32_t code = static_cast<int32_t>(first.code());
  std::string notice(sizeof(code), '\0');
  std::memcpy(notice.data(), &code, sizeof(code));
  notice += fmt::format("{}: {}", rank_name(rank), first.message());
  notice_buffers.push_back(std::move(notice));
  const std::string& buffer = notice_buffers.back();
  for (int r = 0; r < topology.num_ranks(); ++r) {
    if (r == rank) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(buffer.data(), static_cast<int>(buffer.size()), MPI_BYTE, r, kNoticeTag, ctrl, &request) ==
        MPI_SUCCESS)
      notice_requests.push_back(request);
  }
  // Give the notices a moment to leave before the caller exits.
  for (int i = 0; i < 20; ++i) {
    int all_done = 1;
    for (MPI_Request& r : notice_requests) {
      int done = 1;
      if (r != MPI_REQUEST_NULL) MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      all_done = all_done && done;
    }
    if (all_done) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool MpiState::take_notice(int32_t* code, std::string* message) {
  // Matched probe: a notice is received by the thread that found it.
  int flag = 0;
  MPI_Status status;
  MPI_Message probed = MPI_MESSAGE_NULL;
  if (ctrl == MPI_COMM_NULL || MPI_Improbe(MPI_ANY_SOURCE, kNoticeTag, ctrl, &flag, &probed, &status) != MPI_SUCCESS ||
      !flag)
    return false;
  int bytes = 0;
  MPI_Get_count(&status, MPI_BYTE, &bytes);
  std::string notice(static_cast<std::size_t>(std::max(bytes, 0)), '\0');
  MPI_Mrecv(notice.data(), bytes, MPI_BYTE, &probed, MPI_STATUS_IGNORE);
  *code = static_cast<int32_t>(StatusCode::kAborted);
  if (notice.size() >= sizeof(*code)) std::memcpy(code, notice.data(), sizeof(*code));
  *message = notice.size() >= sizeof(*code) ? notice.substr(sizeof(*code)) : notice;
  return true;
}

Status MpiState::check_world(std::string_view what, int64_t waited_ms, bool force_liveness) {
  if (failed()) return aborted_now(what);
  // A notice from a rank that failed, on this state or an ancestor (every
  // failure reaches the root world's ctrl).
  for (MpiState* s = this; s != nullptr; s = s->parent.get()) {
    int32_t code = 0;
    std::string message;
    if (!s->take_notice(&code, &message)) continue;
    // As in-process: a rank stalled by the same absent peer whose deadline
    // passed first reports a timeout too.
    Status cause = static_cast<StatusCode>(code) == StatusCode::kDeadlineExceeded
                       ? deadline_exceeded("{} waited {} ms in {}; the deadline of another rank passed first: {}",
                                           rank_name(rank), waited_ms, what, message)
                       : aborted("{} on {} aborted: {}", what, rank_name(rank), message);
    s->fail_tree(aborted("{}", message), /*notify=*/false);
    return cause;
  }
  return check_host_peers(what, waited_ms, force_liveness);
}

Status MpiState::check_host_peers(std::string_view what, int64_t waited_ms, bool force) {
  const auto now = Clock::now();
  if (!force && now - last_liveness < options.liveness_interval) return Status::ok();
  last_liveness = now;
  for (int r : host_ranks) {
    if (!process_gone(pids[r], start_ticks[r])) continue;
    Status gone = aborted("{} (pid {} on {}) is gone: the process exited or was killed; {} noticed after {} ms in {}",
                          rank_name(r), pids[r], hosts[r], rank_name(rank), waited_ms, what);
    fail(gone);
    return gone;
  }
  return Status::ok();
}

uint64_t MpiState::enter_round() {
  const uint64_t round = next_round++;
  if (!arrivals.empty() && arrivals[rank] != nullptr)
    std::atomic_ref<uint64_t>(arrivals[rank][0]).store(round, std::memory_order_release);
  beat();
  return round;
}

namespace {

// Milliseconds on the host's monotonic clock (the same in every process).
uint64_t host_clock_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<Milliseconds>(Clock::now().time_since_epoch()).count());
}

}  // namespace

void MpiState::beat() {
  if (!arrivals.empty() && arrivals[rank] != nullptr)
    std::atomic_ref<uint64_t>(arrivals[rank][1]).store(host_clock_ms(), std::memory_order_relaxed);
}

std::string MpiState::arrival_report(uint64_t round) const {
  std::vector<detail::Arrival> seen(static_cast<std::size_t>(topology.num_ranks()), detail::Arrival::kUnknown);
  for (int r = 0; r < topology.num_ranks(); ++r) {
    if (r == rank) {
      seen[r] = detail::Arrival::kArrived;
    } else if (r < static_cast<int>(arrivals.size()) && arrivals[r] != nullptr) {
      const uint64_t entered = std::atomic_ref<uint64_t>(arrivals[r][0]).load(std::memory_order_acquire);
      const uint64_t beat_ms = std::atomic_ref<uint64_t>(arrivals[r][1]).load(std::memory_order_relaxed);
      // Polling a wait in an earlier round within the last few liveness
      // intervals: held up by the missing rank too, not missing itself.
      const uint64_t recent_ms = 4 * static_cast<uint64_t>(std::max<int64_t>(options.liveness_interval.count(), 50));
      const bool waiting = beat_ms + recent_ms >= host_clock_ms();
      seen[r] = entered >= round ? detail::Arrival::kArrived
                : waiting        ? detail::Arrival::kBehind
                                 : detail::Arrival::kMissing;
    }
  }
  // A process that entered the round but is stopped (SIGSTOP, a debugger)
  // holds it up as much as one that never came.
  const std::vector<int> stopped = stopped_host_ranks();
  for (int r : stopped) seen[r] = detail::Arrival::kMissing;
  return detail::arrival_report(seen, world_ranks) + stopped_note(stopped);
}

std::vector<int> MpiState::stopped_host_ranks() const {
  std::vector<int> stopped;
  for (int r : host_ranks) {
    char state = 0;
    uint64_t ticks = 0;
    if (read_proc_stat(pids[r], &state, &ticks) && (state == 'T' || state == 't')) stopped.push_back(r);
  }
  return stopped;
}

std::string MpiState::stopped_note(const std::vector<int>& stopped) const {
  if (stopped.empty()) return "";
  return fmt::format("; {} stopped (process state T: SIGSTOP or a debugger)",
                     detail::rank_list(stopped, world_ranks));
}

Status MpiState::wait(MPI_Request* request, const Deadline& deadline, const std::function<std::string()>& what,
                      int peer, MPI_Status* status_out, bool cancel, uint64_t round) {
  const auto start = Clock::now();
  auto give_up = [&](Status status) {
    if (cancel && *request != MPI_REQUEST_NULL) {
      // A receive that never matched can be cancelled; one that did may
      // still be writing, so it is left (and leaked) unless it finishes soon.
      MPI_Cancel(request);
      for (int i = 0; i < 100 && *request != MPI_REQUEST_NULL; ++i) {
        int done = 0;
        MPI_Test(request, &done, MPI_STATUS_IGNORE);
        if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    return status;
  };
  for (uint64_t polls = 0;; ++polls) {
    int done = 0;
    MPI_Status status;
    const int rc = MPI_Test(request, &done, &status);
    if (rc != MPI_SUCCESS) {
      if (error_class(rc) == MPI_ERR_TRUNCATE) {
        if (status_out) *status_out = status;
        return resource_exhausted("{}: {}", what(), mpi_error_string(rc));
      }
      Status error = internal_error("{} on {}: {}", what(), rank_name(rank), mpi_error_string(rc));
      fail(error);
      return give_up(error);
    }
    if (done) {
      if (status_out) *status_out = status;
      return Status::ok();
    }
    if (polls % 64 == 63) {
      const int64_t waited = elapsed_ms(start);
      beat();
      if (Status s = check_world(what(), waited, false); !s.is_ok()) return give_up(s);
      if (deadline.expired()) {
        // Last look: a peer that died explains the wait better than the deadline.
        if (Status s = check_world(what(), waited, true); !s.is_ok()) return give_up(s);
        const std::string me = rank_name(rank);
        Status late = peer >= 0  ? deadline_exceeded("{} waited {} ms in {}; {} did not answer{}", me, waited, what(),
                                                     rank_name(peer), stopped_note(stopped_host_ranks()))
                      : round > 0 ? deadline_exceeded("{} waited {} ms in {}: {}", me, waited, what(),
                                                      arrival_report(round))
                                : deadline_exceeded("{} waited {} ms in {}", me, waited, what());
        fail(late);
        return give_up(late);
      }
    }
    back_off(polls, start);
  }
}

Status MpiState::wait_gate(MPI_Request* request, std::string_view what) {
  const auto start = Clock::now();
  const Deadline deadline = Deadline::after(options.setup_timeout);
  for (uint64_t polls = 0;; ++polls) {
    int done = 0;
    const int rc = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      Status error = internal_error("{} on {}: {}", what, rank_name(rank), mpi_error_string(rc));
      fail(error);
      return error;
    }
    if (done) return Status::ok();
    if (polls % 64 == 63) {
      if (Status s = check_host_peers(what, elapsed_ms(start), false); !s.is_ok()) return s;
      if (deadline.expired()) {
        Status late = deadline_exceeded("{} waited {} ms in {} for every rank of its node (setup_timeout)",
                                        rank_name(rank), elapsed_ms(start), what);
        fail(late);
        return late;
      }
    }
    back_off(polls, start);
  }
}

void MpiState::sync_windows() {
  std::lock_guard lock(windows_mutex);
  for (MPI_Win win : windows) MPI_Win_sync(win);
}

void MpiState::add_window(MPI_Win win) {
  std::lock_guard lock(windows_mutex);
  windows.push_back(win);
}

void MpiState::remove_window(MPI_Win win) {
  std::lock_guard lock(windows_mutex);
  windows.erase(std::remove(windows.begin(), windows.end(), win), windows.end());
}

}  // namespace detail

namespace {

Status fail_on_error(MpiState& state, int rc, std::string_view what) {
  Status status = mpi_call(rc, what);
  if (!status.is_ok()) state.fail(status);
  return status;
}

class MpiPeerMemory final : public PeerMemory {
 public:
  MpiPeerMemory(std::shared_ptr<MpiState> state, MPI_Win win, uint64_t id, std::size_t size,
                std::vector<std::byte*> regions)
      : state_(std::move(state)), win_(win), id_(id), size_(size), regions_(std::move(regions)) {}

  ~MpiPeerMemory() override {
    MpiState& s = *state_;
    s.remove_window(win_);
    // MPI_Win_free is a blocking collective of the node: enter it only once
    // every rank of the node is here, freeing the same window, and none has
    // failed. The gate is posted whatever this rank's state, so that all
    // ranks of the node decide together from the same (id, failed) pairs.
    int node_size = 0;
    MPI_Comm_size(s.node, &node_size);
    // Every rank's (id, failed) pair, then this rank's own (the send buffer):
    // on the heap, as MPI may still use both after an early return.
    const std::size_t n = 2 * static_cast<std::size_t>(node_size);
    auto* all = new std::vector<uint64_t>(n + 2);
    uint64_t* mine = all->data() + n;
    mine[0] = id_;
    mine[1] = s.failed() ? 1 : 0;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Iallgather(mine, 2, MPI_UINT64_T, all->data(), 2, MPI_UINT64_T, s.node, &request) != MPI_SUCCESS) return;
    // A rank that failed before the gate says so in it, so every rank that
    // sees the gate complete leaks the window: it need not wait (a stalled
    // peer would keep it here for setup_timeout).
    if (mine[1] != 0) return;  // `all` stays MPI's
    if (!s.wait_gate(&request, fmt::format("freeing peer memory #{}", id_)).is_ok()) return;  // `all` stays MPI's
    std::unique_ptr<std::vector<uint64_t>> owned(all);
    for (int i = 0; i < node_size; ++i) {
      if ((*all)[2 * i + 1] != 0) return;  // a rank of the node failed: every rank leaks the window
      if ((*all)[2 * i] != id_) {
        s.fail(failed_precondition(
            "rank {} freed peer memory #{} while rank {} of its node freed #{}: every rank must free its PeerMemory "
            "objects in the same order; both windows are leaked",
            s.rank, id_, s.topology.rank_of(s.topology.node_of(s.rank), i), (*all)[2 * i]));
        return;
      }
    }
    MPI_Win_unlock_all(win_);
    MPI_Win_free(&win_);
  }

  [[nodiscard]] std::size_t size() const override { return size_; }
  [[nodiscard]] std::byte* local() const override { return regions_[state_->rank]; }
  [[nodiscard]] std::byte* peer(int rank) const override {
    if (rank < 0 || rank >= static_cast<int>(regions_.size())) return nullptr;
    return regions_[rank];
  }

 private:
  std::shared_ptr<MpiState> state_;
  MPI_Win win_;
  uint64_t id_;  // this rank's n-th PeerMemory
  std::size_t size_;
  std::vector<std::byte*> regions_;  // by rank; null off this node
};

class MpiRequest final : public Request::Impl {
 public:
  MpiRequest(std::shared_ptr<MpiState> state, MPI_Request request, int peer, int tag, std::size_t bytes)
      : state_(std::move(state)), request_(request), peer_(peer), tag_(tag), bytes_(bytes) {}
  ~MpiRequest() override {
    // Dropped without wait(): the send goes on; its buffer must outlive it.
    if (request_ != MPI_REQUEST_NULL && !state_->failed()) MPI_Request_free(&request_);
  }
  Status wait(const Deadline& deadline) override {
    if (request_ == MPI_REQUEST_NULL) return Status::ok();
    return state_->wait(
        &request_, deadline,
        [&] { return fmt::format("send to {} with tag {} ({} bytes)", state_->rank_name(peer_), tag_, bytes_); }, peer_);
  }

 private:
  std::shared_ptr<MpiState> state_;
  MPI_Request request_;
  int peer_;
  int tag_;
  std::size_t bytes_;
};

Status check_message_size(std::size_t bytes, std::string_view what) {
  if (bytes > static_cast<std::size_t>(INT_MAX))
    return invalid_argument("{} of {} bytes: the MPI backend sends at most {} bytes per message", what, bytes, INT_MAX);
  return Status::ok();
}

}  // namespace

MpiTransport::~MpiTransport() {
  if (state_->failed()) {
    // MPI may still hold pointers into the state (pending collectives,
    // receives that could not be cancelled): keep it forever.
    new std::shared_ptr<MpiState>(std::move(state_));
  }
}

Status MpiTransport::agree(CollectiveDescriptor mine, std::span<const std::byte> data, const Deadline& deadline,
                           uint64_t* seq_out, bool* inlined) {
  MpiState& s = *state_;
  const uint64_t seq = s.next_seq++;
  mine.seq = seq;
  auto what = [&] { return fmt::format("{} #{}", detail::collective_op_name(mine.op), seq); };
  // A failure already heard of, or a notice waiting (a rank that resumes
  // after a stall hears of the failure it caused before it joins anything).
  EPX_RETURN_IF_ERROR(s.check_world(what(), 0, false));
  const std::size_t R = static_cast<std::size_t>(num_ranks());
  const std::size_t slot = s.slot_bytes;
  const std::size_t capacity = slot - sizeof(CollectiveDescriptor);
  // The send slot lives in the state, which outlives a failed wait (MPI may
  // still read it then).
  s.send_slot.assign(slot, std::byte{0});
  s.slots.resize(R * slot);
  s.descriptors.resize(R);
  std::memcpy(s.send_slot.data(), &mine, sizeof(mine));
  const bool fits = data.size() <= capacity;
  if (fits && !data.empty()) std::memcpy(s.send_slot.data() + sizeof(mine), data.data(), data.size());
  // The whole slot travels, a fixed count, so ranks that disagree about the
  // sizes still make matching MPI calls; validation then fails on every rank.
  s.sync_windows();
  MPI_Request request = MPI_REQUEST_NULL;
  const uint64_t round = s.enter_round();
  EPX_RETURN_IF_ERROR(fail_on_error(s,
                                    MPI_Iallgather(s.send_slot.data(), static_cast<int>(slot), MPI_BYTE, s.slots.data(),
                                                   static_cast<int>(slot), MPI_BYTE, s.coll, &request),
                                    what()));
  EPX_RETURN_IF_ERROR(s.wait(&request, deadline, what, -1, nullptr, false, round));
  s.sync_windows();
  for (std::size_t r = 0; r < R; ++r) std::memcpy(&s.descriptors[r], s.slots.data() + r * slot, sizeof(mine));
  *seq_out = seq;
  *inlined = fits;
  return detail::validate_collective(s.descriptors, seq);
}

namespace {

// Rank r's inline data in the first round's slots.
const std::byte* slot_data(const MpiState& s, int r) {
  return s.slots.data() + static_cast<std::size_t>(r) * s.slot_bytes + sizeof(CollectiveDescriptor);
}

}  // namespace

Status MpiTransport::barrier(const Deadline& deadline) {
  state_->counters.count_collective(0);
  CollectiveDescriptor mine;
  mine.op = CollectiveOp::kBarrier;
  uint64_t seq = 0;
  bool inlined = false;
  return agree(mine, {}, deadline, &seq, &inlined);
}

Status MpiTransport::all_gather_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                                      const Deadline& deadline) {
  MpiState& s = *state_;
  s.counters.count_collective(in.size());
  CollectiveDescriptor mine;
  mine.op = CollectiveOp::kAllGather;
  mine.in_bytes = in.size();
  mine.out_bytes = out.size();
  uint64_t seq = 0;
  bool inlined = false;
  EPX_RETURN_IF_ERROR(agree(mine, in, deadline, &seq, &inlined));
  if (in.empty()) return Status::ok();
  if (inlined) {
    for (int r = 0; r < num_ranks(); ++r)
      std::memcpy(out.data() + static_cast<std::size_t>(r) * in.size(), slot_data(s, r), in.size());
    return Status::ok();
  }
  // Past validation every rank has the same sizes, so the same verdict.
  EPX_RETURN_IF_ERROR(check_message_size(out.size(), "all_gather_bytes output"));
  s.scratch.resize(out.size());
  MPI_Request request = MPI_REQUEST_NULL;
  auto what = [&] { return fmt::format("all_gather_bytes #{} ({} bytes per rank)", seq, in.size()); };
  const uint64_t round = s.enter_round();
  EPX_RETURN_IF_ERROR(fail_on_error(s,
                                    MPI_Iallgather(in.data(), static_cast<int>(in.size()), MPI_BYTE, s.scratch.data(),
                                                   static_cast<int>(in.size()), MPI_BYTE, s.coll, &request),
                                    what()));
  EPX_RETURN_IF_ERROR(s.wait(&request, deadline, what, -1, nullptr, false, round));
  std::memcpy(out.data(), s.scratch.data(), out.size());
  return Status::ok();
}

Status MpiTransport::all_to_all_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                                      const Deadline& deadline) {
  MpiState& s = *state_;
  s.counters.count_collective(in.size());
  CollectiveDescriptor mine;
  mine.op = CollectiveOp::kAllToAll;
  mine.in_bytes = in.size();
  mine.out_bytes = out.size();
  uint64_t seq = 0;
  bool inlined = false;
  EPX_RETURN_IF_ERROR(agree(mine, in, deadline, &seq, &inlined));
  const std::size_t block = in.size() / static_cast<std::size_t>(num_ranks());
  if (block == 0) return Status::ok();
  if (inlined) {
    for (int src = 0; src < num_ranks(); ++src)
      std::memcpy(out.data() + static_cast<std::size_t>(src) * block,
                  slot_data(s, src) + static_cast<std::size_t>(rank()) * block, block);
    return Status::ok();
  }
  EPX_RETURN_IF_ERROR(check_message_size(in.size(), "all_to_all_bytes input"));
  s.scratch.resize(out.size());
  MPI_Request request = MPI_REQUEST_NULL;
  auto what = [&] { return fmt::format("all_to_all_bytes #{} ({} bytes per block)", seq, block); };
  const uint64_t round = s.enter_round();
  EPX_RETURN_IF_ERROR(fail_on_error(s,
                                    MPI_Ialltoall(in.data(), static_cast<int>(block), MPI_BYTE, s.scratch.data(),
                                                  static_cast<int>(block), MPI_BYTE, s.coll, &request),
                                    what()));
  EPX_RETURN_IF_ERROR(s.wait(&request, deadline, what, -1, nullptr, false, round));
  std::memcpy(out.data(), s.scratch.data(), out.size());
  return Status::ok();
}

namespace {

// Element range [first, first + count) of chunk c when `count` elements are
// cut into R nearly equal chunks.
std::pair<std::size_t, std::size_t> chunk_of(std::size_t count, std::size_t R, std::size_t c) {
  const std::size_t base = count / R, extra = count % R;
  return {c * base + std::min(c, extra), base + (c < extra ? 1 : 0)};
}

}  // namespace

Status MpiTransport::all_reduce_raw(void* data, std::size_t count, DType dtype, ReduceOp op,
                                    const Deadline& deadline) {
  MpiState& s = *state_;
  const std::size_t bytes = count * dtype_size(dtype);
  s.counters.count_collective(bytes);
  CollectiveDescriptor mine;
  mine.op = CollectiveOp::kAllReduce;
  mine.in_bytes = bytes;
  mine.count = count;
  mine.dtype = dtype;
  mine.reduce_op = op;
  uint64_t seq = 0;
  bool inlined = false;
  const std::span<const std::byte> in(static_cast<const std::byte*>(data), bytes);
  EPX_RETURN_IF_ERROR(agree(mine, in, deadline, &seq, &inlined));
  if (count == 0) return Status::ok();
  if (!inlined) return reduce_scatter_all_gather(data, count, dtype, op, seq, deadline);
  // Every rank's contribution, reduced in rank order: the same bits on every
  // rank and as the in-process backend (MPI_Allreduce fixes no order).
  std::vector<const std::byte*> contributions(static_cast<std::size_t>(num_ranks()));
  for (int r = 0; r < num_ranks(); ++r) contributions[r] = slot_data(s, r);
  detail::reduce_in_rank_order(contributions, count, dtype, op, data);
  return Status::ok();
}

// Large all-reduces move what a ring moves, 2 (R-1)/R x the bytes per rank,
// and keep the rank-order bits: rank c receives chunk c of every rank's data
// (all-to-all), reduces it in rank order (element-wise, so each element gets
// exactly the bits of the whole rank-order reduction), and every rank gathers
// the reduced chunks (all-gather). Both rounds land in scratch, which
// outlives a failed wait; `data` is written only after both completed.
Status MpiTransport::reduce_scatter_all_gather(void* data, std::size_t count, DType dtype, ReduceOp op, uint64_t seq,
                                               const Deadline& deadline) {
  MpiState& s = *state_;
  const std::size_t R = static_cast<std::size_t>(num_ranks()), elem = dtype_size(dtype), bytes = count * elem;
  EPX_RETURN_IF_ERROR(check_message_size(bytes, "all_reduce_raw data"));
  std::vector<int> sizes(R), offsets(R), mine_sizes(R), mine_offsets(R);
  const auto [my_first, my_count] = chunk_of(count, R, static_cast<std::size_t>(rank()));
  for (std::size_t c = 0; c < R; ++c) {
    const auto [first, n] = chunk_of(count, R, c);
    sizes[c] = static_cast<int>(n * elem);
    offsets[c] = static_cast<int>(first * elem);
    mine_sizes[c] = static_cast<int>(my_count * elem);
    mine_offsets[c] = static_cast<int>(c * my_count * elem);
  }
  const std::size_t gathered = R * my_count * elem;  // chunk `rank` of every rank
  s.scratch.resize(gathered + bytes);
  std::byte* parts = s.scratch.data();
  std::byte* result = s.scratch.data() + gathered;
  auto what = [&] { return fmt::format("all_reduce_raw #{} ({} x {})", seq, count, dtype_name(dtype)); };
  MPI_Request request = MPI_REQUEST_NULL;
  uint64_t round = s.enter_round();
  EPX_RETURN_IF_ERROR(fail_on_error(s,
                                    MPI_Ialltoallv(data, sizes.data(), offsets.data(), MPI_BYTE, parts,
                                                   mine_sizes.data(), mine_offsets.data(), MPI_BYTE, s.coll, &request),
                                    what()));
  EPX_RETURN_IF_ERROR(s.wait(&request, deadline, what, -1, nullptr, false, round));
  std::vector<const std::byte*> contributions(R);
  for (std::size_t r = 0; r < R; ++r) contributions[r] = parts + r * my_count * elem;
  detail::reduce_in_rank_order(contributions, my_count, dtype, op, result + my_first * elem);
  round = s.enter_round();
  EPX_RETURN_IF_ERROR(fail_on_error(s,
                                    MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, result, sizes.data(), offsets.data(),
                                                    MPI_BYTE, s.coll, &request),
                                    what()));
  EPX_RETURN_IF_ERROR(s.wait(&request, deadline, what, -1, nullptr, false, round));
  std::memcpy(data, result, bytes);
  return Status::ok();
}

Result<std::unique_ptr<PeerMemory>> MpiTransport::map_peer_memory(std::size_t bytes, const Deadline& deadline) {
  MpiState& s = *state_;
  const bool fits = bytes <= std::numeric_limits<std::size_t>::max() - kWindowAlignment &&
                    bytes <= static_cast<std::size_t>(std::numeric_limits<MPI_Aint>::max()) - kWindowAlignment;
  const std::size_t padded =
      fits ? std::max(kWindowAlignment, (bytes + kWindowAlignment - 1) / kWindowAlignment * kWindowAlignment) : 0;
  CollectiveDescriptor mine;
  mine.op = CollectiveOp::kMapPeerMemory;
  mine.in_bytes = bytes;
  mine.allocated = fits;
  uint64_t seq = 0;
  bool inlined = false;
  // Every rank has arrived once this returns, so the blocking window
  // allocation below cannot wait for an absent rank.
  EPX_RETURN_IF_ERROR(agree(mine, {}, deadline, &seq, &inlined));
  const std::string what = fmt::format("map_peer_memory #{} ({} bytes)", seq, bytes);
  // The gate: the allocation below blocks until every rank of the node
  // calls it, so it starts only once they all have arrived here.
  {
    MPI_Request gate = MPI_REQUEST_NULL;
    EPX_RETURN_IF_ERROR(fail_on_error(s, MPI_Ibarrier(s.node, &gate), what));
    EPX_RETURN_IF_ERROR(s.wait_gate(&gate, what));
  }

  void* base = nullptr;  // this rank's segment (regions[rank()] is its aligned start)
  MPI_Win win = MPI_WIN_NULL;
  // One spare cache line: MPI aligns a segment less (Open MPI 4.1: 8 bytes),
  // so each rank's region starts at the first 64-byte boundary of its segment.
  int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(padded + kWindowAlignment), 1, MPI_INFO_NULL, s.node, &base,
                                   &win);
  if (rc != MPI_SUCCESS) {
    Status error = resource_exhausted("{}: MPI_Win_allocate_shared of {} bytes on rank {} failed: {}", what, padded,
                                      rank(), mpi_error_string(rc));
    s.fail(error);
    return error;
  }
  MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);

  int node_size = 0;
  MPI_Comm_size(s.node, &node_size);
  const int first = topology().rank_of(node(), 0);
  std::vector<std::byte*> regions(static_cast<std::size_t>(num_ranks()), nullptr);
  for (int i = 0; i < node_size; ++i) {
    MPI_Aint size = 0;
    int disp_unit = 0;
    void* ptr = nullptr;
    rc = MPI_Win_shared_query(win, i, &size, &disp_unit, &ptr);
    if (rc != MPI_SUCCESS || ptr == nullptr || static_cast<std::size_t>(size) < padded + kWindowAlignment) {
      Status error = internal_error("{}: the shared segment of rank {} is missing or too small: {}", what, first + i,
                                    rc == MPI_SUCCESS ? fmt::format("{} bytes", size) : mpi_error_string(rc));
      s.fail(error);
      return error;
    }
    const auto address = reinterpret_cast<std::uintptr_t>(ptr);
    const std::uintptr_t aligned = (address + kWindowAlignment - 1) / kWindowAlignment * kWindowAlignment;
    regions[first + i] = static_cast<std::byte*>(ptr) + (aligned - address);
  }
  std::memset(regions[rank()], 0, padded);
  MPI_Win_lock_all(MPI_MODE_NOCHECK, win);
  s.add_window(win);
  auto memory = std::make_unique<MpiPeerMemory>(state_, win, s.windows_made++, bytes, std::move(regions));
  // Nobody writes into a region before its owner has zeroed it.
  s.sync_windows();
  MPI_Request request = MPI_REQUEST_NULL;
  EPX_RETURN_IF_ERROR(fail_on_error(s, MPI_Ibarrier(s.node, &request), what));
  EPX_RETURN_IF_ERROR(s.wait(&request, deadline, [&] { return what + ": node barrier"; }, -1));
  s.sync_windows();
  std::unique_ptr<PeerMemory> result = std::move(memory);
  return result;
}

Result<Request> MpiTransport::send_async(int peer, int tag, std::span<const std::byte> data) {
  MpiState& s = *state_;
  EPX_RETURN_IF_ERROR(detail::check_peer_and_tag(peer, tag, num_ranks()));
  if (tag > s.tag_ub) return invalid_argument("tag = {} is above this MPI's MPI_TAG_UB = {}", tag, s.tag_ub);
  EPX_RETURN_IF_ERROR(check_message_size(data.size(), fmt::format("message to rank {}", peer)));
  if (s.failed()) return s.aborted_now(fmt::format("send to {} with tag {}", s.rank_name(peer), tag));
  MPI_Request request = MPI_REQUEST_NULL;
  EPX_RETURN_IF_ERROR(fail_on_error(
      s, MPI_Isend(data.data(), static_cast<int>(data.size()), MPI_BYTE, peer, tag, s.comm, &request),
      fmt::format("MPI_Isend to rank {} with tag {}", peer, tag)));
  s.counters.count_message(topology().same_node(rank(), peer), data.size());
  return Request(std::make_shared<MpiRequest>(state_, request, peer, tag, data.size()));
}

Result<std::size_t> MpiTransport::recv(int peer, int tag, std::span<std::byte> out, const Deadline& deadline) {
  MpiState& s = *state_;
  EPX_RETURN_IF_ERROR(detail::check_peer_and_tag(peer, tag, num_ranks()));
  if (tag > s.tag_ub) return invalid_argument("tag = {} is above this MPI's MPI_TAG_UB = {}", tag, s.tag_ub);
  auto what = [&] { return fmt::format("recv from {} with tag {}", s.rank_name(peer), tag); };
  if (s.failed()) return s.aborted_now(what());
  const int capacity = static_cast<int>(std::min<std::size_t>(out.size(), INT_MAX));
  MPI_Request request = MPI_REQUEST_NULL;
  EPX_RETURN_IF_ERROR(
      fail_on_error(s, MPI_Irecv(out.data(), capacity, MPI_BYTE, peer, tag, s.comm, &request), "MPI_Irecv"));
  MPI_Status status;
  const Status waited = s.wait(&request, deadline, what, peer, &status, /*cancel=*/true);
  if (waited.code() == StatusCode::kResourceExhausted)
    return resource_exhausted("message from rank {} with tag {} is larger than out ({} bytes); the message was dropped",
                              peer, tag, out.size());
  EPX_RETURN_IF_ERROR(waited);
  int got = 0;
  MPI_Get_count(&status, MPI_BYTE, &got);
  return static_cast<std::size_t>(got);
}

namespace {

// MpiState::arrivals: two words per rank of this host (round entered, last
// poll) in a shared window of the host, zeroed by their owner. Blocking calls: every rank has arrived.
Status map_arrivals(MpiState& state) {
  MPI_Comm host = MPI_COMM_NULL;
  EPX_RETURN_IF_ERROR(mpi_call(
      MPI_Comm_split_type(state.comm, MPI_COMM_TYPE_SHARED, state.rank, MPI_INFO_NULL, &host), "MPI_Comm_split_type"));
  void* base = nullptr;
  MPI_Win win = MPI_WIN_NULL;
  const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(kWindowAlignment), 1, MPI_INFO_NULL, host, &base, &win);
  if (rc != MPI_SUCCESS) {
    MPI_Comm_free(&host);
    return mpi_call(rc, "MPI_Win_allocate_shared (arrivals)");
  }
  int host_size = 0;
  MPI_Comm_size(host, &host_size);
  MPI_Group host_group = MPI_GROUP_NULL, comm_group = MPI_GROUP_NULL;
  MPI_Comm_group(host, &host_group);
  MPI_Comm_group(state.comm, &comm_group);
  std::vector<int> host_ranks(static_cast<std::size_t>(host_size)), ranks(static_cast<std::size_t>(host_size));
  for (int i = 0; i < host_size; ++i) host_ranks[i] = i;
  MPI_Group_translate_ranks(host_group, host_size, host_ranks.data(), comm_group, ranks.data());
  MPI_Group_free(&host_group);
  MPI_Group_free(&comm_group);
  state.arrivals.assign(static_cast<std::size_t>(state.topology.num_ranks()), nullptr);
  for (int i = 0; i < host_size; ++i) {
    MPI_Aint size = 0;
    int disp_unit = 0;
    void* ptr = nullptr;
    if (MPI_Win_shared_query(win, i, &size, &disp_unit, &ptr) != MPI_SUCCESS || ptr == nullptr ||
        reinterpret_cast<std::uintptr_t>(ptr) % alignof(uint64_t) != 0)
      continue;  // not seen: reported as such
    state.arrivals[ranks[i]] = static_cast<uint64_t*>(ptr);
  }
  if (state.arrivals[state.rank] != nullptr) state.arrivals[state.rank][0] = state.arrivals[state.rank][1] = 0;
  MPI_Win_lock_all(MPI_MODE_NOCHECK, win);
  MPI_Win_sync(win);
  MPI_Barrier(host);
  MPI_Win_sync(win);
  MPI_Comm_free(&host);
  return Status::ok();
}

// The communicators, arrival words and liveness of `group`, split from
// `parent` as `plan` says. Blocking MPI calls: every rank of the parent has
// arrived (the split's all-gather), and each calls these in the same order.
Status connect_group(MpiState& parent, const detail::GroupPlan& plan, MpiState& group) {
  EPX_RETURN_IF_ERROR(
      mpi_call(MPI_Comm_split(parent.comm, plan.color, plan.rank, &group.comm), "MPI_Comm_split(group)"));
  EPX_RETURN_IF_ERROR(mpi_call(MPI_Comm_dup(group.comm, &group.coll), "MPI_Comm_dup(group)"));
  EPX_RETURN_IF_ERROR(mpi_call(MPI_Comm_dup(group.comm, &group.ctrl), "MPI_Comm_dup(group)"));
  EPX_RETURN_IF_ERROR(mpi_call(MPI_Comm_split(group.comm, group.topology.node_of(plan.rank), plan.rank, &group.node),
                               "MPI_Comm_split(group node)"));
  for (MPI_Comm c : {group.comm, group.coll, group.ctrl, group.node}) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
  int check = -1;
  MPI_Comm_rank(group.comm, &check);
  EPX_CHECK_EQ(check, plan.rank);
  EPX_RETURN_IF_ERROR(map_arrivals(group));
  group.tag_ub = parent.tag_ub;
  group.slot_bytes = detail::collective_slot_bytes(group.topology.num_ranks());
  for (int g = 0; g < group.topology.num_ranks(); ++g) {
    const int p = plan.members[g];
    group.pids.push_back(parent.pids[p]);
    group.start_ticks.push_back(parent.start_ticks[p]);
    group.hosts.push_back(parent.hosts[p]);
    if (std::find(parent.host_ranks.begin(), parent.host_ranks.end(), p) != parent.host_ranks.end())
      group.host_ranks.push_back(g);
  }
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<Transport>> MpiTransport::split(int color, int key, const Deadline& deadline) {
  MpiState& s = *state_;
  EPX_ASSIGN_OR_RETURN(detail::GroupPlan plan, detail::plan_split(*this, color, key, deadline));
  auto group = std::make_shared<MpiState>(plan.topology(), plan.rank, s.options);
  group->world_ranks = plan.world_ranks;
  group->parent = state_;
  group->label = plan.label;
  if (Status connected = connect_group(s, plan, *group); !connected.is_ok()) {
    s.fail(connected);
    new std::shared_ptr<MpiState>(std::move(group));  // MPI may hold parts of it: leaked, as a failed state is
    return connected;
  }
  {
    std::lock_guard lock(s.mutex);
    if (s.failure.is_ok()) {
      std::erase_if(s.children, [](const std::weak_ptr<MpiState>& child) { return child.expired(); });
      s.children.push_back(group);
    }
  }
  MpiState& made = *group;
  std::unique_ptr<Transport> transport = std::make_unique<MpiTransport>(std::move(group));
  if (s.failed()) {
    // The parent failed before the group was registered: the group fails too
    // (and its transport, going now, leaks it as any failed state).
    Status failed = s.aborted_now(fmt::format("split into {}", plan.label));
    made.fail_tree(failed, /*notify=*/false);
    return failed;
  }
  return transport;
}

// ---------------------------------------------------------------------------
// MpiSession

bool mpi_available() { return true; }

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}

Result<std::unique_ptr<MpiSession>> MpiSession::init(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    MPI_Query_thread(&provided);
  } else if (MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
    return internal_error("MPI_Init_thread failed");
  }
  if (provided < MPI_THREAD_MULTIPLE)
    return failed_precondition(
        "this MPI library gives thread level {} but epx needs MPI_THREAD_MULTIPLE ({}); use an MPI built with thread "
        "support (Debian's Open MPI is)",
        provided, MPI_THREAD_MULTIPLE);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return std::unique_ptr<MpiSession>(new MpiSession(rank, size));
}

namespace {

// A barrier of every process, polled: OK, DeadlineExceeded when `deadline`
// passes first (the request is left), or Internal on an MPI error.
Status poll_world_barrier(const Deadline& deadline) {
  MPI_Request request = MPI_REQUEST_NULL;
  EPX_RETURN_IF_ERROR(mpi_call(MPI_Ibarrier(MPI_COMM_WORLD, &request), "MPI_Ibarrier"));
  const auto start = Clock::now();
  for (uint64_t polls = 0;; ++polls) {
    int done = 0;
    EPX_RETURN_IF_ERROR(mpi_call(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test"));
    if (done) return Status::ok();
    if (deadline.expired()) return deadline_exceeded("waited {} ms", elapsed_ms(start));
    back_off(polls, start);
  }
}

}  // namespace

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // MPI_Finalize waits for every process, and a gone one never comes: first
  // a polled barrier of every process, then finalize only if all arrived.
  // After a failure a peer is likely gone, so wait less.
  const bool failed = g_failed.load(std::memory_order_acquire);
  const auto deadline = Deadline::after(failed ? std::chrono::seconds(3) : std::chrono::seconds(120));
  // Otherwise exit without MPI_Finalize: the launcher reports it. Two
  // rounds: the first completes on a process that arrives late (a stopped
  // one that resumed) once the others had posted it, even if they have
  // given up and exited since; only those that completed the first post the
  // second, so completing both means every process is still here.
  if (!poll_world_barrier(deadline).is_ok()) return;
  if (poll_world_barrier(Deadline::after(std::chrono::seconds(3))).is_ok()) MPI_Finalize();
}

std::string MpiSession::library_version() const {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string version(text, static_cast<std::size_t>(length));
  const std::size_t end = version.find_first_of("\r\n");
  return end == std::string::npos ? version : version.substr(0, end);
}

namespace {

// Waits (polled) until every process has arrived: the set-up after it is
// made of blocking MPI calls, which then cannot wait for an absent process.
Status wait_for_every_process(const MpiOptions& options, int world_rank, int world_size) {
  Status arrived = poll_world_barrier(Deadline::after(options.setup_timeout));
  if (arrived.is_ok()) return arrived;
  g_failed.store(true);
  if (arrived.code() != StatusCode::kDeadlineExceeded) return arrived;
  return deadline_exceeded("process {} {} for every one of the {} processes to connect", world_rank, arrived.message(),
                           world_size);
}

// What every process knows about itself, gathered by all.
struct ProcessInfo {
  int32_t host_size = 0;
  int32_t host_rank = 0;
  int32_t host_leader = 0;  // the smallest world rank of the host
  int32_t ranks_per_node = 0;
  int64_t pid = 0;
  char host[64] = {};
};

// Every process's ProcessInfo, indexed by world rank.
Result<std::vector<ProcessInfo>> gather_process_infos(const MpiOptions& options, int world_rank, int world_size) {
  MPI_Comm host = MPI_COMM_NULL;
  EPX_RETURN_IF_ERROR(
      mpi_call(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &host),
               "MPI_Comm_split_type(SHARED)"));
  ProcessInfo mine;
  MPI_Comm_size(host, &mine.host_size);
  MPI_Comm_rank(host, &mine.host_rank);
  int leader = world_rank;
  MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, host);
  mine.host_leader = leader;
  mine.ranks_per_node = options.ranks_per_node;
  mine.pid = static_cast<int64_t>(::getpid());
  gethostname(mine.host, sizeof(mine.host) - 1);
  MPI_Comm_free(&host);
  std::vector<ProcessInfo> all(static_cast<std::size_t>(world_size));
  EPX_RETURN_IF_ERROR(mpi_call(MPI_Allgather(&mine, sizeof(ProcessInfo), MPI_BYTE, all.data(), sizeof(ProcessInfo),
                                             MPI_BYTE, MPI_COMM_WORLD),
                               "MPI_Allgather"));
  return all;
}

// Where the processes sit: hosts numbered in the order of their leaders, the
// same number of processes on each, ranks numbered node-major.
struct HostLayout {
  std::map<int, int> host_index;  // leader world rank -> host number, in leader order
  int per_host = 0;
  int ranks_per_node = 0;

  int node_major(const ProcessInfo& info) const { return host_index.at(info.host_leader) * per_host + info.host_rank; }
};

// Every process reaches the same verdict from the same table.
Result<HostLayout> layout_hosts(const std::vector<ProcessInfo>& all, const MpiOptions& options) {
  HostLayout layout;
  for (const ProcessInfo& info : all) layout.host_index.emplace(info.host_leader, 0);
  int next = 0;
  for (auto& [leader_rank, index] : layout.host_index) index = next++;
  const int per_host = all[0].host_size;
  layout.per_host = per_host;
  for (std::size_t w = 0; w < all.size(); ++w) {
    if (all[w].host_size != per_host)
      return invalid_argument(
          "host {} runs {} processes but host {} runs {}; epx needs the same number of ranks on every node", all[0].host,
          per_host, all[w].host, all[w].host_size);
    if (all[w].ranks_per_node != all[0].ranks_per_node)
      return invalid_argument("process {} asked for ranks_per_node = {} but process 0 for {}", w, all[w].ranks_per_node,
                              all[0].ranks_per_node);
  }
  layout.ranks_per_node = options.ranks_per_node == 0 ? per_host : options.ranks_per_node;
  if (layout.ranks_per_node < 1 || per_host % layout.ranks_per_node != 0)
    return invalid_argument("ranks_per_node = {} must divide the {} processes per host{}", options.ranks_per_node,
                            per_host, options.ranks_per_node < 0 ? " (and be at least 1)" : "");
  return layout;
}

// The transport's communicators, in node-major rank order, and the tag limit.
Status open_communicators(MpiState& state, const Topology& topology, int rank) {
  EPX_RETURN_IF_ERROR(mpi_call(MPI_Comm_split(MPI_COMM_WORLD, 0, rank, &state.comm), "MPI_Comm_split"));
  EPX_RETURN_IF_ERROR(mpi_call(MPI_Comm_dup(state.comm, &state.coll), "MPI_Comm_dup"));
  EPX_RETURN_IF_ERROR(mpi_call(MPI_Comm_dup(state.comm, &state.ctrl), "MPI_Comm_dup"));
  EPX_RETURN_IF_ERROR(
      mpi_call(MPI_Comm_split(state.comm, topology.node_of(rank), rank, &state.node), "MPI_Comm_split(node)"));
  for (MPI_Comm c : {state.comm, state.coll, state.ctrl, state.node}) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
  EPX_RETURN_IF_ERROR(map_arrivals(state));
  int check = -1;
  MPI_Comm_rank(state.comm, &check);
  EPX_CHECK_EQ(check, rank);
  void* tag_ub = nullptr;
  int has_tag_ub = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &has_tag_ub);
  if (has_tag_ub && tag_ub != nullptr) state.tag_ub = *static_cast<int*>(tag_ub);
  return Status::ok();
}

// Every rank's pid and host; the ranks of this host whose pid is visible
// here are watched (ranks of one host may sit in different pid namespaces,
// e.g. containers: watching an invisible one would make a live rank look dead).
void record_peers(MpiState& state, const std::vector<ProcessInfo>& all, const HostLayout& layout, int world_rank,
                  int rank) {
  const int world_size = static_cast<int>(all.size());
  state.slot_bytes = detail::collective_slot_bytes(world_size);
  state.pids.resize(static_cast<std::size_t>(world_size));
  state.start_ticks.resize(static_cast<std::size_t>(world_size), 0);
  state.hosts.resize(static_cast<std::size_t>(world_size));
  for (int w = 0; w < world_size; ++w) {
    const int r = layout.node_major(all[w]);
    state.pids[r] = all[w].pid;
    state.hosts[r] = all[w].host;
    if (all[w].host_leader != all[world_rank].host_leader || r == rank) continue;
    const bool visible = ::kill(static_cast<pid_t>(all[w].pid), 0) == 0 || errno == EPERM;
    if (!visible) continue;
    state.start_ticks[r] = start_ticks(all[w].pid);
    state.host_ranks.push_back(r);
  }
}

}  // namespace

Result<std::unique_ptr<Transport>> MpiSession::connect(const MpiOptions& options) {
  EPX_RETURN_IF_ERROR(wait_for_every_process(options, world_rank_, world_size_));
  EPX_ASSIGN_OR_RETURN(std::vector<ProcessInfo> all, gather_process_infos(options, world_rank_, world_size_));
  EPX_ASSIGN_OR_RETURN(HostLayout layout, layout_hosts(all, options));
  EPX_ASSIGN_OR_RETURN(Topology topology, Topology::create(world_size_, world_size_ / layout.ranks_per_node));
  const int rank = layout.node_major(all[world_rank_]);
  auto state = std::make_shared<MpiState>(topology, rank, options);
  EPX_RETURN_IF_ERROR(open_communicators(*state, topology, rank));
  record_peers(*state, all, layout, world_rank_, rank);
  std::unique_ptr<Transport> transport = std::make_unique<MpiTransport>(std::move(state));
  return transport;
}

}  // namespace epx
