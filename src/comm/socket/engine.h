// The socket backend's connections (private): one TCP connection to every
// other rank, and the I/O thread that moves frames over them.
//
// A frame is a header (kind, channel, tag, size) and a body. Data frames are
// queued by (channel, tag) on the receiving side until a transport takes
// them; a send completes once its frame is written to the socket, so a
// stopped peer's full socket holds the sender's request (its wait has a
// deadline). Every rank drains its sockets whatever its program does, so a
// send never waits for the receiver to post a receive.
//
// Failures: the first one is kept (every later wait returns it) and sent to
// every peer as a notice frame; a peer's notice fails this rank the same way
// (without sending notices again). A connection that ends before its peer
// said goodbye (a killed process) fails the rank naming that peer. Closing
// sends goodbye, then waits (close_timeout) until every peer has closed too;
// a failed rank sends its failure as a notice before its goodbye, so that a
// peer waiting on it learns why it left, whatever order the peer reads its
// connections in.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "epx/core/clock.h"
#include "epx/core/status.h"

namespace epx::socket_detail {

enum class FrameKind : uint32_t { kData = 1, kNotice = 2, kGoodbye = 3 };

struct FrameHeader {
  uint32_t magic = 0;
  FrameKind kind = FrameKind::kData;
  uint32_t channel = 0;
  int32_t tag = 0;
  uint64_t size = 0;  // body bytes
};

// One frame on its way out: header, an owned prefix, then the caller's data.
struct Send {
  FrameHeader header;
  std::vector<std::byte> prefix;
  std::span<const std::byte> data;
  std::size_t written = 0;  // of header + prefix + data
  bool done = false;
  [[nodiscard]] std::size_t total() const { return sizeof(FrameHeader) + prefix.size() + data.size(); }
};

// What each rank knows of every rank after the rendezvous.
struct PeerInfo {
  std::string address;
  int port = 0;
  std::string host;
  int64_t pid = 0;
};

class Engine {
 public:
  // `fds`: by rank, a connected socket (-1 for this rank); the engine owns them.
  Engine(int rank, std::vector<PeerInfo> peers, std::vector<int> fds, std::chrono::milliseconds close_timeout);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Why the engine could not start (OK once its I/O thread runs). Not
  // failure(): a peer's notice may fail a started engine at once (a rank
  // that aborts right after connecting), and that is no reason to refuse
  // this rank its transport; its calls report the failure.
  [[nodiscard]] const Status& setup_error() const { return setup_error_; }

  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int num_ranks() const { return static_cast<int>(peers_.size()); }
  [[nodiscard]] const PeerInfo& peer(int r) const { return peers_[r]; }

  // Queues a data frame to `peer` (to this rank: delivered at once, as a
  // copy); the data must stay valid until the send is done.
  Result<std::shared_ptr<Send>> send(int peer, uint32_t channel, int32_t tag, std::vector<std::byte> prefix,
                                     std::span<const std::byte> data);
  // Waits until `send` is written. DeadlineExceeded (the engine not failed:
  // the caller decides) when the deadline passes first.
  Status wait_sent(const Send& send, const Deadline& deadline);
  // The next data frame from `peer` on (channel, tag), or why there is none:
  // the engine's failure, the peer closed (Aborted), DeadlineExceeded.
  Result<std::vector<std::byte>> take(int peer, uint32_t channel, int32_t tag, const Deadline& deadline);
  // Whether a frame from `peer` on (channel, tag) is queued (deadline reports).
  [[nodiscard]] bool has_frame(int peer, uint32_t channel, int32_t tag);

  // Records the first failure and sends it to every peer (notify).
  void fail(const Status& reason, bool notify = true);
  [[nodiscard]] Status failure() const;
  [[nodiscard]] bool failed() const;

  // Channels for groups: every rank of a split takes max + 1 of the members' next channel.
  [[nodiscard]] uint32_t next_channel() const;
  void use_channels_from(uint32_t next);

 private:
  struct Link {
    int fd = -1;
    std::deque<std::shared_ptr<Send>> out;  // guarded by mutex_
    bool goodbye = false;                   // the peer said goodbye (mutex_)
    bool closed = false;                    // the connection ended (mutex_)
    // Reading state: the I/O thread's only.
    FrameHeader header;
    std::size_t header_got = 0;
    std::vector<std::byte> body;
    std::size_t body_got = 0;
  };
  using QueueKey = std::pair<uint32_t, int32_t>;

  void run();
  void wake();
  // Reads what `peer`'s socket holds; false when the connection ended.
  bool read_from(int peer);
  // Writes what `peer`'s socket takes; false on a write error.
  bool write_to(int peer);
  void deliver(int peer, FrameHeader header, std::vector<std::byte> body);
  void connection_lost(int peer, const std::string& why);
  void queue_locked(int peer, std::shared_ptr<Send> send);
  // A notice frame of failure_ (code, 4 bytes, then the message).
  [[nodiscard]] std::shared_ptr<Send> notice_locked() const;
  void say_goodbye_and_wait();

  const int rank_;
  const std::vector<PeerInfo> peers_;
  const std::chrono::milliseconds close_timeout_;
  std::vector<Link> links_;
  int wake_fds_[2] = {-1, -1};
  Status setup_error_;  // set by the constructor only

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::map<QueueKey, std::deque<std::vector<std::byte>>>> inbox_;  // by peer
  Status failure_;
  uint32_t next_channel_ = 1;
  bool stopping_ = false;
  std::thread thread_;
};

// "rank 3 (pid 4711 on hostb)".
std::string describe_peer(const Engine& engine, int r);

}  // namespace epx::socket_detail
