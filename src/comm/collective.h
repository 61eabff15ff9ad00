// What every backend's collectives share (private): the description of one
// rank's part of a collective, the check that every rank called the same
// collective with consistent sizes, and the rank-order reduction that gives
// every rank and every backend the same bits.
//
// Each backend gathers every rank's CollectiveDescriptor (in-process: slots
// in shared memory; MPI: an all-gather of the descriptors before the data)
// and calls validate_collective on the same array on every rank, so every
// rank reaches the same verdict and a mismatch is InvalidArgument everywhere.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "epx/comm/transport.h"
#include "epx/core/dtype.h"
#include "epx/core/status.h"

namespace epx::detail {

enum class CollectiveOp : uint8_t { kBarrier, kAllGather, kAllToAll, kAllReduce, kMapPeerMemory };

std::string_view collective_op_name(CollectiveOp op);
std::string_view reduce_op_name(ReduceOp op);

// One rank's part of one collective. Trivially copyable: the MPI backend
// exchanges it as bytes.
struct CollectiveDescriptor {
  uint64_t seq = 0;        // the collective's number on this rank (1, 2, ...)
  uint64_t in_bytes = 0;   // map_peer_memory: the bytes asked for
  uint64_t out_bytes = 0;
  uint64_t count = 0;      // all_reduce elements
  CollectiveOp op = CollectiveOp::kBarrier;
  DType dtype = DType::kF32;
  ReduceOp reduce_op = ReduceOp::kSum;
  bool allocated = true;   // map_peer_memory: this rank's region exists
  uint8_t reserved[4] = {};
};

// OK when every rank's descriptor (all[r] from rank r) agrees with rank 0's
// on the op and on what must match, and each is consistent in itself.
Status validate_collective(std::span<const CollectiveDescriptor> all, uint64_t seq);

// out = ((contribution 0 op contribution 1) op contribution 2) ..., element by
// element; integer sums wrap. `dtype` must be kF32, kF64, kI32 or kI64.
// Contributions need no alignment.
void reduce_in_rank_order(std::span<const std::byte* const> contributions, std::size_t count, DType dtype,
                          ReduceOp op, void* out);

// One rank's TransportCounters, counted by its thread and read from any.
class AtomicCounters {
 public:
  void count_message(bool same_node, std::size_t bytes) {
    (same_node ? intra_node_bytes_ : inter_node_bytes_).fetch_add(bytes, std::memory_order_relaxed);
    (same_node ? intra_node_messages_ : inter_node_messages_).fetch_add(1, std::memory_order_relaxed);
  }
  void count_collective(std::size_t bytes) {
    collective_calls_.fetch_add(1, std::memory_order_relaxed);
    collective_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  [[nodiscard]] TransportCounters snapshot() const;
  void reset();

 private:
  std::atomic<uint64_t> inter_node_bytes_{0};
  std::atomic<uint64_t> inter_node_messages_{0};
  std::atomic<uint64_t> intra_node_bytes_{0};
  std::atomic<uint64_t> intra_node_messages_{0};
  std::atomic<uint64_t> collective_calls_{0};
  std::atomic<uint64_t> collective_bytes_{0};
};

// Whether a rank had arrived at a collective when another gave up waiting:
// arrived, missing, still waiting in an earlier collective (held up by a
// missing rank itself), or not visible from here (MPI: another host).
enum class Arrival : uint8_t { kArrived, kMissing, kBehind, kUnknown };

// For deadline messages, from every rank's arrival: "rank 2 did not arrive
// (ranks 1, 3 waited; rank 0 was still waiting in an earlier collective)";
// ranks whose arrival this rank cannot see are listed as not seen from here.
// In a group (world_ranks: the world rank of each group rank) ranks are
// named by world rank first: "rank 6 (rank 2 of the group) did not arrive".
std::string arrival_report(std::span<const Arrival> arrivals, std::span<const int> world_ranks = {});

// "rank 2", "ranks 0, 1, 3"; in a group "ranks 4, 5 (ranks 0, 1 of the group)".
std::string rank_list(std::span<const int> ranks, std::span<const int> world_ranks = {});

// InvalidArgument unless 0 <= peer < num_ranks and tag >= 0.
Status check_peer_and_tag(int peer, int tag, int num_ranks);

}  // namespace epx::detail
