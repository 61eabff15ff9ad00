// map_cuda_peer_memory over the in-process transport: R rank threads on GPU 0
// (each rank writes a pattern into the next rank's region through peer(),
// and every rank finds its neighbour's pattern in local()). Skipped, with the
// reason, where no GPU is. The IPC path (ranks as processes under MPI) is
// not exercised here: docs/design.md, The CUDA backend.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

#include "device_memory.h"
#include "epx/comm/cuda.h"
#include "epx/comm/inproc.h"

namespace epx::cuda_test {
namespace {

TEST(CudaPeerMemory, RankThreadsWriteIntoTheirNeighbours) {
  EPX_SKIP_WITHOUT_GPU();
  for (auto [ranks, nodes] : {std::pair{1, 1}, {4, 1}, {4, 2}}) {
    SCOPED_TRACE(::testing::Message() << ranks << " ranks as " << nodes << " nodes");
    const Topology topology = *Topology::create(ranks, nodes);
    const std::size_t bytes = 4096;
    const std::vector<Status> statuses = run_ranks(topology, [&](Transport& t) -> Status {
      const Deadline deadline = Deadline::after(Milliseconds(20000));
      EPX_ASSIGN_OR_RETURN(auto memory, map_cuda_peer_memory(t, 0, bytes, deadline));
      if (memory->size() != bytes) return internal_error("size {} != {}", memory->size(), bytes);
      const int rpn = topology.ranks_per_node();
      const int next = topology.rank_of(t.node(), (t.local_rank() + 1) % rpn);
      for (int r = 0; r < ranks; ++r)
        if ((memory->peer(r) != nullptr) != topology.same_node(r, t.rank()))
          return internal_error("peer({}) is {} on rank {}", r, static_cast<void*>(memory->peer(r)), t.rank());
      std::vector<int32_t> pattern(bytes / 4, 1000 + t.rank());
      if (cudaMemcpy(memory->peer(next), pattern.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess)
        return internal_error("cudaMemcpy into rank {} failed", next);
      EPX_RETURN_IF_ERROR(t.barrier(deadline));
      std::vector<int32_t> got(bytes / 4);
      if (cudaMemcpy(got.data(), memory->local(), bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
        return internal_error("cudaMemcpy from local() failed");
      const int prev = topology.rank_of(t.node(), (t.local_rank() + rpn - 1) % rpn);
      for (int32_t v : got)
        if (v != 1000 + prev) return internal_error("rank {} holds {}, expected {} from rank {}", t.rank(), v, 1000 + prev, prev);
      return t.barrier(deadline);  // nobody frees while a neighbour still writes
    });
    for (int r = 0; r < ranks; ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].message();
  }
}

}  // namespace
}  // namespace epx::cuda_test
