// The exchange conformance table: the shapes and sub-cases every backend
// runs against the reference (reference.h), and the BufferConfig of a case.
// tests/exchange/conformance_test.cc runs it on Buffer (every transport:
// in-process, socket, MPI); tests/cuda/cuda_conformance_test.cc runs the
// same shapes and sub-cases on the CUDA backend.
//
// Swept: world sizes {1, 2, 3, 4, 8}, node shapes (1 x R, 2 x 1, 2 x 2,
// 2 x 4, 4 x 2), flat, two-hop and automatic algorithms, f32 and bf16
// payloads, top-k {1, 2, 8}, expert counts {R, 4R, 32+}, the routing shapes
// of harness.h, and per sub-case the knobs below (a hash of its index picks
// them, so every knob meets every shape).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "epx/core/tensor.h"
#include "epx/exchange/buffer.h"
#include "exchange/harness.h"

namespace epx::exchange_test {

inline constexpr int kConformanceMaxTokens = 40;
// Written into expanded padding rows; must never reach an output.
inline constexpr float kPaddingGarbage = 1.0e4f;

// One (shape, algorithm, payload dtype): a gtest case.
struct Shape {
  int num_ranks;
  int num_nodes;
  DispatchAlgorithm algorithm;
  DType dtype;
};

const char* algorithm_name(DispatchAlgorithm a);
// The gtest name of a shape, e.g. 8ranks_2nodes_hierarchical_bf16.
std::string shape_name(const ::testing::TestParamInfo<Shape>& info);
// Every shape of the table.
std::vector<Shape> all_shapes();

// How a case calls the operations: the blocking form, the asynchronous form
// (issued, then waited for), or the split form (dispatch_send/recv and
// combine_send/recv; the other operations asynchronously). Every form must
// give the reference's bits. A backend without a form runs the blocking one.
enum class Form { kBlocking, kAsync, kSplit };
const char* form_name(Form f);

// One sub-case: the routing and the knobs that vary with it.
struct Case {
  Shape shape;
  int num_experts = 0;
  int topk = 0;
  Routing routing = Routing::kUniform;
  uint32_t seed = 0;
  int hidden = 0;
  int alignment = 1;
  bool with_weights = false;
  bool pass_layout = false;
  bool with_bias = false;
  DType combine_input_dtype = DType::kF32;
  DType expanded_dtype = DType::kF32;
  bool explicit_expand_weights = false;
  std::vector<int32_t> expert_map;  // expert -> rank; empty: contiguous blocks
  Form form = Form::kBlocking;

  // Every field, for a SCOPED_TRACE.
  [[nodiscard]] std::string name() const;
};

// The sub-cases of a shape: expert counts x top-k x routings.
std::vector<Case> make_cases(const Shape& shape);

// Seeds of the per-rank tensors a rank makes up (biases, weights, gradients);
// the checking side makes the same ones.
enum : int { kBiasA = 1, kBiasB, kExpandWeights, kGradRecvWeights };
uint32_t sub_seed(const Case& c, int what, int rank);

// The buffer configuration of a case (max_topk = min(8, E): at least topk,
// and may be wider).
BufferConfig make_config(const Case& c);

}  // namespace epx::exchange_test
