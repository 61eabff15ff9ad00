#include "comm/socket/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <thread>

#include <fmt/format.h>

namespace epx::socket_detail {
namespace {

constexpr uint32_t kHelloMagic = 0x65707848;  // "epxH"

// The first bytes on every connection: who connects, to which run.
struct Hello {
  uint32_t magic = kHelloMagic;
  int32_t rank = 0;
  uint64_t job = 0;
};

// A socket closed on scope exit unless released.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    reset();
    fd_ = other.release();
    return *this;
  }
  [[nodiscard]] int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset() {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }

 private:
  int fd_;
};

Status errno_error(std::string_view what) { return internal_error("{} failed: {}", what, std::strerror(errno)); }

// Waits for `events` on `fd` until the deadline.
Status wait_for(int fd, short events, const Deadline& deadline, std::string_view what) {
  for (;;) {
    const auto left = std::chrono::duration_cast<Milliseconds>(deadline.remaining()).count();
    if (left <= 0) return deadline_exceeded("{}: no answer in time", what);
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (n > 0) return Status::ok();
    if (n < 0 && errno != EINTR) return errno_error("poll");
  }
}

// Reads or writes exactly `bytes` on non-blocking `fd`.
Status transfer(int fd, void* at, std::size_t bytes, bool write, const Deadline& deadline, std::string_view what) {
  auto* p = static_cast<char*>(at);
  while (bytes > 0) {
    const ssize_t n = write ? ::send(fd, p, bytes, MSG_NOSIGNAL) : ::recv(fd, p, bytes, 0);
    if (n > 0) {
      p += n;
      bytes -= static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) return aborted("{}: the connection closed", what);
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return errno_error(what);
    EPX_RETURN_IF_ERROR(wait_for(fd, write ? POLLOUT : POLLIN, deadline, what));
  }
  return Status::ok();
}

Result<Fd> new_socket() {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return errno_error("socket");
  return fd;
}

// Listens on every interface, on a port the kernel picks (*port).
Result<Fd> listen_any(int backlog, int* port) {
  EPX_ASSIGN_OR_RETURN(Fd fd, new_socket());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return errno_error("bind");
  if (::listen(fd.get(), std::max(backlog, 16)) != 0) return errno_error("listen");
  socklen_t length = sizeof(addr);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &length) != 0) return errno_error("getsockname");
  *port = ntohs(addr.sin_port);
  return fd;
}

// Connects to `peer` (retrying refusals until the deadline: its network may come up late).
Result<Fd> connect_to(const PeerInfo& peer, const Deadline& deadline, std::string_view who) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(peer.port);
  if (const int rc = ::getaddrinfo(peer.address.c_str(), port.c_str(), &hints, &found); rc != 0)
    return invalid_argument("{}'s address {} does not resolve: {}", who, peer.address, ::gai_strerror(rc));
  const sockaddr_in target = *reinterpret_cast<const sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  for (;;) {
    EPX_ASSIGN_OR_RETURN(Fd fd, new_socket());
    int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&target), sizeof(target));
    if (rc != 0 && errno == EINPROGRESS) {
      EPX_RETURN_IF_ERROR(wait_for(fd.get(), POLLOUT, deadline, fmt::format("connecting to {}", who)));
      int error = 0;
      socklen_t length = sizeof(error);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
      errno = error;
      rc = error == 0 ? 0 : -1;
    }
    if (rc == 0) return fd;
    if ((errno != ECONNREFUSED && errno != ENETUNREACH && errno != EHOSTUNREACH) || deadline.expired())
      return internal_error("connecting to {} at {}:{} failed: {}", who, peer.address, peer.port, std::strerror(errno));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

struct Entry {
  PeerInfo info;
  int launcher_rank = 0;
};

Result<Entry> parse_entry(const std::string& text, int launcher_rank) {
  Entry entry;
  entry.launcher_rank = launcher_rank;
  std::istringstream in(text);
  if (!(in >> entry.info.address >> entry.info.port >> entry.info.pid >> entry.info.host))
    return invalid_argument("the store's entry of rank {} is not \"address port pid host\": '{}'", launcher_rank, text);
  return entry;
}

// Orders the entries node-major: hosts by their lowest launcher rank, then
// launcher rank; checks every host holds as many ranks and sets *ranks_per_node.
Status number_node_major(std::vector<Entry>* entries, int asked_per_node, int* ranks_per_node) {
  std::map<std::string, int> first_rank;
  std::map<std::string, int> count;
  for (const Entry& e : *entries) {
    first_rank.try_emplace(e.info.host, e.launcher_rank);
    ++count[e.info.host];
  }
  const int per_host = count.begin()->second;
  for (const auto& [host, n] : count)
    if (n != per_host)
      return invalid_argument("host {} runs {} ranks but host {} runs {}; epx needs the same number of ranks on every "
                              "node",
                              count.begin()->first, per_host, host, n);
  std::stable_sort(entries->begin(), entries->end(), [&](const Entry& a, const Entry& b) {
    return std::pair(first_rank[a.info.host], a.launcher_rank) < std::pair(first_rank[b.info.host], b.launcher_rank);
  });
  *ranks_per_node = asked_per_node == 0 ? per_host : asked_per_node;
  if (*ranks_per_node < 1 || per_host % *ranks_per_node != 0)
    return invalid_argument("ranks_per_node = {} must divide the {} ranks per host{}", asked_per_node, per_host,
                            asked_per_node < 0 ? " (and be at least 1)" : "");
  return Status::ok();
}

