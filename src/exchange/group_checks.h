// Private: the argument checks of a device exchange call made for all ranks
// at once (CudaGroup). Plain host code that never touches device memory, so
// it is unit-tested on the CPU in every build (tests/exchange/group_checks_test.cc).
// Messages name the rank, the argument, its value and the limit.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "epx/core/status.h"
#include "epx/core/tensor.h"
#include "epx/exchange/buffer.h"

namespace epx::detail {

// One argument per rank: InvalidArgument unless got == num_ranks.
Status check_per_rank(std::size_t got, int num_ranks, std::string_view what);

// One rank's dispatch inputs (the messages name no rank).
Status check_dispatch_inputs(const BufferConfig& config, const DispatchInputs& in, Device device);

// Dispatch inputs of every rank: topk_idx i32 [T, K] and x [T, hidden] of
// config.dtype on the rank's device, T <= max_tokens_per_rank, the same K in
// [1, max_topk] on every rank, topk_weights f32 [T, K] on every rank or none.
Status validate_group_dispatch(const BufferConfig& config, std::span<const DispatchInputs> inputs,
                               std::span<const Device> devices);

// Rows each destination would receive against max_recv: ResourceExhausted
// naming the first destination over it (the same message as Buffer's).
Status check_recv_capacity(std::span<const int32_t> counts, int num_ranks, int64_t max_recv);

// What one rank's combine-like call works on.
struct CombineShape {
  int64_t num_recv = 0;
  int num_tokens = 0;
  int topk = 0;
  Device device;
};
// One rank's combine arguments (the messages name no rank).
Status check_combine_inputs(const BufferConfig& config, const TensorView& y, const TensorView& out,
                            const CombineOptions& options, const CombineShape& shape);
// One rank's arguments of combine_expanded (backward = false: no gradients)
// or of its backward, against `rows` expanded rows (the messages name no
// rank): y_expanded [rows, hidden] bf16 or f32; grad_y_expanded [rows,
// hidden] f32; weights and grad_weights, when given, dense f32 [num_recv,
// topk]; every view on shape.device. combine_expanded sums in f32, so it
// needs max_combine_dtype = f32.
Status check_expanded_inputs(const BufferConfig& config, bool backward, const TensorView& y_expanded,
                             const TensorView& weights, const TensorView& grad_y_expanded,
                             const TensorView& grad_weights, int64_t rows, const CombineShape& shape);

// combine_expanded writes its partial sums into the rank's combine region
// [region, region + bytes): InvalidArgument when y_expanded lies there.
Status check_outside_combine_region(const TensorView& y_expanded, const std::byte* region, std::size_t bytes);

// Prefixes a failed status with the rank it is about ("rank 3: ...").
Status on_rank(int rank, Status status);

// Combine arguments of every rank: y [num_recv, hidden] bf16 or f32, the same
// dtype on every rank and no wider than max_combine_dtype; out [T, hidden]
// bf16 or f32; bias f32 or out's dtype; weight gradients in pairs, on every
// rank or none. `options` is empty or one per rank.
Status validate_group_combine(const BufferConfig& config, std::span<const TensorView> y,
                              std::span<const TensorView> out, std::span<const CombineOptions> options,
                              std::span<const CombineShape> shapes);

}  // namespace epx::detail
