// The element-wise middle of a SwiGLU expert, forward and backward, over f32
// rows (the GEMM outputs), writing the next GEMM's operands in f32 or bf16.
#pragma once

#include <cstdint>

#include "epx/core/dtype.h"

namespace epx::detail {

// a = silu(h1) * h3 for n elements; `a` is of `dtype` (bf16: rounded to
// nearest even).
void swiglu_forward(const float* h1, const float* h3, int64_t n, DType dtype, void* a);

// From grad_a = d loss / d a: a (recomputed), grad_h1 and grad_h3, each of
// `dtype`.
void swiglu_backward(const float* h1, const float* h3, const float* grad_a, int64_t n, DType dtype, void* a,
                     void* grad_h1, void* grad_h3);

}  // namespace epx::detail
