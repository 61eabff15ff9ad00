// The socket backend's transport (include/epx/comm/socket.h): collectives,
// messages and peer memory over the Engine's connections.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>

#include <fmt/format.h>

#include "comm/collective.h"
#include "comm/group.h"
#include "comm/socket/engine.h"
#include "comm/socket/rendezvous.h"
#include "epx/comm/socket.h"

namespace epx {
namespace {

using detail::CollectiveDescriptor;
using detail::CollectiveOp;
using socket_detail::Engine;

// Collectives travel on their channel's tag -1 (messages use tags >= 0).
constexpr int32_t kCollectiveTag = -1;

int64_t elapsed_ms(Clock::time_point start) {
  return std::chrono::duration_cast<Milliseconds>(Clock::now() - start).count();
}

// This rank's region of one PeerMemory and the mappings of its node's regions.
class ShmPeerMemory final : public PeerMemory {
 public:
  ShmPeerMemory(std::size_t size, std::size_t mapped, std::vector<std::byte*> regions, int rank)
      : size_(size), mapped_(mapped), regions_(std::move(regions)), rank_(rank) {}
  ~ShmPeerMemory() override {
    for (std::byte* region : regions_)
      if (region != nullptr) ::munmap(region, mapped_);
  }
  [[nodiscard]] std::size_t size() const override { return size_; }
  [[nodiscard]] std::byte* local() const override { return regions_[rank_]; }
  [[nodiscard]] std::byte* peer(int rank) const override {
    return rank >= 0 && rank < static_cast<int>(regions_.size()) ? regions_[rank] : nullptr;
  }

 private:
  std::size_t size_;
  std::size_t mapped_;
  std::vector<std::byte*> regions_;
  int rank_;
};

// Maps the shared-memory object `name` of `bytes` (creating it, zero-filled, when `create`).
Result<std::byte*> map_shm(const std::string& name, std::size_t bytes, bool create) {
  const int fd = ::shm_open(name.c_str(), create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
  if (fd < 0) return internal_error("shm_open({}) failed: {}", name, std::strerror(errno));
  if (create && ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int error = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    return resource_exhausted("ftruncate of {} to {} bytes failed: {}", name, bytes, std::strerror(error));
  }
  void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  ::close(fd);
  if (at == MAP_FAILED) {
    if (create) ::shm_unlink(name.c_str());
    return resource_exhausted("mmap of {} ({} bytes) failed: {}", name, bytes, std::strerror(error));
  }
  return static_cast<std::byte*>(at);
}

class SocketTransport final : public Transport {
 public:
  // `members`: by rank of this transport, the engine's rank (the world rank).
  SocketTransport(std::shared_ptr<Engine> engine, uint32_t channel, Topology topology, int rank,
                  std::vector<int> members, std::string job)
      : engine_(std::move(engine)), channel_(channel), topology_(std::move(topology)), rank_(rank),
        members_(std::move(members)), job_(std::move(job)) {
    if (channel_ != 0) world_ranks_ = members_;
  }

  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] const Topology& topology() const override { return topology_; }
  [[nodiscard]] std::string_view backend_name() const override { return "socket"; }
  [[nodiscard]] int world_rank(int rank) const override { return members_[rank]; }
  [[nodiscard]] TransportCounters counters() const override { return counters_.snapshot(); }
  void reset_counters() override { counters_.reset(); }
  void abort(const Status& reason) override { engine_->fail(reason); }

  Result<std::unique_ptr<PeerMemory>> map_peer_memory(std::size_t bytes, const Deadline& deadline) override;
  Result<Request> send_async(int peer, int tag, std::span<const std::byte> data) override;
  Result<std::size_t> recv(int peer, int tag, std::span<std::byte> out, const Deadline& deadline) override;
  Status barrier(const Deadline& deadline) override;
  Status all_gather_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                          const Deadline& deadline) override;
  Status all_to_all_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                          const Deadline& deadline) override;
  Status all_reduce_raw(void* data, std::size_t count, DType dtype, ReduceOp op, const Deadline& deadline) override;
  Result<std::unique_ptr<Transport>> split(int color, int key, const Deadline& deadline) override;

