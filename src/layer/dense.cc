#include "layer/dense.h"

#include "experts/gemm.h"
#include "core/bf16_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace epx::detail {

Status dense_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, const float* B,
                  bool accumulate, float* C) {
  if (M == 0 || N == 0) return Status::ok();
  if (K == 0) {
    if (!accumulate) std::fill(C, C + M * N, 0.0f);
    return Status::ok();
  }
  return gemm({.dtype = DType::kF32, .trans_a = trans_a, .trans_b = trans_b, .accumulate = accumulate, .m = M,
               .n = N, .k = K, .a = A, .lda = trans_a ? M : K, .b = B, .ldb = trans_b ? K : N, .c = C, .ldc = N},
              /*num_threads=*/1);
}

void rms_norm_forward(const float* x, const float* g, float eps, int64_t T, int64_t H, float* n, float* rstd) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * H;
    double ss = 0.0;
    for (int64_t h = 0; h < H; ++h) ss += static_cast<double>(xt[h]) * xt[h];
    const auto r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(H) + eps));
    rstd[t] = r;
    float* nt = n + t * H;
    for (int64_t h = 0; h < H; ++h) nt[h] = xt[h] * r * g[h];
  }
}

void rms_norm_backward(const float* x, const float* g, const float* rstd, const float* grad_n, int64_t T,
                       int64_t H, float* grad_x, float* grad_g) {
  // n = xhat * g, xhat = x * r: dx = r * (dxhat - xhat * mean(dxhat * xhat)).
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * H;
    const float* gn = grad_n + t * H;
    const float r = rstd[t];
    double dot = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      const float xhat = xt[h] * r;
      grad_g[h] += gn[h] * xhat;
      dot += static_cast<double>(gn[h]) * g[h] * xhat;
    }
    const auto mean = static_cast<float>(dot / static_cast<double>(H));
    float* gx = grad_x + t * H;
    for (int64_t h = 0; h < H; ++h) gx[h] += r * (gn[h] * g[h] - xt[h] * r * mean);
  }
}

void convert_from_f32(const float* in, int64_t count, DType dtype, void* out) {
  if (dtype == DType::kF32) {
    std::memcpy(out, in, static_cast<std::size_t>(count) * sizeof(float));
    return;
  }
  to_bf16(in, count, static_cast<uint16_t*>(out));  // the experts' vectorized rounding
}

}  // namespace epx::detail
