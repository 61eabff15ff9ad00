// Where chunked experts lose time: the experts of one rank
// of the two-host overlap bench (8 local experts, 1024 expanded rows, hidden
// 1024, ffn 768, bf16 payload, one thread), forward + backward data pass as
// one call over the whole batch against the same rows in C chunks (one call
// per chunk, as MoELayer's chunked mode runs them), interleaved, medians.
//
//   build/bench/expert_chunks_bench                       # bf16 GEMMs (the layer's default here)
//   build/bench/expert_chunks_bench --compute f32 --reps 9
//
// The chunked cost is split three ways, each measured:
// - calls: the fixed cost of one oneDNN call (a 16x16x16 GEMM, timed many
//   times) times the extra calls;
// - padding: the rows the gemm helper pads to kRowBlock per (expert, chunk),
//   priced at the whole batch's time per row;
// - weight re-reads: the same per-(chunk, expert) calls run chunk-major (the
//   layer's order: every chunk reads all 8 experts' weights) and expert-major
//   (each expert's weights read once, its chunks back to back); the
//   difference is what reading the weights once per chunk costs. A streaming
//   read of the weights gives the memory time of one pass.
// The weight pass runs once over the whole batch in every mode (the layer
// does so) and is timed apart. Also printed: one expert GEMM's time per row
// by its row count m; weights packed once in oneDNN's layout (--packed-m);
// and the named fix, prototyped: one batched oneDNN matmul per chunk over
// all its experts against the per-expert calls, with a same-bits check;
// and (bf16) the chunk calls with the weights packed (pack_expert_weights),
// with the cost of packing.
// docs/performance.md, Overlapping the exchange with compute.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "epx/experts/ffn.h"
#include "experts/gemm.h"
#include "stats.h"

