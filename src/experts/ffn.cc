#include "epx/experts/ffn.h"

#include <omp.h>

#include <algorithm>
#include <numeric>

#include "experts/gemm.h"
#include "core/bf16_rows.h"
#include "experts/swiglu.h"

namespace epx {
namespace {

using detail::gemm;
using detail::GemmArgs;

// The checked inputs of one call, with the sizes and strides the experts use.
struct Problem {
  const ExpertFfnConfig* config = nullptr;
  const ExpertWeights* weights = nullptr;
  std::span<const int64_t> offsets;
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t ffn = 0;
  std::size_t elem = 4;  // bytes per GEMM operand element (the compute dtype)
  bool convert_x = false;  // x's dtype differs from the compute dtype
};

int64_t ld(const TensorView& view) { return view.size(0) > 1 ? view.stride(0) : view.size(1); }

const std::byte* expert_rows(const TensorView& w, int64_t first_row) {
  return w.row<const std::byte>(first_row);
}

Status check_common(const ExpertFfnConfig& config, const ExpertWeights& weights, const TensorView& x,
                    std::span<const int64_t> offsets, Problem* problem) {
  EPX_RETURN_IF_ERROR(config.validate());
  const int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  const DType compute = config.gemm_dtype();
  EPX_RETURN_IF_ERROR(check_matrix(weights.w1, "weights.w1", compute, E * H, F));
  EPX_RETURN_IF_ERROR(check_matrix(weights.w3, "weights.w3", compute, E * H, F));
  EPX_RETURN_IF_ERROR(check_matrix(weights.w2, "weights.w2", compute, E * F, H));
  if (x.ndim() != 2)
    return invalid_argument("x must be 2-D [rows, hidden = {}], got {}", H, x.defined() ? x.describe() : "an undefined view");
  const int64_t rows = x.size(0);
  EPX_RETURN_IF_ERROR(check_matrix(x, "x", config.dtype, rows, H));
  if (static_cast<int64_t>(offsets.size()) != E + 1)
    return invalid_argument("offsets has {} entries; it must have num_experts + 1 = {}", offsets.size(), E + 1);
  if (offsets[0] != 0) return invalid_argument("offsets[0] = {} must be 0", offsets[0]);
  for (int64_t e = 0; e < E; ++e)
    if (offsets[e + 1] < offsets[e])
      return invalid_argument("offsets[{}] = {} is below offsets[{}] = {}; offsets must be non-decreasing", e + 1,
                              offsets[e + 1], e, offsets[e]);
  if (offsets[E] != rows)
    return invalid_argument("offsets[{}] = {} must equal the rows of x, {}", E, offsets[E], rows);
  if (weights.packed != nullptr) {
    const PackedExpertWeights& packed = *weights.packed;
    if (compute != DType::kBF16)
      return invalid_argument("packed weights serve bf16 GEMMs only; this call's GEMMs are {}", dtype_name(compute));
    if (packed.source != weights.w1.data() || static_cast<int64_t>(packed.w1.size()) != E)
      return invalid_argument("weights.packed holds {} experts packed from other weights than weights.w1 ({} experts): "
                              "pack these weights",
                              packed.w1.size(), E);
  }
  *problem = Problem{&config, &weights, offsets, rows, H, F, dtype_size(compute), compute != config.dtype};
  return Status::ok();
}

// x's rows [first, first + m) as the GEMMs read them: the rows themselves,
// or converted to the compute dtype into `scratch` (m * H elements of it).
// Returns the leading dimension.
int64_t gemm_x_rows(const Problem& p, const TensorView& x, int64_t first, int64_t m, void* scratch, const void** rows) {
  if (!p.convert_x) {
    *rows = x.row(first);
    return ld(x);
  }
  const int64_t H = p.hidden;
  for (int64_t r = 0; r < m; ++r) {
    if (p.config->dtype == DType::kBF16)
      detail::to_f32(x.row<const uint16_t>(first + r), H, static_cast<float*>(scratch) + r * H);
    else
      detail::to_bf16(x.row<const float>(first + r), H, static_cast<uint16_t*>(scratch) + r * H);
  }
  *rows = scratch;
  return H;
}

using PackedList = std::vector<std::shared_ptr<detail::PackedB>> PackedExpertWeights::*;

// Expert e's packed B from `list`, or null (plain weights).
const detail::PackedB* packed_b(const ExpertWeights& weights, PackedList list, int e) {
  return weights.packed == nullptr ? nullptr : (weights.packed->*list)[e].get();
}

// Sizes the pieces `carve` takes from a Carver, reserves that much of
// `workspace`, then carves them out of it.
template <typename Carve>
Status carve_workspace(AlignedBuffer& workspace, Carve&& carve) {
  Carver sizer(nullptr);
  carve(sizer);
  EPX_RETURN_IF_ERROR(workspace.reserve(sizer.bytes(), "an expert's workspace"));
  Carver carver(workspace.data());
  carve(carver);
  return Status::ok();
}

// Experts with rows, largest first (ties: lower id), and the threads each GEMM gets.
struct Plan {
  std::vector<int> experts;
  int threads = 1;       // threads of the call
  bool split_experts = false;
};

Plan make_plan(const Problem& p) {
  Plan plan;
  const int E = p.config->num_experts;
  for (int e = 0; e < E; ++e)
    if (p.offsets[e + 1] > p.offsets[e]) plan.experts.push_back(e);
  auto count = [&](int e) { return p.offsets[e + 1] - p.offsets[e]; };
  std::stable_sort(plan.experts.begin(), plan.experts.end(), [&](int a, int b) { return count(a) > count(b); });
  plan.threads = p.config->num_threads == 0 ? detail::available_cores() : p.config->num_threads;
  if (plan.threads <= 1 || plan.experts.size() < 2) return plan;
  switch (p.config->schedule) {
    case ExpertFfnSchedule::kSplitGemms: break;
    case ExpertFfnSchedule::kSplitExperts: plan.split_experts = true; break;
    case ExpertFfnSchedule::kAuto:
      plan.split_experts = static_cast<int>(plan.experts.size()) >= plan.threads &&
                           count(plan.experts.front()) * plan.threads <= p.rows;
      break;
  }
  return plan;
}

// Runs body(expert, gemm_threads, workspace) for every planned expert: one
// after another on all threads, or spread over the threads, one each.
template <typename Body>
Status run_plan(const Plan& plan, Body&& body) {
  if (!plan.split_experts) {
    AlignedBuffer workspace;
    for (int e : plan.experts) EPX_RETURN_IF_ERROR(body(e, plan.threads, workspace));
    return Status::ok();
  }
  std::vector<Status> status(plan.experts.size());
  const int n = static_cast<int>(plan.experts.size());
  detail::ScopedOmpThreads outer(plan.threads);
#pragma omp parallel num_threads(plan.threads)
  {
    AlignedBuffer workspace;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) status[i] = body(plan.experts[i], 1, workspace);
  }
  for (Status& s : status) EPX_RETURN_IF_ERROR(std::move(s));
  return Status::ok();
}

}  // namespace

