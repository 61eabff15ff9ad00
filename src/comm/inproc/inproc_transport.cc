#include "comm/inproc/inproc_transport.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/guard.h"

namespace epx {
namespace {

using detail::CollectiveOp;
using detail::check_peer_and_tag;

int64_t elapsed_ms(Clock::time_point start) {
  return std::chrono::duration_cast<Milliseconds>(Clock::now() - start).count();
}

bool passed(const Deadline& deadline) { return Clock::now() >= deadline.when(); }

}  // namespace

namespace detail {

InprocState::InprocState(const Topology& topology, std::vector<int> world_ranks, std::shared_ptr<InprocState> parent,
                         std::string label)
    : topology(topology),
      world_ranks(std::move(world_ranks)),
      parent(std::move(parent)),
      label(std::move(label)),
      ranks(std::make_unique<RankState[]>(static_cast<std::size_t>(topology.num_ranks()))) {
  for (CollectiveSlot& slot : slots) slot.entries.resize(static_cast<std::size_t>(topology.num_ranks()));
}

bool InprocState::poison_locked(const Status& reason) {
  if (!failure.is_ok()) return false;
  failure = reason.is_ok() ? internal_error("abort() was called with an OK status") : reason;
  poisoned.store(true, std::memory_order_release);
  return true;
}

void InprocState::abort(const Status& reason) {
  Status first;
  {
    std::lock_guard lock(mutex);
    if (!poison_locked(reason)) return;
    first = failure;
  }
  spread_failure(first);
}

void InprocState::spread_failure(const Status& reason) {
  notify_all_ranks();
  std::vector<std::shared_ptr<InprocState>> relatives;
  {
    std::lock_guard lock(mutex);
    for (const std::weak_ptr<InprocState>& child : children) {
      if (std::shared_ptr<InprocState> alive = child.lock()) relatives.push_back(std::move(alive));
    }
  }
  // Each relative that was not yet poisoned spreads it on; one already
  // poisoned stops it, so every state is visited once.
  if (parent) parent->abort(Status(reason.code(), fmt::format("in {}: {}", label, reason.message())));
  for (const std::shared_ptr<InprocState>& child : relatives) child->abort(reason);
}

Result<std::shared_ptr<InprocState>> InprocState::join_group(uint64_t split, const GroupPlan& plan, int rank) {
  std::lock_guard lock(mutex);
  if (!failure.is_ok()) return aborted_locked(fmt::format("split #{}", split), rank);
  const std::pair<uint64_t, int> id(split, plan.color);
  FormingGroup& forming = forming_groups[id];
  if (!forming.state) {
    forming.state = std::make_shared<InprocState>(plan.topology(), plan.world_ranks, shared_from_this(), plan.label);
    std::erase_if(children, [](const std::weak_ptr<InprocState>& child) { return child.expired(); });
    children.push_back(forming.state);
  }
  std::shared_ptr<InprocState> group = forming.state;
  if (++forming.num_joined == static_cast<int>(plan.members.size())) forming_groups.erase(id);
  return group;
}

void InprocState::notify_all_ranks() {
  for (int r = 0; r < topology.num_ranks(); ++r) ranks[r].cv.notify_all();
}

Status InprocState::aborted_locked(std::string_view what, int rank) const {
  const std::string cause = failure.code() == StatusCode::kAborted ? failure.message() : failure.to_string();
  return aborted("{} on {} aborted: {}", what, rank_name(rank), cause);
}

Status InprocState::interrupted_locked(std::string_view what, int rank, int64_t waited_ms,
                                       std::string_view waiting_for) const {
  if (failure.code() != StatusCode::kDeadlineExceeded) return aborted_locked(what, rank);
  return deadline_exceeded("{} waited {} ms in {}{}; the deadline of another rank passed first: {}", rank_name(rank),
                           waited_ms, what, waiting_for.empty() ? "" : fmt::format(" ({})", waiting_for),
                           failure.message());
}



}  // namespace detail

namespace {

using detail::CollectiveEntry;
using detail::CollectiveSlot;
using detail::InprocState;
using detail::SendOp;

// Checks that every rank called the same collective with consistent sizes.
// Every rank computes the same verdict from the same entries.
Status validate(const CollectiveSlot& slot, uint64_t seq, int num_ranks) {
  std::vector<detail::CollectiveDescriptor> all(static_cast<std::size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) {
    all[r] = slot.entries[r].desc;
    all[r].allocated = all[r].op != CollectiveOp::kMapPeerMemory || slot.entries[r].region != nullptr;
  }
  return detail::validate_collective(all, seq);
}

class InprocPeerMemory final : public PeerMemory {
 public:
  InprocPeerMemory(std::size_t size, int rank, std::vector<std::shared_ptr<AlignedBuffer>> regions)
      : size_(size), rank_(rank), regions_(std::move(regions)) {}
  [[nodiscard]] std::size_t size() const override { return size_; }
  [[nodiscard]] std::byte* local() const override { return regions_[rank_]->data(); }
  [[nodiscard]] std::byte* peer(int rank) const override {
    if (rank < 0 || rank >= static_cast<int>(regions_.size()) || !regions_[rank]) return nullptr;
    return regions_[rank]->data();
  }

