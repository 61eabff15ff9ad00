// MoELayer: one Mixture-of-Experts block with forward and backward.
//
//   out = x + combine(experts(dispatch(RMSNorm(x), route(RMSNorm(x) Wr))))
//           + shared_experts(RMSNorm(x))
//
// Every rank of the transport holds one MoELayer per model layer and calls
// forward and backward with its own tokens (the counts may differ, and may be
// 0). The router, the norm and the shared experts are dense parameters
// (replicated; sum their gradients over ranks before an optimizer step); the
// routed experts are the rank's local experts of the Buffer's placement, and
// their gradients already hold every rank's tokens. Forward and backward are
// collectives (dispatch, combine and, with balancing statistics, a small
// all-reduce): every rank calls them in the same order.
//
// Maths in fp32; the dispatch payload uses config.dtype and the expert GEMMs
// config.compute_dtype (default: the same; f32 or bf16 storage with fp32
// accumulation). Deterministic: the same
// inputs on the same topology give the same bits on every run.
//
// Initialisation is a pure function of (seed, layer_index, logical expert
// id), so one rank holding every expert starts from the same weights as R
// ranks holding a share each, and every replica of an expert starts equal.
//
// Redundant experts (EPLB): with a slot -> logical expert map the router
// still picks logical experts (E of them) while the Buffer holds S >= E
// physical slots; after routing, each (token t, expert e) goes to replica
// t mod (e's replica count) of e (map_to_replicas, kTokenModulo). Without a
// map (or with the identity) slot e holds expert e and nothing changes.
//
//   epx::MoELayerConfig config{.hidden = 64, .ffn_hidden = 128, .router = {.num_experts = 8, .topk = 2}};
//   EPX_ASSIGN_OR_RETURN(auto layer, epx::MoELayer::create(config, transport, *buffer, /*layer_index=*/0));
//   EPX_RETURN_IF_ERROR(layer->forward(x, out));
//   EPX_RETURN_IF_ERROR(layer->backward(grad_out, grad_x));
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/core/status.h"
#include "epx/core/tensor.h"
#include "epx/core/trace.h"
#include "epx/exchange/buffer.h"
#include "epx/layer/parameter.h"
#include "epx/routing/expert_bias.h"
#include "epx/routing/load_stats.h"
#include "epx/routing/replicas.h"
#include "epx/routing/router.h"