DType faster_compute_dtype(DType payload) {
  return payload == DType::kBF16 && detail::bf16_gemm_beats_f32() ? DType::kBF16 : DType::kF32;
}

Status ExpertFfnConfig::validate() const {
  if (num_experts <= 0) return invalid_argument("num_experts = {} must be positive", num_experts);
  if (hidden <= 0) return invalid_argument("hidden = {} must be positive", hidden);
  if (ffn_hidden <= 0) return invalid_argument("ffn_hidden = {} must be positive", ffn_hidden);
  if (dtype != DType::kF32 && dtype != DType::kBF16)
    return invalid_argument("dtype = {} is not supported by the experts; use f32 or bf16", dtype_name(dtype));
  if (compute_dtype && *compute_dtype != DType::kF32 && *compute_dtype != DType::kBF16)
    return invalid_argument("compute_dtype = {} is not supported by the experts; use f32 or bf16",
                            dtype_name(*compute_dtype));
  if (num_threads < 0) return invalid_argument("num_threads = {} must be >= 0 (0 = one per core)", num_threads);
  return Status::ok();
}

namespace {

// oneDNN stores bf16 straight from bf16 GEMMs; f32 GEMMs (not supported with
// a bf16 destination) store f32 rows into scratch, rounded after.
bool down_needs_f32_scratch(const ExpertFfnConfig& config, const TensorView& y) {
  return y.dtype() == DType::kBF16 && config.gemm_dtype() != DType::kBF16;
}

// y's rows [first, first + down.m) = the down GEMM `down` (its C unset), in y's dtype.
Status down_projection(GemmArgs down, const TensorView& y, int64_t first, float* y_scratch, int threads) {
  if (y_scratch == nullptr) {
    down.c = y.row(first), down.ldc = ld(y), down.c_dtype = y.dtype();
    return gemm(down, threads);
  }
  down.c = y_scratch, down.ldc = down.n;
  EPX_RETURN_IF_ERROR(gemm(down, threads));
  for (int64_t r = 0; r < down.m; ++r)
    detail::to_bf16(y_scratch + r * down.n, down.n, y.row<uint16_t>(first + r));
  return Status::ok();
}

}  // namespace

