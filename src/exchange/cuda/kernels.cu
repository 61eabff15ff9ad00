// The exchange's CUDA kernels (see kernels.h for what each promises).
#include "exchange/cuda/kernels.h"

#include <cuda_bf16.h>

#include <cub/block/block_scan.cuh>

namespace epx::cuda {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t items, int64_t per_block, int64_t cap = 65535) {
  const int64_t b = (items + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > cap ? cap : b));
}

__device__ __forceinline__ float load_f32(const std::byte* row, bool bf16, int64_t c) {
  return bf16 ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[c])
              : reinterpret_cast<const float*>(row)[c];
}

__device__ __forceinline__ void store_f32(std::byte* row, bool bf16, int64_t c, float v) {
  if (bf16)
    reinterpret_cast<__nv_bfloat16*>(row)[c] = __float2bfloat16_rn(v);
  else
    reinterpret_cast<float*>(row)[c] = v;
}

__global__ void layout_kernel(LayoutArgs a) {
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < a.num_tokens; t += gridDim.x * blockDim.x) {
    const int32_t* row = a.topk_idx + t * a.topk_stride;
    unsigned long long rank_mask = 0, node_mask = 0;
    for (int k = 0; k < a.topk; ++k) {
      const int32_t e = row[k];
      int32_t r = -1;
      if (e != -1) {
        const unsigned long long where = static_cast<unsigned long long>(t) * a.topk + k;
        if (e < 0 || e >= a.num_experts) {
          atomicMin(a.error, where * 4 + 1);
        } else {
          bool twice = false;
          for (int j = 0; j < k; ++j) twice = twice || row[j] == e;
          if (twice) {
            atomicMin(a.error, where * 4 + 2);
          } else {
            atomicAdd(a.counts + a.num_ranks + a.num_nodes + e, 1);
            r = a.expert_rank[e];
            rank_mask |= 1ull << r;
            node_mask |= 1ull << (r / a.ranks_per_node);
          }
        }
      }
      a.topk_rank[static_cast<int64_t>(t) * a.topk + k] = r;
    }
    for (int r = 0; r < a.num_ranks; ++r) {
      const bool in = (rank_mask >> r) & 1ull;
      a.in_rank[static_cast<int64_t>(t) * a.num_ranks + r] = in ? 1 : 0;
      if (in) atomicAdd(a.counts + r, 1);
    }
    for (int n = 0; n < a.num_nodes; ++n)
      if ((node_mask >> n) & 1ull) atomicAdd(a.counts + a.num_ranks + n, 1);
  }
}

// One block per destination: a running exclusive scan down the column.
__global__ void send_row_kernel(SendRowArgs a) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage storage;
  const int d = blockIdx.x;
  int64_t running = a.base[d];
  for (int first = 0; first < a.num_tokens; first += kThreads) {
    const int t = first + threadIdx.x;
    const int flag = t < a.num_tokens ? a.in_rank[static_cast<int64_t>(t) * a.num_ranks + d] : 0;
    int prefix = 0, total = 0;
    Scan(storage).ExclusiveSum(flag, prefix, total);
    if (t < a.num_tokens)
      a.send_row[static_cast<int64_t>(t) * a.num_ranks + d] = flag ? static_cast<int32_t>(running + prefix) : -1;
    running += total;
    __syncthreads();  // the scan storage is reused
  }
}

