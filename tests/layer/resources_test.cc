// Expert weights that do not fit: MoELayer::create returns ResourceExhausted
// naming the parameter and its bytes (failure injected through core/guard.h).
#include <gtest/gtest.h>

#include <memory>

#include "core/guard.h"
#include "epx/comm/inproc.h"
#include "epx/comm/topology.h"
#include "epx/exchange/buffer.h"
#include "epx/layer/moe_layer.h"

namespace epx {
namespace {

TEST(MoELayerResources, ExpertWeightsThatDoNotFitAreResourceExhausted) {
  MoELayerConfig config;
  config.hidden = 16;
  config.ffn_hidden = 8;
  config.router = {.num_experts = 4, .topk = 2};
  std::vector<Status> statuses = run_ranks(*Topology::create(1, 1), [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, {.num_experts = 4, .hidden = 16, .dtype = DType::kF32,
                                                         .max_topk = 2, .max_tokens_per_rank = 8, .placement = {}}));
    detail::fail_allocations(2, 1);  // the norm and the router pass; the first expert matrix fails
    Result<std::unique_ptr<MoELayer>> layer = MoELayer::create(config, t, *buffer, 0);
    detail::fail_allocations(0, 0);
    EXPECT_FALSE(layer.is_ok());
    EXPECT_EQ(layer.status().code(), StatusCode::kResourceExhausted) << layer.status().to_string();
    // 4 experts x 16 rows x 8 columns, value and gradient, 4 bytes each.
    EXPECT_EQ(layer.status().message(),
              "could not allocate 4096 bytes for parameter 'layer0.experts.w1' ([64, 8] f32, value and gradient): out "
              "of memory");
    return MoELayer::create(config, t, *buffer, 0).status();  // and then it works
  });
  EXPECT_TRUE(statuses[0].is_ok()) << statuses[0].to_string();
}

}  // namespace
}  // namespace epx