Status expert_ffn_forward(const ExpertFfnConfig& config, const ExpertWeights& weights, const TensorView& x,
                          std::span<const int64_t> offsets, const TensorView& y, ExpertFfnCache* cache) {
  Problem p;
  EPX_RETURN_IF_ERROR(check_common(config, weights, x, offsets, &p));
  if (y.dtype() != DType::kF32 && y.dtype() != DType::kBF16)
    return invalid_argument("y must be f32 or bf16, got {}", y.describe());
  EPX_RETURN_IF_ERROR(check_matrix(y, "y", y.dtype(), p.rows, p.hidden));
  const int64_t H = p.hidden, F = p.ffn;
  if (cache != nullptr) {
    cache->h1.resize(static_cast<std::size_t>(p.rows * F));
    cache->h3.resize(static_cast<std::size_t>(p.rows * F));
    cache->rows = p.rows;
  }
  const Plan plan = make_plan(p);
  return run_plan(plan, [&](int e, int threads, AlignedBuffer& workspace) -> Status {
    const int64_t first = offsets[e], m = offsets[e + 1] - first;
    float* h1 = nullptr;
    float* h3 = nullptr;
    void* a = nullptr;
    void* x_scratch = nullptr;
    float* y_scratch = nullptr;
    auto carve = [&](Carver& c) {
      if (cache == nullptr) {
        h1 = c.take<float>(m * F);
        h3 = c.take<float>(m * F);
      }
      a = c.take<std::byte>(m * F * p.elem);
      if (p.convert_x) x_scratch = c.take<std::byte>(m * H * p.elem);
      if (down_needs_f32_scratch(config, y)) y_scratch = c.take<float>(m * H);
    };
    EPX_RETURN_IF_ERROR(carve_workspace(workspace, carve));
    if (cache != nullptr) {
      h1 = cache->h1.data() + first * F;
      h3 = cache->h3.data() + first * F;
    }
    const DType compute = config.gemm_dtype();
    const void* x_rows = nullptr;
    const int64_t ldx = gemm_x_rows(p, x, first, m, x_scratch, &x_rows);
    GemmArgs up{.dtype = compute, .m = m, .n = F, .k = H, .a = x_rows, .lda = ldx};
    up.b = expert_rows(weights.w1, e * H), up.ldb = ld(weights.w1), up.c = h1, up.ldc = F;
    up.packed_b = packed_b(weights, &PackedExpertWeights::w1, e);
    EPX_RETURN_IF_ERROR(gemm(up, threads));
    up.b = expert_rows(weights.w3, e * H), up.ldb = ld(weights.w3), up.c = h3;
    up.packed_b = packed_b(weights, &PackedExpertWeights::w3, e);
    EPX_RETURN_IF_ERROR(gemm(up, threads));
    detail::swiglu_forward(h1, h3, m * F, compute, a);
    GemmArgs down{.dtype = compute, .m = m, .n = H, .k = F, .a = a, .lda = F,
                  .b = expert_rows(weights.w2, e * F), .ldb = ld(weights.w2),
                  .packed_b = packed_b(weights, &PackedExpertWeights::w2, e)};
    return down_projection(down, y, first, y_scratch, threads);
  });
}