 private:
  std::size_t size_;
  int rank_;
  // The regions of this rank's node (null elsewhere). Shared: a region lives
  // while any rank of its node still holds its PeerMemory.
  std::vector<std::shared_ptr<AlignedBuffer>> regions_;
};

class InprocRequest final : public Request::Impl {
 public:
  InprocRequest(std::shared_ptr<InprocState> state, std::shared_ptr<SendOp> op)
      : state_(std::move(state)), op_(std::move(op)) {}

  Status wait(const Deadline& deadline) override {
    const auto start = Clock::now();
    InprocState& state = *state_;
    std::condition_variable& cv = state.ranks[op_->src].cv;
    const std::string what =
        fmt::format("send to {} with tag {} ({} bytes)", state.rank_name(op_->dst), op_->tag, op_->size);
    std::unique_lock lock(state.mutex);
    for (bool blocked = false;; blocked = true) {
      if (op_->stage == SendOp::Stage::kDone) return op_->status;
      if (op_->stage == SendOp::Stage::kCopying) {
        // The receiver is copying out of our buffer; it finishes without waiting on anyone.
        cv.wait(lock);
        continue;
      }
      if (passed(deadline)) {
        Status status = deadline_exceeded("{} waited {} ms in {}; the receiver did not take the message",
                                          state.rank_name(op_->src), elapsed_ms(start), what);
        finish_unreceived_locked(status);
        if (state.poison_locked(status)) {
          lock.unlock();
          state.spread_failure(status);
        }
        return status;
      }
      if (!state.failure.is_ok()) {
        Status status = blocked ? state.interrupted_locked(what, op_->src, elapsed_ms(start), "")
                                : state.aborted_locked(what, op_->src);
        finish_unreceived_locked(status);
        return status;
      }
      cv.wait_until(lock, deadline.when());
    }
  }

 private:
  // Takes a message nobody received out of its FIFO, so no receiver reads
  // the buffer after wait() returns.
  void finish_unreceived_locked(const Status& status) {
    auto& fifo = state_->mailboxes[{op_->src, op_->dst, op_->tag}];
    fifo.erase(std::remove(fifo.begin(), fifo.end(), op_), fifo.end());
    op_->stage = SendOp::Stage::kDone;
    op_->status = status;
  }

