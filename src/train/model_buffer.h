// The BufferConfig of an MoEModel's exchange Buffers, built in one place:
// MoEModel creates its Buffers from it and estimate_train_memory sizes their
// regions from it, so the estimate follows every change to the model's
// Buffers (dtypes, receiver weights' max_expanded_rows, placement).
#pragma once

#include "epx/exchange/buffer.h"
#include "epx/train/model.h"

namespace epx::detail {

// The Buffer over `num_experts` experts (EPLB: slots) on `num_ranks` ranks.
// rank_major: slots rank-major (EPLB), so a contiguous placement, and
// num_experts must be a multiple of num_ranks; otherwise m.placement.
[[nodiscard]] Result<BufferConfig> model_buffer_config(const ModelConfig& m, int num_experts, int num_ranks,
                                                       bool rank_major);

}  // namespace epx::detail
