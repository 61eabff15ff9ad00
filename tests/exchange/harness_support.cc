#include "exchange/harness.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include <fmt/format.h>

namespace epx::exchange_test {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t hash4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return splitmix64(splitmix64(splitmix64(splitmix64(a) ^ b) ^ c) ^ d);
}

// A float in [1, 2) * 2^(-2..2), with a random sign; never zero.
float float_from_hash(uint64_t h) {
  const float mantissa = 1.0f + static_cast<float>(h & 0x7fffffu) / 8388608.0f;
  const int exponent = static_cast<int>((h >> 23) % 5) - 2;
  const float sign = ((h >> 31) & 1u) ? -1.0f : 1.0f;
  return sign * std::ldexp(mantissa, exponent);
}

// `count` distinct values from `pool`, in random order.
std::vector<int32_t> pick_distinct(std::vector<int32_t> pool, int count, std::mt19937& rng) {
  for (int i = 0; i < count; ++i) {
    std::uniform_int_distribution<int> pick(i, static_cast<int>(pool.size()) - 1);
    std::swap(pool[i], pool[pick(rng)]);
  }
  pool.resize(count);
  return pool;
}

}  // namespace

const char* routing_name(Routing routing) {
  switch (routing) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kAllToFirst: return "all-to-expert-0";
    case Routing::kAllToLast: return "all-to-last-expert";
    case Routing::kHoles: return "holes";
    case Routing::kEmptyRank: return "empty-rank";
    case Routing::kOneRankPerToken: return "one-rank-per-token";
  }
  return "?";
}

std::vector<int32_t> make_routing(Routing routing, const ExpertPlacement& placement, int num_tokens, int topk,
                                  std::mt19937& rng) {
  const int num_experts = placement.num_experts();
  std::vector<int32_t> all(num_experts);
  std::iota(all.begin(), all.end(), 0);
  std::vector<int32_t> idx;
  idx.reserve(static_cast<std::size_t>(num_tokens) * topk);
  for (int t = 0; t < num_tokens; ++t) {
    std::vector<int32_t> row;
    switch (routing) {
      case Routing::kUniform:
      case Routing::kEmptyRank:
      case Routing::kHoles:
        row = pick_distinct(all, topk, rng);
        if (routing == Routing::kHoles) {
          std::bernoulli_distribution hole(0.3);
          for (int32_t& e : row)
            if (hole(rng)) e = -1;
        }
        break;
      case Routing::kSkewed: {
        std::vector<double> weight(num_experts);
        for (int e = 0; e < num_experts; ++e) weight[e] = 1.0 / std::pow(e + 1.0, 1.5);
        std::uniform_real_distribution<double> unit(0.0, 1.0);
        for (int k = 0; k < topk; ++k) {
          const double total = std::accumulate(weight.begin(), weight.end(), 0.0);
          double u = unit(rng) * total;
          int chosen = -1;
          for (int e = 0; e < num_experts; ++e) {
            if (weight[e] == 0.0) continue;
            chosen = e;
            if (u < weight[e]) break;
            u -= weight[e];
          }
          row.push_back(chosen);
          weight[chosen] = 0.0;
        }
        break;
      }
      case Routing::kAllToFirst:
      case Routing::kAllToLast: {
        row.assign(topk, -1);
        std::uniform_int_distribution<int> slot(0, topk - 1);
        row[slot(rng)] = routing == Routing::kAllToFirst ? 0 : num_experts - 1;
        break;
      }
      case Routing::kOneRankPerToken: {
        std::vector<int> ranks;
        for (int r = 0; r < placement.num_ranks(); ++r)
          if (placement.num_local_experts(r) > 0) ranks.push_back(r);
        std::uniform_int_distribution<int> pick(0, static_cast<int>(ranks.size()) - 1);
        const int r = ranks[pick(rng)];
        std::vector<int32_t> local;
        for (int l = 0; l < placement.num_local_experts(r); ++l) local.push_back(placement.global_id(r, l));
        row = pick_distinct(local, std::min<int>(topk, static_cast<int>(local.size())), rng);
        row.resize(topk, -1);
        std::shuffle(row.begin(), row.end(), rng);
        break;
      }
    }
    idx.insert(idx.end(), row.begin(), row.end());
  }
  return idx;
}

std::vector<int> make_token_counts(Routing routing, int num_ranks, int max_tokens, std::mt19937& rng) {
  std::uniform_int_distribution<int> count(0, max_tokens);
  std::vector<int> counts(num_ranks);
  for (int& c : counts) c = count(rng);
  if (routing == Routing::kEmptyRank) {
    std::uniform_int_distribution<int> rank(0, num_ranks - 1);
    counts[rank(rng)] = 0;
  }
  return counts;
}

float payload_value(uint32_t salt, int rank, int token, int col, DType dtype) {
  const float value = float_from_hash(hash4(salt, static_cast<uint64_t>(rank), static_cast<uint64_t>(token),
                                            static_cast<uint64_t>(col)));
  return dtype == DType::kBF16 ? bf16_to_f32(f32_to_bf16(value)) : value;
}

Matrix make_payload(uint32_t salt, int rank, int num_tokens, int hidden, DType dtype) {
  Matrix m(dtype, num_tokens, hidden);
  for (int t = 0; t < num_tokens; ++t)
    for (int c = 0; c < hidden; ++c) m.set(t, c, payload_value(salt, rank, t, c, dtype));
  return m;
}