 private:
  [[nodiscard]] std::string name(int r) const { return detail::rank_name(r, world_ranks_); }
  // Aborted: `what` could not start because the transport failed before.
  [[nodiscard]] Status aborted_now(std::string_view what) const;
  // A wait's error, told from the engine's: DeadlineExceeded fails the
  // transport (and so tells every peer), naming `waited_for`.
  Status wait_error(const Status& status, std::string_view what, const std::string& waited_for,
                    Clock::time_point start);
  // One collective: sends every peer this rank's descriptor and
  // payload(peer), receives every peer's, validates the descriptors. On OK,
  // parts[r] holds rank r's payload to this rank (parts[rank()] empty).
  Status exchange(CollectiveDescriptor mine, const std::function<std::span<const std::byte>(int)>& payload,
                  std::vector<std::vector<std::byte>>* parts, const Deadline& deadline);
  Status receive_parts(std::vector<std::vector<std::byte>>* parts, const Deadline& deadline, const std::string& what);

  std::shared_ptr<Engine> engine_;
  const uint32_t channel_;
  const Topology topology_;
  const int rank_;
  const std::vector<int> members_;
  std::vector<int> world_ranks_;  // empty in a world (rank_name's convention)
  const std::string job_;         // unique to the run: names its shared-memory objects
  uint64_t next_seq_ = 1;
  uint64_t next_region_ = 0;
  detail::AtomicCounters counters_;
};

class SocketRequest final : public Request::Impl {
 public:
  SocketRequest(std::shared_ptr<Engine> engine, std::shared_ptr<socket_detail::Send> send, std::string what)
      : engine_(std::move(engine)), send_(std::move(send)), what_(std::move(what)) {}
  Status wait(const Deadline& deadline) override {
    const auto start = Clock::now();
    Status status = engine_->wait_sent(*send_, deadline);
    if (status.code() != StatusCode::kDeadlineExceeded || engine_->failed()) return status;
    Status late = deadline_exceeded("{} waited {} ms: the peer did not take the data", what_, elapsed_ms(start));
    engine_->fail(late);
    return late;
  }

 private:
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<socket_detail::Send> send_;
  std::string what_;
};

Status SocketTransport::aborted_now(std::string_view what) const {
  const Status failure = engine_->failure();
  return aborted("{} on {} aborted: {}", what, name(rank_), failure.message());
}

Status SocketTransport::wait_error(const Status& status, std::string_view what, const std::string& waited_for,
                                   Clock::time_point start) {
  if (status.code() != StatusCode::kDeadlineExceeded || engine_->failed()) {
    if (status.code() == StatusCode::kDeadlineExceeded || status.code() == StatusCode::kAborted)
      return Status(status.code(), fmt::format("{} on {}: {}", what, name(rank_), status.message()));
    return status;
  }
  Status late = deadline_exceeded("{} waited {} ms in {}: {}", name(rank_), elapsed_ms(start), what, waited_for);
  engine_->fail(late);
  return late;
}

Result<Request> SocketTransport::send_async(int peer, int tag, std::span<const std::byte> data) {
  EPX_RETURN_IF_ERROR(detail::check_peer_and_tag(peer, tag, num_ranks()));
  const std::string what = fmt::format("send to {} with tag {}", name(peer), tag);
  if (engine_->failed()) return aborted_now(what);
  counters_.count_message(topology_.same_node(rank_, peer), data.size());
  EPX_ASSIGN_OR_RETURN(auto send, engine_->send(members_[peer], channel_, tag, {}, data));
  return Request(std::make_shared<SocketRequest>(engine_, std::move(send), what));
}