namespace {

using Clock = std::chrono::steady_clock;
using epx::DType;
using epx::TensorView;

struct Shape {
  int experts = 8;
  int64_t rows = 1024, hidden = 1024, ffn = 768;
};

void check(const epx::Status& s, const char* what) {
  if (!s.is_ok()) {
    fmt::print(stderr, "{} failed: {}\n", what, s.to_string());
    std::exit(1);
  }
}

double seconds(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Bytes of small pseudo-random values of `dtype`.
std::vector<std::byte> random_values(int64_t n, DType dtype, uint32_t seed, float scale) {
  std::vector<std::byte> out(static_cast<std::size_t>(n) * epx::dtype_size(dtype));
  uint32_t s = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const float v = scale * (float(s >> 8) * (1.0f / 16777216.0f) - 0.5f);
    if (dtype == DType::kBF16)
      reinterpret_cast<uint16_t*>(out.data())[i] = epx::f32_to_bf16(v);
    else
      reinterpret_cast<float*>(out.data())[i] = v;
  }
  return out;
}

// One call's rows: x of the payload dtype, grad_y f32, expert-sorted by offsets.
struct Part {
  std::vector<int64_t> offsets;
  std::vector<std::byte> x;
  std::vector<float> y, grad_y, grad_x;
  epx::ExpertFfnCache cache;
  epx::ExpertFfnGradState state;
};

Part make_part(const Shape& s, const std::vector<int64_t>& counts, DType payload, uint32_t seed) {
  Part p;
  p.offsets.assign(1, 0);
  for (int64_t c : counts) p.offsets.push_back(p.offsets.back() + c);
  const int64_t rows = p.offsets.back();
  p.x = random_values(rows * s.hidden, payload, seed, 2.0f);
  p.y.assign(static_cast<std::size_t>(rows * s.hidden), 0.0f);
  p.grad_x = p.y;
  p.grad_y.resize(p.y.size());
  uint32_t r = seed;
  for (float& g : p.grad_y) g = 1e-3f * (float((r = r * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f);
  return p;
}

struct Setup {
  Shape shape;
  epx::ExpertFfnConfig config;
  std::vector<std::byte> w1, w3, w2;
  epx::PackedExpertWeights packed;  // bf16 GEMMs: the weights packed (pack_expert_weights)
  mutable bool use_packed = false;
  epx::ExpertWeights weights() const {
    const DType c = config.gemm_dtype();
    const int64_t E = shape.experts, H = shape.hidden, F = shape.ffn;
    return {TensorView::contiguous(const_cast<std::byte*>(w1.data()), c, {E * H, F}),
            TensorView::contiguous(const_cast<std::byte*>(w3.data()), c, {E * H, F}),
            TensorView::contiguous(const_cast<std::byte*>(w2.data()), c, {E * F, H}), use_packed ? &packed : nullptr};
  }
  TensorView rows_view(Part& p, std::vector<float>& v) const {
    return TensorView::contiguous(v.data(), DType::kF32, {p.offsets.back(), shape.hidden});
  }
  void forward(Part& p) const {
    const TensorView x = TensorView::contiguous(p.x.data(), config.dtype, {p.offsets.back(), shape.hidden});
    check(epx::expert_ffn_forward(config, weights(), x, p.offsets, rows_view(p, p.y), &p.cache), "forward");
  }
  void data(Part& p) const {
    const TensorView x = TensorView::contiguous(p.x.data(), config.dtype, {p.offsets.back(), shape.hidden});
    check(epx::expert_ffn_backward_data(config, weights(), x, p.offsets, p.cache, rows_view(p, p.grad_y),
                                        rows_view(p, p.grad_x), &p.state),
          "backward data");
  }
};

// counts[c][e]: rows of expert e in chunk c. Each row has a uniform expert;
// chunk c holds rows [rows c / C, rows (c + 1) / C) (the layer's chunks are
// slices of the tokens).
std::vector<std::vector<int64_t>> chunk_counts(const Shape& s, int C, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> expert(0, s.experts - 1);
  std::vector<std::vector<int64_t>> counts(C, std::vector<int64_t>(s.experts, 0));
  for (int64_t r = 0; r < s.rows; ++r) counts[r * C / s.rows][expert(rng)]++;
  return counts;
}

// GEMM calls and padded rows of one (expert, rows) GEMM in the gemm helper.
int64_t calls_of(int64_t m) { return m == 0 ? 0 : (m >= epx::detail::kRowBlock) + (m % epx::detail::kRowBlock != 0); }
int64_t padding_of(int64_t m) { return (epx::detail::kRowBlock - m % epx::detail::kRowBlock) % epx::detail::kRowBlock; }

// Microseconds of one oneDNN call of a 16 x 16 x 16 GEMM (the fixed cost).
double call_us(DType dtype, int reps) {
  std::vector<std::byte> a = random_values(16 * 16, dtype, 7, 1.0f), b = random_values(16 * 16, dtype, 8, 1.0f);
  std::vector<float> c(16 * 16);
  epx::detail::GemmArgs g{.dtype = dtype, .m = 16, .n = 16, .k = 16, .a = a.data(), .lda = 16, .b = b.data(),
                          .ldb = 16, .c = c.data(), .ldc = 16};
  std::vector<double> t;
  for (int r = 0; r < reps; ++r)
    t.push_back(seconds([&] {
      for (int i = 0; i < 2000; ++i) check(epx::detail::gemm(g, 1), "gemm");
    }) / 2000 * 1e6);
  return epx::bench::median(t);
}

// Milliseconds to stream-read `bytes` of weights once (a sum of 64-bit words).
double read_ms(const Setup& s) {
  uint64_t sum = 0;
  const double t = seconds([&] {
    for (const auto* w : {&s.w1, &s.w3, &s.w2}) {
      const auto* p = reinterpret_cast<const uint64_t*>(w->data());
      for (std::size_t i = 0; i < w->size() / 8; ++i) sum += p[i];
    }
  });
  if (sum == 42) std::puts("");  // keeps the loop
  return t * 1e3;
}

// Microseconds per row of one expert's up GEMM ([m, H] x [H, F]) and of
// the data pass's transposed one ([m, H] x [F, H]^T), m rows at once, the
// expert cycling over all 8 (weights cold, as in the layer).
void per_row_by_m(const Setup& s, int reps) {
  const DType c = s.config.gemm_dtype();
  const int64_t H = s.shape.hidden, F = s.shape.ffn, E = s.shape.experts;
  std::vector<std::byte> a = random_values(256 * H, c, 9, 1.0f);
  std::vector<float> out(static_cast<std::size_t>(256 * H));
  fmt::print("| m | up GEMM us/row | data-pass GEMM (B transposed) us/row |\n|---:|---:|---:|\n");
  for (int64_t m : {16, 32, 48, 64, 128, 256}) {
    std::vector<double> up, tr;
    for (int r = 0; r < reps; ++r) {
      up.push_back(seconds([&] {
        for (int e = 0; e < E; ++e) {
          epx::detail::GemmArgs g{.dtype = c, .m = m, .n = F, .k = H, .a = a.data(), .lda = H,
                                  .b = s.w1.data() + e * H * F * epx::dtype_size(c), .ldb = F, .c = out.data(), .ldc = F};
          check(epx::detail::gemm(g, 1), "gemm");
        }
      }) / double(E * m) * 1e6);
      tr.push_back(seconds([&] {
        for (int e = 0; e < E; ++e) {
          epx::detail::GemmArgs g{.dtype = c, .trans_b = true, .m = m, .n = F, .k = H, .a = a.data(), .lda = H,
                                  .b = s.w2.data() + e * F * H * epx::dtype_size(c), .ldb = H, .c = out.data(), .ldc = F};
          check(epx::detail::gemm(g, 1), "gemm");
        }
      }) / double(E * m) * 1e6);
    }
    fmt::print("| {} | {:.2f} | {:.2f} |\n", m, epx::bench::median(up), epx::bench::median(tr));
  }
  fmt::print("\n");
}

// Weights packed once into oneDNN's own layout (weights format `any`, K and
// N fixed; m at run time, or fixed at `packed_m` when > 0, which is when
// oneDNN picks a blocked layout) against the plain [H, F] weights the gemm
// helper passes (which oneDNN may repack on every call): us/row of one
// expert's up GEMM at m rows, experts cycling, and whether the bits agree.
void packed_vs_plain(const Setup& s, int64_t packed_m, int reps) {
  using dnnl::memory;
  const int64_t H = s.shape.hidden, F = s.shape.ffn, E = s.shape.experts;
  const DType c = s.config.gemm_dtype();
  const auto type = c == DType::kBF16 ? memory::data_type::bf16 : memory::data_type::f32;
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const memory::dim rt = DNNL_RUNTIME_DIM_VAL;
  const memory::dim pm = packed_m > 0 ? packed_m : rt;
  memory::desc ad({pm, H}, type, {pm == rt ? rt : H, 1}), bd({H, F}, type, memory::format_tag::any), cd({pm, F}, memory::data_type::f32, {pm == rt ? rt : F, 1});
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), engine);
  dnnl::matmul mm(pd);
  std::vector<memory> packed;
  const std::size_t elem = epx::dtype_size(c);
  for (int64_t e = 0; e < E; ++e) {
    memory plain({{H, F}, type, memory::format_tag::ab}, engine, const_cast<std::byte*>(s.w1.data()) + e * H * F * elem);
    packed.emplace_back(pd.weights_desc(), engine);
    dnnl::reorder(plain, packed.back()).execute(stream, plain, packed.back());
  }
  stream.wait();
  std::vector<std::byte> scratch(pd.scratchpad_desc().get_size());
  std::vector<std::byte> a = random_values(256 * H, c, 9, 1.0f);
  std::vector<float> out(static_cast<std::size_t>(256 * F)), ref(out.size());
  fmt::print("weights packed as oneDNN picks ({}): \n| m | plain us/row | packed us/row | same bits |\n|---:|---:|---:|---|\n",
             pd.weights_desc() == memory::desc({H, F}, type, memory::format_tag::ab) ? "plain" : "blocked");
  for (int64_t m : {16, 32, 64, 128, 256}) {
    if (pm != rt && m != pm) continue;
    auto run_packed = [&](int64_t e) {
      memory am({{m, H}, type, memory::format_tag::ab}, engine, a.data());
      memory cm({{m, F}, memory::data_type::f32, memory::format_tag::ab}, engine, out.data());
      memory sp(pd.scratchpad_desc(), engine, scratch.data());
      mm.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, packed[e]}, {DNNL_ARG_DST, cm}});
      stream.wait();
    };
    auto run_plain = [&](int64_t e, float* into) {
      epx::detail::GemmArgs g{.dtype = c, .m = m, .n = F, .k = H, .a = a.data(), .lda = H,
                              .b = s.w1.data() + e * H * F * elem, .ldb = F, .c = into, .ldc = F};
      check(epx::detail::gemm(g, 1), "gemm");
    };
    run_plain(1, ref.data()), run_packed(1);
    const bool same = std::memcmp(ref.data(), out.data(), m * F * sizeof(float)) == 0;
    std::vector<double> tp, tk;
    for (int r = 0; r < reps; ++r) {
      tp.push_back(seconds([&] { for (int64_t e = 0; e < E; ++e) run_plain(e, ref.data()); }) / double(E * m) * 1e6);
      tk.push_back(seconds([&] { for (int64_t e = 0; e < E; ++e) run_packed(e); }) / double(E * m) * 1e6);
    }
    fmt::print("| {} | {:.2f} | {:.2f} | {} |\n", m, epx::bench::median(tp), epx::bench::median(tk), same ? "yes" : "no");
  }
  fmt::print("\n");
}

