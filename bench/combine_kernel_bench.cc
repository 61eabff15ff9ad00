// The inner loop of a combine, alone on one core: each output row is the
// fp32 sum of n bf16 rows (n = ranks the token reached, about 5.3 for top-8
// of 256 experts over 8 ranks), stored as bf16. Compares the plain loop (one
// fp32 accumulator pass per source row over the whole row) with the
// library's kernel (epx::detail::sum_row: L1-sized slices, SIMD clones; same
// bits, checked) and with memcpy of the same source bytes.
//
//   build/bench/epx_combine_kernel_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "epx/core/buffer.h"
#include "epx/core/dtype.h"
#include "exchange/cpu/row_kernels.h"

namespace {

constexpr int kHidden = 7168;
constexpr int kTokens = 512;

// Rows of every token: n_t source rows, scattered over a pool like the peers' regions.
struct Workload {
  Workload() {
    std::mt19937 rng(7);
    std::vector<int> count(kTokens);
    int64_t total = 0;
    for (int t = 0; t < kTokens; ++t) {
      count[t] = 3 + static_cast<int>(rng() % 6);  // 3..8, mean 5.5
      total += count[t];
    }
    pool = epx::AlignedBuffer(static_cast<std::size_t>(total) * kHidden * 2, 4096);
    auto* p = pool.as<uint16_t>();
    for (int64_t i = 0; i < total * kHidden; ++i) p[i] = epx::f32_to_bf16(static_cast<float>(i % 97) / 32.0f - 1.5f);
    std::vector<int64_t> order(total);
    for (int64_t i = 0; i < total; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    int64_t next = 0;
    for (int t = 0; t < kTokens; ++t) {
      offsets.push_back(static_cast<int64_t>(rows.size()));
      for (int j = 0; j < count[t]; ++j) rows.push_back(p + order[next++] * kHidden);
    }
    offsets.push_back(static_cast<int64_t>(rows.size()));
    out = epx::AlignedBuffer(static_cast<std::size_t>(kTokens) * kHidden * 2, 4096, true);
    copy_src = epx::AlignedBuffer(static_cast<std::size_t>(total) * kHidden * 2, 4096, true);
    copy_dst = epx::AlignedBuffer(static_cast<std::size_t>(total) * kHidden * 2, 4096, true);
  }
  [[nodiscard]] int64_t source_bytes() const { return static_cast<int64_t>(rows.size()) * kHidden * 2; }
  epx::AlignedBuffer pool, out, copy_src, copy_dst;
  std::vector<const uint16_t*> rows;
  std::vector<int64_t> offsets;
};

Workload& workload() {
  static Workload w;
  return w;
}

// One pass per source row through an fp32 accumulator row (buffer.cc today).
void row_at_a_time(const Workload& w, uint16_t* out, std::vector<float>& acc) {
  for (int t = 0; t < kTokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = w.offsets[t]; j < w.offsets[t + 1]; ++j)
      for (int c = 0; c < kHidden; ++c) acc[c] += epx::bf16_to_f32(w.rows[j][c]);
    uint16_t* o = out + static_cast<int64_t>(t) * kHidden;
    for (int c = 0; c < kHidden; ++c) o[c] = epx::f32_to_bf16(acc[c]);
  }
}

// The library's kernel: slices that stay in L1, SIMD clones picked at load time.
void library_sum_row(const Workload& w, uint16_t* out) {
  std::vector<epx::detail::SumGroup> groups;
  for (int t = 0; t < kTokens; ++t) {
    groups.clear();
    for (int64_t j = w.offsets[t]; j < w.offsets[t + 1]; ++j)
      groups.push_back({reinterpret_cast<const std::byte* const*>(&w.rows[j]), 1, epx::DType::kBF16});
    epx::detail::sum_row(reinterpret_cast<std::byte*>(out + static_cast<int64_t>(t) * kHidden), epx::DType::kBF16,
                         groups, nullptr, epx::DType::kF32, kHidden);
  }
}

void BM_RowAtATime(benchmark::State& state) {
  Workload& w = workload();
  std::vector<float> acc(kHidden);
  for (auto _ : state) {
    row_at_a_time(w, w.out.as<uint16_t>(), acc);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * w.source_bytes());
}

void BM_LibrarySumRow(benchmark::State& state) {
  Workload& w = workload();
  std::vector<float> acc(kHidden);
  {
    epx::AlignedBuffer reference(w.out.size(), 4096, true);
    row_at_a_time(w, reference.as<uint16_t>(), acc);
    library_sum_row(w, w.out.as<uint16_t>());
    if (std::memcmp(reference.data(), w.out.data(), w.out.size()) != 0) {
      state.SkipWithError("epx::detail::sum_row gives other bits than row_at_a_time");
      return;
    }
  }
  for (auto _ : state) {
    library_sum_row(w, w.out.as<uint16_t>());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * w.source_bytes());
}

void BM_Memcpy(benchmark::State& state) {
  Workload& w = workload();
  for (auto _ : state) {
    std::memcpy(w.copy_dst.data(), w.copy_src.data(), static_cast<std::size_t>(w.source_bytes()));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * w.source_bytes());
}

BENCHMARK(BM_RowAtATime)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_LibrarySumRow)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
