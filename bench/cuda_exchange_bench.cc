// The CUDA backend's dispatch and combine on R emulated ranks of one GPU,
// against a device-to-device copy of the same bytes (the HBM limit).
// bench/torch_exchange.py does the same job with PyTorch's index_select /
// index_add_ on the same GPU; scripts/gpu-check.sh runs both.
//
// Method (docs/performance.md): CUDA events on the legacy default stream
// around each call (the group's streams are blocking, so the events bracket
// all of its work), warm-up calls first, the median of --reps calls, and
// --sets rotating input sets (each larger than the L2 cache at the default
// shape). Logical bytes: rows moved x row bytes, each (token, destination
// rank) row counted once; combine reads the same rows back.
//
//   cuda_exchange_bench --ranks 8 --tokens 4096 --hidden 7168 --experts 256 --topk 8 --json out.json
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "epx/exchange/cuda_group.h"
#include "stats.h"

namespace {

#define BENCH_CUDA(expr)                                                                         \
  do {                                                                                           \
    const cudaError_t err_ = (expr);                                                             \
    if (err_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #expr, __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

void* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  BENCH_CUDA(cudaMalloc(&p, std::max<std::size_t>(bytes, 16)));
  BENCH_CUDA(cudaMemset(p, 0, std::max<std::size_t>(bytes, 16)));
  return p;
}

// Median milliseconds of `reps` timed calls of fn(i) after `warmup` untimed ones.
template <typename F>
double median_ms(int warmup, int reps, F fn) {
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) fn(i);
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaEventRecord(start, 0));
    fn(warmup + i);
    BENCH_CUDA(cudaEventRecord(stop, 0));
    BENCH_CUDA(cudaEventSynchronize(stop));
    BENCH_CUDA(cudaEventElapsedTime(&ms[i], start, stop));
  }
  BENCH_CUDA(cudaEventDestroy(start));
  BENCH_CUDA(cudaEventDestroy(stop));
  return epx::bench::median(std::vector<double>(ms.begin(), ms.end()));
}