  std::shared_ptr<InprocState> state_;
  std::shared_ptr<SendOp> op_;
};

}  // namespace

InprocTransport::InprocTransport(std::shared_ptr<detail::InprocState> state, int rank)
    : state_(std::move(state)), rank_(rank) {}

Status InprocTransport::rendezvous(const Contribution& mine, const Deadline& deadline,
                                   const detail::CollectiveSlot** slot_out, uint64_t* seq_out) {
  const auto start = Clock::now();
  InprocState& state = *state_;
  detail::RankState& me = state.ranks[rank_];
  const uint64_t seq = me.next_seq++;
  const int num_ranks = this->num_ranks();
  auto what = [&] { return fmt::format("{} #{}", detail::collective_op_name(mine.op), seq); };

  // A rank that saw a failure must not touch the slots again: a slower rank
  // may still be reading an unfinished collective's entries.
  if (state.poisoned.load(std::memory_order_acquire)) {
    std::lock_guard lock(state.mutex);
    return state.aborted_locked(what(), rank_);
  }

  CollectiveSlot& slot = state.slots[seq % 2];
  CollectiveEntry& entry = slot.entries[rank_];
  if (entry.staged.size() < mine.stage.size()) entry.staged.resize(mine.stage.size());
  if (!mine.stage.empty()) std::memcpy(entry.staged.data(), mine.stage.data(), mine.stage.size());
  entry.region = mine.region;

  std::unique_lock lock(state.mutex);
  if (!state.failure.is_ok()) return state.aborted_locked(what(), rank_);
  if (slot.seq != seq) {
    EPX_CHECK_LT(slot.seq, seq);
    slot.seq = seq;
    slot.num_arrived = 0;
  }
  entry.seq = seq;
  entry.desc.seq = seq;
  entry.desc.op = mine.op;
  entry.desc.in_bytes = mine.in_bytes;
  entry.desc.out_bytes = mine.out_bytes;
  entry.desc.count = mine.count;
  entry.desc.dtype = mine.dtype;
  entry.desc.reduce_op = mine.reduce_op;
  if (++slot.num_arrived == num_ranks) {
    lock.unlock();
    for (int r = 0; r < num_ranks; ++r) {
      if (r != rank_) state.ranks[r].cv.notify_all();
    }
  } else {
    // "rank 2 did not arrive (ranks 0, 1, 3 waited)".
    auto waiting_for = [&] {
      std::vector<detail::Arrival> arrivals(static_cast<std::size_t>(num_ranks));
      for (int r = 0; r < num_ranks; ++r)
        arrivals[r] = slot.entries[r].seq == seq ? detail::Arrival::kArrived : detail::Arrival::kMissing;
      return detail::arrival_report(arrivals, state.world_ranks);
    };
    // slot.seq stays `seq` until this rank arrives at seq + 1.
    for (;;) {
      me.cv.wait_until(lock, deadline.when());
      if (slot.num_arrived == num_ranks) break;
      if (passed(deadline)) {
        Status status = deadline_exceeded("{} waited {} ms in {}: {}", state.rank_name(rank_), elapsed_ms(start),
                                          what(), waiting_for());
        if (state.poison_locked(status)) {
          lock.unlock();
          state.spread_failure(status);
        }
        return status;
      }
      if (!state.failure.is_ok()) return state.interrupted_locked(what(), rank_, elapsed_ms(start), waiting_for());
    }
    lock.unlock();
  }
  *slot_out = &slot;
  *seq_out = seq;
  return validate(slot, seq, num_ranks);
}

Status InprocTransport::barrier(const Deadline& deadline) {
  state_->ranks[rank_].counters.count_collective(0);
  const CollectiveSlot* slot = nullptr;
  uint64_t seq = 0;
  Contribution mine;
  mine.op = CollectiveOp::kBarrier;
  return rendezvous(mine, deadline, &slot, &seq);
}

// Counts and contributes `in` to a byte collective (all-gather, all-to-all).
Status InprocTransport::stage_bytes(CollectiveOp op, std::span<const std::byte> in, std::size_t out_bytes,
                                    const Deadline& deadline, const CollectiveSlot** slot) {
  detail::RankState& me = state_->ranks[rank_];
  me.counters.count_collective(in.size());
  uint64_t seq = 0;
  Contribution mine;
  mine.op = op;
  mine.stage = in;
  mine.in_bytes = in.size();
  mine.out_bytes = out_bytes;
  return rendezvous(mine, deadline, slot, &seq);
}

Status InprocTransport::all_gather_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                                         const Deadline& deadline) {
  const CollectiveSlot* slot = nullptr;
  EPX_RETURN_IF_ERROR(stage_bytes(CollectiveOp::kAllGather, in, out.size(), deadline, &slot));
  if (in.empty()) return Status::ok();
  for (int r = 0; r < num_ranks(); ++r)
    std::memcpy(out.data() + static_cast<std::size_t>(r) * in.size(), slot->entries[r].staged.data(), in.size());
  return Status::ok();
}

Status InprocTransport::all_to_all_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                                         const Deadline& deadline) {
  const CollectiveSlot* slot = nullptr;
  EPX_RETURN_IF_ERROR(stage_bytes(CollectiveOp::kAllToAll, in, out.size(), deadline, &slot));
  const std::size_t block = in.size() / static_cast<std::size_t>(num_ranks());
  if (block == 0) return Status::ok();
  for (int src = 0; src < num_ranks(); ++src) {
    std::memcpy(out.data() + static_cast<std::size_t>(src) * block,
                slot->entries[src].staged.data() + static_cast<std::size_t>(rank_) * block, block);
  }
  return Status::ok();
}

