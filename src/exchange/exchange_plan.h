// Private: the host-side arithmetic of an exchange that every backend shares.
//
// The CPU Buffer and the CUDA backend compute their offsets, counts and the
// expanded layout here, so the two can never disagree about where a row goes.
// Everything is plain host code, unit-tested on the CPU in every build
// (tests/exchange/exchange_plan_test.cc), including the parts only the GPU
// kernels consume.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "epx/core/status.h"
#include "epx/exchange/buffer.h"

namespace epx::detail {

// Checks a BufferConfig for a world of `num_ranks` and fills the default
// placement (contiguous blocks). InvalidArgument names the field, its value
// and the limit; fp8 payloads are Unimplemented.
Status validate_buffer_config(BufferConfig* config, int num_ranks);
// Rows one rank can receive: max_recv_tokens, or num_ranks * max_tokens_per_rank when 0.
int64_t max_recv_rows(const BufferConfig& config, int num_ranks);
// Rows of max_combine_dtype in the combine region: max_recv_rows, or
// max_expanded_rows when larger.
int64_t combine_region_rows(const BufferConfig& config, int num_ranks);

// counts[s * R + d]: rows rank s sends to rank d. The row on rank d where the
// block from rank s starts: the sum of counts[q * R + d] over q < s.
int64_t block_base(std::span<const int32_t> counts, int num_ranks, int s, int d);
// All of them: offsets[s * R + d] = block_base(counts, R, s, d) (the prefix
// matrix the dispatch kernels take).
std::vector<int64_t> block_offsets(std::span<const int32_t> counts, int num_ranks);
// Rows rank d receives: the sum of counts[s * R + d] over s.
int64_t num_recv_rows(std::span<const int32_t> counts, int num_ranks, int d);

// Per-local-expert receive counts of `rank`, each rounded up to `alignment`:
// expert_counts[s * E + e] is the number of rank s's tokens that list global
// expert e.
std::vector<int32_t> aligned_recv_expert_counts(std::span<const int64_t> expert_counts, int num_ranks,
                                                const ExpertPlacement& placement, int rank, int alignment);
// Rounds n up to a multiple of alignment.
inline int64_t round_up(int64_t n, int64_t alignment) { return (n + alignment - 1) / alignment * alignment; }

// The expanded per-expert layout of one rank's received rows (buffer.h's
// ExpandedLayout) from their local top-k ids [num_recv, topk].
void build_expanded_layout(std::span<const int32_t> recv_topk_idx, int64_t num_recv, int topk, int num_local_experts,
                           int alignment, ExpandedLayout* out);

// Checks row `token` of topk_idx (topk ids): each is -1 or in [0, num_experts)
// and none twice; InvalidArgument names the first bad slot. validate_topk_idx
// runs it on every row; the CUDA backend on the row its layout kernel flagged.
Status check_topk_row(const int32_t* row, int64_t topk, int64_t token, int num_experts);

// The widest unit (16, 8, 4, 2 or 1 bytes) that divides `row_bytes` and the
// alignment of every address in `addresses`: the unit of a row copy kernel.
int row_copy_unit(std::size_t row_bytes, std::span<const void* const> addresses);

}  // namespace epx::detail