Result<std::size_t> SocketTransport::recv(int peer, int tag, std::span<std::byte> out, const Deadline& deadline) {
  EPX_RETURN_IF_ERROR(detail::check_peer_and_tag(peer, tag, num_ranks()));
  const std::string what = fmt::format("recv from {} with tag {}", name(peer), tag);
  if (engine_->failed()) return aborted_now(what);
  const auto start = Clock::now();
  Result<std::vector<std::byte>> got = engine_->take(members_[peer], channel_, tag, deadline);
  if (!got.is_ok())
    return wait_error(got.status(), what, fmt::format("{} did not answer", name(peer)), start);
  if (got->size() > out.size())
    return resource_exhausted("message from rank {} with tag {} is larger than out ({} > {} bytes); the message was "
                              "dropped",
                              peer, tag, got->size(), out.size());
  std::memcpy(out.data(), got->data(), got->size());
  return got->size();
}

Status SocketTransport::receive_parts(std::vector<std::vector<std::byte>>* parts, const Deadline& deadline,
                                      const std::string& what) {
  const auto start = Clock::now();
  for (int r = 0; r < num_ranks(); ++r) {
    if (r == rank_) continue;
    Result<std::vector<std::byte>> got = engine_->take(members_[r], channel_, kCollectiveTag, deadline);
    if (got.is_ok()) {
      (*parts)[r] = std::move(*got);
      continue;
    }
    // Who never came: the ranks whose part is neither here nor queued.
    std::vector<detail::Arrival> seen(static_cast<std::size_t>(num_ranks()), detail::Arrival::kArrived);
    for (int p = r; p < num_ranks(); ++p)
      if (p != rank_ && !engine_->has_frame(members_[p], channel_, kCollectiveTag)) seen[p] = detail::Arrival::kMissing;
    return wait_error(got.status(), what, detail::arrival_report(seen, world_ranks_), start);
  }
  return Status::ok();
}

Status SocketTransport::exchange(CollectiveDescriptor mine, const std::function<std::span<const std::byte>(int)>& payload,
                                 std::vector<std::vector<std::byte>>* parts, const Deadline& deadline) {
  const std::string what = fmt::format("{} #{}", detail::collective_op_name(mine.op), next_seq_);
  if (engine_->failed()) return aborted_now(what);
  mine.seq = next_seq_++;
  const int R = num_ranks();
  std::vector<std::byte> prefix(sizeof(CollectiveDescriptor));
  std::memcpy(prefix.data(), &mine, sizeof(mine));
  std::vector<std::shared_ptr<socket_detail::Send>> sends;
  std::size_t bytes = 0;
  for (int r = 0; r < R; ++r) {
    if (r == rank_) continue;
    const std::span<const std::byte> data = payload(r);
    bytes += data.size();
    Result<std::shared_ptr<socket_detail::Send>> send = engine_->send(members_[r], channel_, kCollectiveTag, prefix, data);
    if (!send.is_ok()) return wait_error(send.status(), what, "", Clock::now());
    sends.push_back(std::move(*send));
  }
  counters_.count_collective(bytes);
  parts->assign(static_cast<std::size_t>(R), {});
  EPX_RETURN_IF_ERROR(receive_parts(parts, deadline, what));
  const auto start = Clock::now();
  for (const auto& send : sends)
    if (Status s = engine_->wait_sent(*send, deadline); !s.is_ok())
      return wait_error(s, what, "a peer did not take this rank's part", start);
  std::vector<CollectiveDescriptor> all(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) {
    if (r == rank_) {
      all[r] = mine;
      continue;
    }
    std::vector<std::byte>& part = (*parts)[r];
    if (part.size() < sizeof(CollectiveDescriptor)) {
      Status bad = internal_error("{}: {} sent {} bytes, less than a descriptor", what, name(r), part.size());
      engine_->fail(bad);
      return bad;
    }
    std::memcpy(&all[r], part.data(), sizeof(CollectiveDescriptor));
    part.erase(part.begin(), part.begin() + sizeof(CollectiveDescriptor));
  }
  return detail::validate_collective(all, mine.seq);
}

