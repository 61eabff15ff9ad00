#include "exchange/config_check.h"

#include <vector>

namespace epx::detail {

Status resolve_placement(std::optional<ExpertPlacement>* placement, int num_experts, int num_ranks) {
  if (*placement) {
    if ((*placement)->num_ranks() != num_ranks)
      return invalid_argument("the placement is for {} ranks but the transport has {}", (*placement)->num_ranks(),
                              num_ranks);
    if ((*placement)->num_experts() != num_experts)
      return invalid_argument("the placement places {} experts but num_experts = {}", (*placement)->num_experts(),
                              num_experts);
    return Status::ok();
  }
  EPX_ASSIGN_OR_RETURN(ExpertPlacement p, ExpertPlacement::contiguous(num_experts, num_ranks));
  *placement = std::move(p);
  return Status::ok();
}

int64_t placement_hash(const ExpertPlacement& placement) {
  uint64_t hash = 1469598103934665603ull;
  for (int32_t r : placement.expert_rank()) hash = (hash ^ static_cast<uint32_t>(r)) * 1099511628211ull;
  return static_cast<int64_t>(hash >> 1);
}

Status agree_on_config(Transport& transport, const Status& local_status, std::span<const int64_t> fields,
                       std::span<const char* const> names, std::string_view config, std::string_view object,
                       const Deadline& deadline) {
  // Word 0 says whether this rank's config passed its own checks.
  const std::size_t width = names.size() + 1;
  std::vector<int64_t> mine(width, 0);
  if (local_status.is_ok()) {
    EPX_CHECK_EQ(fields.size(), names.size());
    std::copy(fields.begin(), fields.end(), mine.begin() + 1);
  } else {
    mine[0] = 1;
  }
  const int num_ranks = transport.num_ranks();
  std::vector<int64_t> all(width * num_ranks);
  EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const int64_t>(mine), std::span<int64_t>(all), deadline));
  EPX_RETURN_IF_ERROR(local_status);
  for (int r = 0; r < num_ranks; ++r)
    if (all[r * width] != 0) return aborted("rank {} rejected its {}, so no {} was made", r, config, object);
  for (int r = 0; r < num_ranks; ++r)
    for (std::size_t i = 1; i < width; ++i)
      if (all[r * width + i] != all[i])
        return invalid_argument("{} differs between ranks: {} is {} on rank 0 but {} on rank {}", config, names[i - 1],
                                all[i], all[r * width + i], r);
  return Status::ok();
}

}  // namespace epx::detail
