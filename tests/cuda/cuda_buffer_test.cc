// CudaBuffer (one rank per thread here, per process under MPI) against the
// reference: R rank threads of the in-process transport on GPU 0, their
// regions shared through map_cuda_peer_memory. Dispatch rows and metadata
// bit for bit, combine (f32 and bf16 y, with bias and weight gradients) in
// the flat order, the cached dispatch; then every operation against a host
// Buffer on one node and across nodes (host-staged). Skipped, with the
// reason, without a GPU.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <mutex>

#include "device_memory.h"
#include "epx/comm/inproc.h"
#include "epx/exchange/cuda_buffer.h"
#include "exchange/device_buffer_checks.h"
#include "exchange/harness.h"
#include "exchange/reference.h"

namespace epx::cuda_test {
namespace {

using exchange_test::Matrix;

struct RankOut {
  Matrix recv_x, out_f32, out_bf16, recv_again;
  std::vector<int32_t> src_rank, src_idx, topk_idx, per_expert;
  std::vector<float> grad_w;
};

TEST(CudaBuffer, RankThreadsMatchTheReference) {
  EPX_SKIP_WITHOUT_GPU();
  for (int R : {1, 2, 4, 8})
    for (DType dtype : {DType::kF32, DType::kBF16})
      for (exchange_test::Routing routing : exchange_test::kAllRoutings) {
        const int E = 4 * R, K = std::min(8, E), H = 64, T = 24;
        const uint32_t seed = 7u * R + 3u * static_cast<uint32_t>(dtype) + static_cast<uint32_t>(routing);
        SCOPED_TRACE(fmt::format("{} ranks, {}, routing {}", R, dtype_name(dtype), exchange_test::routing_name(routing)));
        const exchange_test::ExchangeSpec spec{*Topology::create(R), *ExpertPlacement::contiguous(E, R), dtype, H, 1};
        const auto inputs = exchange_test::make_inputs(spec, routing, K, T, true, seed);
        const auto recv = exchange_test::reference_dispatch(spec, inputs);
        const auto xs = exchange_test::xs_of(inputs);
        const auto recv_x = exchange_test::gather_rows(xs, recv);
        std::vector<Matrix> y_f32, y_bf16;
        std::vector<std::vector<float>> grad_recv_w;
        for (int r = 0; r < R; ++r) {
          y_f32.push_back(exchange_test::expert_output(recv_x[r], r, DType::kF32));
          y_bf16.push_back(exchange_test::expert_output(recv_x[r], r, DType::kBF16));
          grad_recv_w.push_back(exchange_test::make_random_floats(seed + r, recv[r].num_recv() * K));
        }
        const auto x2 = [&] {
          std::vector<Matrix> m;
          for (int r = 0; r < R; ++r) m.push_back(exchange_test::make_payload(5, r, inputs[r].num_tokens(), H, dtype));
          return m;
        }();
        std::vector<RankOut> outs(R);
        BufferConfig config;
        config.num_experts = E;
        config.hidden = H;
        config.dtype = dtype;
        config.max_topk = K;
        config.max_tokens_per_rank = T;
        const std::vector<Status> statuses = run_ranks(spec.topology, [&](Transport& t) -> Status {
          const int r = t.rank();
          EPX_ASSIGN_OR_RETURN(auto buffer, CudaBuffer::create(t, config, 0));
          const exchange_test::RankInputs& in = inputs[r];
          DeviceMatrix x = upload(in.x), idx = upload(in.topk_idx, DType::kI32, in.num_tokens(), K),
                       w = upload(in.topk_weights, DType::kF32, in.num_tokens(), K);
          DispatchResult res;
          EPX_RETURN_IF_ERROR(buffer->dispatch({x.view, idx.view, w.view}, &res));
          RankOut& o = outs[r];
          o.recv_x = download(res.recv_x);
          o.src_rank = download_vector<int32_t>(res.recv_src_rank);
          o.src_idx = download_vector<int32_t>(res.recv_src_idx);
          o.topk_idx = download_vector<int32_t>(res.recv_topk_idx);
          o.per_expert = res.num_recv_tokens_per_expert;
          DeviceMatrix yf = upload(y_f32[r]), yb = upload(y_bf16[r]);
          DeviceMatrix of = filled(DType::kF32, in.num_tokens(), H, exchange_test::kUnwritten);
          DeviceMatrix ob = filled(DType::kBF16, in.num_tokens(), H, exchange_test::kUnwritten);
          DeviceMatrix grw = upload(grad_recv_w[r], DType::kF32, recv[r].num_recv(), K);
          DeviceMatrix gw = filled(DType::kF32, in.num_tokens(), K, exchange_test::kUnwritten);
          EPX_RETURN_IF_ERROR(buffer->combine(yf.view, res.handle, of.view));
          CombineOptions options;
          options.grad_recv_topk_weights = grw.view;
          options.grad_topk_weights = gw.view;
          EPX_RETURN_IF_ERROR(buffer->combine(yb.view, res.handle, ob.view, options));
          o.out_f32 = download(of.view);
          o.out_bf16 = download(ob.view);
          o.grad_w = download_vector<float>(gw.view);
          DeviceMatrix x2d = upload(x2[r]);
          TensorView again;
          EPX_RETURN_IF_ERROR(buffer->dispatch_cached(x2d.view, res.handle, &again));
          o.recv_again = download(again);
          return t.barrier(Deadline::after(Milliseconds(20000)));  // nobody frees memory a peer still reads
        });
        const auto ref_f32 = exchange_test::reference_combine(spec, inputs, recv, y_f32, {}, DType::kF32,
                                                              exchange_test::CombineOrder::kFlat);
        const auto ref_bf16 = exchange_test::reference_combine(spec, inputs, recv, y_bf16, {}, DType::kBF16,
                                                               exchange_test::CombineOrder::kFlat);
        const auto grad_w = exchange_test::reference_weight_grads(spec, inputs, recv, grad_recv_w);
        const auto recv_again = exchange_test::gather_rows(x2, recv);
        for (int r = 0; r < R; ++r) {
          SCOPED_TRACE(fmt::format("rank {}", r));
          ASSERT_TRUE(statuses[r].is_ok()) << statuses[r].message();
          EXPECT_TRUE(exchange_test::same_matrix(outs[r].recv_x, recv_x[r], &xs)) << "recv_x";
          EXPECT_EQ(outs[r].src_rank, recv[r].src_rank);
          EXPECT_EQ(outs[r].src_idx, recv[r].src_idx);
          EXPECT_EQ(outs[r].topk_idx, recv[r].topk_idx);
          EXPECT_EQ(outs[r].per_expert, recv[r].num_recv_tokens_per_expert);
          EXPECT_TRUE(exchange_test::same_combine(outs[r].out_f32, ref_f32[r], nullptr)) << "combine f32";
          EXPECT_TRUE(exchange_test::same_combine(outs[r].out_bf16, ref_bf16[r], nullptr)) << "combine bf16";
          EXPECT_TRUE(exchange_test::same_vector(outs[r].grad_w, grad_w[r], K)) << "weight gradients";
          EXPECT_TRUE(exchange_test::same_matrix(outs[r].recv_again, recv_again[r], &x2)) << "dispatch_cached";
        }
        if (::testing::Test::HasFailure()) return;
      }
}

struct CudaBackend {
  using Exchange = CudaBuffer;
  static Result<std::unique_ptr<Exchange>> make(Transport& t, const BufferConfig& config) {
    return CudaBuffer::create(t, config, 0);
  }
  using Array = DeviceMatrix;
  static Array upload(const Matrix& m) { return cuda_test::upload(m); }
  static Matrix download(const TensorView& v) { return cuda_test::download(v); }
  static void write(const TensorView& dst, const Matrix& m) {
    EPX_CHECK(m.rows() <= 1 || dst.row_stride_bytes() == m.row_bytes());
    if (!m.bytes().empty())
      EPX_CHECK(cudaMemcpy(dst.data(), m.bytes().data(), m.bytes().size(), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  static Device device() { return kGpu0; }
};

// Every operation, the expanded ones too, against a host Buffer on the same
// transport: peer-memory kernels inside one node, host staging across nodes.
TEST(CudaBuffer, MatchesTheHostBufferOnOneAndSeveralNodes) {
  EPX_SKIP_WITHOUT_GPU();
  const std::pair<int, int> shapes[] = {{1, 1}, {2, 1}, {4, 1}, {8, 1}, {4, 2}, {8, 2}, {8, 4}};
  for (const auto& [R, N] : shapes)
    for (DType dtype : {DType::kF32, DType::kBF16})
      for (exchange_test::Routing routing : exchange_test::kAllRoutings) {
        exchange_test::check_device_exchange_like_host<CudaBackend>(
            *Topology::create(R, N), dtype, routing, 100u * R + 10u * N + static_cast<uint32_t>(routing));
        if (::testing::Test::HasFailure()) return;
      }
}

// dispatch_async and combine_async (queued on the progress thread, with this
// thread free in between) give the blocking forms' bits, on one node and
// host-staged across two.
TEST(CudaBuffer, AsyncFormsMatchTheBlockingOnes) {
  EPX_SKIP_WITHOUT_GPU();
  for (const auto& [R, N] : {std::pair{4, 1}, std::pair{4, 2}}) {
    SCOPED_TRACE(fmt::format("{} ranks on {} nodes", R, N));
    const int E = 4 * R, K = 4, H = 64, T = 24;
    const exchange_test::ExchangeSpec spec{*Topology::create(R, N), *ExpertPlacement::contiguous(E, R), DType::kBF16,
                                           H, 1};
    const auto inputs = exchange_test::make_inputs(spec, exchange_test::Routing::kSkewed, K, T, true, 41u + N);
    BufferConfig config;
    config.num_experts = E;
    config.hidden = H;
    config.dtype = DType::kBF16;
    config.max_topk = K;
    config.max_tokens_per_rank = T;
    std::vector<Matrix> recv_blocking(R), recv_async(R), out_blocking(R), out_async(R);
    const std::vector<Status> statuses = run_ranks(spec.topology, [&](Transport& t) -> Status {
      const int r = t.rank();
      const exchange_test::RankInputs& in = inputs[r];
      EPX_ASSIGN_OR_RETURN(auto buffer, CudaBuffer::create(t, config, 0));
      DeviceMatrix x = upload(in.x), idx = upload(in.topk_idx, DType::kI32, in.num_tokens(), K),
                   w = upload(in.topk_weights, DType::kF32, in.num_tokens(), K);
      DeviceMatrix out = filled(DType::kF32, in.num_tokens(), H, exchange_test::kUnwritten);
      DispatchResult res;
      EPX_RETURN_IF_ERROR(buffer->dispatch({x.view, idx.view, w.view}, &res));
      recv_blocking[r] = download(res.recv_x);
      DeviceMatrix y = upload(exchange_test::expert_output(recv_blocking[r], r, DType::kF32));
      EPX_RETURN_IF_ERROR(buffer->combine(y.view, res.handle, out.view));
      out_blocking[r] = download(out.view);
      DispatchResult res2;
      const PendingOp dispatched = buffer->dispatch_async({x.view, idx.view, w.view}, &res2);
      EPX_RETURN_IF_ERROR(dispatched.wait());
      recv_async[r] = download(res2.recv_x);
      DeviceMatrix out2 = filled(DType::kF32, in.num_tokens(), H, exchange_test::kUnwritten);
      EPX_RETURN_IF_ERROR(buffer->combine_async(y.view, res2.handle, out2.view).wait());
      out_async[r] = download(out2.view);
      return t.barrier(Deadline::after(Milliseconds(20000)));
    });
    for (int r = 0; r < R; ++r) {
      ASSERT_TRUE(statuses[r].is_ok()) << statuses[r].message();
      EXPECT_TRUE(recv_async[r].same_bits(recv_blocking[r])) << "rank " << r << " recv_x";
      EXPECT_TRUE(out_async[r].same_bits(out_blocking[r])) << "rank " << r << " combine";
    }
  }
}

}  // namespace
}  // namespace epx::cuda_test
