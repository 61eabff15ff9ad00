#include "comm/socket/engine.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace epx::socket_detail {
namespace {

constexpr uint32_t kMagic = 0x65707846;  // "epxF"
// A body larger than this is a corrupt stream, not a message.
constexpr uint64_t kMaxBody = uint64_t{1} << 40;

}  // namespace

std::string describe_peer(const Engine& engine, int r) {
  const PeerInfo& p = engine.peer(r);
  return fmt::format("rank {} (pid {} on {})", r, p.pid, p.host);
}

Engine::Engine(int rank, std::vector<PeerInfo> peers, std::vector<int> fds, std::chrono::milliseconds close_timeout)
    : rank_(rank), peers_(std::move(peers)), close_timeout_(close_timeout), links_(peers_.size()),
      inbox_(peers_.size()) {
  for (std::size_t r = 0; r < fds.size(); ++r) {
    links_[r].fd = fds[r];
    if (fds[r] < 0) links_[r].closed = true;
  }
  if (::pipe2(wake_fds_, O_CLOEXEC | O_NONBLOCK) != 0) {
    setup_error_ = internal_error("pipe2 failed: {}", std::strerror(errno));
    failure_ = setup_error_;
    return;
  }
  thread_ = std::thread([this] { run(); });
}

Engine::~Engine() {
  if (thread_.joinable()) {
    say_goodbye_and_wait();
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake();
    thread_.join();
  }
  for (Link& link : links_)
    if (link.fd >= 0) ::close(link.fd);
  for (int fd : wake_fds_)
    if (fd >= 0) ::close(fd);
}

void Engine::say_goodbye_and_wait() {
  std::unique_lock lock(mutex_);
  const bool failed = !failure_.is_ok();
  for (int r = 0; r < num_ranks(); ++r) {
    if (links_[r].closed) continue;
    // A failed rank's goodbye alone would read as a clean close ("closed its
    // transport before sending") to a peer that has not yet read the notice
    // that failed this rank (it may come on another connection, later): the
    // failure goes first, on this connection. A peer already failed keeps its own.
    if (failed) queue_locked(r, notice_locked());
    auto bye = std::make_shared<Send>();
    bye->header = FrameHeader{kMagic, FrameKind::kGoodbye, 0, 0, 0};
    queue_locked(r, std::move(bye));
  }
  // A failed rank waits only for its goodbyes (and notices) to leave.
  const Deadline deadline = Deadline::after(failed ? std::chrono::milliseconds(200) : close_timeout_);
  changed_.wait_until(lock, deadline.when(), [&] {
    for (const Link& link : links_)
      if (!link.closed && (!link.out.empty() || (!failed && !link.goodbye))) return false;
    return true;
  });
}

void Engine::wake() {
  const char byte = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fds_[1], &byte, 1);
}

void Engine::queue_locked(int peer, std::shared_ptr<Send> send) {
  links_[peer].out.push_back(std::move(send));
  wake();
}

Result<std::shared_ptr<Send>> Engine::send(int peer, uint32_t channel, int32_t tag, std::vector<std::byte> prefix,
                                           std::span<const std::byte> data) {
  auto send = std::make_shared<Send>();
  send->prefix = std::move(prefix);
  send->data = data;
  send->header = FrameHeader{kMagic, FrameKind::kData, channel, tag, send->prefix.size() + data.size()};
  std::lock_guard lock(mutex_);
  if (!failure_.is_ok()) return failure_;
  if (peer == rank_) {
    // To itself: queued as if received, as a copy (the frame outlives `data`).
    std::vector<std::byte> body = std::move(send->prefix);
    body.insert(body.end(), data.begin(), data.end());
    inbox_[peer][QueueKey{channel, tag}].push_back(std::move(body));
    send->data = {};
    send->done = true;
    changed_.notify_all();
    return send;
  }
  if (links_[peer].closed || links_[peer].goodbye)
    return aborted("send to {}: it closed its transport", describe_peer(*this, peer));
  queue_locked(peer, send);
  return send;
}

Status Engine::wait_sent(const Send& send, const Deadline& deadline) {
  std::unique_lock lock(mutex_);
  changed_.wait_until(lock, deadline.when(), [&] { return send.done || !failure_.is_ok(); });
  if (send.done) return Status::ok();
  if (!failure_.is_ok()) return failure_;
  return deadline_exceeded("the send was not taken");
}

