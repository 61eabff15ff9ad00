// main() of the transport and exchange tests on the socket backend: every
// rank is a thread of this process with a transport of its own (its own TCP
// connections, its own I/O thread, shared memory through /dev/shm), met
// through a MemoryStore, so the whole backend runs as it does across
// processes. Emulated nodes (ranks_per_node) put the two-hop path on TCP.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <thread>

#include <fmt/format.h>

#include "epx/comm/socket.h"
#include "exchange/world.h"

namespace epx::exchange_test {
namespace {

class SocketTestWorld final : public TestWorld {
 public:
  [[nodiscard]] std::string_view name() const override { return "socket"; }
  [[nodiscard]] int ranks_for(int inproc_ranks) const override { return inproc_ranks; }
  [[nodiscard]] int nodes_for(int inproc_nodes) const override { return inproc_nodes; }
  [[nodiscard]] std::string cannot_run(const Topology&) const override { return {}; }
  std::vector<Status> run(const Topology& topology, const std::function<Status(Transport&)>& fn) override {
    const int R = topology.num_ranks();
    std::vector<Status> statuses(static_cast<std::size_t>(R));
    MemoryStore store;
    const std::string prefix = fmt::format("run{}", ++runs_);
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r) {
      threads.emplace_back([&, r] {
        SocketOptions options;
        options.rank = r;
        options.world_size = R;
        options.address = "127.0.0.1";
        options.ranks_per_node = topology.ranks_per_node();
        options.prefix = prefix;
        options.setup_timeout = std::chrono::seconds(60);
        statuses[r] = run_rank(store, options, fn);
      });
    }
    for (std::thread& t : threads) t.join();
    return statuses;
  }
  [[nodiscard]] bool holds(int) const override { return true; }
  void sum(std::span<int64_t>) override {}

 private:
  static Status run_rank(KeyValueStore& store, const SocketOptions& options,
                         const std::function<Status(Transport&)>& fn) {
    Result<std::unique_ptr<Transport>> transport = connect_sockets(store, options);
    if (!transport.is_ok()) return transport.status();
    if ((*transport)->rank() != options.rank)
      return internal_error("launcher rank {} became rank {}", options.rank, (*transport)->rank());
    Status status;
    try {
      status = fn(**transport);
    } catch (const std::exception& e) {
      status = internal_error("rank {} threw: {}", options.rank, e.what());
    }
    if (!status.is_ok()) (*transport)->abort(aborted("rank {} failed: {}", options.rank, status.to_string()));
    return status;
  }
  std::atomic<int> runs_{0};
};

}  // namespace
}  // namespace epx::exchange_test

int main(int argc, char** argv) {
  using namespace epx::exchange_test;
  ::testing::InitGoogleTest(&argc, argv);
  SocketTestWorld world;
  set_test_world(&world);
  std::printf("transport and exchange tests on the socket backend (ranks: threads, each with its own connections)\n");
  const int result = RUN_ALL_TESTS();
  set_test_world(nullptr);
  return result;
}