Status SocketTransport::barrier(const Deadline& deadline) {
  CollectiveDescriptor mine;
  mine.op = CollectiveOp::kBarrier;
  std::vector<std::vector<std::byte>> parts;
  return exchange(mine, [](int) { return std::span<const std::byte>(); }, &parts, deadline);
}

Status SocketTransport::all_gather_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                                         const Deadline& deadline) {
  CollectiveDescriptor mine;
  mine.op = CollectiveOp::kAllGather;
  mine.in_bytes = in.size();
  mine.out_bytes = out.size();
  std::vector<std::vector<std::byte>> parts;
  EPX_RETURN_IF_ERROR(exchange(mine, [&](int) { return in; }, &parts, deadline));
  for (int r = 0; r < num_ranks(); ++r) {
    const std::span<const std::byte> from = r == rank_ ? in : std::span<const std::byte>(parts[r]);
    std::memcpy(out.data() + r * in.size(), from.data(), in.size());
  }
  return Status::ok();
}

Status SocketTransport::all_to_all_bytes(std::span<const std::byte> in, std::span<std::byte> out,
                                         const Deadline& deadline) {
  CollectiveDescriptor mine;
  mine.op = CollectiveOp::kAllToAll;
  mine.in_bytes = in.size();
  mine.out_bytes = out.size();
  const std::size_t block = in.size() / static_cast<std::size_t>(num_ranks());
  std::vector<std::vector<std::byte>> parts;
  EPX_RETURN_IF_ERROR(exchange(mine, [&](int r) { return in.subspan(r * block, block); }, &parts, deadline));
  for (int r = 0; r < num_ranks(); ++r) {
    const std::span<const std::byte> from = r == rank_ ? in.subspan(r * block, block) : std::span<const std::byte>(parts[r]);
    std::memcpy(out.data() + r * block, from.data(), block);
  }
  return Status::ok();
}

Status SocketTransport::all_reduce_raw(void* data, std::size_t count, DType dtype, ReduceOp op,
                                       const Deadline& deadline) {
  CollectiveDescriptor mine;
  mine.op = CollectiveOp::kAllReduce;
  mine.count = count;
  mine.dtype = dtype;
  mine.reduce_op = op;
  const std::size_t bytes = count * dtype_size(dtype);
  const std::vector<std::byte> own(static_cast<const std::byte*>(data), static_cast<const std::byte*>(data) + bytes);
  std::vector<std::vector<std::byte>> parts;
  EPX_RETURN_IF_ERROR(exchange(mine, [&](int) { return std::span<const std::byte>(own); }, &parts, deadline));
  std::vector<const std::byte*> contributions(static_cast<std::size_t>(num_ranks()));
  for (int r = 0; r < num_ranks(); ++r) contributions[r] = r == rank_ ? own.data() : parts[r].data();
  detail::reduce_in_rank_order(contributions, count, dtype, op, data);
  return Status::ok();
}