Result<std::vector<std::byte>> Engine::take(int peer, uint32_t channel, int32_t tag, const Deadline& deadline) {
  std::unique_lock lock(mutex_);
  auto& queues = inbox_[peer];
  const QueueKey key{channel, tag};
  auto ready = [&] {
    auto it = queues.find(key);
    return (it != queues.end() && !it->second.empty()) || !failure_.is_ok() || links_[peer].closed ||
           links_[peer].goodbye;
  };
  changed_.wait_until(lock, deadline.when(), ready);
  auto it = queues.find(key);
  if (it != queues.end() && !it->second.empty()) {
    std::vector<std::byte> body = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) queues.erase(it);
    return body;
  }
  if (!failure_.is_ok()) return failure_;
  if (links_[peer].closed && !links_[peer].goodbye)  // its failure is being recorded
    return aborted("{} closed its connection without closing its transport: the process exited or was killed",
                   describe_peer(*this, peer));
  if (links_[peer].closed || links_[peer].goodbye)
    return aborted("{} closed its transport before sending", describe_peer(*this, peer));
  return deadline_exceeded("nothing arrived");
}

bool Engine::has_frame(int peer, uint32_t channel, int32_t tag) {
  std::lock_guard lock(mutex_);
  auto it = inbox_[peer].find(QueueKey{channel, tag});
  return it != inbox_[peer].end() && !it->second.empty();
}

void Engine::fail(const Status& reason, bool notify) {
  std::unique_lock lock(mutex_);
  if (!failure_.is_ok()) return;
  failure_ = reason.is_ok() ? internal_error("abort() was called with an OK status") : reason;
  std::vector<std::shared_ptr<Send>> notices;
  if (notify) {
    for (int r = 0; r < num_ranks(); ++r) {
      if (links_[r].closed) continue;
      auto notice = notice_locked();
      notices.push_back(notice);
      queue_locked(r, std::move(notice));
    }
  }
  changed_.notify_all();
  // Give the notices a moment to leave before the caller (maybe) exits; the
  // I/O thread itself cannot wait for its own writes.
  if (std::this_thread::get_id() == thread_.get_id()) return;
  changed_.wait_for(lock, std::chrono::milliseconds(200), [&] {
    return std::all_of(notices.begin(), notices.end(), [](const auto& n) { return n->done; });
  });
}

std::shared_ptr<Send> Engine::notice_locked() const {
  const int32_t code = static_cast<int32_t>(failure_.code());
  auto notice = std::make_shared<Send>();
  notice->prefix.resize(sizeof(code) + failure_.message().size());
  std::memcpy(notice->prefix.data(), &code, sizeof(code));
  std::memcpy(notice->prefix.data() + sizeof(code), failure_.message().data(), failure_.message().size());
  notice->header = FrameHeader{kMagic, FrameKind::kNotice, 0, 0, notice->prefix.size()};
  return notice;
}

Status Engine::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

bool Engine::failed() const {
  std::lock_guard lock(mutex_);
  return !failure_.is_ok();
}

uint32_t Engine::next_channel() const {
  std::lock_guard lock(mutex_);
  return next_channel_;
}

void Engine::use_channels_from(uint32_t next) {
  std::lock_guard lock(mutex_);
  next_channel_ = std::max(next_channel_, next);
}

// ---------------------------------------------------------------------------
// The I/O thread

void Engine::run() {
  std::vector<pollfd> fds;
  std::vector<int> ranks;
  for (;;) {
    fds.assign(1, pollfd{wake_fds_[0], POLLIN, 0});
    ranks.assign(1, -1);
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      for (int r = 0; r < num_ranks(); ++r) {
        if (links_[r].closed) continue;
        const short events = static_cast<short>(POLLIN | (links_[r].out.empty() ? 0 : POLLOUT));
        fds.push_back(pollfd{links_[r].fd, events, 0});
        ranks.push_back(r);
      }
    }
    if (::poll(fds.data(), fds.size(), 100) < 0 && errno != EINTR) {
      fail(internal_error("poll failed: {}", std::strerror(errno)));
      return;
    }
    char drain[64];
    while (::read(wake_fds_[0], drain, sizeof(drain)) > 0) {
    }
    for (std::size_t i = 1; i < fds.size(); ++i) {
      const int r = ranks[i];
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) != 0 && !read_from(r)) continue;
      if ((fds[i].revents & POLLOUT) != 0) write_to(r);
    }
  }
}

