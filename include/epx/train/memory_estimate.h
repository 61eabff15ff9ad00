// The memory one training rank needs, estimated from a TrainConfig before
// anything is allocated: weights, gradients and AdamW moments (expert and
// dense), the activations and backward state each MoE layer keeps, the
// exchange regions of its Buffers (Buffer::estimate_region_bytes), the
// staging of rows that cross nodes, the batch, and a slack of 10% + 4 MiB
// for the allocator, threads and GEMM library (fitted to peak RSS; the
// comparison is in docs/design.md).
//
//   EPX_ASSIGN_OR_RETURN(epx::MemoryEstimate e, epx::estimate_train_memory(config));
//   EPX_RETURN_IF_ERROR(epx::check_memory_fits(e, epx::available_memory()));
//
// Received rows are counted as if routing were balanced (batch_tokens * topk
// / ranks expanded rows per rank); a skewed routing needs more activations on
// the busiest rank. Each item names the setting that drives it, the one most
// above its default ("experts = 1000000000"). Sizes saturate instead of
// overflowing. In-process ranks share this process: copies = ranks (under
// MPI, config.transport set: 1).
#pragma once

#include "epx/core/memory.h"
#include "epx/train/run_plan.h"
#include "epx/train/trainer.h"

namespace epx {

[[nodiscard]] Result<MemoryEstimate> estimate_train_memory(const TrainConfig& config);
// The same for a plan's settings and resolved model (nothing resolved again).
[[nodiscard]] Result<MemoryEstimate> estimate_train_memory(const RunPlan& plan);
// The same for `model`, config's resolved model.
[[nodiscard]] Result<MemoryEstimate> estimate_train_memory(const TrainConfig& config, const ModelConfig& model);

}  // namespace epx