namespace epx {

enum class AuxLossKind : uint8_t {
  kMicroBatch,   // each rank's tokens (Switch/GShard); the model's loss averages it over ranks
  kGlobalBatch,  // f and P over every rank's tokens (one all-reduce)
};

// How forward and backward hide the exchange behind compute (the Buffer's
// asynchronous operations). Every mode gives the same bits as kNone, forward
// and gradients (tests/layer), provided the expert GEMMs give each row the
// same bits whatever the number of rows (oneDNN's matmul does, tested).
enum class OverlapMode : uint8_t {
  kNone,           // router, dispatch, experts, combine one after another
  kSharedExperts,  // the shared experts compute while the dispatch is in flight
  // Tokens in overlap_chunks chunks: chunk i+1's dispatch and chunk i-1's
  // combine run under chunk i's experts (and the shared experts under the
  // first dispatch).
  kChunked,
  // Two micro-batches (the two halves of the tokens): the second's norm and
  // routing run under the first's dispatch, its dispatch under the first's
  // experts, the first's combine under its experts. Each half is routed on
  // its own, so capacity and redundant experts are refused (use kChunked).
  kTwoMicroBatches,
};
[[nodiscard]] std::string_view overlap_mode_name(OverlapMode mode);
// "none", "shared", "chunked", "two-micro-batches".
[[nodiscard]] Result<OverlapMode> parse_overlap_mode(std::string_view name);

struct MoELayerConfig {
  int hidden = 0;
  int ffn_hidden = 0;  // width of each routed expert
  // num_experts, topk, gates, groups, capacity: see router.h.
  RouterConfig router;
  // Shared experts, replicated on every rank: one SwiGLU FFN of width
  // num_shared_experts * ffn_hidden applied to every token.
  int num_shared_experts = 0;
  DType dtype = DType::kF32;  // dispatch payload (and, by default, expert GEMMs): kF32 or kBF16
  // What the dispatch sends. Unset (or dtype): dtype. kFP8E4M3: e4m3 with one
  // scale per 128 channels (hidden a multiple of 128), which the experts read
  // dequantised to dtype; the combine and the whole backward stay in dtype
  // (as DeepSeek-V3 trains). The Buffer then has dtype kFP8E4M3 and
  // gradient_dtype == dtype.
  std::optional<DType> dispatch_dtype = std::nullopt;
  // The combine's per-(token, rank) partial rows (CombineOptions::partial_dtype):
  // kF32 (exact) or kBF16 (half the combine's bytes, each partial rounded once;
  // the backward is the same).
  DType combine_dtype = DType::kF32;
  // Where the combine applies the top-k weights (CombineOptions::weights_at).
  // kHolder: weighted partials per (token, rank) of combine_dtype. kReceiver:
  // the experts write y in dtype straight into the Buffer's combine region
  // (Buffer::combine_expanded_input; the Buffer needs max_expanded_rows, see
  // Buffer::expanded_rows_bound) and each token's rank sums w * y in top-k
  // order in fp32: other bits than kHolder, the same on every flat topology.
  // kReceiver needs combine_dtype f32, overlap kNone and a flat Buffer.
  CombineWeights combine_weights = CombineWeights::kHolder;
  double aux_loss_coeff = 0.0;
  AuxLossKind aux_loss = AuxLossKind::kMicroBatch;
  double z_loss_coeff = 0.0;
  bool expert_bias = false;  // aux-loss-free balancing (update_bias after each step)
  float bias_rate = ExpertBias::kDefaultRate;
  float norm_eps = 1e-6f;
  uint64_t seed = 1;
  float init_std = 0.0f;  // 0: 1/sqrt(fan_in) for every weight
  OverlapMode overlap = OverlapMode::kNone;
  int overlap_chunks = 4;  // kChunked: chunks per forward (the same on every rank), 1..64
  // The expert GEMMs' operand type (routed and shared experts; kF32 or
  // kBF16); unset = dtype. A bf16 payload into f32 GEMMs is exact on the way
  // in (the rows widen); where a CPU's bf16 GEMM is slower than its f32 one
  // (no bf16 dot products, or AVX512-BF16 on Intel), that is the faster choice. See
  // faster_compute_dtype (epx/experts/ffn.h) and `epx train --compute-dtype`.
  std::optional<DType> compute_dtype = std::nullopt;
  // bf16 GEMMs only: the routed experts' weights packed once per weight
  // version (pack_expert_weights, epx/experts/ffn.h), which the overlap
  // modes' small per-chunk calls gain most from; it pays where a version
  // serves several steps (inference, gradient accumulation): the repack
  // after each update costs about what a chunked step gains. Packed bits
  // differ from the plain calls' for some shapes; the plain layer and every
  // overlap mode get the same bits with it on (docs/design.md, "Experts").
  bool pack_expert_weights = false;

  [[nodiscard]] Status validate() const;
};

// Wall time of the last forward + backward on this rank, in seconds. With an
// overlap mode, dispatch and combine count only the time the caller waited
// for them (what the overlap left exposed), not the time they were in flight.
struct LayerTimes {
  double router = 0;    // norm, router GEMM, routing, aux losses (and their backward)
  double dispatch = 0;  // dispatch + expand (forward), their backward
  double experts = 0;   // routed and shared experts (and, overlapped, gathering their rows)
  double combine = 0;   // combine (forward), its backward
  double stats = 0;     // the load-statistics all-reduce
  double experts_cpu = 0;  // the experts phases' CPU time on the calling thread (the rest of `experts` is
                           // time the thread waited for its core)
  LayerTimes& operator+=(const LayerTimes& other);
};

class MoELayer {
 public:
  // `buffer` must be built on `transport` with hidden == config.hidden, dtype
  // == the dispatch dtype (fp8: and gradient_dtype == config.dtype), max_combine_dtype kF32 and num_experts == the number of
  // physical slots; it may be shared by several layers (they use it one after
  // another). `slot_expert` maps each slot of the Buffer to the logical expert
  // it holds (-1 = empty slot); every logical expert needs a slot. Empty: the
  // identity (the Buffer then has the router's num_experts slots).
  // `global` (default: `transport`) holds every rank of the run when
  // `transport` is one EP group of several (EP x EDP training): the
  // global-batch aux loss, the micro-batch aux and z losses' 1/ranks, and the
  // load statistics (so the expert bias) then cover every rank's tokens.
  static Result<std::unique_ptr<MoELayer>> create(const MoELayerConfig& config, Transport& transport,
                                                  Buffer& buffer, int layer_index,
                                                  std::vector<int32_t> slot_expert = {}, Transport* global = nullptr);
  ~MoELayer();
  MoELayer(const MoELayer&) = delete;
  MoELayer& operator=(const MoELayer&) = delete;

