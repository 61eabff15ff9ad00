// Expert FFN: SwiGLU experts run as a grouped GEMM over expert-sorted rows.
//
// The rows come in the expanded layout that dispatch delivers
// (Buffer::expand / ExpandedLayout): rows [offsets[e], offsets[e+1]) belong
// to local expert e. For each expert
//
//   h1 = x W1[e], h3 = x W3[e]           W1, W3: [H, F]
//   a  = silu(h1) * h3                   silu(z) = z / (1 + exp(-z))
//   y  = a W2[e]                         W2: [F, H]
//
// Storage is f32 or bf16 (the weights of compute_dtype, x of dtype, which
// may differ: a bf16 payload into f32 GEMMs); accumulation is fp32 and y is f32. Experts with no rows cost nothing; zero (padding) rows
// give zero output. Backward gives grad_x and adds the weight gradients into
// f32 accumulators. With a bf16 compute dtype every GEMM takes bf16 operands:
// a (forward), and grad_y, a, grad_h1, grad_h3 (backward) are rounded to bf16
// (nearest even) on their way in, as bf16 training does; the products still sum in
// fp32. The GEMMs are oneDNN's matmul (docs/design.md, "Experts").
//
// Errors: InvalidArgument naming the value and its limit (shapes, dtypes,
// offsets, a cache from another x), checked before anything is written;
// Internal if oneDNN fails. Calls from several threads at once are safe;
// a rank running as a thread passes num_threads = 1 and the call then runs
// on the calling thread only. The same inputs and thread count give the
// same bits on every run.
//
//   epx::ExpertFfnConfig config{.num_experts = 8, .hidden = 512, .ffn_hidden = 1024};
//   epx::ExpertFfnCache cache;
//   EPX_RETURN_IF_ERROR(epx::expert_ffn_forward(config, weights, x, offsets, y, &cache));
//   ...
//   EPX_RETURN_IF_ERROR(epx::expert_ffn_backward(config, weights, x, offsets, cache, grad_y,
//                                                grad_x, grads));
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "epx/core/buffer.h"
#include "epx/core/status.h"
#include "epx/core/tensor.h"

namespace epx {

// How the threads of one call share the work. kSplitGemms runs the experts
// one after another, each GEMM on all threads; kSplitExperts gives whole
// experts to threads (largest first), each GEMM on one thread. kAuto picks
// kSplitExperts when there are at least as many non-empty experts as threads
// and no expert has more than its fair share (rows / threads) of the rows,
// so the threads can be kept evenly busy: it needs no synchronization inside
// a GEMM and holds up far better when other processes take cores
// (docs/performance.md, Experts). Results may differ between the two
// in the last bits (a GEMM's summation order depends on its thread count).
enum class ExpertFfnSchedule : uint8_t { kAuto, kSplitGemms, kSplitExperts };

struct ExpertFfnConfig {
  int num_experts = 0;  // local experts
  int hidden = 0;       // H
  int ffn_hidden = 0;   // F
  DType dtype = DType::kF32;  // storage of x: kF32 or kBF16
  // Threads the grouped GEMM may use; 0 = one per core. Inside an in-process
  // world each rank is already a thread: pass 1 there.
  int num_threads = 0;
  ExpertFfnSchedule schedule = ExpertFfnSchedule::kAuto;  // ignored when num_threads = 1
  // The weights' storage and the GEMMs' operand type; unset = dtype. When it
  // differs from dtype, each expert's rows of x are converted on their way
  // into the GEMMs (bf16 -> f32 exactly; f32 -> bf16 to nearest even).
  std::optional<DType> compute_dtype = std::nullopt;

