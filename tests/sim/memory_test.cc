#include "epx/sim/memory.h"

#include <gtest/gtest.h>

namespace epx::sim {
namespace {

int64_t item(const MemoryEstimate& e, const std::string& name) {
  for (const MemoryItem& i : e.items)
    if (i.name == name) return i.bytes;
  ADD_FAILURE() << "no item " << name;
  return -1;
}

TEST(SimMemory, CountsTheSampledLogitsAndThePerExpertState) {
  Scenario s;
  s.model.layers = 4;
  s.model.experts = 256;
  s.parallelism.ep = 8;
  s.parallelism.tokens_per_gpu = 4096;
  s.routing.sample_tokens = 128;
  const MemoryEstimate e = estimate_memory(s);
  EXPECT_EQ(e.copies, 1);
  // 128 sampled tokens x 256 experts of f32 logits, and their top-k.
  EXPECT_GE(item(e, "routing samples and layouts"), int64_t{128} * 256 * 4);
  EXPECT_GE(item(e, "per-expert state of every layer"), int64_t{4} * 256 * 40);
  EXPECT_LT(e.total(), int64_t{64} << 20);  // the template's scale: a few MiB
}

TEST(SimMemory, TwoBillionExpertsIsRefusedNamingTheKey) {
  Scenario s;
  s.model.experts = 2000000000;
  s.routing.sample_tokens = 65536;
  s.parallelism.tokens_per_gpu = 65536;
  const Status fits = check_memory_fits(estimate_memory(s), {.bytes = int64_t{1} << 40, .source = "test"});
  EXPECT_EQ(fits.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(fits.message().rfind("model.experts = 2000000000 needs ", 0), 0u) << fits.message();
  EXPECT_NE(fits.message().find("; 1.0 TiB is available (test)"), std::string::npos) << fits.message();
}

}  // namespace
}  // namespace epx::sim
