#include "comm/collective.h"

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

namespace epx::detail {
namespace {

bool reducible(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kI32 || dtype == DType::kI64;
}

template <typename T>
T apply(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;  // wraps instead of overflowing
        return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
      } else {
        return a + b;
      }
    case ReduceOp::kMax: return b > a ? b : a;
    case ReduceOp::kMin: return b < a ? b : a;
  }
  return a;
}

template <typename T>
void reduce_typed(std::span<const std::byte* const> contributions, std::size_t count, ReduceOp op, void* data) {
  T* out = static_cast<T*>(data);
  if (count == 0 || contributions.empty()) return;
  std::memcpy(out, contributions[0], count * sizeof(T));
  for (std::size_t r = 1; r < contributions.size(); ++r) {
    const std::byte* in = contributions[r];
    for (std::size_t i = 0; i < count; ++i) {
      T value;
      std::memcpy(&value, in + i * sizeof(T), sizeof(T));
      out[i] = apply(out[i], value, op);
    }
  }
}

}  // namespace

std::string_view collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kBarrier: return "barrier";
    case CollectiveOp::kAllGather: return "all_gather_bytes";
    case CollectiveOp::kAllToAll: return "all_to_all_bytes";
    case CollectiveOp::kAllReduce: return "all_reduce_raw";
    case CollectiveOp::kMapPeerMemory: return "map_peer_memory";
  }
  return "unknown collective";
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

Status validate_collective(std::span<const CollectiveDescriptor> all, uint64_t seq) {
  const int num_ranks = static_cast<int>(all.size());
  const CollectiveDescriptor& first = all[0];
  for (int r = 1; r < num_ranks; ++r) {
    const CollectiveDescriptor& e = all[r];
    if (e.seq != first.seq)
      return invalid_argument(
          "collective #{} of rank 0 met collective #{} of rank {} ({}); a rank skipped a collective the others made",
          first.seq, e.seq, r, collective_op_name(e.op));
    if (e.op != first.op)
      return invalid_argument(
          "collective #{}: rank 0 called {} but rank {} called {}; every rank must call the collectives in the same "
          "order",
          seq, collective_op_name(first.op), r, collective_op_name(e.op));
  }
  const std::string what = fmt::format("{} #{}", collective_op_name(first.op), seq);
  switch (first.op) {
    case CollectiveOp::kBarrier:
      return Status::ok();
    case CollectiveOp::kAllGather:
    case CollectiveOp::kAllToAll:
      for (int r = 1; r < num_ranks; ++r) {
        const CollectiveDescriptor& e = all[r];
        if (e.in_bytes != first.in_bytes)
          return invalid_argument("{}: rank 0 passed {} bytes but rank {} passed {} bytes; every rank must pass the same size",
                                  what, first.in_bytes, r, e.in_bytes);
      }
      for (int r = 0; r < num_ranks; ++r) {
        const CollectiveDescriptor& e = all[r];
        if (first.op == CollectiveOp::kAllGather && e.out_bytes != e.in_bytes * num_ranks)
          return invalid_argument("{}: rank {} passed out of {} bytes for {} ranks x {} bytes = {} bytes", what, r,
                                  e.out_bytes, num_ranks, e.in_bytes, e.in_bytes * num_ranks);
        if (first.op == CollectiveOp::kAllToAll && (e.out_bytes != e.in_bytes || e.in_bytes % num_ranks != 0))
          return invalid_argument(
              "{}: rank {} passed in of {} bytes and out of {} bytes; they must be equal and a multiple of num_ranks = {}",
              what, r, e.in_bytes, e.out_bytes, num_ranks);
      }
      return Status::ok();
    case CollectiveOp::kAllReduce:
      for (int r = 1; r < num_ranks; ++r) {
        const CollectiveDescriptor& e = all[r];
        if (e.count != first.count)
          return invalid_argument("{}: rank 0 passed {} elements but rank {} passed {}; every rank must pass the same count",
                                  what, first.count, r, e.count);
        if (e.dtype != first.dtype)
          return invalid_argument("{}: rank 0 passed dtype {} but rank {} passed {}", what, dtype_name(first.dtype), r,
                                  dtype_name(e.dtype));
        if (e.reduce_op != first.reduce_op)
          return invalid_argument("{}: rank 0 passed op {} but rank {} passed {}", what,
                                  reduce_op_name(first.reduce_op), r, reduce_op_name(e.reduce_op));
      }
      if (!reducible(first.dtype))
        return invalid_argument("{}: dtype {} cannot be reduced; use f32, f64, i32 or i64", what,
                                dtype_name(first.dtype));
      return Status::ok();
    case CollectiveOp::kMapPeerMemory:
      for (int r = 1; r < num_ranks; ++r) {
        const CollectiveDescriptor& e = all[r];
        if (e.in_bytes != first.in_bytes)
          return invalid_argument("{}: rank 0 asked for {} bytes but rank {} asked for {} bytes; every rank must ask for "
                                  "the same size",
                                  what, first.in_bytes, r, e.in_bytes);
      }
      for (int r = 0; r < num_ranks; ++r) {
        if (!all[r].allocated)
          return resource_exhausted("{}: rank {} could not allocate {} bytes of peer memory", what, r, first.in_bytes);
      }
      return Status::ok();
  }
  return internal_error("{}: unknown collective", what);
}