// Whether packed weights could serve the layer with the bits it has: for
// fixed-m primitives (m = 16 ... 512) with weights format `any`, does oneDNN
// pick one weights layout for every m, does each row get the same bits
// whatever m, and are they the bits of the gemm helper's plain calls? For the
// up GEMM (B = W1[e], [H, F]) and the data pass's (B = W2[e]^T, stored [F, H]).
void packed_layout_check(const Setup& s) {
  using dnnl::memory;
  const int64_t H = s.shape.hidden, F = s.shape.ffn;
  const DType c = s.config.gemm_dtype();
  const auto type = c == DType::kBF16 ? memory::data_type::bf16 : memory::data_type::f32;
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  std::vector<std::byte> a = random_values(512 * H, c, 9, 1.0f);
  std::vector<float> out(static_cast<std::size_t>(512 * F)), ref(out.size()), first(out.size());
  for (bool trans : {false, true}) {
    const std::byte* w = trans ? s.w2.data() : s.w1.data();
    const memory::desc source = trans ? memory::desc({H, F}, type, memory::dims{1, H}) : memory::desc({H, F}, type, memory::format_tag::ab);
    bool same_layout = true, same_rows = true, same_as_plain = true;
    std::optional<memory::desc> layout;
    for (int64_t m : {16, 32, 48, 64, 96, 128, 256, 512}) {
      memory::desc ad({m, H}, type, memory::format_tag::ab), cd({m, F}, memory::data_type::f32, memory::format_tag::ab);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, memory::desc({H, F}, type, memory::format_tag::any), cd), engine);
      if (!layout) layout = pd.weights_desc();
      same_layout = same_layout && pd.weights_desc() == *layout;
      memory plain(source, engine, const_cast<std::byte*>(w)), packed(pd.weights_desc(), engine);
      dnnl::reorder(plain, packed).execute(stream, plain, packed);
      memory am(ad, engine, a.data()), cm(cd, engine, out.data());
      dnnl::matmul(pd).execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, packed}, {DNNL_ARG_DST, cm}});
      stream.wait();
      epx::detail::GemmArgs g{.dtype = c, .trans_b = trans, .m = m, .n = F, .k = H, .a = a.data(), .lda = H, .b = w,
                              .ldb = trans ? H : F, .c = ref.data(), .ldc = F};
      check(epx::detail::gemm(g, 1), "gemm");
      same_as_plain = same_as_plain && std::memcmp(out.data(), ref.data(), m * F * sizeof(float)) == 0;
      if (m == 16) first = out;
      same_rows = same_rows && std::memcmp(out.data(), first.data(), 16 * F * sizeof(float)) == 0;
    }
    fmt::print("packed weights, {} GEMM, m = 16 ... 512: one layout {}, rows' bits independent of m {}, the gemm "
               "helper's bits {}\n",
               trans ? "data-pass (B transposed)" : "up", same_layout ? "yes" : "no", same_rows ? "yes" : "no",
               same_as_plain ? "yes" : "no");
  }
  fmt::print("\n");
}