namespace {

// grad_y's rows [first, first + m) as the backward GEMMs read them: the f32
// rows themselves, or (bf16) rounded into `scratch`. Returns the leading dimension.
int64_t backward_grad_y(const ExpertFfnConfig& config, const TensorView& grad_y, int64_t first, int64_t m,
                        void* scratch, const void** gy) {
  if (config.gemm_dtype() != DType::kBF16) {
    *gy = grad_y.row(first);
    return ld(grad_y);
  }
  const int64_t H = config.hidden;
  for (int64_t r = 0; r < m; ++r) detail::to_bf16(grad_y.row<const float>(first + r), H, static_cast<uint16_t*>(scratch) + r * H);
  *gy = scratch;
  return H;
}

Status check_grad_y(const Problem& p, const TensorView& grad_y) {
  return check_matrix(grad_y, "grad_y", DType::kF32, p.rows, p.hidden);
}

Status check_grads(const ExpertFfnConfig& config, const ExpertGrads& grads) {
  const int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  EPX_RETURN_IF_ERROR(check_matrix(grads.w1, "grads.w1", DType::kF32, E * H, F));
  EPX_RETURN_IF_ERROR(check_matrix(grads.w3, "grads.w3", DType::kF32, E * H, F));
  return check_matrix(grads.w2, "grads.w2", DType::kF32, E * F, H);
}

}  // namespace

Status expert_ffn_backward_data(const ExpertFfnConfig& config, const ExpertWeights& weights, const TensorView& x,
                                std::span<const int64_t> offsets, const ExpertFfnCache& cache,
                                const TensorView& grad_y, const TensorView& grad_x, ExpertFfnGradState* state) {
  Problem p;
  EPX_RETURN_IF_ERROR(check_common(config, weights, x, offsets, &p));
  const int64_t H = p.hidden, F = p.ffn;
  EPX_RETURN_IF_ERROR(check_grad_y(p, grad_y));
  EPX_RETURN_IF_ERROR(check_matrix(grad_x, "grad_x", DType::kF32, p.rows, H));
  if (state == nullptr) return invalid_argument("expert_ffn_backward_data needs a state to fill");
  const auto cached = static_cast<std::size_t>(p.rows * F);
  if (cache.rows != p.rows || cache.h1.size() != cached || cache.h3.size() != cached)
    return invalid_argument(
        "cache holds {} rows (h1 {} and h3 {} values) but x has {} rows ({} values each): pass the cache that "
        "expert_ffn_forward filled for this x",
        cache.rows, cache.h1.size(), cache.h3.size(), p.rows, cached);
  const std::size_t state_bytes = cached * p.elem;
  state->a.resize(state_bytes);
  state->grad_h1.resize(state_bytes);
  state->grad_h3.resize(state_bytes);
  state->rows = p.rows;
  const bool round_grad_y = config.gemm_dtype() == DType::kBF16;
  state->grad_y.resize(round_grad_y ? static_cast<std::size_t>(p.rows * H) * sizeof(uint16_t) : 0);
  const Plan plan = make_plan(p);
  return run_plan(plan, [&](int e, int threads, AlignedBuffer& workspace) -> Status {
    const int64_t first = offsets[e], m = offsets[e + 1] - first;
    float* grad_a = nullptr;
    auto carve = [&](Carver& c) { grad_a = c.take<float>(m * F); };
    EPX_RETURN_IF_ERROR(carve_workspace(workspace, carve));
    void* gy_bf16 = round_grad_y ? state->grad_y.data() + first * H * sizeof(uint16_t) : nullptr;
    const void* gy = nullptr;
    const int64_t ldgy = backward_grad_y(config, grad_y, first, m, gy_bf16, &gy);
    std::byte* a = state->a.data() + first * F * p.elem;
    std::byte* grad_h1 = state->grad_h1.data() + first * F * p.elem;
    std::byte* grad_h3 = state->grad_h3.data() + first * F * p.elem;
    // grad_a = grad_y W2^T
    const DType compute = config.gemm_dtype();
    GemmArgs g{.dtype = compute, .trans_b = true, .m = m, .n = F, .k = H, .a = gy, .lda = ldgy,
               .b = expert_rows(weights.w2, e * F), .ldb = ld(weights.w2), .c = grad_a, .ldc = F,
               .packed_b = packed_b(weights, &PackedExpertWeights::w2_t, e)};
    EPX_RETURN_IF_ERROR(gemm(g, threads));
    detail::swiglu_backward(cache.h1.data() + first * F, cache.h3.data() + first * F, grad_a, m * F, compute, a,
                            grad_h1, grad_h3);
    // grad_x = grad_h1 W1^T + grad_h3 W3^T
    GemmArgs d{.dtype = compute, .trans_b = true, .m = m, .n = H, .k = F, .a = grad_h1, .lda = F,
               .b = expert_rows(weights.w1, e * H), .ldb = ld(weights.w1), .c = grad_x.row<float>(first),
               .ldc = ld(grad_x), .packed_b = packed_b(weights, &PackedExpertWeights::w1_t, e)};
    EPX_RETURN_IF_ERROR(gemm(d, threads));
    d.accumulate = true, d.a = grad_h3, d.b = expert_rows(weights.w3, e * H), d.ldb = ld(weights.w3);
    d.packed_b = packed_b(weights, &PackedExpertWeights::w3_t, e);
    return gemm(d, threads);
  });
}