Matrix make_random_matrix(uint32_t seed, int64_t rows, int64_t cols, DType dtype) {
  Matrix m(dtype, rows, cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      m.set(r, c, float_from_hash(hash4(seed, 0x5eed, static_cast<uint64_t>(r), static_cast<uint64_t>(c))) / 8.0f);
  return m;
}

std::vector<float> make_random_floats(uint32_t seed, std::size_t count) {
  std::vector<float> out(count);
  for (std::size_t i = 0; i < count; ++i)
    out[i] = std::fabs(float_from_hash(hash4(seed, 0xf10a7, i, 0))) / 4.0f;  // (0, 2)
  return out;
}

std::vector<RankInputs> make_inputs(const ExchangeSpec& spec, Routing routing, int topk, int max_tokens,
                                    bool with_weights, uint32_t seed) {
  std::mt19937 rng(seed);
  const std::vector<int> counts = make_token_counts(routing, spec.num_ranks(), max_tokens, rng);
  std::vector<RankInputs> inputs(spec.num_ranks());
  for (int s = 0; s < spec.num_ranks(); ++s) {
    RankInputs& in = inputs[s];
    in.x = make_payload(0, s, counts[s], spec.hidden, spec.dtype);
    in.topk = topk;
    in.topk_idx = make_routing(routing, spec.placement, counts[s], topk, rng);
    in.with_weights = with_weights;
    if (with_weights) in.topk_weights = make_random_floats(seed * 131u + static_cast<uint32_t>(s), in.topk_idx.size());
  }
  return inputs;
}

float expert_value(float x, int rank, int64_t col) {
  const float scale = 1.0f + 0.1f * static_cast<float>(rank + 1);
  const float scaled = x * scale;
  return scaled + 0.01f * static_cast<float>(col);
}

Matrix expert_output(const Matrix& x, int rank, DType dtype) {
  Matrix y(dtype, x.rows(), x.cols());
  for (int64_t i = 0; i < x.rows(); ++i)
    for (int64_t c = 0; c < x.cols(); ++c) y.set(i, c, expert_value(x.get(i, c), rank, c));
  return y;
}

TransportCounters counters_delta(const TransportCounters& before, const TransportCounters& after) {
  TransportCounters d;
  d.inter_node_bytes = after.inter_node_bytes - before.inter_node_bytes;
  d.inter_node_messages = after.inter_node_messages - before.inter_node_messages;
  d.intra_node_bytes = after.intra_node_bytes - before.intra_node_bytes;
  d.intra_node_messages = after.intra_node_messages - before.intra_node_messages;
  d.collective_calls = after.collective_calls - before.collective_calls;
  d.collective_bytes = after.collective_bytes - before.collective_bytes;
  return d;
}

std::string describe_row_source(const Matrix& m, int64_t row, const std::vector<Matrix>& sources) {
  for (std::size_t s = 0; s < sources.size(); ++s)
    for (int64_t t = 0; t < sources[s].rows(); ++t)
      if (m.same_row_bits(row, sources[s], t)) return fmt::format("x of rank {}, token {}", s, t);
  bool zero = true;
  for (int64_t c = 0; c < m.cols(); ++c) zero = zero && m.get(row, c) == 0.0f;
  return zero ? "a zero row" : "no input row";
}

::testing::AssertionResult same_matrix(const Matrix& actual, const Matrix& expected,
                                       const std::vector<Matrix>* sources) {
  if (actual.dtype() != expected.dtype() || actual.rows() != expected.rows() || actual.cols() != expected.cols())
    return ::testing::AssertionFailure() << fmt::format("got {}[{}, {}], expected {}[{}, {}]",
                                                        dtype_name(actual.dtype()), actual.rows(), actual.cols(),
                                                        dtype_name(expected.dtype()), expected.rows(),
                                                        expected.cols());
  if (actual.same_bits(expected)) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure();
  int64_t bad_rows = 0;
  for (int64_t r = 0; r < actual.rows(); ++r) {
    if (actual.same_row_bits(r, expected, r)) continue;
    if (++bad_rows > 6) continue;
    int64_t c = 0;
    while (std::memcmp(actual.row(r) + c * dtype_size(actual.dtype()), expected.row(r) + c * dtype_size(actual.dtype()),
                       dtype_size(actual.dtype())) == 0)
      ++c;
    failure << fmt::format("\n  row {}: first difference at col {}: got {:.9g}, expected {:.9g}", r, c,
                           actual.get(r, c), expected.get(r, c));
    if (sources) {
      failure << fmt::format(" (got {}; expected {})", describe_row_source(actual, r, *sources),
                             describe_row_source(expected, r, *sources));
    }
  }
  failure << fmt::format("\n  {} of {} rows differ", bad_rows, actual.rows());
  return failure;
}

::testing::AssertionResult same_combine(const Matrix& actual, const Matrix& expected, const Matrix* other_order) {
  auto result = same_matrix(actual, expected);
  if (result || !other_order || !actual.same_bits(*other_order)) return result;
  return result << "\n  (the output matches the OTHER summation order bit for bit)";
}

::testing::AssertionResult near_matrix(const Matrix& actual, const Matrix& expected, float rel) {
  if (actual.rows() != expected.rows() || actual.cols() != expected.cols())
    return ::testing::AssertionFailure() << "shape differs";
  auto failure = ::testing::AssertionFailure();
  int bad = 0;
  for (int64_t r = 0; r < actual.rows(); ++r) {
    for (int64_t c = 0; c < actual.cols(); ++c) {
      const float a = actual.get(r, c);
      const float b = expected.get(r, c);
      if (std::fabs(a - b) <= rel * std::max(std::fabs(b), 1.0f)) continue;
      if (++bad <= 6) failure << fmt::format("\n  [{}][{}] = {:.9g}, expected {:.9g}", r, c, a, b);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return failure << fmt::format("\n  {} elements outside the relative tolerance {}", bad, rel);
}

bool any_nonzero(const std::vector<Matrix>& ms) {
  for (const Matrix& m : ms)
    if (!m.all_zero()) return true;
  return false;
}

}  // namespace epx::exchange_test