// The named fix, prototyped: one oneDNN batched matmul per chunk over all
// its experts ([E, M, H] x [E, H, F], each expert's rows zero-padded to the
// chunk's largest count M rounded up to kRowBlock, the weights a strided view
// of [E * H, F]; sizes fixed at creation, its best kernel), against the
// per-expert calls of the gemm helper on the same rows: the up GEMM (W1) of
// every chunk. The copy into the padded [E, M, H] is timed apart.
class BatchedUp {
 public:
  BatchedUp(const Setup& s, const std::vector<int64_t>& counts) : s_(s), counts_(counts), engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {
    using dnnl::memory;
    const int64_t E = s.shape.experts, H = s.shape.hidden, F = s.shape.ffn;
    int64_t most = 0;
    for (int64_t c : counts) most = std::max(most, c);
    M_ = (most + epx::detail::kRowBlock - 1) / epx::detail::kRowBlock * epx::detail::kRowBlock;
    const auto type = s.config.gemm_dtype() == DType::kBF16 ? memory::data_type::bf16 : memory::data_type::f32;
    memory::desc ad({E, M_, H}, type, memory::format_tag::abc), bd({E, H, F}, type, memory::format_tag::abc),
        cd({E, M_, F}, memory::data_type::f32, memory::format_tag::abc);
    pd_ = dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), engine_);
    matmul_ = dnnl::matmul(pd_);
    const std::size_t elem = epx::dtype_size(s.config.gemm_dtype());
    src_.assign(static_cast<std::size_t>(E * M_ * H) * elem, std::byte{0});
    x_ = random_values(std::max<int64_t>(1, std::accumulate(counts.begin(), counts.end(), int64_t{0})) * H,
                       s.config.gemm_dtype(), 31, 1.0f);
    dst_.resize(static_cast<std::size_t>(E * M_ * F));
    a_ = memory(ad, engine_, src_.data()), b_ = memory(bd, engine_, const_cast<std::byte*>(s.w1.data()));
    c_ = memory(cd, engine_, dst_.data());
  }
  int64_t padded_rows() const { return M_ * s_.shape.experts; }
  // Expert-sorted rows into the padded batch (the padding stays zero).
  void copy_in() {
    const std::size_t row = static_cast<std::size_t>(s_.shape.hidden) * epx::dtype_size(s_.config.gemm_dtype());
    int64_t first = 0;
    for (std::size_t e = 0; e < counts_.size(); ++e) {
      std::memcpy(src_.data() + e * M_ * row, x_.data() + first * row, counts_[e] * row);
      first += counts_[e];
    }
  }
  void batched() {
    matmul_.execute(stream_, {{DNNL_ARG_SRC, a_}, {DNNL_ARG_WEIGHTS, b_}, {DNNL_ARG_DST, c_}});
    stream_.wait();
  }
  // Whether the batched call's rows have the bits of the per-expert calls'.
  bool same_bits() {
    copy_in(), batched();
    const std::vector<float> b = dst_;
    per_expert();
    const int64_t F = s_.shape.ffn;
    int64_t first = 0;
    for (std::size_t e = 0; e < counts_.size(); ++e) {
      if (std::memcmp(b.data() + e * M_ * F, dst_.data() + first * F, counts_[e] * F * sizeof(float)) != 0) return false;
      first += counts_[e];
    }
    return true;
  }
  void per_expert() {
    const int64_t H = s_.shape.hidden, F = s_.shape.ffn;
    const std::size_t elem = epx::dtype_size(s_.config.gemm_dtype());
    int64_t first = 0;
    for (std::size_t e = 0; e < counts_.size(); ++e) {
      epx::detail::GemmArgs g{.dtype = s_.config.gemm_dtype(), .m = counts_[e], .n = F, .k = H,
                              .a = x_.data() + first * H * elem, .lda = H, .b = s_.w1.data() + e * H * F * elem,
                              .ldb = F, .c = dst_.data() + first * F, .ldc = F};
      check(epx::detail::gemm(g, 1), "gemm");
      first += counts_[e];
    }
  }

 private:
  const Setup& s_;
  std::vector<int64_t> counts_;
  int64_t M_ = 0;
  dnnl::engine engine_;
  dnnl::stream stream_;
  dnnl::matmul::primitive_desc pd_;
  dnnl::matmul matmul_;
  std::vector<std::byte> src_, x_;
  std::vector<float> dst_;
  dnnl::memory a_, b_, c_;
};

