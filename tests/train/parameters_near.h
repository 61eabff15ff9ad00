// Two runs' TrainSummary::parameters hold the same names and shapes, none all
// zero, and every value within `tolerance` x max(1, the largest magnitude of
// that parameter): what fp32 reassociation across layouts leaves after a few
// AdamW steps.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace epx::testing {

inline void expect_parameters_near(const std::map<std::string, std::vector<float>>& a,
                                   const std::map<std::string, std::vector<float>>& b, double tolerance) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, values] : a) {
    ASSERT_TRUE(b.contains(name)) << name;
    const auto& other = b.at(name);
    ASSERT_EQ(values.size(), other.size()) << name;
    double max_diff = 0, max_abs = 0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      max_diff = std::max(max_diff, static_cast<double>(std::abs(values[i] - other[i])));
      max_abs = std::max(max_abs, static_cast<double>(std::abs(values[i])));
    }
    EXPECT_GT(max_abs, 0.0) << name;
    EXPECT_LE(max_diff, tolerance * std::max(1.0, max_abs)) << name;
  }
}

}  // namespace epx::testing
