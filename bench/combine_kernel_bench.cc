// The inner loop of a combine, alone on one core: each output row is the
// fp32 sum of n bf16 rows (n = ranks the token reached, about 5.3 for top-8
// of 256 experts over 8 ranks), stored as bf16. Compares the loop shape
// src/exchange/buffer.cc uses (one fp32 accumulator pass per source row)
// with two rows per pass and the first and last passes fused with the
// initialisation and the store, against memcpy of the same source bytes.
//
//   build/bench/epx_combine_kernel_bench --benchmark_counters_tabular=true
//
// Build it once more with -march=native (CMAKE_CXX_FLAGS) to see what the
// wider vectors give; the default build targets baseline x86-64 (SSE2).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "epx/core/buffer.h"
#include "epx/core/dtype.h"

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

// Two source rows per pass; the first pass initialises, the last one stores.
// The additions happen in the same order, so the bits are the same. Needs
// at least two rows per token (the workload has 3..8).
void two_rows_fused(const Workload& w, uint16_t* out, std::vector<float>& acc) {
  float* a = acc.data();
  for (int t = 0; t < kTokens; ++t) {
    const uint16_t* const* r = w.rows.data() + w.offsets[t];
    const int64_t n = w.offsets[t + 1] - w.offsets[t];
    uint16_t* o = out + static_cast<int64_t>(t) * kHidden;
    for (int c = 0; c < kHidden; ++c) a[c] = (0.0f + epx::bf16_to_f32(r[0][c])) + epx::bf16_to_f32(r[1][c]);
    int64_t j = 2;
    for (; j + 2 < n; j += 2)
      for (int c = 0; c < kHidden; ++c) a[c] = (a[c] + epx::bf16_to_f32(r[j][c])) + epx::bf16_to_f32(r[j + 1][c]);
    if (j + 2 == n) {
      for (int c = 0; c < kHidden; ++c)
        o[c] = epx::f32_to_bf16((a[c] + epx::bf16_to_f32(r[j][c])) + epx::bf16_to_f32(r[j + 1][c]));
    } else {
      for (int c = 0; c < kHidden; ++c) o[c] = epx::f32_to_bf16(a[c] + epx::bf16_to_f32(r[j][c]));
    }
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

void BM_TwoRowsFused(benchmark::State& state) {
  Workload& w = workload();
  std::vector<float> acc(kHidden);
  {
    epx::AlignedBuffer reference(w.out.size(), 4096, true);
    row_at_a_time(w, reference.as<uint16_t>(), acc);
    two_rows_fused(w, w.out.as<uint16_t>(), acc);
    if (std::memcmp(reference.data(), w.out.data(), w.out.size()) != 0) {
      state.SkipWithError("two_rows_fused gives other bits than row_at_a_time");
      return;
    }
  }
  for (auto _ : state) {
    two_rows_fused(w, w.out.as<uint16_t>(), acc);
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
BENCHMARK(BM_TwoRowsFused)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