// One block per token (grid-stride): each vector of the row is loaded once
// and stored to every destination holding the token.
template <typename Unit>
__global__ void dispatch_kernel(DispatchArgs a) {
  __shared__ int32_t rows[kMaxRanks];
  const int64_t units = static_cast<int64_t>(a.row_bytes / sizeof(Unit));
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    for (int d = threadIdx.x; d < a.num_ranks; d += blockDim.x)
      rows[d] = a.send_row[static_cast<int64_t>(t) * a.num_ranks + d];
    __syncthreads();
    const Unit* src = reinterpret_cast<const Unit*>(a.x + t * a.x_stride_bytes);
    for (int64_t i = threadIdx.x; i < units; i += blockDim.x) {
      const Unit v = src[i];
      for (int d = 0; d < a.num_ranks; ++d)
        if (rows[d] >= 0) reinterpret_cast<Unit*>(a.targets.recv_x[d] + rows[d] * a.row_bytes)[i] = v;
    }
    if (a.topk_idx != nullptr) {
      const int32_t* idx = a.topk_idx + t * a.topk_stride;
      for (int job = threadIdx.x; job < a.num_ranks * (a.topk + 1); job += blockDim.x) {
        const int d = job / (a.topk + 1), k = job % (a.topk + 1) - 1;
        const int64_t row = rows[d];
        if (row < 0) continue;
        if (k < 0) {
          a.targets.src_idx[d][row] = t;
          a.targets.src_rank[d][row] = a.src_rank;
          continue;
        }
        const int32_t e = idx[k];
        const bool here = e >= 0 && a.expert_rank[e] == d;
        a.targets.topk_idx[d][row * a.topk + k] = here ? a.local_id[e] : -1;
        a.targets.topk_weights[d][row * a.topk + k] =
            here && a.topk_weights != nullptr ? a.topk_weights[t * a.weights_stride + k] : 0.0f;
      }
    }
    __syncthreads();  // rows[] is rewritten for the next token
  }
}

// 8 consecutive elements (bf16 or f32) of a row, as floats: one 16-byte load
// for bf16, two for f32 (the caller checked the alignment).
__device__ __forceinline__ void load8(const std::byte* row, bool bf16, int64_t c, float v[8]) {
  if (bf16) {
    const uint4 u = *reinterpret_cast<const uint4*>(row + c * 2);
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&u);
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(p[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  } else {
    const float4 lo = *reinterpret_cast<const float4*>(row + c * 4);
    const float4 hi = *reinterpret_cast<const float4*>(row + c * 4 + 16);
    v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
  }
}

__device__ __forceinline__ void store8(std::byte* row, bool bf16, int64_t c, const float v[8]) {
  if (bf16) {
    uint4 u;
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&u);
    for (int i = 0; i < 4; ++i) p[i] = __halves2bfloat162(__float2bfloat16_rn(v[2 * i]), __float2bfloat16_rn(v[2 * i + 1]));
    *reinterpret_cast<uint4*>(row + c * 2) = u;
  } else {
    *reinterpret_cast<float4*>(row + c * 4) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(row + c * 4 + 16) = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// One block per token (grid-stride); each thread sums W consecutive columns
// (W = 8: 16-byte loads; W = 1: any alignment). The order of the adds per
// element is the same either way, so the bits are too.
template <int W>
__global__ void combine_kernel(CombineArgs a) {
  __shared__ int32_t rows[kMaxRanks];
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    for (int d = threadIdx.x; d < a.num_ranks; d += blockDim.x)
      rows[d] = a.send_row[static_cast<int64_t>(t) * a.num_ranks + d];
    __syncthreads();
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * W; c < a.hidden; c += static_cast<int64_t>(blockDim.x) * W) {
      float acc[W], g[W], v[W];
      for (int i = 0; i < W; ++i) acc[i] = 0.0f;
      auto load = [&](const std::byte* row, bool bf16, float* out) {
        if constexpr (W == 8) {
          load8(row, bf16, c, out);
        } else {
          out[0] = load_f32(row, bf16, c);
        }
      };
      const int group = a.hierarchical ? a.ranks_per_node : 1;
      for (int first = 0; first < a.num_ranks; first += group) {
        for (int i = 0; i < W; ++i) g[i] = 0.0f;
        bool any = false;
        for (int d = first; d < first + group; ++d) {
          if (rows[d] < 0) continue;
          load(a.y[d] + rows[d] * a.y_stride_bytes[d], a.y_bf16, v);
          for (int i = 0; i < W; ++i) g[i] = __fadd_rn(g[i], v[i]);
          any = true;
        }
        if (any)
          for (int i = 0; i < W; ++i) acc[i] = __fadd_rn(acc[i], g[i]);
      }
      if (a.bias != nullptr) {
        load(a.bias + t * a.bias_stride_bytes, a.bias_bf16, v);
        for (int i = 0; i < W; ++i) acc[i] = __fadd_rn(acc[i], v[i]);
      }
      std::byte* out = a.out + t * a.out_stride_bytes;
      if constexpr (W == 8) {
        store8(out, a.out_bf16, c, acc);
      } else {
        store_f32(out, a.out_bf16, c, acc[0]);
      }
    }
    if (a.grad_topk_weights != nullptr)
      for (int k = threadIdx.x; k < a.topk; k += blockDim.x) {
        const int r = a.topk_rank[static_cast<int64_t>(t) * a.topk + k];
        a.grad_topk_weights[static_cast<int64_t>(t) * a.topk + k] =
            r < 0 ? 0.0f : a.grad_recv_weights[r][static_cast<int64_t>(rows[r]) * a.topk + k];
      }
    __syncthreads();
  }
}