  [[nodiscard]] const MoELayerConfig& config() const;
  [[nodiscard]] int num_local_experts() const;
  [[nodiscard]] Buffer& buffer();
  // slot -> logical expert (-1 = empty), over the Buffer's slots.
  [[nodiscard]] const std::vector<int32_t>& slot_expert() const;
  // Logical expert held by local expert `local` of this rank (-1 = empty slot).
  [[nodiscard]] int local_logical_expert(int local) const;

  // x, out: f32 [T, hidden] (T <= the Buffer's max_tokens_per_rank). Keeps
  // what backward needs until the next forward.
  [[nodiscard]] Status forward(const TensorView& x, const TensorView& out);
  // grad_out, grad_x: f32 [T, hidden] of the last forward. Adds into every
  // parameter's grad (zero them between steps).
  [[nodiscard]] Status backward(const TensorView& grad_out, const TensorView& grad_x);

  // This rank's share of the weighted auxiliary and z losses of the last
  // forward (summed over the global ranks they give the layer's auxiliary loss).
  [[nodiscard]] double aux_loss() const;
  // Load statistics of the last forward over every global rank's tokens (the
  // same on every rank); tokens_per_expert are the global kept (token, slot)
  // pairs per LOGICAL expert, tokens_per_rank and work_per_rank follow the
  // physical slots (so replicas spread a hot expert's work over ranks) and
  // have one entry per rank of the EP group: with several EP groups, entry r
  // sums EP rank r of every group (the ranks that hold the same experts), and
  // worst_rank is such an EP rank.
  [[nodiscard]] const LoadStats& load_stats() const;
  [[nodiscard]] const LayerTimes& times() const;
  // How many weight matrices the forwards so far rounded into the compute
  // dtype: with bf16 GEMMs each expert and shared-expert weight is copied on
  // the first forward and again only after Parameter::mark_written(); f32
  // GEMMs read the masters and copy none.
  [[nodiscard]] int64_t weight_copies() const;
  // Who this rank waited for in the last forward's and backward's dispatches
  // and combines, summed (WaitRecord, over the ranks of the layer's EP
  // group); zeros when the Buffer's record_waits is off.
  [[nodiscard]] const WaitRecord& waits() const;
  // Records spans "router", "dispatch", "experts", "combine" (forward) and
  // "*_backward" per rank while set; null turns it off.
  void set_tracer(Tracer* tracer);

  // Aux-loss-free balancing: moves the expert bias by the last forward's
  // global load (a no-op without config.expert_bias or when frozen).
  [[nodiscard]] Status update_bias();
  [[nodiscard]] ExpertBias& bias();

  // Replicated experts: sums each replicated logical expert's gradients over
  // the ranks holding its replicas (one all-reduce of only those experts'
  // gradients; a no-op without replicas), so that all replicas take the same
  // optimizer update and stay bit-identical. Collective; call after backward.
  [[nodiscard]] Status sum_replica_gradients();
  // The same over `transport`: a duplicate of the layer's (same ranks, same
  // rank numbers; InvalidArgument otherwise), e.g. one a gradient thread owns
  // so its all-reduce runs beside the layer's own collectives.
  [[nodiscard]] Status sum_replica_gradients(Transport& transport, const Deadline& deadline);
  // This rank's squared norm of the expert gradients that repeat another
  // replica (every replica but the lowest slot of its expert), to count each
  // logical expert once in a global gradient norm (clip_grad_norm).
  [[nodiscard]] double duplicate_grad_sq() const;

  // Dense: norm, router, shared experts; expert: w1, w3, w2 of the local experts.
  [[nodiscard]] std::vector<Parameter*> parameters();
  // The expert ones alone: w1, w3, w2, each num_local_experts() blocks.
  [[nodiscard]] std::vector<Parameter*> expert_parameters();

 private:
  struct Impl;
  explicit MoELayer(std::unique_ptr<Impl> impl);
  // create() without its guard (which turns an exception into a Status).
  static Result<std::unique_ptr<MoELayer>> create_unguarded(const MoELayerConfig& config, Transport& transport,
                                                            Buffer& buffer, int layer_index,
                                                            std::vector<int32_t> slot_expert, Transport& global);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epx
