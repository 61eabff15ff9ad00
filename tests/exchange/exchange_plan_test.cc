// The host-side arithmetic shared by the CPU Buffer and the CUDA backend
// (exchange/exchange_plan.h): offsets, counts, the expanded layout, the
// top-k row check and the copy unit. Runs in every build, GPU or not.
#include "exchange/exchange_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <random>

#include "epx/exchange/layout.h"
#include "exchange/reference.h"

namespace epx::detail {
namespace {

// counts[s * 3 + d] for 3 ranks.
constexpr std::array<int32_t, 9> kCounts = {1, 2, 0,   // rank 0 sends
                                            4, 0, 3,   // rank 1
                                            0, 5, 6};  // rank 2

TEST(ExchangePlan, BlockOffsetsArePrefixSumsOverSources) {
  const std::vector<int64_t> offsets = block_offsets(kCounts, 3);
  const std::vector<int64_t> expected = {0, 0, 0,   // rank 0's blocks start every column
                                         1, 2, 0,   // after rank 0's 1, 2, 0 rows
                                         5, 2, 3};  // after 1+4, 2+0, 0+3
  EXPECT_EQ(offsets, expected);
  for (int s = 0; s < 3; ++s)
    for (int d = 0; d < 3; ++d) EXPECT_EQ(block_base(kCounts, 3, s, d), offsets[s * 3 + d]) << s << " -> " << d;
  EXPECT_EQ(num_recv_rows(kCounts, 3, 0), 5);
  EXPECT_EQ(num_recv_rows(kCounts, 3, 1), 7);
  EXPECT_EQ(num_recv_rows(kCounts, 3, 2), 9);
}

TEST(ExchangePlan, BlockOffsetsMatchTheReferenceRowOrder) {
  // Rows of rank d are ordered by (source rank, source token): the block of
  // source s starts where the reference's first row from s sits.
  const Topology topology = *Topology::create(4, 2);
  const ExpertPlacement placement = *ExpertPlacement::contiguous(16, 4);
  std::mt19937 rng(7);
  std::vector<exchange_test::RankInputs> inputs(4);
  std::vector<int32_t> counts(16, 0);
  for (int r = 0; r < 4; ++r) {
    const int T = 5 + 3 * r;
    inputs[r].x = exchange_test::Matrix(DType::kF32, T, 8);
    inputs[r].topk = 3;
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> experts(16);
      for (int e = 0; e < 16; ++e) experts[e] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      inputs[r].topk_idx.insert(inputs[r].topk_idx.end(), experts.begin(), experts.begin() + 3);
    }
    const DispatchLayout layout = *compute_layout(inputs[r].idx_view(), placement, topology);
    for (int d = 0; d < 4; ++d) counts[r * 4 + d] = layout.num_tokens_per_rank[d];
  }
  const exchange_test::ExchangeSpec spec{topology, placement, DType::kF32, 8, 1};
  const std::vector<exchange_test::RefRecv> recv = exchange_test::reference_dispatch(spec, inputs);
  const std::vector<int64_t> offsets = block_offsets(counts, 4);
  for (int d = 0; d < 4; ++d) {
    ASSERT_EQ(recv[d].num_recv(), num_recv_rows(counts, 4, d));
    for (int s = 0; s < 4; ++s) {
      const int64_t first = offsets[s * 4 + d];
      if (counts[s * 4 + d] == 0) continue;
      EXPECT_EQ(recv[d].src_rank[first], s) << "block of rank " << s << " on rank " << d;
      if (first > 0) {
        EXPECT_LT(recv[d].src_rank[first - 1], s) << "the row before the block of rank " << s;
      }
    }
  }
}

TEST(ExchangePlan, AlignedReceiveCountsRoundUpPerLocalExpert) {
  // 4 experts on 2 ranks: rank 1 holds experts 2 and 3.
  const ExpertPlacement placement = *ExpertPlacement::contiguous(4, 2);
  const std::vector<int64_t> expert_counts = {1, 0, 3, 0,   // rank 0's tokens per expert
                                              2, 5, 1, 4};  // rank 1's
  EXPECT_EQ(aligned_recv_expert_counts(expert_counts, 2, placement, 1, 1), (std::vector<int32_t>{4, 4}));
  EXPECT_EQ(aligned_recv_expert_counts(expert_counts, 2, placement, 1, 4), (std::vector<int32_t>{4, 4}));
  EXPECT_EQ(aligned_recv_expert_counts(expert_counts, 2, placement, 0, 4), (std::vector<int32_t>{4, 8}));
  EXPECT_EQ(round_up(0, 8), 0);
  EXPECT_EQ(round_up(9, 8), 16);
}

TEST(ExchangePlan, ExpandedLayoutGroupsByExpertInReceiveOrder) {
  // 3 received rows, K = 2, 2 local experts, alignment 2.
  const std::vector<int32_t> recv_topk = {1, 0,    // row 0: experts 1 and 0
                                          -1, 1,   // row 1: expert 1
                                          0, -1};  // row 2: expert 0
  ExpandedLayout layout;
  build_expanded_layout(recv_topk, 3, 2, 2, 2, &layout);
  EXPECT_EQ(layout.num_tokens_per_expert, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(layout.expert_offsets, (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(layout.recv_row, (std::vector<int64_t>{0, 2, 0, 1}));
  EXPECT_EQ(layout.row_of, (std::vector<int64_t>{2, 0, -1, 3, 1, -1}));
  // Against the test reference, with padding (alignment 4).
  exchange_test::RefRecv recv;
  recv.topk = 2;
  recv.src_rank = {0, 0, 1};
  recv.topk_idx = recv_topk;
  build_expanded_layout(recv_topk, 3, 2, 2, 4, &layout);
  const exchange_test::RefExpanded ref = exchange_test::reference_expanded(recv, 2, 4);
  EXPECT_EQ(layout.expert_offsets, ref.expert_offsets);
  EXPECT_EQ(layout.recv_row, ref.recv_row);
  EXPECT_EQ(layout.row_of, ref.row_of);
}

TEST(ExchangePlan, TopkRowCheckNamesTheFirstBadSlot) {
  const int32_t good[] = {3, -1, 0};
  EXPECT_TRUE(check_topk_row(good, 3, 5, 4).is_ok());
  const int32_t out_of_range[] = {3, 4, 4};
  const Status a = check_topk_row(out_of_range, 3, 17, 4);
  EXPECT_EQ(a.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.message(), "topk_idx[17][1] = 4 is outside [0, 4) and is not -1");
  const int32_t twice[] = {2, 1, 2, -7};
  EXPECT_EQ(check_topk_row(twice, 4, 0, 4).message(), "topk_idx[0] lists expert 2 twice (slots 0 and 2)");
  const int32_t negative[] = {-2};
  EXPECT_EQ(check_topk_row(negative, 1, 9, 4).message(), "topk_idx[9][0] = -2 is outside [0, 4) and is not -1");
}

TEST(ExchangePlan, RowCopyUnitIsTheWidestThatFitsEverything) {
  alignas(16) static std::byte block[64];
  const void* a16[] = {block, block + 32};
  EXPECT_EQ(row_copy_unit(14336, a16), 16);  // hidden 7168 in bf16
  EXPECT_EQ(row_copy_unit(24, a16), 8);
  const void* a8[] = {block, block + 8};
  EXPECT_EQ(row_copy_unit(32, a8), 8);
  const void* a2[] = {block + 2};
  EXPECT_EQ(row_copy_unit(32, a2), 2);
  const void* a1[] = {block + 1};
  EXPECT_EQ(row_copy_unit(32, a1), 1);
}

TEST(ExchangePlan, BufferConfigChecks) {
  BufferConfig config;
  config.num_experts = 8;
  config.hidden = 64;
  config.dtype = DType::kBF16;
  config.max_tokens_per_rank = 16;
  ASSERT_TRUE(validate_buffer_config(&config, 4).is_ok());
  ASSERT_TRUE(config.placement.has_value());
  EXPECT_EQ(config.placement->num_ranks(), 4);
  EXPECT_EQ(max_recv_rows(config, 4), 64);
  BufferConfig odd = config;
  odd.hidden = 3;
  EXPECT_EQ(validate_buffer_config(&odd, 4).message(),
            "hidden = 3 gives rows of 6 bytes; rows must be a multiple of 8 bytes");
  BufferConfig fp8 = config;
  fp8.dtype = DType::kFP8E4M3;
  fp8.hidden = 192;
  EXPECT_EQ(validate_buffer_config(&fp8, 4).message(),
            "hidden = 192 is not a multiple of 128, the channels per fp8 scale; fp8 payloads need it");
  fp8.hidden = 256;
  EXPECT_TRUE(validate_buffer_config(&fp8, 4).is_ok());
  BufferConfig wrong_ranks = config;
  EXPECT_EQ(validate_buffer_config(&wrong_ranks, 2).message(), "the placement is for 4 ranks but the transport has 2");
}

}  // namespace
}  // namespace epx::detail