Status InprocTransport::all_reduce_raw(void* data, std::size_t count, DType dtype, ReduceOp op,
                                       const Deadline& deadline) {
  const std::size_t bytes = count * dtype_size(dtype);
  detail::RankState& me = state_->ranks[rank_];
  me.counters.count_collective(bytes);
  const CollectiveSlot* slot = nullptr;
  uint64_t seq = 0;
  Contribution mine;
  mine.op = CollectiveOp::kAllReduce;
  mine.stage = std::span(static_cast<const std::byte*>(data), bytes);
  mine.in_bytes = bytes;
  mine.count = count;
  mine.dtype = dtype;
  mine.reduce_op = op;
  EPX_RETURN_IF_ERROR(rendezvous(mine, deadline, &slot, &seq));
  std::vector<const std::byte*> contributions(static_cast<std::size_t>(num_ranks()));
  for (int r = 0; r < num_ranks(); ++r) contributions[r] = slot->entries[r].staged.data();
  detail::reduce_in_rank_order(contributions, count, dtype, op, data);
  return Status::ok();
}

Result<std::unique_ptr<PeerMemory>> InprocTransport::map_peer_memory(std::size_t bytes, const Deadline& deadline) {
  // Padded to whole cache lines, and at least one, so every region has a
  // distinct non-null address.
  std::shared_ptr<AlignedBuffer> region;
  if (bytes <= std::numeric_limits<std::size_t>::max() - kCacheLine) {
    const std::size_t padded = std::max(kCacheLine, (bytes + kCacheLine - 1) / kCacheLine * kCacheLine);
    try {
      region = std::make_shared<AlignedBuffer>(padded, kCacheLine, /*zero=*/true);
    } catch (const std::bad_alloc&) {
      region = nullptr;  // reported on every rank by validate()
    }
  }
  const CollectiveSlot* slot = nullptr;
  uint64_t seq = 0;
  Contribution mine;
  mine.op = CollectiveOp::kMapPeerMemory;
  mine.in_bytes = bytes;
  mine.region = std::move(region);
  EPX_RETURN_IF_ERROR(rendezvous(mine, deadline, &slot, &seq));
  std::vector<std::shared_ptr<AlignedBuffer>> regions(static_cast<std::size_t>(num_ranks()));
  for (int r = 0; r < num_ranks(); ++r) {
    if (topology().same_node(rank_, r)) regions[r] = slot->entries[r].region;
  }
  std::unique_ptr<PeerMemory> memory = std::make_unique<InprocPeerMemory>(bytes, rank_, std::move(regions));
  return memory;
}

Result<Request> InprocTransport::send_async(int peer, int tag, std::span<const std::byte> data) {
  EPX_RETURN_IF_ERROR(check_peer_and_tag(peer, tag, num_ranks()));
  InprocState& state = *state_;
  auto op = std::make_shared<SendOp>();
  op->data = data.data();
  op->size = data.size();
  op->src = rank_;
  op->dst = peer;
  op->tag = tag;
  {
    std::lock_guard lock(state.mutex);
    if (!state.failure.is_ok())
      return state.aborted_locked(fmt::format("send to {} with tag {}", state.rank_name(peer), tag), rank_);
    state.mailboxes[{rank_, peer, tag}].push_back(op);
  }
  state.ranks[peer].cv.notify_all();
  state.ranks[rank_].counters.count_message(topology().same_node(rank_, peer), data.size());
  return Request(std::make_shared<InprocRequest>(state_, std::move(op)));
}