// Milliseconds (medians) of the up GEMM over all chunks of a C-way split:
// per-expert calls, the batched call, the copy into the padded batch.
void batched_vs_per_expert(const Setup& s, const std::vector<int>& chunk_counts_list, int reps) {
  fmt::print("| up GEMM (W1) over the batch | per-expert calls ms | one batched call per chunk ms | copy into padded batch ms | rows computed per-expert / batched | same bits |\n");
  fmt::print("|---|---:|---:|---:|---:|---|\n");
  for (int C : chunk_counts_list) {
    std::vector<std::unique_ptr<BatchedUp>> parts;
    int64_t per_expert_rows = 0, batched_rows = 0;
    for (const auto& counts : chunk_counts(s.shape, C, 11)) {
      parts.push_back(std::make_unique<BatchedUp>(s, counts));
      batched_rows += parts.back()->padded_rows();
      for (int64_t m : counts) per_expert_rows += m + padding_of(m);
    }
    bool same = true;
    for (auto& p : parts) same = p->same_bits() && same;
    std::vector<double> t_per, t_batched, t_copy;
    for (int r = 0; r < reps; ++r) {
      t_per.push_back(seconds([&] { for (auto& p : parts) p->per_expert(); }));
      t_batched.push_back(seconds([&] { for (auto& p : parts) p->batched(); }));
      t_copy.push_back(seconds([&] { for (auto& p : parts) p->copy_in(); }));
    }
    fmt::print("| {} chunk{} | {:.2f} | {:.2f} | {:.2f} | {} / {} | {} |\n", C, C > 1 ? "s" : "", epx::bench::median(t_per) * 1e3,
               epx::bench::median(t_batched) * 1e3, epx::bench::median(t_copy) * 1e3, per_expert_rows, batched_rows, same ? "yes" : "no");
  }
  fmt::print("\n");
}

