// The GEMM library's own rate, the limit the experts' benchmarks divide by:
// one oneDNN matmul C[m, n] = A[m, k] B[k, n] (row-major, f32 or bf16
// operands, f32 C) with every size fixed at creation, so oneDNN picks its
// best kernel for the shape. (The experts' path, epx::detail::gemm, gives
// the sizes at run time.) Used by expert_ffn_bench and moe_layer_bench.
#pragma once

#include <cstdint>

#include <oneapi/dnnl/dnnl.hpp>

#include "epx/core/dtype.h"

namespace epx::bench {

class FixedGemm {
 public:
  FixedGemm(DType dtype, int64_t m, int64_t n, int64_t k, const void* a, const void* b, float* c)
      : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {
    using dnnl::memory;
    const auto type = dtype == DType::kBF16 ? memory::data_type::bf16 : memory::data_type::f32;
    memory::desc ad({m, k}, type, memory::format_tag::ab), bd({k, n}, type, memory::format_tag::ab),
        cd({m, n}, memory::data_type::f32, memory::format_tag::ab);
    pd_ = dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), engine_);
    matmul_ = dnnl::matmul(pd_);
    a_ = memory(ad, engine_, const_cast<void*>(a)), b_ = memory(bd, engine_, const_cast<void*>(b));
    c_ = memory(cd, engine_, c);
  }
  // Runs on the calling thread's OpenMP thread count.
  void run() {
    matmul_.execute(stream_, {{DNNL_ARG_SRC, a_}, {DNNL_ARG_WEIGHTS, b_}, {DNNL_ARG_DST, c_}});
    stream_.wait();
  }

 private:
  dnnl::engine engine_;
  dnnl::stream stream_;
  dnnl::matmul::primitive_desc pd_;
  dnnl::matmul matmul_;
  dnnl::memory a_, b_, c_;
};

}  // namespace epx::bench
