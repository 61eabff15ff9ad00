#include "exchange/exchange_plan.h"

#include "exchange/config_check.h"
#include "exchange/payload.h"

#include <algorithm>
#include <cstdint>

namespace epx::detail {

Status validate_buffer_config(BufferConfig* config_ptr, int num_ranks) {
  BufferConfig& config = *config_ptr;
  if (config.num_experts < 1) return invalid_argument("num_experts = {} must be at least 1", config.num_experts);
  if (config.hidden < 1) return invalid_argument("hidden = {} must be at least 1", config.hidden);
  EPX_RETURN_IF_ERROR(PayloadFormat::of(*config_ptr).status());  // dtype, fp8 scales, row size
  EPX_RETURN_IF_ERROR(PayloadFormat::gradients_of(*config_ptr).status());  // gradient_dtype
  if (config.max_combine_dtype != DType::kF32 && config.max_combine_dtype != DType::kBF16)
    return invalid_argument("max_combine_dtype = {} must be bf16 or f32", dtype_name(config.max_combine_dtype));
  if (config.max_topk < 1 || config.max_topk > config.num_experts)
    return invalid_argument("max_topk = {} is outside [1, num_experts = {}]", config.max_topk, config.num_experts);
  if (config.max_tokens_per_rank < 1)
    return invalid_argument("max_tokens_per_rank = {} must be at least 1", config.max_tokens_per_rank);
  if (config.max_recv_tokens < 0)
    return invalid_argument("max_recv_tokens = {} must be 0 (the worst case) or positive", config.max_recv_tokens);
  if (config.max_expanded_rows < 0 || config.max_expanded_rows > INT32_MAX)
    return invalid_argument("max_expanded_rows = {} is outside [0 (the receive rows only), {}] (rows are indexed "
                            "with int32)", config.max_expanded_rows, INT32_MAX);
  if (config.expert_alignment < 1)
    return invalid_argument("expert_alignment = {} must be at least 1", config.expert_alignment);
  if (config.timeout.count() <= 0) return invalid_argument("timeout = {} ms must be positive", config.timeout.count());
  const int64_t max_recv = max_recv_rows(config, num_ranks);
  if (max_recv > INT32_MAX)
    return invalid_argument("max_recv_tokens = {} is above the limit {} (rows are indexed with int32)", max_recv,
                            INT32_MAX);
  return resolve_placement(&config.placement, config.num_experts, num_ranks);
}

int64_t max_recv_rows(const BufferConfig& config, int num_ranks) {
  return config.max_recv_tokens > 0 ? config.max_recv_tokens
                                    : static_cast<int64_t>(num_ranks) * config.max_tokens_per_rank;
}

int64_t combine_region_rows(const BufferConfig& config, int num_ranks) {
  return std::max(max_recv_rows(config, num_ranks), config.max_expanded_rows);
}

int64_t block_base(std::span<const int32_t> counts, int num_ranks, int s, int d) {
  int64_t base = 0;
  for (int q = 0; q < s; ++q) base += counts[static_cast<std::size_t>(q) * num_ranks + d];
  return base;
}

std::vector<int64_t> block_offsets(std::span<const int32_t> counts, int num_ranks) {
  const auto R = static_cast<std::size_t>(num_ranks);
  std::vector<int64_t> offsets(R * R, 0);
  for (std::size_t d = 0; d < R; ++d)
    for (std::size_t s = 1; s < R; ++s) offsets[s * R + d] = offsets[(s - 1) * R + d] + counts[(s - 1) * R + d];
  return offsets;
}

int64_t num_recv_rows(std::span<const int32_t> counts, int num_ranks, int d) {
  return block_base(counts, num_ranks, num_ranks, d);
}

std::vector<int32_t> aligned_recv_expert_counts(std::span<const int64_t> expert_counts, int num_ranks,
                                                const ExpertPlacement& placement, int rank, int alignment) {
  const int num_local = placement.num_local_experts(rank);
  const auto E = static_cast<std::size_t>(placement.num_experts());
  std::vector<int32_t> out(num_local, 0);
  for (int e = 0; e < num_local; ++e) {
    int64_t n = 0;
    for (int s = 0; s < num_ranks; ++s) n += expert_counts[s * E + placement.global_id(rank, e)];
    out[e] = static_cast<int32_t>(round_up(n, alignment));
  }
  return out;
}

void build_expanded_layout(std::span<const int32_t> recv_topk_idx, int64_t num_recv, int topk, int num_local_experts,
                           int alignment, ExpandedLayout* out) {
  // Group e holds the rows listing local expert e, in receive order.
  const int K = topk;
  ExpandedLayout& x = *out;
  x.num_tokens_per_expert.assign(num_local_experts, 0);
  for (int64_t row = 0; row < num_recv * K; ++row)
    if (recv_topk_idx[row] >= 0) ++x.num_tokens_per_expert[recv_topk_idx[row]];
  x.expert_offsets.assign(num_local_experts + 1, 0);
  for (int e = 0; e < num_local_experts; ++e)
    x.expert_offsets[e + 1] = x.expert_offsets[e] + round_up(x.num_tokens_per_expert[e], alignment);
  x.recv_row.assign(x.num_rows(), -1);
  x.row_of.assign(num_recv * K, -1);
  std::vector<int64_t> next(x.expert_offsets.begin(), x.expert_offsets.end() - 1);
  for (int64_t row = 0; row < num_recv; ++row)
    for (int k = 0; k < K; ++k) {
      const int32_t e = recv_topk_idx[row * K + k];
      if (e < 0) continue;
      x.row_of[row * K + k] = next[e];
      x.recv_row[next[e]++] = row;
    }
}

Status check_topk_row(const int32_t* row, int64_t topk, int64_t token, int num_experts) {
  for (int64_t k = 0; k < topk; ++k) {
    const int32_t e = row[k];
    if (e == -1) continue;
    if (e < 0 || e >= num_experts)
      return invalid_argument("topk_idx[{}][{}] = {} is outside [0, {}) and is not -1", token, k, e, num_experts);
    for (int64_t j = 0; j < k; ++j)
      if (row[j] == e) return invalid_argument("topk_idx[{}] lists expert {} twice (slots {} and {})", token, e, j, k);
  }
  return Status::ok();
}

int row_copy_unit(std::size_t row_bytes, std::span<const void* const> addresses) {
  for (int unit : {16, 8, 4, 2}) {
    bool fits = row_bytes % unit == 0;
    for (const void* a : addresses) fits = fits && reinterpret_cast<std::uintptr_t>(a) % unit == 0;
    if (fits) return unit;
  }
  return 1;
}

}  // namespace epx::detail