template <typename Unit>
__global__ void expand_kernel(const std::byte* recv_x, std::size_t recv_stride, const int64_t* recv_row,
                              int64_t num_rows, std::size_t row_bytes, std::byte* out, std::size_t out_stride) {
  const int64_t units = static_cast<int64_t>(row_bytes / sizeof(Unit));
  for (int64_t i = blockIdx.x; i < num_rows; i += gridDim.x) {
    const int64_t src = recv_row[i];
    Unit* dst = reinterpret_cast<Unit*>(out + i * out_stride);
    for (int64_t j = threadIdx.x; j < units; j += blockDim.x)
      dst[j] = src < 0 ? Unit{} : reinterpret_cast<const Unit*>(recv_x + src * recv_stride)[j];
  }
}

__global__ void expanded_partial_kernel(const std::byte* y, std::size_t y_stride, bool y_bf16, const int64_t* row_of,
                                        const float* weights, int64_t num_recv, int topk, int hidden,
                                        float* partial) {
  for (int64_t i = blockIdx.x; i < num_recv; i += gridDim.x)
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
      float p = 0.0f;
      for (int k = 0; k < topk; ++k) {
        const int64_t row = row_of[i * topk + k];
        if (row >= 0) p = __fadd_rn(p, __fmul_rn(weights[i * topk + k], load_f32(y + row * y_stride, y_bf16, c)));
      }
      partial[i * hidden + c] = p;
    }
}

// The dot products first (one thread per slot, columns in order), so that
// grad_y may share y's memory.
__global__ void expanded_dot_kernel(ExpandedBackwardArgs a) {
  const int64_t slots = a.num_recv * a.topk;
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < slots;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = s / a.topk, row = a.row_of[s];
    float dot = 0.0f;
    if (row >= 0) {
      const std::byte* g = a.grad_partial + i * a.hidden * (a.grad_bf16 ? 2 : 4);
      const std::byte* y = a.y + row * a.y_stride_bytes;
      for (int c = 0; c < a.hidden; ++c) dot = __fadd_rn(dot, __fmul_rn(load_f32(g, a.grad_bf16, c), load_f32(y, a.y_bf16, c)));
    }
    a.grad_weights[s] = dot;
  }
}

// One block per expanded row: w * grad_partial of its received row, or 0.
__global__ void expanded_grad_y_kernel(ExpandedBackwardArgs a) {
  for (int64_t r = blockIdx.x; r < a.num_rows; r += gridDim.x) {
    const int64_t i = a.recv_row[r];
    float w = 0.0f;
    if (i >= 0)
      for (int k = 0; k < a.topk; ++k)
        if (a.row_of[i * a.topk + k] == r) w = a.weights[i * a.topk + k];
    float* gy = reinterpret_cast<float*>(reinterpret_cast<std::byte*>(a.grad_y) + r * a.grad_y_stride_bytes);
    const std::byte* g = i < 0 ? nullptr : a.grad_partial + i * a.hidden * (a.grad_bf16 ? 2 : 4);
    for (int c = threadIdx.x; c < a.hidden; c += blockDim.x) gy[c] = i < 0 ? 0.0f : __fmul_rn(w, load_f32(g, a.grad_bf16, c));
  }
}

}  // namespace

