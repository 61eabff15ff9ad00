// detail::sum_row, detail::sum_parts and detail::weighted_partial (the
// combine's sums of rows, read in registers a block of columns at a time,
// with a slice path for the last columns) give, bit for bit, a plain scalar
// loop in the documented order: out = 0 + g_0 + g_1 + ..., a group
// g = 0 + p_0 + p_1 + ..., a part p = 0 + w_0 * r_0 + w_1 * r_1 + ... (or a
// single row as it is), then one rounding. The widths cover blocks only, a
// tail only and both; the groups cover every shape the exchange builds
// (none, one row, several, empty), bf16 and f32 rows, and rows of -0.0,
// whose sign "0 +" turns.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

#include "epx/core/dtype.h"
#include "exchange/cpu/holder_sums.h"
#include "exchange/cpu/row_kernels.h"

namespace epx::detail {
namespace {

constexpr int kWidths[] = {1, 37, 64, 100, 512, 600, 1100};

// Mixed magnitudes, so another order of additions rounds differently; row 7
// is all -0.0.
float value(int row, int col) {
  if (row == 7) return -0.0f;
  const float scale = (col % 3 == 0) ? 1024.0f : ((col % 3 == 1) ? 1.0f : 1.0f / 1024.0f);
  return scale * (static_cast<float>((row * 131 + col * 71) % 97) - 48.0f) / 17.0f;
}

// Rows 0..9 of `hidden` columns in f32 and in bf16.
struct Rows {
  explicit Rows(int hidden) : f32(10, std::vector<float>(hidden)), bf16(10, std::vector<uint16_t>(hidden)) {
    for (int r = 0; r < 10; ++r)
      for (int c = 0; c < hidden; ++c) f32[r][c] = value(r, c), bf16[r][c] = f32_to_bf16(value(r, c));
  }
  const std::byte* row(int r, DType dtype) const {
    return dtype == DType::kBF16 ? reinterpret_cast<const std::byte*>(bf16[r].data())
                                 : reinterpret_cast<const std::byte*>(f32[r].data());
  }
  std::vector<std::vector<float>> f32;
  std::vector<std::vector<uint16_t>> bf16;
};

float read(const std::byte* row, DType dtype, int c) {
  if (dtype == DType::kBF16) return bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[c]);
  return reinterpret_cast<const float*>(row)[c];
}

// The row the r-th pointer of case s reads: the first round of cases mixes
// rows 0..7; the second reads row 7 (-0.0) only.
int pick(int r, std::size_t s, std::size_t num_shapes) {
  return s < num_shapes ? (r * 3 + static_cast<int>(s)) % 8 : 7;
}

// Group shapes as row counts: {} is no group at all; 0 an empty group.
const std::vector<std::vector<int>> kShapes = {{}, {1}, {0}, {3}, {1, 1}, {1, 3, 1}, {2, 0, 1}, {1, 1, 1, 1, 1, 1, 1, 1}};

TEST(SumRowBlocks, GiveTheSerialOrderBitForBit) {
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (int hidden : kWidths)
      for (std::size_t s = 0; s < kShapes.size() * 2; ++s) {
        SCOPED_TRACE(testing::Message() << dtype_name(dtype) << ", hidden " << hidden << ", shape " << s);
        const Rows rows(hidden);
        std::vector<const std::byte*> pointers;
        for (int r = 0; r < 10; ++r) pointers.push_back(rows.row(pick(r, s, kShapes.size()), dtype));
        std::vector<SumGroup> groups;
        int next = 0;
        for (int n : kShapes[s % kShapes.size()]) groups.push_back({pointers.data() + next, n, dtype}), next += n;
        std::vector<float> out(hidden, 7.0f);
        sum_row(reinterpret_cast<std::byte*>(out.data()), DType::kF32, groups, nullptr, DType::kF32, hidden);
        for (int c = 0; c < hidden; ++c) {
          float total = 0.0f;
          for (const SumGroup& g : groups) {
            if (g.num_rows == 1) {
              total = total + read(g.rows[0], dtype, c);
              continue;
            }
            float group = 0.0f;
            for (int r = 0; r < g.num_rows; ++r) group = group + read(g.rows[r], dtype, c);
            total = total + group;
          }
          ASSERT_EQ(std::bit_cast<uint32_t>(out[c]), std::bit_cast<uint32_t>(total)) << "column " << c;
        }
      }
}

// A part per count: -1 an f32 partial row, else that many weighted rows.
TEST(SumPartsBlocks, GiveTheSerialOrderBitForBit) {
  const std::vector<std::vector<std::vector<int>>> shapes = {
      {}, {{2}}, {{0}}, {{-1}}, {{1}, {-1}, {3}}, {{1, 2, 0}}, {{}, {1}}, {{1, -1}, {2}}, {{1}, {1}, {1}, {1}, {1}}};
  const float weights[] = {0.25f, -1.5f, 3.0f, 0.125f};
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (int hidden : kWidths)
      for (std::size_t s = 0; s < shapes.size() * 2; ++s) {
        SCOPED_TRACE(testing::Message() << dtype_name(dtype) << ", hidden " << hidden << ", shape " << s);
        const Rows rows(hidden);
        std::vector<const std::byte*> pointers;
        for (int r = 0; r < 40; ++r) pointers.push_back(rows.row(pick(r, s, shapes.size()), dtype));
        std::vector<float> w(40);
        for (int r = 0; r < 40; ++r) w[r] = weights[r % 4];
        std::vector<HolderPart> parts;
        parts.reserve(40);
        std::vector<std::pair<std::size_t, int>> group_spans;
        int next = 0;
        for (const auto& group : shapes[s % shapes.size()]) {
          group_spans.push_back({parts.size(), static_cast<int>(group.size())});
          for (int n : group) {
            if (n < 0) parts.push_back({.partial = rows.row(pick(next++, s, shapes.size()), DType::kF32)});
            else parts.push_back({.rows = pointers.data() + next, .weights = w.data() + next, .num_rows = n, .row_dtype = dtype}), next += n;
          }
        }
        std::vector<PartGroup> groups;
        for (auto [first, n] : group_spans) groups.push_back({parts.data() + first, n});
        std::vector<float> out(hidden, 7.0f);
        sum_parts(reinterpret_cast<std::byte*>(out.data()), DType::kF32, groups, nullptr, DType::kF32, hidden);
        for (int c = 0; c < hidden; ++c) {
          auto part_value = [&](const HolderPart& p) {
            if (p.partial) return read(p.partial, DType::kF32, c);
            float sum = 0.0f;
            for (int r = 0; r < p.num_rows; ++r) sum = sum + p.weights[r] * read(p.rows[r], dtype, c);
            return sum;
          };
          float total = 0.0f;
          for (const PartGroup& g : groups) {
            if (g.num_parts == 1) {
              total = total + part_value(g.parts[0]);
              continue;
            }
            float group = 0.0f;
            for (int i = 0; i < g.num_parts; ++i) group = group + part_value(g.parts[i]);
            total = total + group;
          }
          ASSERT_EQ(std::bit_cast<uint32_t>(out[c]), std::bit_cast<uint32_t>(total)) << "column " << c;
        }
      }
}

// weighted_partial (a holder's partial, rounded once to the partials' type).
TEST(WeightedPartialBlocks, GiveTheSerialOrderBitForBit) {
  const float weights[] = {0.25f, -1.5f, 3.0f, 0.125f, 1.0f};
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (DType out_dtype : {DType::kF32, DType::kBF16})
      for (int hidden : kWidths)
        for (int num_rows : {0, 1, 2, 5})
          for (std::size_t s : {std::size_t{1}, std::size_t{3}, std::size_t{100}}) {
            SCOPED_TRACE(testing::Message() << dtype_name(dtype) << " to " << dtype_name(out_dtype) << ", hidden "
                                            << hidden << ", " << num_rows << " rows, case " << s);
            const Rows rows(hidden);
            std::vector<const std::byte*> pointers;
            for (int r = 0; r < num_rows; ++r) pointers.push_back(rows.row(pick(r, s, 8), dtype));
            std::vector<float> out(hidden, 7.0f);
            weighted_partial(reinterpret_cast<std::byte*>(out.data()), out_dtype, pointers.data(), weights, num_rows, dtype,
                             hidden);
            for (int c = 0; c < hidden; ++c) {
              float sum = 0.0f;
              for (int r = 0; r < num_rows; ++r) sum = sum + weights[r] * read(pointers[r], dtype, c);
              const std::byte* got = reinterpret_cast<const std::byte*>(out.data());
              ASSERT_EQ(std::bit_cast<uint32_t>(read(got, out_dtype, c)),
                        std::bit_cast<uint32_t>(out_dtype == DType::kBF16 ? bf16_to_f32(f32_to_bf16(sum)) : sum))
                  << "column " << c;
            }
          }
}

// The checks can fail: the -0.0 row alone, summed without the leading
// "0 +", keeps its sign; and on these rows, a node's three rows added one by
// one into the total (instead of summed on their own first) give other bits
// in some column.
TEST(SumRowBlocks, TheReferenceSeesSignAndOrder) {
  EXPECT_NE(std::bit_cast<uint32_t>(0.0f + value(7, 0)), std::bit_cast<uint32_t>(value(7, 0)));
  int differ = 0;
  for (int c = 0; c < 1100; ++c) {
    const float grouped = (0.0f + value(0, c)) + ((0.0f + value(1, c)) + value(2, c) + value(3, c));
    const float flat = 0.0f + value(0, c) + value(1, c) + value(2, c) + value(3, c);
    differ += std::bit_cast<uint32_t>(grouped) != std::bit_cast<uint32_t>(flat);
  }
  EXPECT_GT(differ, 0);
}

}  // namespace
}  // namespace epx::detail