Status expert_ffn_backward_weights(const ExpertFfnConfig& config, const ExpertWeights& weights, const TensorView& x,
                                   std::span<const int64_t> offsets, const TensorView& grad_y,
                                   const ExpertFfnGradState& state, const ExpertGrads& grads) {
  Problem p;
  EPX_RETURN_IF_ERROR(check_common(config, weights, x, offsets, &p));
  const int64_t H = p.hidden, F = p.ffn;
  EPX_RETURN_IF_ERROR(check_grad_y(p, grad_y));
  EPX_RETURN_IF_ERROR(check_grads(config, grads));
  const std::size_t state_bytes = static_cast<std::size_t>(p.rows * F) * p.elem;
  if (state.rows != p.rows || state.a.size() != state_bytes || state.grad_h1.size() != state_bytes ||
      state.grad_h3.size() != state_bytes)
    return invalid_argument("state holds {} rows but x has {}: pass the state expert_ffn_backward_data filled for "
                            "this x",
                            state.rows, p.rows);
  const DType compute = config.gemm_dtype();
  // The data pass's rounded grad_y where the state holds all of it.
  const bool rounded = compute == DType::kBF16 &&
                       state.grad_y.size() == static_cast<std::size_t>(p.rows * H) * sizeof(uint16_t);
  const Plan plan = make_plan(p);
  return run_plan(plan, [&](int e, int threads, AlignedBuffer& workspace) -> Status {
    const int64_t first = offsets[e], m = offsets[e + 1] - first;
    void* gy_bf16 = nullptr;
    void* x_scratch = nullptr;
    auto carve = [&](Carver& c) {
      if (compute == DType::kBF16 && !rounded) gy_bf16 = c.take<uint16_t>(m * H);
      if (p.convert_x) x_scratch = c.take<std::byte>(m * H * p.elem);
    };
    EPX_RETURN_IF_ERROR(carve_workspace(workspace, carve));
    const void* gy = rounded ? state.grad_y.data() + first * H * sizeof(uint16_t) : nullptr;
    const int64_t ldgy = rounded ? H : backward_grad_y(config, grad_y, first, m, gy_bf16, &gy);
    const void* x_rows = nullptr;
    const int64_t ldx = gemm_x_rows(p, x, first, m, x_scratch, &x_rows);
    const std::byte* a = state.a.data() + first * F * p.elem;
    // grad_W2 += a^T grad_y
    GemmArgs w{.dtype = compute, .trans_a = true, .accumulate = true, .m = F, .n = H, .k = m, .a = a, .lda = F,
               .b = gy, .ldb = ldgy, .c = grads.w2.row<float>(e * F), .ldc = ld(grads.w2)};
    EPX_RETURN_IF_ERROR(gemm(w, threads));
    // grad_W1 += x^T grad_h1, grad_W3 += x^T grad_h3
    w = GemmArgs{.dtype = compute, .trans_a = true, .accumulate = true, .m = H, .n = F, .k = m,
                 .a = x_rows, .lda = ldx, .b = state.grad_h1.data() + first * F * p.elem, .ldb = F,
                 .c = grads.w1.row<float>(e * H), .ldc = ld(grads.w1)};
    EPX_RETURN_IF_ERROR(gemm(w, threads));
    w.b = state.grad_h3.data() + first * F * p.elem, w.c = grads.w3.row<float>(e * H), w.ldc = ld(grads.w3);
    return gemm(w, threads);
  });
}

