// Dense building blocks of the layer and the model: a row-major GEMM over
// the BLAS, RMSNorm forward/backward, and dtype conversion of whole matrices.
#pragma once

#include <cstdint>

#include "epx/core/dtype.h"
#include "epx/core/status.h"

namespace epx::detail {

// f32, row-major, on the calling thread: C[M, N] = op(A) op(B), or C += with
// `accumulate`; op transposes when the flag is set. A is [M, K] (stored
// [K, M] transposed), B is [K, N] (stored [N, K] transposed). The experts'
// oneDNN matmul does the work.
[[nodiscard]] Status dense_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
                                const float* B, bool accumulate, float* C);

// n[t] = x[t] / sqrt(mean(x[t]^2) + eps) * g; rstd[t] = 1 / sqrt(mean + eps).
void rms_norm_forward(const float* x, const float* g, float eps, int64_t T, int64_t H, float* n, float* rstd);
// Adds d/dx into grad_x and d/dg into grad_g.
void rms_norm_backward(const float* x, const float* g, const float* rstd, const float* grad_n, int64_t T,
                       int64_t H, float* grad_x, float* grad_g);

// Converts count f32 values to `dtype` (kF32: copy, kBF16: round to nearest even).
void convert_from_f32(const float* in, int64_t count, DType dtype, void* out);

}  // namespace epx::detail