// The whole batch, or one C-way split of it: the chunks (one call each, as
// the layer) and each (chunk, expert)'s rows alone ([c * E + e]).
struct Split {
  int C = 1;
  std::vector<Part> chunk;
  std::vector<Part> pieces;
  int64_t calls = 0, padded = 0;  // GEMM calls and padded rows of the chunk calls (6 GEMMs per expert)
};

Split make_split(const Setup& s, int C) {
  Split sp;
  sp.C = C;
  const int E = s.shape.experts;
  const auto counts = chunk_counts(s.shape, C, 11);
  for (int c = 0; c < C; ++c) {
    sp.chunk.push_back(make_part(s.shape, counts[c], s.config.dtype, 20 + c));
    for (int64_t m : counts[c]) sp.calls += 6 * calls_of(m), sp.padded += padding_of(m);
    for (int e = 0; e < E; ++e) {
      std::vector<int64_t> one(E, 0);
      one[e] = counts[c][e];
      sp.pieces.push_back(make_part(s.shape, one, s.config.dtype, 100 + c * E + e));
    }
  }
  return sp;
}

void forward_and_data(const Setup& s, std::vector<Part>& parts, const std::vector<int>& order) {
  for (int i : order) s.forward(parts[i]);
  for (int i : order) s.data(parts[i]);
}

// The parts in order (chunk-major: the layer's), or each expert's chunks back to back.
std::vector<int> part_order(const Split& sp, int E, bool expert_major) {
  std::vector<int> v;
  for (int e = 0; e < (expert_major ? E : 1); ++e)
    for (int c = 0; c < sp.C; ++c)
      for (int i = 0; i < (expert_major ? 1 : E); ++i) v.push_back(c * E + (expert_major ? e : i));
  return v;
}

