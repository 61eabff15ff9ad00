#include "exchange/world.h"

#include "epx/comm/inproc.h"

namespace epx::exchange_test {
namespace {

class InprocTestWorld final : public TestWorld {
 public:
  [[nodiscard]] std::string_view name() const override { return "inproc"; }
  [[nodiscard]] int ranks_for(int inproc_ranks) const override { return inproc_ranks; }
  [[nodiscard]] int nodes_for(int inproc_nodes) const override { return inproc_nodes; }
  [[nodiscard]] std::string cannot_run(const Topology&) const override { return {}; }
  std::vector<Status> run(const Topology& topology, const std::function<Status(Transport&)>& fn) override {
    InprocWorld world(topology);
    return world.run(fn);
  }
  [[nodiscard]] bool holds(int) const override { return true; }
  void sum(std::span<int64_t>) override {}
};

TestWorld* g_world = nullptr;

}  // namespace

TestWorld& test_world() {
  static InprocTestWorld inproc;
  return g_world != nullptr ? *g_world : inproc;
}

void set_test_world(TestWorld* world) { g_world = world; }

}  // namespace epx::exchange_test
