// The shapes, routing and "experts'" output of the combine_expanded tests
// (expanded_bf16_test.cc, expanded_receiver_test.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace epx::expanded_test {

constexpr int kExperts = 16, kHidden = 40, kTopk = 4, kTokens = 11;

// The "experts'" output for (source rank, source token, global expert, column).
inline float y_value(int rank, int token, int expert, int col) {
  return 0.0131f * static_cast<float>((rank * 131 + token * 17 + expert * 7 + col * 3) % 97) - 0.61f;
}

struct Routing {
  std::vector<int32_t> idx;
  std::vector<float> w;
};

// Distinct experts per token, some slots -1, weights growing with k and t.
inline Routing make_routing(int rank, unsigned seed) {
  std::mt19937 rng(seed + static_cast<unsigned>(rank));
  Routing r{std::vector<int32_t>(kTokens * kTopk), std::vector<float>(kTokens * kTopk)};
  std::vector<int32_t> experts(kExperts);
  for (int e = 0; e < kExperts; ++e) experts[e] = e;
  for (int t = 0; t < kTokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < kTopk; ++k) {
      r.idx[t * kTopk + k] = (t + k) % 7 == 3 ? -1 : experts[k];
      r.w[t * kTopk + k] = 0.173f * static_cast<float>(k + 1) + 0.0091f * static_cast<float>(t);
    }
  }
  return r;
}

}  // namespace epx::expanded_test
