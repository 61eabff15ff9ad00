// The host-staged exchange (CudaBuffer's path between nodes) on the CPU: its
// "device" is host memory tagged cuda:7, copied with memcpy, so the staging
// logic (shapes, strides, which results are copied back, collective errors)
// runs in every build. Results must equal a host Buffer's bit for bit, on
// one node and on two-hop topologies, with ranks as threads and (in
// epx_mpi_tests) as MPI processes; the error cases run on threads.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "epx/comm/inproc.h"
#include "exchange/device_buffer_checks.h"
#include "exchange/host_staged_exchange.h"

namespace epx::exchange_test {
namespace {

constexpr Device kFakeDevice{DeviceKind::kCuda, 7};

// Faults a copier injects: a failed allocation, or failed copies from the nth on.
struct Faults {
  bool fail_allocation = false;
  int fail_copies_from = -1;
};

// Copies are queued and done at sync(), as a GPU's would be, so a missing
// sync() leaves stale bytes that the comparisons catch.
class HostAsDeviceCopier final : public detail::DeviceCopier {
 public:
  explicit HostAsDeviceCopier(Faults faults = {}) : faults_(faults) {}
  ~HostAsDeviceCopier() override { EPX_CHECK(queued_.empty()); }
  [[nodiscard]] Device device() const override { return kFakeDevice; }
  [[nodiscard]] Status copy_rows(void* dst, std::size_t dst_stride, const void* src, std::size_t src_stride,
                                 std::size_t row_bytes, int64_t rows) override {
    if (faults_.fail_copies_from >= 0 && copies_++ >= faults_.fail_copies_from)
      return internal_error("injected copy failure");
    queued_.push_back([=] {
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(static_cast<std::byte*>(dst) + r * dst_stride, static_cast<const std::byte*>(src) + r * src_stride,
                    row_bytes);
    });
    return Status::ok();
  }
  [[nodiscard]] Status sync() override {
    for (const auto& copy : queued_) copy();
    queued_.clear();
    return Status::ok();
  }
  [[nodiscard]] Result<std::byte*> allocate(std::size_t bytes) override {
    if (faults_.fail_allocation) return resource_exhausted("injected: no {} bytes of device memory", bytes);
    blocks_.push_back(std::make_unique<std::byte[]>(bytes));  // value-initialised: zero
    return blocks_.back().get();
  }

