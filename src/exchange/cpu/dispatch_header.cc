#include "exchange/cpu/dispatch_header.h"

#include <algorithm>

namespace epx::detail {

std::vector<int64_t> dispatch_header_words(const DispatchLayout& layout, int topk, bool has_weights) {
  std::vector<int64_t> words{layout.num_tokens, topk, has_weights ? 1 : 0};
  words.insert(words.end(), layout.num_tokens_per_rank.begin(), layout.num_tokens_per_rank.end());
  words.insert(words.end(), layout.num_tokens_per_node.begin(), layout.num_tokens_per_node.end());
  words.insert(words.end(), layout.num_tokens_per_expert.begin(), layout.num_tokens_per_expert.end());
  return words;
}

Status DispatchHeaders::check_ranks_agree(int my_rank) const {
  const int mine = topk(my_rank);
  for (int r = 0; r < R_; ++r) {
    if (topk(r) != mine)
      return invalid_argument("topk differs between ranks: rank {} passes {} and rank {} passes {}", my_rank, mine, r,
                              topk(r));
    if (has_weights(r) != has_weights(0))
      return invalid_argument("rank 0 {} topk_weights but rank {} {}; pass them on every rank or none",
                              has_weights(0) ? "passes" : "does not pass", r, has_weights(r) ? "does" : "does not");
  }
  return Status::ok();
}

std::vector<int32_t> DispatchHeaders::rank_counts() const {
  std::vector<int32_t> counts(static_cast<std::size_t>(R_) * R_);
  for (int s = 0; s < R_; ++s)
    for (int d = 0; d < R_; ++d) counts[static_cast<std::size_t>(s) * R_ + d] = static_cast<int32_t>(rows_to_rank(s, d));
  return counts;
}

std::vector<int32_t> DispatchHeaders::node_counts() const {
  std::vector<int32_t> counts(static_cast<std::size_t>(R_) * N_);
  for (int s = 0; s < R_; ++s)
    for (int n = 0; n < N_; ++n) counts[static_cast<std::size_t>(s) * N_ + n] = static_cast<int32_t>(rows_to_node(s, n));
  return counts;
}

std::vector<int64_t> DispatchHeaders::expert_counts() const {
  std::vector<int64_t> counts(static_cast<std::size_t>(R_) * E_);
  for (int s = 0; s < R_; ++s)
    for (int e = 0; e < E_; ++e) counts[static_cast<std::size_t>(s) * E_ + e] = rows_for_expert(s, e);
  return counts;
}

}  // namespace epx::detail