Status check_options(const SocketOptions& o) {
  if (o.world_size < 1) return invalid_argument("world_size = {} must be at least 1", o.world_size);
  if (o.rank < 0 || o.rank >= o.world_size)
    return invalid_argument("rank = {} is outside [0, world_size = {})", o.rank, o.world_size);
  if (o.address.empty())
    return invalid_argument("address is empty: give the address the other ranks reach this rank at");
  if (o.address.find_first_of(" \t\n") != std::string::npos)
    return invalid_argument("address '{}' contains white space", o.address);
  return Status::ok();
}

// The connections of `me`: it connects to every lower rank and accepts every higher one.
Status connect_mesh(Mesh& mesh, Fd& listener, uint64_t job, const Deadline& deadline) {
  const int R = mesh.topology.num_ranks();
  std::vector<Fd> fds(static_cast<std::size_t>(R));
  for (int q = 0; q < mesh.rank; ++q) {
    const std::string who = fmt::format("rank {} (pid {} on {})", q, mesh.peers[q].pid, mesh.peers[q].host);
    EPX_ASSIGN_OR_RETURN(fds[q], connect_to(mesh.peers[q], deadline, who));
    Hello hello{kHelloMagic, mesh.rank, job};
    EPX_RETURN_IF_ERROR(transfer(fds[q].get(), &hello, sizeof(hello), true, deadline, "greeting " + who));
  }
  for (int accepted = mesh.rank + 1; accepted < R;) {
    EPX_RETURN_IF_ERROR(wait_for(listener.get(), POLLIN, deadline,
                                 fmt::format("rank {} waiting for ranks above it to connect", mesh.rank)));
    Fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (fd.get() < 0) continue;
    Hello hello;
    if (!transfer(fd.get(), &hello, sizeof(hello), false, deadline, "a greeting").is_ok()) continue;
    // Someone else's connection (another run, a port scan): dropped.
    if (hello.magic != kHelloMagic || hello.job != job || hello.rank <= mesh.rank || hello.rank >= R ||
        fds[hello.rank].get() >= 0)
      continue;
    fds[hello.rank] = std::move(fd);
    ++accepted;
  }
  mesh.fds.assign(static_cast<std::size_t>(R), -1);
  for (int r = 0; r < R; ++r) {
    if (r == mesh.rank) continue;
    const int one = 1;
    ::setsockopt(fds[r].get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    mesh.fds[r] = fds[r].release();
  }
  return Status::ok();
}

}  // namespace

Result<Mesh> rendezvous(KeyValueStore& store, const SocketOptions& options) {
  EPX_RETURN_IF_ERROR(check_options(options));
  const Deadline deadline = Deadline::after(options.setup_timeout);
  int port = 0;
  EPX_ASSIGN_OR_RETURN(Fd listener, listen_any(options.world_size, &port));
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string key = options.prefix + "/rank/";
  EPX_RETURN_IF_ERROR(
      store.set(key + std::to_string(options.rank), fmt::format("{} {} {} {}", options.address, port, ::getpid(), host)));
  std::vector<Entry> entries;
  for (int r = 0; r < options.world_size; ++r) {
    Result<std::string> text = store.get(key + std::to_string(r), deadline);
    if (!text.is_ok())
      return Status(text.status().code(), fmt::format("rank {} waiting for the entry of rank {} in the store: {}",
                                                      options.rank, r, text.status().message()));
    EPX_ASSIGN_OR_RETURN(Entry entry, parse_entry(*text, r));
    entries.push_back(std::move(entry));
  }
  int ranks_per_node = 0;
  EPX_RETURN_IF_ERROR(number_node_major(&entries, options.ranks_per_node, &ranks_per_node));
  Mesh mesh;
  EPX_ASSIGN_OR_RETURN(mesh.topology, Topology::create(options.world_size, options.world_size / ranks_per_node));
  for (int r = 0; r < options.world_size; ++r) {
    if (entries[r].launcher_rank == options.rank) mesh.rank = r;
    mesh.peers.push_back(entries[r].info);
  }
  mesh.job = fmt::format("{}-{}", mesh.peers[0].pid, mesh.peers[0].port);
  EPX_RETURN_IF_ERROR(connect_mesh(mesh, listener, std::hash<std::string>()(mesh.job + options.prefix), deadline));
  return mesh;
}

}  // namespace epx::socket_detail