struct ChunkTimes {
  std::vector<Split> splits;  // [0]: the whole batch
  std::vector<std::vector<double>> chunked, chunk_major, expert_major;  // seconds per split
  std::vector<std::vector<double>> chunked_packed;                      // bf16: the chunk calls, weights packed
  std::vector<double> weights, read_ms;  // the weight pass (whole batch); one streaming read of the weights
  std::vector<double> first_packed;      // per split: the first packed pass (makes its primitives), seconds
};

// Forward + data pass of every split, the splits interleaved within each repetition.
ChunkTimes time_chunks(const Setup& s, const std::vector<int>& chunks, int reps) {
  ChunkTimes t;
  const int E = s.shape.experts;
  t.splits.push_back(make_split(s, 1));
  for (int C : chunks) t.splits.push_back(make_split(s, C));
  const std::size_t n = t.splits.size();
  t.chunked.resize(n), t.chunk_major.resize(n), t.expert_major.resize(n), t.chunked_packed.resize(n);
  const bool packed = !s.packed.w1.empty();
  const int64_t H = s.shape.hidden, F = s.shape.ffn;
  std::vector<float> g1(static_cast<std::size_t>(E * H * F)), g3(g1.size()), g2(g1.size());
  const epx::ExpertGrads grads{TensorView::contiguous(g1.data(), DType::kF32, {E * H, F}),
                               TensorView::contiguous(g3.data(), DType::kF32, {E * H, F}),
                               TensorView::contiguous(g2.data(), DType::kF32, {E * F, H})};
  Part& whole = t.splits[0].chunk[0];
  const auto weight_pass = [&] {
    const TensorView x = TensorView::contiguous(whole.x.data(), s.config.dtype, {whole.offsets.back(), H});
    check(epx::expert_ffn_backward_weights(s.config, s.weights(), x, whole.offsets, s.rows_view(whole, whole.grad_y),
                                           whole.state, grads),
          "backward weights");
  };
  for (Split& sp : t.splits) {
    forward_and_data(s, sp.chunk, part_order(sp, 1, false)), forward_and_data(s, sp.pieces, part_order(sp, E, false));
    s.use_packed = packed;
    t.first_packed.push_back(seconds([&] { forward_and_data(s, sp.chunk, part_order(sp, 1, false)); }));
    s.use_packed = false;
  }
  weight_pass();
  for (int r = 0; r < reps; ++r) {
    fmt::print(stderr, "rep {}/{}\n", r + 1, reps);
    for (std::size_t i = 0; i < n; ++i) {
      Split& sp = t.splits[i];
      t.chunked[i].push_back(seconds([&] { forward_and_data(s, sp.chunk, part_order(sp, 1, false)); }));
      t.chunk_major[i].push_back(seconds([&] { forward_and_data(s, sp.pieces, part_order(sp, E, false)); }));
      t.expert_major[i].push_back(seconds([&] { forward_and_data(s, sp.pieces, part_order(sp, E, true)); }));
      if (!packed) continue;
      s.use_packed = true;
      t.chunked_packed[i].push_back(seconds([&] { forward_and_data(s, sp.chunk, part_order(sp, 1, false)); }));
      s.use_packed = false;
    }
    t.weights.push_back(seconds(weight_pass));
    t.read_ms.push_back(read_ms(s));
  }
  return t;
}

