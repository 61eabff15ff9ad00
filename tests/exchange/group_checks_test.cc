// The argument checks of CudaGroup's and CudaBuffer's calls (exchange/group_checks.h): plain
// host code, tested here with device views that are never dereferenced, so
// they run in every build, with or without a GPU.
#include "exchange/group_checks.h"

#include "exchange/exchange_plan.h"

#include <gtest/gtest.h>

#include <array>

namespace epx::detail {
namespace {

constexpr Device kGpu0{DeviceKind::kCuda, 0};
constexpr Device kGpu1{DeviceKind::kCuda, 1};
// Fake device addresses: the checks read shapes, never memory.
alignas(16) std::byte g_fake[16];

TensorView device_matrix(DType dtype, int64_t rows, int64_t cols, Device device = kGpu0) {
  return TensorView::contiguous(g_fake, dtype, {rows, cols}, device);
}

BufferConfig small_config() {
  BufferConfig config;
  config.num_experts = 8;
  config.hidden = 16;
  config.dtype = DType::kBF16;
  config.max_topk = 4;
  config.max_tokens_per_rank = 10;
  EPX_CHECK(validate_buffer_config(&config, 2).is_ok());
  return config;
}

TEST(GroupChecks, GoodDispatchInputsPass) {
  const BufferConfig config = small_config();
  const std::array<Device, 2> devices = {kGpu0, kGpu1};
  std::array<DispatchInputs, 2> in = {
      DispatchInputs{device_matrix(DType::kBF16, 3, 16, kGpu0), device_matrix(DType::kI32, 3, 2, kGpu0), {}},
      DispatchInputs{device_matrix(DType::kBF16, 0, 16, kGpu1), device_matrix(DType::kI32, 0, 2, kGpu1), {}}};
  EXPECT_TRUE(validate_group_dispatch(config, in, devices).is_ok());
}

TEST(GroupChecks, DispatchInputsAreRejectedNamingTheRank) {
  const BufferConfig config = small_config();
  const std::array<Device, 2> devices = {kGpu0, kGpu1};
  auto inputs = [&](int64_t t1, int64_t k1, Device d1) {
    return std::array<DispatchInputs, 2>{
        DispatchInputs{device_matrix(DType::kBF16, 3, 16), device_matrix(DType::kI32, 3, 2), {}},
        DispatchInputs{device_matrix(DType::kBF16, t1, 16, d1), device_matrix(DType::kI32, t1, k1, d1), {}}};
  };
  EXPECT_EQ(validate_group_dispatch(config, inputs(3, 2, kGpu0), devices).message(),
            "rank 1: topk_idx must live on cuda:1 but lives on cuda:0");
  EXPECT_EQ(validate_group_dispatch(config, inputs(11, 2, kGpu1), devices).message(),
            "rank 1: num_tokens = 11 is above max_tokens_per_rank = 10");
  EXPECT_EQ(validate_group_dispatch(config, inputs(3, 5, kGpu1), devices).message(),
            "rank 1: topk = 5 is outside [1, max_topk = 4]");
  EXPECT_EQ(validate_group_dispatch(config, inputs(3, 3, kGpu1), devices).message(),
            "topk differs between ranks: rank 0 passes 2 and rank 1 passes 3");
  EXPECT_EQ(validate_group_dispatch(config, inputs(3, 3, Device{}), devices).message(),
            "rank 1: topk_idx must live on cuda:1 but lives on host");
  auto weights = inputs(3, 2, kGpu1);
  weights[1].topk_weights = device_matrix(DType::kF32, 3, 2, kGpu1);
  EXPECT_EQ(validate_group_dispatch(config, weights, devices).message(),
            "rank 0 does not pass topk_weights but rank 1 does; pass them on every rank or none");
  auto wrong_x = inputs(3, 2, kGpu1);
  wrong_x[0].x = device_matrix(DType::kF32, 3, 16);
  EXPECT_EQ(validate_group_dispatch(config, wrong_x, devices).message(),
            "rank 0: x must be bf16, got f32[3, 16] (strides 16, 1)");
  EXPECT_EQ(validate_group_dispatch(config, std::span(wrong_x.data(), 1), devices).message(),
            "the dispatch inputs must hold one entry per rank (2), got 1");
}

TEST(GroupChecks, ReceiveCapacity) {
  const std::array<int32_t, 4> counts = {3, 1,   // rank 0 sends 3 to itself, 1 to rank 1
                                         2, 6};  // rank 1
  EXPECT_TRUE(check_recv_capacity(counts, 2, 7).is_ok());
  const Status s = check_recv_capacity(counts, 2, 6);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "rank 1 would receive 7 rows but max_recv_tokens = 6; nothing was sent. Raise BufferConfig::max_recv_tokens");
}

TEST(GroupChecks, CombineArguments) {
  BufferConfig config = small_config();
  const std::array<CombineShape, 2> shapes = {CombineShape{4, 3, 2, kGpu0}, CombineShape{2, 5, 2, kGpu0}};
  std::array<TensorView, 2> y = {device_matrix(DType::kF32, 4, 16), device_matrix(DType::kF32, 2, 16)};
  const std::array<TensorView, 2> out = {device_matrix(DType::kBF16, 3, 16), device_matrix(DType::kF32, 5, 16)};
  EXPECT_TRUE(validate_group_combine(config, y, out, {}, shapes).is_ok());
  std::array<TensorView, 2> mixed = {y[0], device_matrix(DType::kBF16, 2, 16)};
  EXPECT_EQ(validate_group_combine(config, mixed, out, {}, shapes).message(),
            "y differs between ranks: rank 0 has f32 and rank 1 has bf16");
  std::array<TensorView, 2> short_y = {y[0], device_matrix(DType::kF32, 3, 16)};
  EXPECT_EQ(validate_group_combine(config, short_y, out, {}, shapes).message(),
            "rank 1: y must be [2, 16], got f32[3, 16] (strides 16, 1)");
  std::array<CombineOptions, 2> options;
  options[1].grad_topk_weights = device_matrix(DType::kF32, 5, 2);
  EXPECT_EQ(validate_group_combine(config, y, out, options, shapes).message(),
            "rank 1: grad_recv_topk_weights and grad_topk_weights go together; got only one");
  options[1].grad_recv_topk_weights = device_matrix(DType::kF32, 2, 2);
  EXPECT_EQ(validate_group_combine(config, y, out, options, shapes).message(),
            "rank 0 does not pass weight gradients but rank 1 does; pass them on every rank or none");
  std::array<CombineOptions, 2> bias;
  bias[0].bias = device_matrix(DType::kF32, 3, 16);
  EXPECT_TRUE(validate_group_combine(config, y, out, bias, shapes).is_ok());
  bias[1].bias = device_matrix(DType::kBF16, 5, 16);
  EXPECT_EQ(validate_group_combine(config, y, out, bias, shapes).message(),
            "rank 1: bias must be f32 or the output's dtype f32, got bf16[5, 16] (strides 16, 1)");
  config.max_combine_dtype = DType::kBF16;
  EXPECT_EQ(validate_group_combine(config, y, out, {}, shapes).message(),
            "rank 0: y is f32 but max_combine_dtype = bf16; raise BufferConfig::max_combine_dtype");
}

TEST(GroupChecks, ExpandedInputs) {
  const BufferConfig config = small_config();  // max_combine_dtype f32
  const CombineShape shape{5, 3, 2, kGpu0};     // 5 received rows, 3 tokens, topk 2
  const TensorView y = device_matrix(DType::kBF16, 7, 16), w = device_matrix(DType::kF32, 5, 2);
  const TensorView gy = device_matrix(DType::kF32, 7, 16), gw = device_matrix(DType::kF32, 5, 2);
  EXPECT_TRUE(check_expanded_inputs(config, false, y, w, {}, {}, 7, shape).is_ok());
  EXPECT_TRUE(check_expanded_inputs(config, false, y, {}, {}, {}, 7, shape).is_ok());
  EXPECT_TRUE(check_expanded_inputs(config, true, y, w, gy, gw, 7, shape).is_ok());
  EXPECT_TRUE(check_expanded_inputs(config, true, y, {}, gy, {}, 7, shape).is_ok());
  EXPECT_EQ(check_expanded_inputs(config, false, device_matrix(DType::kI32, 7, 16), w, {}, {}, 7, shape).code(),
            StatusCode::kInvalidArgument);
  EXPECT_NE(check_expanded_inputs(config, false, device_matrix(DType::kBF16, 6, 16), w, {}, {}, 7, shape)
                .message()
                .find("y_expanded"),
            std::string::npos);
  const TensorView strided(g_fake, DType::kF32, {5, 2}, {3, 1}, kGpu0);
  EXPECT_EQ(check_expanded_inputs(config, false, y, strided, {}, {}, 7, shape).message(),
            "weights must be dense, got f32[5, 2] (strides 3, 1)");
  EXPECT_NE(check_expanded_inputs(config, true, y, w, {}, gw, 7, shape).message().find("grad_y_expanded"),
            std::string::npos);
  EXPECT_NE(check_expanded_inputs(config, true, y, w, gy, device_matrix(DType::kF32, 5, 2, kGpu1), 7, shape)
                .message()
                .find("grad_weights"),
            std::string::npos);
  BufferConfig narrow = config;
  narrow.max_combine_dtype = DType::kBF16;
  EXPECT_EQ(check_expanded_inputs(narrow, false, y, w, {}, {}, 7, shape).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(check_expanded_inputs(narrow, true, y, w, gy, gw, 7, shape).is_ok());  // the backward sums nothing
}

}  // namespace
}  // namespace epx::detail
