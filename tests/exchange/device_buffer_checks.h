// One check for every per-rank exchange on device views (CudaBuffer, the
// host-staged exchange): the ranks of the test world (threads, or MPI
// processes: shapes of another size return at once), each running the
// device backend and a host Buffer on the same transport, one after the
// other, on the same inputs; every result must equal the host Buffer's bit for bit (the host
// Buffer is held to the reference by the conformance table). Covers
// dispatch and its metadata, combine (f32 and bf16 y, bias, weight
// gradients), the cached dispatch, the expanded layout, expand,
// combine_expanded and its backward, and that results are device views.
//
// A Backend provides:
//   using Exchange;                                   // the device-side buffer
//   static Result<std::unique_ptr<Exchange>> make(Transport&, const BufferConfig&);
//   using Array;                                      // owns device memory; .view
//   static Array upload(const exchange_test::Matrix&);
//   static exchange_test::Matrix download(const TensorView&);
//   static void write(const TensorView& dense_device_view, const exchange_test::Matrix&);
//   static Device device();
#pragma once

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <memory>
#include <vector>

#include "epx/exchange/buffer.h"
#include "exchange/harness.h"
#include "exchange/reference.h"
#include "exchange/world.h"

namespace epx::exchange_test {

// A Matrix holding `v` as [rows, cols] of `dtype` (4-byte elements).
template <typename T>
Matrix matrix_of(const std::vector<T>& v, DType dtype, int64_t rows, int64_t cols) {
  Matrix m(dtype, rows, cols);
  if (!v.empty()) std::memcpy(m.row(0), v.data(), v.size() * sizeof(T));
  return m;
}

// What one rank got from the device backend (first) and the host Buffer (second).
struct DeviceHostPair {
  std::string what;
  Matrix device, host;
};

template <typename Backend>
void check_device_exchange_like_host(const Topology& topology, DType dtype, Routing routing, uint32_t seed) {
  TestWorld& world = test_world();
  if (!world.cannot_run(topology).empty()) return;
  const int R = topology.num_ranks(), E = 4 * R, K = std::min(8, E), H = 64, T = 24;
  SCOPED_TRACE(fmt::format("{} ranks on {} nodes, {}, routing {}", R, topology.num_nodes(), dtype_name(dtype),
                           routing_name(routing)));
  const ExchangeSpec spec{topology, *ExpertPlacement::contiguous(E, R), dtype, H, 1};
  const std::vector<RankInputs> inputs = make_inputs(spec, routing, K, T, true, seed);
  BufferConfig config;
  config.num_experts = E;
  config.hidden = H;
  config.dtype = dtype;
  config.max_topk = K;
  config.max_tokens_per_rank = T;
  config.expert_alignment = 4;
  std::vector<std::vector<DeviceHostPair>> got(R);
  std::vector<std::string> not_on_device(R);
  const std::vector<Status> statuses = world.run(topology, [&](Transport& t) -> Status {
    const int r = t.rank();
    const RankInputs& in = inputs[r];
    const int64_t Tr = in.num_tokens();
    EPX_ASSIGN_OR_RETURN(auto dev, Backend::make(t, config));
    EPX_ASSIGN_OR_RETURN(auto host, Buffer::create(t, config));
    std::vector<DeviceHostPair>& out = got[r];
    const auto keep_matrices = [&](std::string what, Matrix d, Matrix h) {
      out.push_back({std::move(what), std::move(d), std::move(h)});
    };
    const auto keep = [&](std::string what, const TensorView& d, const TensorView& h) {
      if (d.defined() && d.device() != Backend::device()) not_on_device[r] += what + " ";
      keep_matrices(std::move(what), d.defined() ? Backend::download(d) : Matrix(), h.defined() ? Matrix::copy_of(h) : Matrix());
    };
    const auto keep_vectors = [&](std::string what, const auto& d, const auto& h, DType type) {
      keep_matrices(std::move(what), matrix_of(d, type, 1, static_cast<int64_t>(d.size())),
                    matrix_of(h, type, 1, static_cast<int64_t>(h.size())));
    };
    const Matrix idx = matrix_of(in.topk_idx, DType::kI32, Tr, K), w = matrix_of(in.topk_weights, DType::kF32, Tr, K);
    auto dx = Backend::upload(in.x), didx = Backend::upload(idx), dw = Backend::upload(w);

    DispatchResult dres, hres;
    EPX_RETURN_IF_ERROR(dev->dispatch({dx.view, didx.view, dw.view}, &dres));
    EPX_RETURN_IF_ERROR(host->dispatch({in.x.view(), idx.view(), w.view()}, &hres));
    keep("recv_x", dres.recv_x, hres.recv_x);
    keep("recv_topk_idx", dres.recv_topk_idx, hres.recv_topk_idx);
    keep("recv_topk_weights", dres.recv_topk_weights, hres.recv_topk_weights);
    keep("recv_src_rank", dres.recv_src_rank, hres.recv_src_rank);
    keep("recv_src_idx", dres.recv_src_idx, hres.recv_src_idx);
    const int64_t n = hres.handle.num_recv_tokens();
    keep_vectors("num_recv_tokens_per_expert", dres.num_recv_tokens_per_expert, hres.num_recv_tokens_per_expert,
                 DType::kI32);
    Matrix recv_x = Matrix::copy_of(hres.recv_x);

    // combine: f32 y with bias and weight gradients into f32, then bf16 y into bf16.
    const Matrix y32 = expert_output(recv_x, r, DType::kF32), y16 = expert_output(recv_x, r, DType::kBF16);
    const Matrix bias = make_random_matrix(seed + 11 + r, Tr, H, DType::kF32);
    const Matrix grad_recv_w = matrix_of(make_random_floats(seed + 13 + r, n * K), DType::kF32, n, K);
    for (DType ydtype : {DType::kF32, DType::kBF16}) {
      const Matrix& y = ydtype == DType::kF32 ? y32 : y16;
      const bool extras = ydtype == DType::kF32;
      auto dy = Backend::upload(y), dbias = Backend::upload(bias), dgrw = Backend::upload(grad_recv_w);
      auto dout = Backend::upload(Matrix::filled(ydtype, Tr, H, kUnwritten));
      auto dgw = Backend::upload(Matrix::filled(DType::kF32, Tr, K, kUnwritten));
      Matrix hout = Matrix::filled(ydtype, Tr, H, kUnwritten), hgw = Matrix::filled(DType::kF32, Tr, K, kUnwritten);
      CombineOptions dopt, hopt;
      if (extras) {
        dopt = {dbias.view, dgrw.view, dgw.view};
        hopt = {bias.view(), grad_recv_w.view(), hgw.view()};
      }
      EPX_RETURN_IF_ERROR(dev->combine(dy.view, dres.handle, dout.view, dopt));
      EPX_RETURN_IF_ERROR(host->combine(y.view(), hres.handle, hout.view(), hopt));
      keep(fmt::format("combine {}", dtype_name(ydtype)), dout.view, hout.view());
      if (extras) keep("grad_topk_weights", dgw.view, hgw.view());
    }

    // combine with y written straight into the combine region (combine_input).
    EPX_ASSIGN_OR_RETURN(const TensorView din, dev->combine_input(dres.handle, DType::kF32));
    Backend::write(din, y32);
    auto dci = Backend::upload(Matrix::filled(DType::kF32, Tr, H, kUnwritten));
    Matrix hci = Matrix::filled(DType::kF32, Tr, H, kUnwritten);
    EPX_RETURN_IF_ERROR(dev->combine(din, dres.handle, dci.view));
    EPX_RETURN_IF_ERROR(host->combine(y32.view(), hres.handle, hci.view()));
    keep("combine from combine_input", dci.view, hci.view());

    // expanded layout, expand, combine_expanded (explicit weights, f32 y; dispatched weights,
    // bf16 y) and its backward (dispatched weights, then explicit ones).
    EPX_ASSIGN_OR_RETURN(const ExpandedLayout* dlayout, dev->expanded_layout(dres.handle));
    const ExpandedLayout& hlayout = host->expanded_layout(hres.handle);
    keep_vectors("expanded row_of", dlayout->row_of, hlayout.row_of, DType::kI64);
    keep_vectors("expanded recv_row", dlayout->recv_row, hlayout.recv_row, DType::kI64);
    keep_vectors("expanded expert_offsets", dlayout->expert_offsets, hlayout.expert_offsets, DType::kI64);
    const int64_t rows = hlayout.num_rows();
    auto dex = Backend::upload(Matrix::filled(dtype, rows, H, kUnwritten));
    Matrix hex = Matrix::filled(dtype, rows, H, kUnwritten);
    auto drecv = Backend::upload(recv_x);
    EPX_RETURN_IF_ERROR(dev->expand(drecv.view, dres.handle, dex.view));
    EPX_RETURN_IF_ERROR(host->expand(recv_x.view(), hres.handle, hex.view()));
    keep("expand", dex.view, hex.view());
    const Matrix y_e = expert_output(hex, r, DType::kF32);
    const Matrix ew = matrix_of(make_random_floats(seed + 17 + r, n * K), DType::kF32, n, K);
    auto dye = Backend::upload(y_e), dew = Backend::upload(ew);
    auto dce = Backend::upload(Matrix::filled(DType::kF32, Tr, H, kUnwritten));
    Matrix hce = Matrix::filled(DType::kF32, Tr, H, kUnwritten);
    EPX_RETURN_IF_ERROR(dev->combine_expanded(dye.view, dres.handle, dce.view, dew.view));
    EPX_RETURN_IF_ERROR(host->combine_expanded(y_e.view(), hres.handle, hce.view(), ew.view()));
    keep("combine_expanded", dce.view, hce.view());
    const Matrix y_e16 = expert_output(hex, r, DType::kBF16);
    auto dye16 = Backend::upload(y_e16);
    auto dce16 = Backend::upload(Matrix::filled(DType::kBF16, Tr, H, kUnwritten));
    Matrix hce16 = Matrix::filled(DType::kBF16, Tr, H, kUnwritten);
    EPX_RETURN_IF_ERROR(dev->combine_expanded(dye16.view, dres.handle, dce16.view));
    EPX_RETURN_IF_ERROR(host->combine_expanded(y_e16.view(), hres.handle, hce16.view()));
    keep("combine_expanded bf16, dispatched weights", dce16.view, hce16.view());
    const Matrix grad_out = make_random_matrix(seed + 19 + r, Tr, H, dtype);
    auto dgo = Backend::upload(grad_out);
    auto dgy = Backend::upload(Matrix::filled(DType::kF32, rows, H, kUnwritten));
    auto dgew = Backend::upload(Matrix::filled(DType::kF32, n, K, kUnwritten));
    Matrix hgy = Matrix::filled(DType::kF32, rows, H, kUnwritten), hgew = Matrix::filled(DType::kF32, n, K, kUnwritten);
    EPX_RETURN_IF_ERROR(dev->combine_expanded_backward(dgo.view, dres.handle, dye.view, TensorView(), dgy.view, dgew.view));
    EPX_RETURN_IF_ERROR(host->combine_expanded_backward(grad_out.view(), hres.handle, y_e.view(), TensorView(), hgy.view(),
                                                        hgew.view()));
    keep("combine_expanded_backward grad_y", dgy.view, hgy.view());
    keep("combine_expanded_backward grad_weights", dgew.view, hgew.view());
    EPX_RETURN_IF_ERROR(dev->combine_expanded_backward(dgo.view, dres.handle, dye16.view, dew.view, dgy.view));
    EPX_RETURN_IF_ERROR(
        host->combine_expanded_backward(grad_out.view(), hres.handle, y_e16.view(), ew.view(), hgy.view()));
    keep("combine_expanded_backward bf16 y, explicit weights", dgy.view, hgy.view());

    // the cached dispatch of new rows (after the backward, which overwrote recv_x).
    const Matrix x2 = make_payload(5, r, static_cast<int>(Tr), H, dtype);
    auto dx2 = Backend::upload(x2);
    TensorView dagain, hagain;
    EPX_RETURN_IF_ERROR(dev->dispatch_cached(dx2.view, dres.handle, &dagain));
    EPX_RETURN_IF_ERROR(host->dispatch_cached(x2.view(), hres.handle, &hagain));
    keep("dispatch_cached", dagain, hagain);
    return t.barrier(Deadline::after(Milliseconds(20000)));  // nobody frees memory a peer still reads
  });
  for (int r = 0; r < R; ++r) {
    if (!world.holds(r)) continue;
    SCOPED_TRACE(fmt::format("rank {}", r));
    ASSERT_TRUE(statuses[r].is_ok()) << statuses[r].message();
    EXPECT_EQ(not_on_device[r], "") << "results that are not device views";
    for (const DeviceHostPair& p : got[r])
      EXPECT_TRUE(p.device.same_bits(p.host)) << p.what << " differs from the host Buffer's";
  }
}

}  // namespace epx::exchange_test