void reduce_in_rank_order(std::span<const std::byte* const> contributions, std::size_t count, DType dtype,
                          ReduceOp op, void* out) {
  switch (dtype) {
    case DType::kF32: reduce_typed<float>(contributions, count, op, out); return;
    case DType::kF64: reduce_typed<double>(contributions, count, op, out); return;
    case DType::kI32: reduce_typed<int32_t>(contributions, count, op, out); return;
    case DType::kI64: reduce_typed<int64_t>(contributions, count, op, out); return;
    default: EPX_CHECK(!"reduce_in_rank_order: a dtype that validate_collective rejects");
  }
}

TransportCounters AtomicCounters::snapshot() const {
  TransportCounters c;
  c.inter_node_bytes = inter_node_bytes_.load(std::memory_order_relaxed);
  c.inter_node_messages = inter_node_messages_.load(std::memory_order_relaxed);
  c.intra_node_bytes = intra_node_bytes_.load(std::memory_order_relaxed);
  c.intra_node_messages = intra_node_messages_.load(std::memory_order_relaxed);
  c.collective_calls = collective_calls_.load(std::memory_order_relaxed);
  c.collective_bytes = collective_bytes_.load(std::memory_order_relaxed);
  return c;
}

void AtomicCounters::reset() {
  for (std::atomic<uint64_t>* c : {&inter_node_bytes_, &inter_node_messages_, &intra_node_bytes_,
                                   &intra_node_messages_, &collective_calls_, &collective_bytes_})
    c->store(0, std::memory_order_relaxed);
}

std::string rank_list(std::span<const int> ranks, std::span<const int> world_ranks) {
  auto list = [&](bool world) {
    std::string out = ranks.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < ranks.size(); ++i)
      out += (i ? ", " : "") + std::to_string(world ? world_ranks[ranks[i]] : ranks[i]);
    return out;
  };
  if (world_ranks.empty()) return list(false);
  return fmt::format("{} ({} of the group)", list(true), list(false));
}

std::string arrival_report(std::span<const Arrival> arrivals, std::span<const int> world_ranks) {
  std::vector<int> by_kind[4];
  for (int r = 0; r < static_cast<int>(arrivals.size()); ++r) by_kind[static_cast<int>(arrivals[r])].push_back(r);
  const std::vector<int>& arrived = by_kind[static_cast<int>(Arrival::kArrived)];
  const std::vector<int>& missing = by_kind[static_cast<int>(Arrival::kMissing)];
  const std::vector<int>& behind = by_kind[static_cast<int>(Arrival::kBehind)];
  const std::vector<int>& unknown = by_kind[static_cast<int>(Arrival::kUnknown)];
  auto names = [&](const std::vector<int>& ranks) { return rank_list(ranks, world_ranks); };
  std::string out;
  if (!missing.empty()) {
    out = fmt::format("{} did not arrive", names(missing));
  } else {
    out = "every rank visible from here had arrived (one stalled inside the collective, or on another host)";
  }
  std::string waited;
  if (!arrived.empty()) waited = fmt::format("{} waited", names(arrived));
  if (!behind.empty())
    waited += fmt::format("{}{} {} still waiting in an earlier collective", waited.empty() ? "" : "; ",
                          names(behind), behind.size() == 1 ? "was" : "were");
  if (!waited.empty()) out += fmt::format(" ({})", waited);
  if (!unknown.empty()) out += fmt::format("; {} not seen from this host", names(unknown));
  return out;
}

Status check_peer_and_tag(int peer, int tag, int num_ranks) {
  if (peer < 0 || peer >= num_ranks) return invalid_argument("peer = {} is outside [0, {})", peer, num_ranks);
  if (tag < 0) return invalid_argument("tag = {} must be at least 0", tag);
  return Status::ok();
}

}  // namespace epx::detail
