// StepReport::to_json prints every number in its shortest round-trip form, so
// equal metrics text means equal bits (the same-loss tests diff these lines).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "epx/train/trainer.h"

namespace epx {
namespace {

double field(const std::string& json, const std::string& key) {
  const std::size_t at = json.find("\"" + key + "\":");
  EXPECT_NE(at, std::string::npos) << key << " in " << json;
  return std::strtod(json.c_str() + at + key.size() + 3, nullptr);
}

TEST(StepReport, NumbersReadBackToTheSameBitsAndOneUlpShows) {
  StepReport a;
  a.loss = 0.1 + 0.2;  // 0.30000000000000004: 8 significant digits would print 0.3
  a.main_loss = 1.0 / 3.0;
  a.learning_rate = 3e-3;
  a.grad_norm = std::nextafter(2.5, 3.0);
  a.layers.resize(1);
  a.layers[0].max_vio = 2.0 / 7.0;
  StepReport b = a;
  b.main_loss = std::nextafter(a.main_loss, 1.0);
  const std::string ja = a.to_json(), jb = b.to_json();
  EXPECT_NE(ja.find("\"loss\":0.30000000000000004,"), std::string::npos) << ja;
  EXPECT_NE(ja.find("\"lr\":0.003,"), std::string::npos) << ja;
  EXPECT_EQ(field(ja, "loss"), a.loss);
  EXPECT_EQ(field(ja, "main_loss"), a.main_loss);
  EXPECT_EQ(field(ja, "grad_norm"), a.grad_norm);
  EXPECT_EQ(field(ja, "max_vio"), a.layers[0].max_vio);
  EXPECT_NE(ja, jb);  // one ulp apart
}

}  // namespace
}  // namespace epx