 private:
  Faults faults_;
  int copies_ = 0;
  std::vector<std::function<void()>> queued_;
  std::vector<std::unique_ptr<std::byte[]>> blocks_;
};

// Host memory tagged as kFakeDevice.
TensorView on_fake_device(const TensorView& v) {
  return v.ndim() == 2 ? TensorView(v.data(), v.dtype(), {v.size(0), v.size(1)}, {v.stride(0), v.stride(1)}, kFakeDevice)
                       : TensorView(v.data(), v.dtype(), {v.size(0)}, {v.stride(0)}, kFakeDevice);
}

struct FakeDeviceBackend {
  using Exchange = detail::StagedExchange;
  static Result<std::unique_ptr<Exchange>> make(Transport& t, const BufferConfig& config) {
    return Exchange::create(t, config, std::make_unique<HostAsDeviceCopier>());
  }
  // Hidden-wide arrays get rows 3 elements longer than their width, so the
  // staging must honour row strides; [rows, topk] arrays stay dense, as the
  // CUDA kernels want their weight gradients.
  static constexpr int64_t kPad = 3;
  struct Array {
    Matrix memory;
    TensorView view;
  };
  static Array upload(const Matrix& m) {
    const int64_t pad = m.cols() >= 16 ? kPad : 0;
    Array a{Matrix(m.dtype(), m.rows(), m.cols() + pad), {}};
    for (int64_t r = 0; r < m.rows(); ++r) std::memcpy(a.memory.row(r), m.row(r), m.row_bytes());
    a.view = TensorView(a.memory.row(0), m.dtype(), {m.rows(), m.cols()}, {m.cols() + pad, 1}, kFakeDevice);
    return a;
  }
  static Matrix download(const TensorView& v) { return Matrix::copy_of(v); }
  static void write(const TensorView& dst, const Matrix& m) {
    for (int64_t r = 0; r < m.rows(); ++r) std::memcpy(dst.row(r), m.row(r), m.row_bytes());
  }
  static Device device() { return kFakeDevice; }
};

TEST(StagedExchange, MatchesTheHostBuffer) {
  const std::pair<int, int> shapes[] = {{1, 1}, {2, 1}, {4, 2}, {8, 2}, {8, 4}};
  for (const auto& [R, N] : shapes)
    for (DType dtype : {DType::kF32, DType::kBF16})
      for (Routing routing : kAllRoutings) {
        check_device_exchange_like_host<FakeDeviceBackend>(*Topology::create(R, N), dtype, routing,
                                                           100u * R + 10u * N + static_cast<uint32_t>(routing));
        if (::testing::Test::HasFailure()) return;
      }
}

BufferConfig small_config(int num_ranks) {
  BufferConfig config;
  config.num_experts = 2 * num_ranks;
  config.hidden = 16;
  config.dtype = DType::kF32;
  config.max_topk = 2;
  config.max_tokens_per_rank = 4;
  config.timeout = Milliseconds(20000);
  return config;
}

// Rank r's inputs: 4 tokens, slot k of token t on expert (t + k + r) % E.
struct SmallInputs {
  Matrix x, idx;
  SmallInputs(int r, const BufferConfig& c) : x(DType::kF32, 4, c.hidden), idx(DType::kI32, 4, 2) {
    for (int t = 0; t < 4; ++t) {
      for (int h = 0; h < c.hidden; ++h) x.set(t, h, static_cast<float>(100 * r + t));
      for (int k = 0; k < 2; ++k) {
        const int32_t e = (t + k + r) % c.num_experts;
        std::memcpy(idx.row(t) + k * sizeof(int32_t), &e, sizeof(e));
      }
    }
  }
  DispatchInputs inputs() const { return {on_fake_device(x.view()), on_fake_device(idx.view()), {}}; }
};

TEST(StagedExchange, AHostViewIsRejectedAndThePeersAbort) {
  const Topology topology = *Topology::create(4, 2);
  const BufferConfig config = small_config(4);
  std::vector<Status> first(4);
  const std::vector<Status> statuses = run_ranks(topology, [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto ex, FakeDeviceBackend::make(t, config));
    const SmallInputs in(t.rank(), config);
    DispatchInputs inputs = in.inputs();
    if (t.rank() == 1) inputs.x = in.x.view();  // a host view, not the device's
    DispatchResult res;
    first[t.rank()] = ex->dispatch(inputs, &res);
    // Nothing was half done: the next dispatch works everywhere.
    return ex->dispatch(in.inputs(), &res);
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(statuses[r].is_ok()) << statuses[r].message();
    if (r == 1) {
      EXPECT_EQ(first[r].code(), StatusCode::kInvalidArgument) << first[r].message();
      EXPECT_NE(first[r].message().find("cuda:7"), std::string::npos) << first[r].message();
    } else {
      EXPECT_EQ(first[r].code(), StatusCode::kAborted) << first[r].message();
      EXPECT_NE(first[r].message().find("rank 1"), std::string::npos) << first[r].message();
    }
  }
}

// A copy that fails while inputs are staged makes the peers abort; one that
// fails after the exchange (copying results back) is the rank's own error.
// Either way no copy is left in flight (the copier checks at destruction).
TEST(StagedExchange, AFailedCopyAbortsThePeersOnlyBeforeTheExchange) {
  const Topology topology = *Topology::create(4, 2);
  const BufferConfig config = small_config(4);
  // Rank 2's copies in a dispatch: x, topk_idx, then recv_x, recv_topk_idx, ...
  for (const int fail_from : {1, 3}) {
    SCOPED_TRACE(fail_from);
    std::vector<Status> first(4);
    const std::vector<Status> statuses = run_ranks(topology, [&](Transport& t) -> Status {
      Faults faults;
      if (t.rank() == 2) faults.fail_copies_from = fail_from;
      EPX_ASSIGN_OR_RETURN(auto ex,
                           detail::StagedExchange::create(t, config, std::make_unique<HostAsDeviceCopier>(faults)));
      const SmallInputs in(t.rank(), config);
      DispatchResult res;
      first[t.rank()] = ex->dispatch(in.inputs(), &res);
      return Status::ok();
    });
    for (int r = 0; r < 4; ++r) {
      EXPECT_TRUE(statuses[r].is_ok()) << statuses[r].message();
      const StatusCode peers = fail_from == 1 ? StatusCode::kAborted : StatusCode::kOk;
      EXPECT_EQ(first[r].code(), r == 2 ? StatusCode::kInternal : peers) << first[r].message();
    }
  }
}

TEST(StagedExchange, AFailedAllocationMakesNone) {
  const Topology topology = *Topology::create(2, 2);
  const BufferConfig config = small_config(2);
  const std::vector<Status> statuses = run_ranks(topology, [&](Transport& t) -> Status {
    Faults faults;
    faults.fail_allocation = t.rank() == 0;
    return detail::StagedExchange::create(t, config, std::make_unique<HostAsDeviceCopier>(faults)).status();
  });
  EXPECT_EQ(statuses[0].code(), StatusCode::kResourceExhausted) << statuses[0].message();
  EXPECT_EQ(statuses[1].code(), StatusCode::kAborted) << statuses[1].message();
}

TEST(StagedExchange, HandlesAreChecked) {
  const Topology topology = *Topology::create(2, 2);
  const BufferConfig config = small_config(2);
  std::vector<Status> combine(2), layout(2);
  const std::vector<Status> statuses = run_ranks(topology, [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto ex, FakeDeviceBackend::make(t, config));
    const SmallInputs in(t.rank(), config);
    DispatchResult res;
    EPX_RETURN_IF_ERROR(ex->dispatch(in.inputs(), &res));
    Matrix y(DType::kF32, res.handle.num_recv_tokens(), config.hidden), out(DType::kF32, 4, config.hidden);
    // Rank 0 passes an empty handle: it says so, and rank 1 is told.
    combine[t.rank()] = ex->combine(on_fake_device(y.view()), t.rank() == 0 ? Handle() : res.handle,
                                    on_fake_device(out.view()));
    layout[t.rank()] = ex->expanded_layout(Handle()).status();
    return Status::ok();
  });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(statuses[r].is_ok()) << statuses[r].message();
  EXPECT_EQ(combine[0].code(), StatusCode::kInvalidArgument) << combine[0].message();
  EXPECT_EQ(combine[1].code(), StatusCode::kAborted) << combine[1].message();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(layout[r].code(), StatusCode::kInvalidArgument) << layout[r].message();
}

// A rank that passes a host view (not the device's) to a collective call is
// told so and its peers return Aborted, for every collective operation; the
// next call works everywhere.
TEST(StagedExchange, EveryCollectiveCallAbortsThePeersOfABadRank) {
  const Topology topology = *Topology::create(4, 2);
  const BufferConfig config = small_config(4);
  const char* const ops[] = {"dispatch_cached", "combine", "combine_expanded", "combine_expanded_backward"};
  for (int op = 0; op < 4; ++op) {
    SCOPED_TRACE(ops[op]);
    std::vector<Status> bad(4);
    const std::vector<Status> statuses = run_ranks(topology, [&](Transport& t) -> Status {
      const int r = t.rank();
      EPX_ASSIGN_OR_RETURN(auto ex, FakeDeviceBackend::make(t, config));
      const SmallInputs in(r, config);
      DispatchResult res;
      EPX_RETURN_IF_ERROR(ex->dispatch(in.inputs(), &res));
      const int64_t n = res.handle.num_recv_tokens(), H = config.hidden;
      EPX_ASSIGN_OR_RETURN(const ExpandedLayout* layout, ex->expanded_layout(res.handle));
      Matrix y(DType::kF32, n, H), out(DType::kF32, 4, H), ye(DType::kF32, layout->num_rows(), H);
      Matrix gy(DType::kF32, layout->num_rows(), H), w(DType::kF32, n, 2);
      // Rank 3 passes its first argument as a host view.
      const auto arg = [&](const Matrix& m, bool first) { return r == 3 && first ? m.view() : on_fake_device(m.view()); };
      TensorView recv;
      switch (op) {
        case 0: bad[r] = ex->dispatch_cached(arg(in.x, true), res.handle, &recv); break;
        case 1: bad[r] = ex->combine(arg(y, true), res.handle, arg(out, false)); break;
        case 2: bad[r] = ex->combine_expanded(arg(ye, true), res.handle, arg(out, false), arg(w, false)); break;
        default:
          bad[r] = ex->combine_expanded_backward(arg(out, true), res.handle, arg(ye, false), arg(w, false),
                                                 arg(gy, false));
      }
      return ex->combine(on_fake_device(y.view()), res.handle, on_fake_device(out.view()));
    });
    for (int r = 0; r < 4; ++r) {
      EXPECT_TRUE(statuses[r].is_ok()) << statuses[r].message();
      EXPECT_EQ(bad[r].code(), r == 3 ? StatusCode::kInvalidArgument : StatusCode::kAborted) << bad[r].message();
    }
  }
}

}  // namespace
}  // namespace epx::exchange_test
