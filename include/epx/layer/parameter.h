// Parameter: one named trainable tensor with its gradient.
//
// Dense parameters (norms, routers, shared experts, projections) are
// replicated on every rank and their gradients are summed over ranks before
// the optimizer step (data parallel). Expert parameters live only on the rank
// that holds the expert; their gradients already contain every rank's tokens.
//
//   for (epx::Parameter* p : layer->parameters())
//     if (p->kind == epx::ParamKind::kDense) all_reduce(p->grad);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/core/status.h"
#include "epx/core/tensor.h"

namespace epx {

enum class ParamKind : uint8_t { kDense, kExpert };

struct Parameter {
  std::string name;  // unique within a model, e.g. "layer1.router"
  ParamKind kind = ParamKind::kDense;
  int64_t rows = 0;  // every parameter is a [rows, cols] f32 matrix
  int64_t cols = 0;
  std::vector<float> value;
  std::vector<float> grad;
  // Bumped by mark_written(): every writer of `value` after construction (the
  // optimizer step, a checkpoint load, a rebalance, a rebuild) calls it, so
  // that copies made from the values (the layer's bf16 GEMM weights) know to
  // refresh. The layer checks sampled values of its copies against `value` and
  // names a parameter that changed without a bump.
  uint64_t version = 0;

  Parameter() = default;
  Parameter(std::string name_in, ParamKind kind_in, int64_t rows_in, int64_t cols_in)
      : name(std::move(name_in)), kind(kind_in), rows(rows_in), cols(cols_in),
        value(static_cast<std::size_t>(rows_in * cols_in), 0.0f),
        grad(static_cast<std::size_t>(rows_in * cols_in), 0.0f) {}

  // The constructor's allocation as a Result: ResourceExhausted naming the
  // bytes (value and gradient) and the parameter where memory is short.
  static Result<Parameter> make(std::string name, ParamKind kind, int64_t rows, int64_t cols);

  [[nodiscard]] int64_t numel() const { return rows * cols; }
  [[nodiscard]] TensorView view() const {
    return TensorView::contiguous(value.data(), DType::kF32, {rows, cols});
  }
  [[nodiscard]] TensorView grad_view() const {
    return TensorView::contiguous(grad.data(), DType::kF32, {rows, cols});
  }
  void zero_grad() { std::fill(grad.begin(), grad.end(), 0.0f); }
  void mark_written() { ++version; }
};

}  // namespace epx