Result<std::unique_ptr<PeerMemory>> SocketTransport::map_peer_memory(std::size_t bytes, const Deadline& deadline) {
  // Objects of at least a page, so that a region's mapping is never empty.
  const std::size_t mapped = std::max<std::size_t>((bytes + 4095) / 4096 * 4096, 4096);
  const uint64_t region = next_region_++;
  auto object = [&](int r) { return fmt::format("/epx-{}-c{}-m{}-r{}", job_, channel_, region, members_[r]); };
  std::vector<std::byte*> regions(static_cast<std::size_t>(num_ranks()), nullptr);
  auto unmap_all = [&] {
    for (std::byte*& at : regions)
      if (at != nullptr) ::munmap(std::exchange(at, nullptr), mapped);
  };
  Result<std::byte*> own = map_shm(object(rank_), mapped, /*create=*/true);
  CollectiveDescriptor mine;
  mine.op = CollectiveOp::kMapPeerMemory;
  mine.in_bytes = bytes;
  mine.allocated = own.is_ok();
  if (own.is_ok()) regions[rank_] = *own;
  std::vector<std::vector<std::byte>> parts;
  Status made = exchange(mine, [](int) { return std::span<const std::byte>(); }, &parts, deadline);
  // Second round: every rank has mapped its node's regions (or says it could not).
  Status mapped_peers = Status::ok();
  for (int r = 0; made.is_ok() && r < num_ranks(); ++r) {
    if (r == rank_ || !topology_.same_node(r, rank_)) continue;
    Result<std::byte*> peer = map_shm(object(r), mapped, /*create=*/false);
    if (!peer.is_ok()) {
      mapped_peers = failed_precondition("{} cannot map the peer memory of {} ({}): ranks that share a hostname must "
                                         "share /dev/shm",
                                         name(rank_), name(r), peer.status().message());
      break;
    }
    regions[r] = *peer;
  }
  if (made.is_ok()) {
    mine.allocated = mapped_peers.is_ok();
    made = exchange(mine, [](int) { return std::span<const std::byte>(); }, &parts, deadline);
  }
  if (own.is_ok()) ::shm_unlink(object(rank_).c_str());
  if (!mapped_peers.is_ok() || !made.is_ok()) {
    unmap_all();
    return mapped_peers.is_ok() ? made : mapped_peers;
  }
  return std::unique_ptr<PeerMemory>(std::make_unique<ShmPeerMemory>(bytes, mapped, std::move(regions), rank_));
}

Result<std::unique_ptr<Transport>> SocketTransport::split(int color, int key, const Deadline& deadline) {
  EPX_ASSIGN_OR_RETURN(detail::GroupPlan plan, detail::plan_split(*this, color, key, deadline));
  // A channel none of the members has used: past every member's next one.
  int64_t next = engine_->next_channel();
  EPX_RETURN_IF_ERROR(all_reduce(std::span<int64_t>(&next, 1), ReduceOp::kMax, deadline));
  engine_->use_channels_from(static_cast<uint32_t>(next) + 1);
  std::vector<int> members;
  for (int p : plan.members) members.push_back(members_[p]);
  return std::unique_ptr<Transport>(std::make_unique<SocketTransport>(
      engine_, static_cast<uint32_t>(next), plan.topology(), plan.rank, std::move(members), job_));
}

}  // namespace

Status MemoryStore::set(const std::string& key, const std::string& value) {
  std::lock_guard lock(mutex_);
  values_[key] = value;
  changed_.notify_all();
  return Status::ok();
}

Result<std::string> MemoryStore::get(const std::string& key, const Deadline& deadline) {
  std::unique_lock lock(mutex_);
  if (!changed_.wait_until(lock, deadline.when(), [&] { return values_.contains(key); }))
    return deadline_exceeded("no rank set the key {} in time", key);
  return values_[key];
}

Result<std::unique_ptr<Transport>> connect_sockets(KeyValueStore& store, const SocketOptions& options) {
  EPX_ASSIGN_OR_RETURN(socket_detail::Mesh mesh, socket_detail::rendezvous(store, options));
  auto engine = std::make_shared<Engine>(mesh.rank, std::move(mesh.peers), std::move(mesh.fds), options.close_timeout);
  // Only a setup error: the I/O thread runs from here on, and a peer that
  // aborted right after connecting may have failed the engine already; this
  // rank still gets its transport, whose calls report that abort.
  if (!engine->setup_error().is_ok()) return engine->setup_error();
  std::vector<int> members(static_cast<std::size_t>(mesh.topology.num_ranks()));
  for (int r = 0; r < mesh.topology.num_ranks(); ++r) members[r] = r;
  return std::unique_ptr<Transport>(std::make_unique<SocketTransport>(
      std::move(engine), 0, mesh.topology, mesh.rank, std::move(members), mesh.job));
}

}  // namespace epx