Result<std::size_t> InprocTransport::recv(int peer, int tag, std::span<std::byte> out, const Deadline& deadline) {
  EPX_RETURN_IF_ERROR(check_peer_and_tag(peer, tag, num_ranks()));
  const auto start = Clock::now();
  InprocState& state = *state_;
  auto what = [&] { return fmt::format("recv from {} with tag {}", state.rank_name(peer), tag); };
  std::unique_lock lock(state.mutex);
  if (!state.failure.is_ok()) return state.aborted_locked(what(), rank_);
  auto& fifo = state.mailboxes[{peer, rank_, tag}];  // map nodes are never erased
  while (fifo.empty()) {
    state.ranks[rank_].cv.wait_until(lock, deadline.when());
    if (!fifo.empty()) break;
    if (passed(deadline)) {
      Status status = deadline_exceeded("{} waited {} ms in {}; no message arrived", state.rank_name(rank_),
                                        elapsed_ms(start), what());
      if (state.poison_locked(status)) {
        lock.unlock();
        state.spread_failure(status);
      }
      return status;
    }
    if (!state.failure.is_ok()) return state.interrupted_locked(what(), rank_, elapsed_ms(start), "");
  }
  std::shared_ptr<SendOp> op = std::move(fifo.front());
  fifo.pop_front();
  op->stage = SendOp::Stage::kCopying;
  lock.unlock();

  // The sender's buffer stays valid while the stage is kCopying: its wait()
  // does not return before kDone.
  Status recv_status;
  Status send_status;
  if (op->size > out.size()) {
    recv_status = resource_exhausted(
        "message from {} with tag {} is {} bytes but out holds {} bytes; the message was dropped",
        state.rank_name(peer), tag, op->size, out.size());
    send_status = resource_exhausted(
        "message to {} with tag {} is {} bytes but the receiver's buffer holds {} bytes; the message was dropped",
        state.rank_name(rank_), tag, op->size, out.size());
  } else if (op->size > 0) {
    std::memcpy(out.data(), op->data, op->size);
  }
  const std::size_t size = op->size;
  const int src = op->src;
  lock.lock();
  op->stage = SendOp::Stage::kDone;
  op->status = std::move(send_status);
  lock.unlock();
  state.ranks[src].cv.notify_all();
  if (!recv_status.is_ok()) return recv_status;
  return size;
}



Result<std::unique_ptr<Transport>> InprocTransport::split(int color, int key, const Deadline& deadline) {
  const uint64_t split = state_->ranks[rank_].next_split++;
  EPX_ASSIGN_OR_RETURN(detail::GroupPlan plan, detail::plan_split(*this, color, key, deadline));
  EPX_ASSIGN_OR_RETURN(std::shared_ptr<InprocState> group, state_->join_group(split, plan, rank_));
  std::unique_ptr<Transport> transport = std::make_unique<InprocTransport>(std::move(group), plan.rank);
  return transport;
}

// ---------------------------------------------------------------------------
// InprocWorld

InprocWorld::InprocWorld(const Topology& topology) : state_(std::make_shared<detail::InprocState>(topology)) {}

InprocWorld::~InprocWorld() = default;

const Topology& InprocWorld::topology() const { return state_->topology; }

std::unique_ptr<Transport> InprocWorld::connect(int rank) {
  EPX_CHECK_GE(rank, 0);
  EPX_CHECK_LT(rank, state_->topology.num_ranks());
  return std::make_unique<InprocTransport>(state_, rank);
}

std::vector<Status> InprocWorld::run(const std::function<Status(Transport&)>& fn) {
  const int num_ranks = state_->topology.num_ranks();
  std::vector<Status> statuses(static_cast<std::size_t>(num_ranks));
  auto fail = [&](int rank, Status status) {
    state_->abort(aborted("rank {} failed: {}", rank, status.to_string()));
    statuses[rank] = std::move(status);
  };
  auto body = [&](int rank) {
    Status status;
    try {
      InprocTransport transport(state_, rank);
      status = fn(transport);
    } catch (...) {
      status = detail::status_of_current_exception(fmt::format("rank {}", rank));
    }
    if (!status.is_ok()) fail(rank, std::move(status));
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(num_ranks));
  // A rank whose thread cannot start fails, which aborts the others' waits.
  for (int rank = 0; rank < num_ranks; ++rank) {
    Result<std::thread> thread = detail::start_thread(fmt::format("the thread of rank {}", rank), body, rank);
    if (thread.is_ok()) threads.push_back(std::move(thread).value());
    else fail(rank, thread.status());
  }
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

TransportCounters InprocWorld::total_counters() const {
  TransportCounters total;
  for (int r = 0; r < state_->topology.num_ranks(); ++r) total += state_->counters_of(r);
  return total;
}

std::vector<Status> run_ranks(const Topology& topology, const std::function<Status(Transport&)>& fn) {
  InprocWorld world(topology);
  return world.run(fn);
}

Status first_error(const std::vector<Status>& statuses) {
  for (std::size_t i = 0; i < statuses.size(); ++i) {
    if (!statuses[i].is_ok()) return Status(statuses[i].code(), fmt::format("rank {}: {}", i, statuses[i].message()));
  }
  return Status::ok();
}

}  // namespace epx