void print_chunk_times(const Setup& s, const ChunkTimes& t, double us_call, int reps) {
  const int64_t E = s.shape.experts, H = s.shape.hidden, F = s.shape.ffn;
  const DType c = s.config.gemm_dtype();
  const Split& whole = t.splits[0];
  const double whole_ms = epx::bench::median(t.chunked[0]) * 1e3;
  const double per_row_ms = whole_ms / double(s.shape.rows + whole.padded);
  fmt::print("experts {} x [{}, {}], {} rows, payload {}, GEMMs {}, 1 thread, median of {}\n", E, H, F, s.shape.rows,
             epx::dtype_name(s.config.dtype), epx::dtype_name(c), reps);
  fmt::print("weights per pass {:.1f} MB, streamed once in {:.2f} ms; one oneDNN call (16x16x16) {:.1f} us; "
             "weight pass (once, every mode) {:.2f} ms\n\n",
             3.0 * double(E * H * F * int64_t(epx::dtype_size(c))) / 1e6, epx::bench::median(t.read_ms), us_call,
             epx::bench::median(t.weights) * 1e3);
  fmt::print("| fwd + data pass | ms | vs whole | GEMM calls | padded rows | calls cost ms | padding cost ms | "
             "chunk-major per expert ms | expert-major per expert ms | re-read cost ms | packed weights ms (vs plain) |\n");
  fmt::print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (std::size_t i = 0; i < t.splits.size(); ++i) {
    const Split& sp = t.splits[i];
    const double ms = epx::bench::median(t.chunked[i]) * 1e3, cm = epx::bench::median(t.chunk_major[i]) * 1e3,
                 em = epx::bench::median(t.expert_major[i]) * 1e3;
    const std::string name = i == 0 ? "whole" : fmt::format("{} chunks", sp.C);
    const double packed_ms = epx::bench::median(t.chunked_packed[i]) * 1e3;
    const std::string packed = t.chunked_packed[i].empty()
                                   ? "-"
                                   : fmt::format("{:.2f} ({:.2f}; first pass {:.1f})", packed_ms, packed_ms / ms,
                                                 t.first_packed[i] * 1e3);
    fmt::print("| {} | {:.2f} | {:.2f} | {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {} |\n", name, ms,
               ms / whole_ms, sp.calls, sp.padded, sp.calls * us_call * 1e-3, sp.padded * per_row_ms, cm, em, cm - em,
               packed);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Chunked experts against one call over the batch: calls, padding, weight re-reads"};
  std::string compute = "bf16", payload = "bf16";
  std::vector<int> chunks{2, 4};
  int reps = 7;
  int64_t packed_m = 0;
  Shape shape;
  app.add_option("--compute", compute, "GEMM dtype: f32 or bf16")->capture_default_str();
  app.add_option("--payload", payload, "x's dtype: f32 or bf16")->capture_default_str();
  app.add_option("--chunks", chunks, "Chunk counts")->capture_default_str();
  app.add_option("--rows", shape.rows, "Expanded rows")->capture_default_str();
  app.add_option("--packed-m", packed_m, "Rows of the packed-weights primitive (0: given at run time)")
      ->capture_default_str();
  app.add_option("--reps", reps, "Repetitions (median)")->check(CLI::Range(1, 100))->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  Setup s;
  s.shape = shape;
  const DType cdt = *epx::parse_dtype(compute), pdt = *epx::parse_dtype(payload);
  s.config = {.num_experts = shape.experts, .hidden = int(shape.hidden), .ffn_hidden = int(shape.ffn), .dtype = pdt,
              .num_threads = 1, .compute_dtype = cdt};
  const int64_t E = shape.experts, H = shape.hidden, F = shape.ffn;
  s.w1 = random_values(E * H * F, cdt, 1, 0.05f), s.w3 = random_values(E * H * F, cdt, 2, 0.05f);
  s.w2 = random_values(E * F * H, cdt, 3, 0.05f);

  if (cdt == DType::kBF16) {
    const double first = seconds([&] { check(epx::pack_expert_weights(s.config, s.weights(), &s.packed), "pack"); });
    const double again = seconds([&] { check(epx::pack_expert_weights(s.config, s.weights(), &s.packed), "pack"); });
    fmt::print("pack_expert_weights: {:.1f} ms the first time (layout checks), {:.1f} ms again\n", first * 1e3,
               again * 1e3);
  }
  const ChunkTimes times = time_chunks(s, chunks, reps);
  per_row_by_m(s, reps);
  packed_vs_plain(s, packed_m, reps);
  packed_layout_check(s);
  std::vector<int> with_one{1};
  with_one.insert(with_one.end(), chunks.begin(), chunks.end());
  batched_vs_per_expert(s, with_one, reps);
  print_chunk_times(s, times, call_us(cdt, reps), reps);
  return 0;
}
