// Test inputs and comparisons shared by the exchange tests.
//
// Payload rows encode where they came from: every element is a hash of
// (salt, source rank, token, column), so a misrouted row can be traced back
// to the (rank, token) it really is (describe_row_source). Routing generators
// are deterministic from a seed (std::mt19937). Comparisons return
// ::testing::AssertionResult with the first few differences spelled out.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "epx/comm/transport.h"
#include "exchange/reference.h"

namespace epx::exchange_test {

enum class Routing {
  kUniform,        // K distinct experts, uniformly
  kSkewed,         // K distinct experts, Zipf-like (a few experts get most tokens)
  kAllToFirst,     // every token to expert 0 only (in a random slot; other slots -1)
  kAllToLast,      // every token to expert E-1 only
  kHoles,          // uniform, then each slot -1 with probability 0.3
  kEmptyRank,      // uniform, and one rank has no tokens at all
  kOneRankPerToken,  // each token's experts all sit on one (random) rank
};
inline constexpr Routing kAllRoutings[] = {Routing::kUniform,   Routing::kSkewed,    Routing::kAllToFirst,
                                           Routing::kAllToLast, Routing::kHoles,     Routing::kEmptyRank,
                                           Routing::kOneRankPerToken};
const char* routing_name(Routing routing);

// topk_idx [T, K] of one rank.
std::vector<int32_t> make_routing(Routing routing, const ExpertPlacement& placement, int num_tokens, int topk,
                                  std::mt19937& rng);
// Per-rank token counts in [0, max_tokens] (kEmptyRank: one rank gets 0).
std::vector<int> make_token_counts(Routing routing, int num_ranks, int max_tokens, std::mt19937& rng);

// Element (rank, token, col) of the payload with `salt`: a nonzero value in
// about [-8, 8] with a full f32 mantissa, rounded to bf16 when `dtype` is bf16.
float payload_value(uint32_t salt, int rank, int token, int col, DType dtype);
Matrix make_payload(uint32_t salt, int rank, int num_tokens, int hidden, DType dtype);
// A [rows, cols] f32 matrix / vector of deterministic values in about [-1, 1].
Matrix make_random_matrix(uint32_t seed, int64_t rows, int64_t cols, DType dtype);
std::vector<float> make_random_floats(uint32_t seed, std::size_t count);

// Every rank's inputs for one routing.
std::vector<RankInputs> make_inputs(const ExchangeSpec& spec, Routing routing, int topk, int max_tokens,
                                    bool with_weights, uint32_t seed);

// What output buffers hold before a call: anything left unwritten shows.
inline constexpr float kUnwritten = -31337.0f;

// What the test "experts" compute: y = x * (1 + 0.1 (rank + 1)) + 0.01 col,
// deliberately inexact in fp32 so that the summation order shows in the bits.
float expert_value(float x, int rank, int64_t col);
Matrix expert_output(const Matrix& x, int rank, DType dtype);

// Snapshot of a transport's counters, and the difference of two.
TransportCounters counters_delta(const TransportCounters& before, const TransportCounters& after);

// "x of rank 2, token 7" when `row` of `m` equals an input row bit for bit
// (searching every salt-0 payload of `inputs`), else "no input row".
std::string describe_row_source(const Matrix& m, int64_t row, const std::vector<Matrix>& sources);

// Bitwise equality of two matrices; on a difference names the first rows that
// differ, their (rank, token) origin when `sources` is given, and the values.
::testing::AssertionResult same_matrix(const Matrix& actual, const Matrix& expected,
                                       const std::vector<Matrix>* sources = nullptr);
// Bitwise equality of an expected combine output; on a difference also says
// whether the actual bits match `other_order` (the other summation order).
::testing::AssertionResult same_combine(const Matrix& actual, const Matrix& expected, const Matrix* other_order);
// |a - b| <= rel * max(|b|, 1) element-wise (f32 or bf16 read as float).
::testing::AssertionResult near_matrix(const Matrix& actual, const Matrix& expected, float rel);

template <typename T>
::testing::AssertionResult same_vector(const std::vector<T>& actual, const std::vector<T>& expected,
                                       int row_length = 1) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure() << "size " << actual.size() << ", expected " << expected.size();
  int shown = 0;
  ::testing::AssertionResult result = ::testing::AssertionSuccess();
  bool failed = false;
  for (std::size_t i = 0; i < actual.size() && shown < 8; ++i) {
    const bool equal = sizeof(T) == 4 ? std::memcmp(&actual[i], &expected[i], sizeof(T)) == 0 : actual[i] == expected[i];
    if (equal) continue;
    if (!failed) result = ::testing::AssertionFailure();
    failed = true;
    result << "\n  [" << i / row_length;
    if (row_length > 1) result << "][" << i % row_length;
    result << "] = " << actual[i] << ", expected " << expected[i];
    ++shown;
  }
  return result;
}

// True when any element of any of `ms` is nonzero.
bool any_nonzero(const std::vector<Matrix>& ms);

}  // namespace epx::exchange_test