void die_on(const epx::Status& s, const char* what) {
  if (s.is_ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, s.message().c_str());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("epx CUDA exchange benchmark (R emulated ranks on one GPU)");
  int ranks = 8, tokens = 4096, hidden = 7168, experts = 256, topk = 8, reps = 20, warmup = 3, sets = 2;
  uint32_t seed = 1;
  std::string json_path;
  app.add_option("--ranks", ranks, "emulated ranks")->check(CLI::Range(1, 64));
  app.add_option("--tokens", tokens, "tokens per rank")->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden, "elements per row (bf16)")->check(CLI::PositiveNumber);
  app.add_option("--experts", experts, "experts")->check(CLI::PositiveNumber);
  app.add_option("--topk", topk, "experts per token")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed calls (the median is reported)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed calls first");
  app.add_option("--sets", sets, "rotating input sets")->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "routing seed");
  app.add_option("--json", json_path, "write the results as one JSON object here");
  CLI11_PARSE(app, argc, argv);

  const std::string why = epx::cuda_unavailable_reason();
  if (!why.empty()) {
    std::fprintf(stderr, "cuda_exchange_bench: %s\n", why.c_str());
    return 77;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  const epx::Topology topology = *epx::Topology::create(ranks);
  epx::BufferConfig config;
  config.num_experts = experts;
  config.hidden = hidden;
  config.dtype = epx::DType::kBF16;
  config.max_topk = topk;
  config.max_tokens_per_rank = tokens;
  auto group_or = epx::CudaGroup::create(topology, config);
  die_on(group_or.status(), "CudaGroup::create");
  epx::CudaGroup& group = **group_or;
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * 2;
  const epx::Device dev{epx::DeviceKind::kCuda, 0};

  // Rotating sets: x and uniform top-k routing per rank (the same routing in
  // every set, so every call moves the same rows; the payload bytes rotate).
  std::mt19937 rng(seed);
  std::vector<std::vector<void*>> x(sets, std::vector<void*>(ranks));
  std::vector<void*> idx(ranks);
  std::vector<int32_t> all(experts);
  std::iota(all.begin(), all.end(), 0);
  for (int r = 0; r < ranks; ++r) {
    std::vector<int32_t> h(static_cast<std::size_t>(tokens) * topk);
    for (int t = 0; t < tokens; ++t) {
      std::shuffle(all.begin(), all.end(), rng);  // k distinct experts
      std::copy(all.begin(), all.begin() + topk, h.begin() + static_cast<std::size_t>(t) * topk);
    }
    idx[r] = device_alloc(h.size() * 4);
    BENCH_CUDA(cudaMemcpy(idx[r], h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    for (int s = 0; s < sets; ++s) {
      x[s][r] = device_alloc(static_cast<std::size_t>(tokens) * row_bytes);
      std::vector<uint16_t> v(static_cast<std::size_t>(tokens) * hidden);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(0x3f80 + ((i * 7 + s * 13 + r) & 0x7f));
      BENCH_CUDA(cudaMemcpy(x[s][r], v.data(), v.size() * 2, cudaMemcpyHostToDevice));
    }
  }
  auto inputs_of = [&](int s) {
    std::vector<epx::DispatchInputs> in(ranks);
    for (int r = 0; r < ranks; ++r)
      in[r] = {epx::TensorView::contiguous(x[s][r], epx::DType::kBF16, {tokens, hidden}, dev),
               epx::TensorView::contiguous(idx[r], epx::DType::kI32, {tokens, topk}, dev), {}};
    return in;
  };

  std::vector<epx::DispatchResult> res;
  die_on(group.dispatch(inputs_of(0), &res), "dispatch");
  const std::vector<epx::Handle> handles = epx::handles_of(res);
  int64_t rows = 0;
  for (const epx::DispatchResult& r : res) rows += r.stats.rows_received;
  const double bytes = static_cast<double>(rows) * static_cast<double>(row_bytes);

  // Combine inputs (y in bf16, rotating) and outputs.
  std::vector<std::vector<void*>> y(sets, std::vector<void*>(ranks));
  std::vector<void*> out(ranks);
  for (int r = 0; r < ranks; ++r) {
    out[r] = device_alloc(static_cast<std::size_t>(tokens) * row_bytes);
    for (int s = 0; s < sets; ++s) y[s][r] = device_alloc(static_cast<std::size_t>(res[r].stats.rows_received) * row_bytes);
  }
  auto y_of = [&](int s) {
    std::vector<epx::TensorView> v(ranks);
    for (int r = 0; r < ranks; ++r) v[r] = epx::TensorView::contiguous(y[s][r], epx::DType::kBF16, {res[r].stats.rows_received, hidden}, dev);
    return v;
  };
  std::vector<epx::TensorView> out_views(ranks);
  for (int r = 0; r < ranks; ++r) out_views[r] = epx::TensorView::contiguous(out[r], epx::DType::kBF16, {tokens, hidden}, dev);

  const double dispatch_ms = median_ms(warmup, reps, [&](int i) {
    die_on(group.dispatch(inputs_of(i % sets), &res), "dispatch");
  });
  const std::vector<epx::Handle> latest = epx::handles_of(res);
  const double cached_ms = median_ms(warmup, reps, [&](int i) {
    std::vector<epx::TensorView> xv(ranks), recv;
    for (int r = 0; r < ranks; ++r) xv[r] = inputs_of(i % sets)[r].x;
    die_on(group.dispatch_cached(xv, latest, &recv), "dispatch_cached");
  });
  const double combine_ms = median_ms(warmup, reps, [&](int i) {
    die_on(group.combine(y_of(i % sets), latest, out_views), "combine");
  });
  // The HBM limit: one device-to-device copy of the same bytes.
  std::vector<void*> copy_src(sets), copy_dst(sets);
  for (int s = 0; s < sets; ++s) {
    copy_src[s] = device_alloc(static_cast<std::size_t>(bytes));
    copy_dst[s] = device_alloc(static_cast<std::size_t>(bytes));
  }
  const double copy_ms = median_ms(warmup, reps, [&](int i) {
    BENCH_CUDA(cudaMemcpyAsync(copy_dst[i % sets], copy_src[i % sets], static_cast<std::size_t>(bytes),
                               cudaMemcpyDeviceToDevice, 0));
  });

  auto gbps = [&](double ms) { return bytes / (ms * 1e-3) / 1e9; };
  const std::string json = fmt::format(
      "{{\"device\":\"{}\",\"l2_bytes\":{},\"ranks\":{},\"tokens\":{},\"hidden\":{},\"experts\":{},\"topk\":{},"
      "\"reps\":{},\"warmup\":{},\"sets\":{},\"rows\":{},\"bytes\":{:.0f},\"dispatch_ms\":{:.4f},"
      "\"dispatch_cached_ms\":{:.4f},\"combine_ms\":{:.4f},\"copy_ms\":{:.4f}}}",
      prop.name, prop.l2CacheSize, ranks, tokens, hidden, experts, topk, reps, warmup, sets, rows, bytes, dispatch_ms,
      cached_ms, combine_ms, copy_ms);
  if (!json_path.empty()) std::ofstream(json_path) << json << "\n";
  fmt::print("{}\n", json);
  fmt::print("\n{} ranks x {} tokens, hidden {}, top-{} of {}, bf16: {} rows, {:.1f} MB moved per call\n", ranks, tokens,
             hidden, topk, experts, rows, bytes / 1e6);
  fmt::print("{:<22}{:>10}{:>10}{:>12}\n", "operation", "ms", "GB/s", "vs copy");
  for (auto [name, ms] : {std::pair<const char*, double>{"dispatch", dispatch_ms}, {"dispatch (cached)", cached_ms},
                          {"combine", combine_ms}, {"d2d copy, same bytes", copy_ms}})
    fmt::print("{:<22}{:>10.3f}{:>10.0f}{:>11.2f}x\n", name, ms, gbps(ms), copy_ms / ms);
  return 0;
}