  [[nodiscard]] DType gemm_dtype() const { return compute_dtype.value_or(dtype); }
  [[nodiscard]] Status validate() const;
};

// The faster expert-GEMM type for a payload of `payload` on this CPU, by a
// fixed rule: an f32 payload computes in f32 (bf16 GEMMs would round it); a
// bf16 payload computes in bf16 with AVX512-BF16 on AMD or with AMX, and in
// f32 elsewhere (without native bf16 dot products oneDNN widens bf16 inside
// its kernels). Honours ONEDNN_MAX_CPU_ISA. Why, with the figures:
// docs/performance.md, "The MoE layer against the GEMM library".
[[nodiscard]] DType faster_compute_dtype(DType payload);

namespace detail {
struct PackedB;
}

// The local experts' weights packed once for bf16 GEMMs (pack_expert_weights):
// each expert's W1, W3, W2 and their transposes, laid out as oneDNN's
// fixed-size kernels read them, so that the forward and the backward's data
// pass skip oneDNN's rearrangement of each expert's weights on every call.
// It pays most where the calls are small (the overlap modes' chunks;
// docs/performance.md, Overlapping the exchange with compute), and where the
// weights serve many calls per packing (inference, gradient accumulation):
// a repack after every weight update costs about what one chunked step
// gains. Row-invariant bits, within fp32 summation order of the plain
// calls' (equal for some shapes only). Twice the weights' memory. It does
// not follow later writes to the weights: pack again after them.
struct PackedExpertWeights {
  // Per expert: the B operands of the up GEMMs (w1, w3), the down GEMM (w2),
  // and the data pass's transposed GEMMs (w2_t, w1_t, w3_t).
  std::vector<std::shared_ptr<detail::PackedB>> w1, w3, w2, w2_t, w1_t, w3_t;
  const void* source = nullptr;  // the w1 data it was packed from
};

// The weights of the local experts, contiguous per expert, of the compute dtype.
struct ExpertWeights {
  TensorView w1;  // [E * H, F]: expert e is rows [e * H, (e + 1) * H)
  TensorView w3;  // [E * H, F]
  TensorView w2;  // [E * F, H]
  // Optional: these weights packed (bf16 GEMMs only); null = the plain calls.
  const PackedExpertWeights* packed = nullptr;
};

// Packs `weights` for config (its GEMM dtype must be bf16) into *packed,
// refilling *packed's memory in place when it holds the same shapes (a
// repack then costs about a copy of the weights, far less than the first
// packing, which touches fresh pages). On an error *packed is empty.
// InvalidArgument for f32 GEMMs or weights of the wrong shape or dtype;
// FailedPrecondition where oneDNN would read packed weights in another
// layout for some row count (then use the plain weights).
[[nodiscard]] Status pack_expert_weights(const ExpertFfnConfig& config, const ExpertWeights& weights,
                                         PackedExpertWeights* packed);

// f32 gradient accumulators of the same shapes; backward adds into them.
struct ExpertGrads {
  TensorView w1;
  TensorView w3;
  TensorView w2;
};

// What forward keeps for backward (h1 and h3, f32, [rows, F] each). Reused
// across calls; owned by the caller.
struct ExpertFfnCache {
  std::vector<float> h1;
  std::vector<float> h3;
  int64_t rows = 0;
};

// x: [rows, H] of config.dtype; offsets: [E + 1], non-decreasing, offsets[0]
// = 0, offsets[E] = rows; y: [rows, H] f32, or bf16 (the down GEMM's fp32 sums rounded
// once to nearest even, e.g. straight into Buffer::combine_expanded_input). cache may be null (inference).
[[nodiscard]] Status expert_ffn_forward(const ExpertFfnConfig& config, const ExpertWeights& weights,
                                        const TensorView& x, std::span<const int64_t> offsets,
                                        const TensorView& y, ExpertFfnCache* cache);

// grad_y: [rows, H] f32; grad_x: [rows, H] f32 (overwritten); grads: added to.
// cache: the one forward filled for the same x and offsets.
[[nodiscard]] Status expert_ffn_backward(const ExpertFfnConfig& config, const ExpertWeights& weights,
                                         const TensorView& x, std::span<const int64_t> offsets,
                                         const ExpertFfnCache& cache, const TensorView& grad_y,
                                         const TensorView& grad_x, const ExpertGrads& grads);

// The same backward in two passes, for callers that overlap it with other
// work: the data pass, row by row (grad_x, and the gradients the weights
// need, kept in `state`), then the weight pass over the rows. Rows are
// independent in the data pass, so it may run on parts of the rows (one
// call per part) and the weight pass once on all of them, in the order the
// single call would see them: the gradients then have the single call's bits.
// expert_ffn_backward is these two in a row.
struct ExpertFfnGradState {
  std::vector<std::byte> a, grad_h1, grad_h3;  // [rows, F] of the compute dtype each
  // bf16 GEMMs: grad_y [rows, H] as the data pass rounded it, read again by
  // the weight pass instead of rounding grad_y a second time (same bits);
  // when empty (f32 GEMMs, or a state gathered from parts) the weight pass
  // rounds grad_y itself.
  std::vector<std::byte> grad_y;
  int64_t rows = 0;
};
[[nodiscard]] Status expert_ffn_backward_data(const ExpertFfnConfig& config, const ExpertWeights& weights,
                                              const TensorView& x, std::span<const int64_t> offsets,
                                              const ExpertFfnCache& cache, const TensorView& grad_y,
                                              const TensorView& grad_x, ExpertFfnGradState* state);
[[nodiscard]] Status expert_ffn_backward_weights(const ExpertFfnConfig& config, const ExpertWeights& weights,
                                                 const TensorView& x, std::span<const int64_t> offsets,
                                                 const TensorView& grad_y, const ExpertFfnGradState& state,
                                                 const ExpertGrads& grads);

}  // namespace epx
