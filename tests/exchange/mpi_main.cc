// main() of the transport and exchange tests under MPI: `mpirun -n P epx_mpi_tests`.
// Each process is one rank (the MPI backend); the conformance table runs the
// shapes with P ranks and skips the others. Rank 0 prints gtest's usual
// output; other ranks print only their failures, prefixed with their rank.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>
#include <mpi.h>

#include "epx/comm/mpi.h"
#include "exchange/world.h"

namespace epx::exchange_test {
namespace {

class MpiTestWorld final : public TestWorld {
 public:
  explicit MpiTestWorld(MpiSession& session) : session_(session) {
    MPI_Comm host = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host);
    MPI_Comm_size(host, &per_host_);
    MPI_Comm_free(&host);
  }
  [[nodiscard]] std::string_view name() const override { return "mpi"; }
  [[nodiscard]] int ranks_for(int) const override { return session_.world_size(); }
  [[nodiscard]] int nodes_for(int inproc_nodes) const override {
    const int hosts = session_.world_size() / per_host_;
    return hosts > 1 || per_host_ % inproc_nodes != 0 ? hosts : inproc_nodes;
  }
  [[nodiscard]] std::string cannot_run(const Topology& topology) const override {
    if (topology.num_ranks() != session_.world_size())
      return fmt::format("{} ranks; this run has {} MPI processes", topology.num_ranks(), session_.world_size());
    if (per_host_ % topology.ranks_per_node() != 0)
      return fmt::format("{}: nodes of {} ranks cannot be made of hosts of {} processes", topology.describe(),
                         topology.ranks_per_node(), per_host_);
    return {};
  }
  std::vector<Status> run(const Topology& topology, const std::function<Status(Transport&)>& fn) override {
    std::vector<Status> statuses(static_cast<std::size_t>(topology.num_ranks()));
    my_rank_ = session_.world_rank();
    // One transport per node shape, reused by the cases (as a program would
    // reuse its transport); a failed one is replaced, on every process at once.
    std::unique_ptr<Transport>& transport = transports_[topology.ranks_per_node()];
    const bool reconnect = any(!transport || failed_.contains(transport.get()));
    if (reconnect) {
      MpiOptions options;
      options.ranks_per_node = topology.ranks_per_node();
      auto connected = session_.connect(options);
      if (!connected.is_ok()) {
        statuses[my_rank_] = connected.status();
        return statuses;
      }
      transport = std::move(*connected);
    }
    my_rank_ = transport->rank();
    if (transport->topology().num_nodes() != topology.num_nodes()) {
      statuses[my_rank_] = internal_error("the MPI transport has {} but the test asked for {}",
                                          transport->topology().describe(), topology.describe());
      return statuses;
    }
    try {
      statuses[my_rank_] = fn(*transport);
    } catch (const std::exception& e) {
      statuses[my_rank_] = internal_error("rank {} threw: {}", my_rank_, e.what());
    }
    if (!statuses[my_rank_].is_ok()) {
      transport->abort(aborted("rank {} failed: {}", my_rank_, statuses[my_rank_].to_string()));
      failed_.insert(transport.get());
    }
    return statuses;
  }
  [[nodiscard]] bool holds(int rank) const override { return rank == my_rank_; }
  void sum(std::span<int64_t> values) override {
    MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  }

 private:
  MpiSession& session_;
  int per_host_ = 1;  // processes on this host (every host has as many, or connect fails)
  int my_rank_ = -1;
  std::map<int, std::unique_ptr<Transport>> transports_;  // by ranks per node
  std::set<const Transport*> failed_;
};

// Prints failed assertions of a rank other than 0, with its rank.
class RankFailurePrinter final : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.summary());
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace epx::exchange_test

int main(int argc, char** argv) {
  using namespace epx::exchange_test;
  ::testing::InitGoogleTest(&argc, argv);
  auto session = epx::MpiSession::init(&argc, &argv);
  if (!session.is_ok()) {
    std::fprintf(stderr, "epx_mpi_tests: %s\n", session.status().to_string().c_str());
    return 1;
  }
  MpiTestWorld world(**session);
  set_test_world(&world);
  if ((*session)->world_rank() != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter((*session)->world_rank()));
  } else {
    std::printf("transport and exchange tests on the MPI backend: %d processes, %s\n", (*session)->world_size(),
                (*session)->library_version().c_str());
  }
  const int result = RUN_ALL_TESTS();
  // Every process's verdict: the run fails if any process failed.
  int worst = result;
  MPI_Allreduce(MPI_IN_PLACE, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  set_test_world(nullptr);
  return worst;
}
