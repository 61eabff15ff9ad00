// The words each rank sends the others before a dispatch moves any row:
// its token count, top-k, whether it passes weights, and its layout's
// counts per destination rank, node and expert. Buffer::Impl::gather_header
// exchanges them as int64 words; DispatchHeaders reads them back by name.
#pragma once

#include <cstdint>
#include <vector>

#include "epx/core/status.h"
#include "epx/exchange/layout.h"

namespace epx::detail {

// This rank's header words (without gather_header's status and stamp words).
std::vector<int64_t> dispatch_header_words(const DispatchLayout& layout, int topk, bool has_weights);

// Every rank's header, as gathered: `all` holds num_ranks equal blocks, each
// gather_header's status word, then dispatch_header_words, then (recording
// waits) an arrival stamp.
class DispatchHeaders {
 public:
  DispatchHeaders(const std::vector<int64_t>& all, int num_ranks, int num_nodes, int num_experts)
      : all_(all), stride_(all.size() / static_cast<std::size_t>(num_ranks)), R_(num_ranks), N_(num_nodes),
        E_(num_experts) {}

  [[nodiscard]] int topk(int rank) const { return static_cast<int>(word(rank, kTopk)); }
  [[nodiscard]] bool has_weights(int rank) const { return word(rank, kHasWeights) != 0; }
  // Rows rank `src` sends to rank `dst`, to node `node`, and for expert `expert`.
  [[nodiscard]] int64_t rows_to_rank(int src, int dst) const { return word(src, kCounts + dst); }
  [[nodiscard]] int64_t rows_to_node(int src, int node) const { return word(src, kCounts + R_ + node); }
  [[nodiscard]] int64_t rows_for_expert(int src, int expert) const { return word(src, kCounts + R_ + N_ + expert); }

  // The same top-k, and weights passed by every rank or by none.
  [[nodiscard]] Status check_ranks_agree(int my_rank) const;
  // rows_to_rank as a num_ranks x num_ranks matrix, [src * R + dst].
  [[nodiscard]] std::vector<int32_t> rank_counts() const;
  // rows_to_node as a num_ranks x num_nodes matrix, [src * N + node].
  [[nodiscard]] std::vector<int32_t> node_counts() const;
  // rows_for_expert as a num_ranks x num_experts matrix, [src * E + expert].
  [[nodiscard]] std::vector<int64_t> expert_counts() const;

 private:
  // Word positions after gather_header's status word.
  static constexpr std::size_t kNumTokens = 0, kTopk = 1, kHasWeights = 2, kCounts = 3;
  [[nodiscard]] int64_t word(int rank, std::size_t i) const { return all_[rank * stride_ + 1 + i]; }

  const std::vector<int64_t>& all_;
  std::size_t stride_;
  int R_, N_, E_;
};

}  // namespace epx::detail