cudaError_t launch_layout(const LayoutArgs& args, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(args.counts, 0, sizeof(int32_t) * (args.num_ranks + args.num_nodes + args.num_experts), stream);
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(args.error, 0xff, sizeof(unsigned long long), stream);
  if (err != cudaSuccess || args.num_tokens == 0) return err;
  layout_kernel<<<blocks_for(args.num_tokens, kThreads), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_send_rows(const SendRowArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  send_row_kernel<<<args.num_ranks, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  const int grid = blocks_for(args.num_tokens, 1);
  switch (args.unit) {
    case 16: dispatch_kernel<uint4><<<grid, kThreads, 0, stream>>>(args); break;
    case 8: dispatch_kernel<uint2><<<grid, kThreads, 0, stream>>>(args); break;
    case 4: dispatch_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(args); break;
    default: dispatch_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(args); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_combine(const CombineArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  // Eight columns per thread when every row of y, bias and out starts on 16 bytes.
  auto aligned = [](const void* p, std::size_t stride) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0 && stride % 16 == 0;
  };
  bool by8 = args.hidden % 8 == 0 && aligned(args.out, args.out_stride_bytes) &&
             (args.bias == nullptr || aligned(args.bias, args.bias_stride_bytes));
  for (int d = 0; d < args.num_ranks && by8; ++d) by8 = args.y[d] == nullptr || aligned(args.y[d], args.y_stride_bytes[d]);
  if (by8)
    combine_kernel<8><<<blocks_for(args.num_tokens, 1), kThreads, 0, stream>>>(args);
  else
    combine_kernel<1><<<blocks_for(args.num_tokens, 1), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_expand(const std::byte* recv_x, std::size_t recv_stride_bytes, const int64_t* recv_row,
                          int64_t num_rows, std::size_t row_bytes, std::byte* out, std::size_t out_stride_bytes,
                          cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  const int grid = blocks_for(num_rows, 1);
  const bool by16 = row_bytes % 16 == 0 && recv_stride_bytes % 16 == 0 && out_stride_bytes % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(recv_x) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (by16)
    expand_kernel<uint4><<<grid, kThreads, 0, stream>>>(recv_x, recv_stride_bytes, recv_row, num_rows, row_bytes, out,
                                                        out_stride_bytes);
  else
    expand_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(recv_x, recv_stride_bytes, recv_row, num_rows, row_bytes,
                                                           out, out_stride_bytes);
  return cudaGetLastError();
}

cudaError_t launch_expanded_partial(const std::byte* y, std::size_t y_stride_bytes, bool y_bf16, const int64_t* row_of,
                                    const float* weights, int64_t num_recv, int topk, int hidden, float* partial,
                                    cudaStream_t stream) {
  if (num_recv == 0) return cudaSuccess;
  expanded_partial_kernel<<<blocks_for(num_recv, 1), kThreads, 0, stream>>>(y, y_stride_bytes, y_bf16, row_of, weights,
                                                                           num_recv, topk, hidden, partial);
  return cudaGetLastError();
}

cudaError_t launch_expanded_backward(const ExpandedBackwardArgs& args, cudaStream_t stream) {
  if (args.grad_weights != nullptr && args.num_recv > 0) {
    expanded_dot_kernel<<<blocks_for(args.num_recv * args.topk, kThreads), kThreads, 0, stream>>>(args);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (args.num_rows == 0) return cudaSuccess;
  expanded_grad_y_kernel<<<blocks_for(args.num_rows, 1), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace epx::cuda