bool Engine::read_from(int peer) {
  Link& link = links_[peer];
  for (;;) {
    std::byte* at = nullptr;
    std::size_t want = 0;
    if (link.header_got < sizeof(FrameHeader)) {
      at = reinterpret_cast<std::byte*>(&link.header) + link.header_got;
      want = sizeof(FrameHeader) - link.header_got;
    } else {
      at = link.body.data() + link.body_got;
      want = link.body.size() - link.body_got;
    }
    const ssize_t n = want == 0 ? 0 : ::recv(link.fd, at, want, 0);
    if (want != 0 && n == 0) {
      connection_lost(peer, "closed its connection");
      return false;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      if (errno == EINTR) continue;
      connection_lost(peer, fmt::format("broke its connection ({})", std::strerror(errno)));
      return false;
    }
    if (link.header_got < sizeof(FrameHeader)) {
      link.header_got += static_cast<std::size_t>(n);
      if (link.header_got < sizeof(FrameHeader)) continue;
      if (link.header.magic != kMagic || link.header.size > kMaxBody) {
        connection_lost(peer, "sent a corrupt frame");
        return false;
      }
      link.body.assign(link.header.size, std::byte{0});
      link.body_got = 0;
    } else {
      link.body_got += static_cast<std::size_t>(n);
    }
    if (link.header_got == sizeof(FrameHeader) && link.body_got == link.body.size()) {
      deliver(peer, link.header, std::move(link.body));
      link.header_got = 0;
      link.body = {};
      link.body_got = 0;
    }
  }
}

void Engine::deliver(int peer, FrameHeader header, std::vector<std::byte> body) {
  switch (header.kind) {
    case FrameKind::kData: {
      std::lock_guard lock(mutex_);
      inbox_[peer][QueueKey{header.channel, header.tag}].push_back(std::move(body));
      changed_.notify_all();
      return;
    }
    case FrameKind::kGoodbye: {
      std::lock_guard lock(mutex_);
      links_[peer].goodbye = true;
      changed_.notify_all();
      return;
    }
    case FrameKind::kNotice: {
      int32_t code = static_cast<int32_t>(StatusCode::kAborted);
      if (body.size() >= sizeof(code)) std::memcpy(&code, body.data(), sizeof(code));
      const std::string message(reinterpret_cast<const char*>(body.data()) + std::min(body.size(), sizeof(code)),
                                body.size() - std::min(body.size(), sizeof(code)));
      // As the other backends: a rank stalled by the same absent peer whose
      // deadline passed first reports a timeout too.
      const Status cause = static_cast<StatusCode>(code) == StatusCode::kDeadlineExceeded
                               ? deadline_exceeded("the deadline of {} passed first: {}", describe_peer(*this, peer),
                                                   message)
                               : aborted("{} failed: {}", describe_peer(*this, peer), message);
      fail(cause, /*notify=*/false);
      return;
    }
  }
  connection_lost(peer, "sent a frame of an unknown kind");
}

void Engine::connection_lost(int peer, const std::string& why) {
  bool expected = false;
  {
    std::lock_guard lock(mutex_);
    Link& link = links_[peer];
    expected = link.goodbye;
    link.closed = true;
    for (auto& send : link.out) send->done = false;
    link.out.clear();
    changed_.notify_all();
  }
  if (!expected)
    fail(aborted("{} {} without closing its transport: the process exited or was killed; rank {} noticed",
                 describe_peer(*this, peer), why, rank_));
}

bool Engine::write_to(int peer) {
  Link& link = links_[peer];
  for (;;) {
    std::shared_ptr<Send> send;
    {
      std::lock_guard lock(mutex_);
      if (link.out.empty() || link.closed) return true;
      send = link.out.front();
    }
    // header, prefix and data as one gather list, from where the last write stopped.
    iovec parts[3] = {{&send->header, sizeof(FrameHeader)},
                      {send->prefix.data(), send->prefix.size()},
                      {const_cast<std::byte*>(send->data.data()), send->data.size()}};
    std::size_t skip = send->written;
    int first = 0;
    while (first < 3 && skip >= parts[first].iov_len) skip -= parts[first++].iov_len;
    if (first < 3) {
      parts[first].iov_base = static_cast<char*>(parts[first].iov_base) + skip;
      parts[first].iov_len -= skip;
      msghdr message{};
      message.msg_iov = parts + first;
      message.msg_iovlen = static_cast<std::size_t>(3 - first);
      const ssize_t n = ::sendmsg(link.fd, &message, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        if (errno == EINTR) continue;
        connection_lost(peer, fmt::format("broke its connection ({})", std::strerror(errno)));
        return false;
      }
      send->written += static_cast<std::size_t>(n);
    }
    if (send->written < send->total()) continue;
    std::lock_guard lock(mutex_);
    send->done = true;
    if (!link.out.empty() && link.out.front() == send) link.out.pop_front();
    changed_.notify_all();
  }
}

}  // namespace epx::socket_detail
