// How a test runs its ranks: all of them as threads of this process (the
// in-process backend, the default), or one per process (the MPI backend:
// the same test binary started by mpirun, see mpi_main.cc).
//
// A test that must pass on both calls test_world().run() and checks only the
// ranks it holds(); anything summed over ranks goes through sum(), called the
// same number of times by every process (so: before any early return).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "epx/comm/topology.h"
#include "epx/comm/transport.h"

namespace epx::exchange_test {

class TestWorld {
 public:
  virtual ~TestWorld() = default;
  [[nodiscard]] virtual std::string_view name() const = 0;
  // How many ranks a test that can use any number should use: `inproc_ranks`
  // in-process, the number of processes under MPI.
  [[nodiscard]] virtual int ranks_for(int inproc_ranks) const = 0;
  // How many nodes such a test should use: `inproc_nodes` in-process and on
  // one MPI host (emulated), the number of hosts when MPI spans several.
  [[nodiscard]] virtual int nodes_for(int inproc_nodes) const = 0;
  // Empty when `topology` can run here, else why not (the test is skipped).
  [[nodiscard]] virtual std::string cannot_run(const Topology& topology) const = 0;
  // Runs fn on every rank of `topology` held here and returns one status per
  // rank (OK for ranks held elsewhere).
  virtual std::vector<Status> run(const Topology& topology, const std::function<Status(Transport&)>& fn) = 0;
  // Whether this process runs `rank` (of the last run's topology).
  [[nodiscard]] virtual bool holds(int rank) const = 0;
  // Element-wise sums over every process.
  virtual void sum(std::span<int64_t> values) = 0;
  bool any(bool mine) {
    int64_t v = mine ? 1 : 0;
    sum(std::span<int64_t>(&v, 1));
    return v > 0;
  }
};

// The world the tests run in: in-process unless a main installed another.
TestWorld& test_world();
void set_test_world(TestWorld* world);

}  // namespace epx::exchange_test

// Skips a test when the world cannot run a (ranks, nodes) shape (MPI:
// another process count), saying why.
#define EPX_SKIP_UNLESS_RUNNABLE(num_ranks, num_nodes)                                                           \
  do {                                                                                                           \
    const std::string why =                                                                                      \
        ::epx::exchange_test::test_world().cannot_run(*::epx::Topology::create(num_ranks, num_nodes));           \
    if (!why.empty())                                                                                            \
      GTEST_SKIP() << "the " << ::epx::exchange_test::test_world().name() << " world cannot run " << why;       \
  } while (false)
