// ExpertPlacement: which rank holds each expert, and its id on that rank.
//
// Experts are numbered globally 0..E-1 (with redundant experts these are
// physical slots). Each rank numbers the experts it holds 0..E_local-1 in
// ascending global id. The default is contiguous blocks of E/R experts.
//
//   EPX_ASSIGN_OR_RETURN(auto p, epx::ExpertPlacement::contiguous(/*num_experts=*/8, /*num_ranks=*/4));
//   p.rank_of(5);      // 2
//   p.local_id(5);     // 1
#pragma once

#include <cstdint>
#include <vector>

#include "epx/core/status.h"

namespace epx {

class ExpertPlacement {
 public:
  // Expert e on rank e / (E / R). InvalidArgument unless R divides E.
  static Result<ExpertPlacement> contiguous(int num_experts, int num_ranks);
  // Expert e on rank expert_rank[e]. A rank may hold no expert.
  static Result<ExpertPlacement> from_map(std::vector<int32_t> expert_rank, int num_ranks);

  [[nodiscard]] int num_experts() const { return static_cast<int>(expert_rank_.size()); }
  [[nodiscard]] int num_ranks() const { return num_ranks_; }
  [[nodiscard]] int rank_of(int expert) const { return expert_rank_[expert]; }
  [[nodiscard]] int local_id(int expert) const { return local_id_[expert]; }
  [[nodiscard]] int num_local_experts(int rank) const {
    return static_cast<int>(local_experts_[rank].size());
  }
  // Global id of local expert `local` on `rank`.
  [[nodiscard]] int global_id(int rank, int local) const { return local_experts_[rank][local]; }
  [[nodiscard]] const std::vector<int32_t>& expert_rank() const { return expert_rank_; }

 private:
  ExpertPlacement() = default;
  int num_ranks_ = 0;
  std::vector<int32_t> expert_rank_;
  std::vector<int32_t> local_id_;
  std::vector<std::vector<int32_t>> local_experts_;
};

}  // namespace epx