Status pack_expert_weights(const ExpertFfnConfig& config, const ExpertWeights& weights, PackedExpertWeights* packed) {
  EPX_RETURN_IF_ERROR(config.validate());
  if (packed == nullptr) return invalid_argument("pack_expert_weights needs somewhere to put the packed weights");
  const int64_t E = config.num_experts, H = config.hidden, F = config.ffn_hidden;
  const DType compute = config.gemm_dtype();
  if (compute != DType::kBF16)
    return invalid_argument("packed weights serve bf16 GEMMs only (packed f32 gives other bits than the plain calls); "
                            "the GEMMs here are {}", dtype_name(compute));
  EPX_RETURN_IF_ERROR(check_matrix(weights.w1, "weights.w1", compute, E * H, F));
  EPX_RETURN_IF_ERROR(check_matrix(weights.w3, "weights.w3", compute, E * H, F));
  EPX_RETURN_IF_ERROR(check_matrix(weights.w2, "weights.w2", compute, E * F, H));
  // Taken over so that pack_b can refill its memory; handed back packed.
  PackedExpertWeights out = std::move(*packed);
  *packed = PackedExpertWeights{};
  out.source = weights.w1.data();
  // Expert e's B of [k, n]: the rows of `w` from first_row on (transposed: stored [n, k]).
  auto add = [&](PackedList list, int64_t e, bool trans_b, int64_t k, int64_t n, const TensorView& w,
                 int64_t first_row) -> Status {
    auto& packed_list = out.*list;
    packed_list.resize(static_cast<std::size_t>(E));
    return detail::pack_b(compute, trans_b, k, n, expert_rows(w, first_row), ld(w), &packed_list[e]);
  };
  for (int64_t e = 0; e < E; ++e) {
    EPX_RETURN_IF_ERROR(add(&PackedExpertWeights::w1, e, false, H, F, weights.w1, e * H));
    EPX_RETURN_IF_ERROR(add(&PackedExpertWeights::w3, e, false, H, F, weights.w3, e * H));
    EPX_RETURN_IF_ERROR(add(&PackedExpertWeights::w2, e, false, F, H, weights.w2, e * F));
    EPX_RETURN_IF_ERROR(add(&PackedExpertWeights::w2_t, e, true, H, F, weights.w2, e * F));
    EPX_RETURN_IF_ERROR(add(&PackedExpertWeights::w1_t, e, true, F, H, weights.w1, e * H));
    EPX_RETURN_IF_ERROR(add(&PackedExpertWeights::w3_t, e, true, F, H, weights.w3, e * H));
  }
  *packed = std::move(out);
  return Status::ok();
}

Status expert_ffn_backward(const ExpertFfnConfig& config, const ExpertWeights& weights, const TensorView& x,
                           std::span<const int64_t> offsets, const ExpertFfnCache& cache, const TensorView& grad_y,
                           const TensorView& grad_x, const ExpertGrads& grads) {
  // Checked before the data pass writes grad_x: nothing is written on bad input.
  EPX_RETURN_IF_ERROR(check_grads(config, grads));
  ExpertFfnGradState state;
  EPX_RETURN_IF_ERROR(expert_ffn_backward_data(config, weights, x, offsets, cache, grad_y, grad_x, &state));
  return expert_ffn_backward_weights(config, weights, x, offsets, grad_y, state, grads);
}

}  // namespace epx
