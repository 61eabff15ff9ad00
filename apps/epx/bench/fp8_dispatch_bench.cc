#include "fp8_dispatch_bench.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/core/buffer.h"
#include "epx/core/clock.h"
#include "epx/core/fp8.h"
#include "epx/exchange/buffer.h"
#include "exchange_bench.h"
#include "synthetic_routing.h"

namespace epx::bench {
namespace {

enum Variant : int { kBf16, kFp8F32, kFp8Ue8m0, kQuantise, kNumVariants };
constexpr const char* kVariantName[kNumVariants] = {"bf16", "fp8 f32 scales", "fp8 ue8m0 scales",
                                                     "quantise only (f32 scales)"};

// A bf16 value per (rank, token, column) of about unit size, scaled per
// 128-channel block by a power of two, so the blocks' scales differ.
float x_value(int rank, int64_t t, int64_t c) {
  const uint64_t h = (static_cast<uint64_t>(rank) * 1000003u + static_cast<uint64_t>(t)) * 2654435761u +
                     static_cast<uint64_t>(c) * 40503u;
  const float unit = static_cast<float>(static_cast<int64_t>((h >> 11) % 2001) - 1000) / 1000.0f;
  return std::ldexp(unit, static_cast<int>((t + c / kFp8BlockSize) % 9) - 4);
}

struct Shared {
  explicit Shared(int ranks, int rounds)
      : begin(static_cast<std::size_t>(rounds) * kNumVariants * ranks),
        end(begin.size()),
        payload_bytes(static_cast<std::size_t>(kNumVariants) * ranks),
        inter_node_bytes(payload_bytes.size()),
        worst(ranks, 0.0) {}
  std::vector<int64_t> begin, end;                        // [round][variant][rank]
  std::vector<int64_t> payload_bytes, inter_node_bytes;   // [variant][rank], from the first round
  std::vector<double> worst;                              // [rank]: worst error / bound
  bool hierarchical = false;
};

// Every rank's routing, and the rows each rank receives: one per (token,
// destination rank) pair.
struct RoutingPlan {
  std::vector<RankRouting> routing;  // [R]
  std::vector<int64_t> recv_rows;    // [R]
  int64_t max_recv = 1;              // the most on one rank (at least 1): sizes the Buffers
  int64_t total_rows = 0;
};

Result<RoutingPlan> plan_routing(const ExchangeBenchConfig& c, const ExpertPlacement& placement) {
  const int R = c.num_ranks, T = c.num_tokens;
  const RoutingSpec spec{.num_tokens = T, .num_experts = c.num_experts, .topk = c.topk, .skew = c.skew, .seed = c.seed};
  RoutingPlan plan;
  plan.recv_rows.assign(R, 0);
  std::vector<char> seen(R);
  for (int r = 0; r < R; ++r) {
    EPX_ASSIGN_OR_RETURN(RankRouting rr, make_routing(spec, r));
    for (int t = 0; t < T; ++t) {
      std::fill(seen.begin(), seen.end(), 0);
      for (int k = 0; k < c.topk; ++k) {
        const int d = placement.rank_of(rr.topk_idx[static_cast<std::size_t>(t) * c.topk + k]);
        if (!seen[d]) ++plan.recv_rows[d];
        seen[d] = 1;
      }
    }
    plan.routing.push_back(std::move(rr));
  }
  plan.max_recv = std::max<int64_t>(1, *std::max_element(plan.recv_rows.begin(), plan.recv_rows.end()));
  for (int64_t n : plan.recv_rows) plan.total_rows += n;
  return plan;
}

// The Buffer of variant `v` (bf16, or fp8 with its scale format).
Result<std::unique_ptr<Buffer>> create_buffer(Transport& t, const ExchangeBenchConfig& c, int v, int64_t max_recv) {
  BufferConfig b;
  b.num_experts = c.num_experts;
  b.hidden = c.hidden;
  b.dtype = v == kBf16 ? DType::kBF16 : DType::kFP8E4M3;
  b.fp8_scales = v == kFp8Ue8m0 ? Fp8ScaleFormat::kUE8M0 : Fp8ScaleFormat::kF32;
  b.max_topk = c.topk;
  b.max_tokens_per_rank = c.num_tokens;
  b.max_recv_tokens = max_recv;
  b.max_combine_dtype = DType::kBF16;
  b.timeout = c.timeout;
  return Buffer::create(t, b);
}

// One rank: its x, its three Buffers and quantise target, and the latest
// result of each dispatch.
class RankRounds {
 public:
  RankRounds(Transport& t, const ExchangeBenchConfig& c, const RoutingPlan& plan, Shared& shared)
      : t_(t),
        c_(c),
        shared_(shared),
        rank_(t.rank()),
        deadline_(Deadline::after(c.timeout)),
        x_(static_cast<std::size_t>(c.num_tokens) * c.hidden * 2, 4096),
        q_(static_cast<std::size_t>(c.num_tokens) * c.hidden),
        scales_(static_cast<std::size_t>(c.num_tokens) * (c.hidden / kFp8BlockSize) * 4) {
    const int T = c.num_tokens, H = c.hidden;
    for (int64_t i = 0; i < T; ++i)
      for (int64_t col = 0; col < H; ++col)
        reinterpret_cast<uint16_t*>(x_.data())[i * H + col] = f32_to_bf16(x_value(rank_, i, col));
    x_view_ = TensorView::contiguous(x_.data(), DType::kBF16, {T, H});
    in_.x = x_view_;
    in_.topk_idx = plan.routing[rank_].idx();
    in_.topk_weights = plan.routing[rank_].weights();
    q_view_ = TensorView::contiguous(q_.data(), DType::kFP8E4M3, {T, H});
    s_view_ = TensorView::contiguous(scales_.data(), DType::kF32, {T, H / kFp8BlockSize});
  }

  Status create_buffers(int64_t max_recv) {
    for (int v = 0; v < 3; ++v) {
      EPX_ASSIGN_OR_RETURN(buffers_[v], create_buffer(t_, c_, v, max_recv));
    }
    if (rank_ == 0) shared_.hierarchical = buffers_[0]->hierarchical();
    return Status::ok();
  }

  // Every variant once, each from a common barrier; the first round also
  // records the bytes.
  Status time_round(int round) {
    const int R = c_.num_ranks;
    for (int v = 0; v < kNumVariants; ++v) {
      EPX_RETURN_IF_ERROR(t_.barrier(deadline_));
      const uint64_t inter_before = t_.counters().inter_node_bytes;
      const std::size_t slot = (static_cast<std::size_t>(round) * kNumVariants + v) * R + rank_;
      shared_.begin[slot] = now_ns();
      const Status s = v == kQuantise ? quantize_fp8(x_view_, Fp8ScaleFormat::kF32, q_view_, s_view_)
                                      : buffers_[v]->dispatch(in_, &results_[v]);
      shared_.end[slot] = now_ns();
      EPX_RETURN_IF_ERROR(s);
      if (round == 0 && v != kQuantise) {
        shared_.payload_bytes[v * R + rank_] =
            results_[v].stats.intra_node_payload_bytes + results_[v].stats.inter_node_payload_bytes;
        shared_.inter_node_bytes[v * R + rank_] = static_cast<int64_t>(t_.counters().inter_node_bytes - inter_before);
      }
    }
    return Status::ok();
  }

  // The fp8 rows, dequantised, against the bf16 rows: within the stated bound.
  Status check_fp8_rows() {
    const int64_t H = c_.hidden;
    const TensorView& ref = results_[kBf16].recv_x;
    std::vector<float> back(static_cast<std::size_t>(ref.size(0)) * H);
    for (int v : {kFp8F32, kFp8Ue8m0}) {
      const DispatchResult& d = results_[v];
      if (d.recv_x.size(0) != ref.size(0))
        return internal_error("fp8 dispatch received {} rows, bf16 {}", d.recv_x.size(0), ref.size(0));
      EPX_RETURN_IF_ERROR(dequantize_fp8(d.recv_x, d.recv_scales,
                                         TensorView::contiguous(back.data(), DType::kF32, {ref.size(0), H})));
      for (int64_t i = 0; i < ref.size(0); ++i)
        for (int64_t col = 0; col < H; ++col) {
          const float want = load_as_f32(ref.row(i), DType::kBF16, static_cast<std::size_t>(col));
          const float scale = v == kFp8F32 ? d.recv_scales.row<float>(i)[col / kFp8BlockSize]
                                           : ue8m0_to_f32(d.recv_scales.row<uint8_t>(i)[col / kFp8BlockSize]);
          const double bound = 0x1p-4 * std::fabs(want) + 0x1p-10 * scale + 0x1p-20 * std::fabs(want);
          const double ratio = std::fabs(back[i * H + col] - want) / bound;
          shared_.worst[rank_] = std::max(shared_.worst[rank_], ratio);
          if (ratio > 1)
            return internal_error("{}: row {} col {} came back {} from {} (bound {})", kVariantName[v], i, col,
                                  back[i * H + col], want, bound);
        }
    }
    return Status::ok();
  }

 private:
  Transport& t_;
  const ExchangeBenchConfig& c_;
  Shared& shared_;
  const int rank_;
  const Deadline deadline_;
  AlignedBuffer x_, q_, scales_;
  TensorView x_view_, q_view_, s_view_;
  DispatchInputs in_;
  std::unique_ptr<Buffer> buffers_[3];
  DispatchResult results_[3];
};

// One rank's part: `warmup` rounds (the first checked), then `reps`.
Status run_rank(Transport& t, const ExchangeBenchConfig& c, const RoutingPlan& plan, Shared& shared,
                const ProgressFn& progress) {
  RankRounds rank(t, c, plan, shared);
  EPX_RETURN_IF_ERROR(rank.create_buffers(plan.max_recv));
  for (int round = 0; round < c.warmup + c.reps; ++round) {
    EPX_RETURN_IF_ERROR(rank.time_round(round));
    if (round == 0 && c.verify) EPX_RETURN_IF_ERROR(rank.check_fp8_rows());
    if (t.rank() == 0 && progress && round + 1 == c.warmup)
      progress(c.verify ? "warm-up done, fp8 rows checked" : "warm-up done");
  }
  return Status::ok();
}

// Bytes of one dispatch row of variant `v` (0 for quantise only).
int64_t variant_row_bytes(int v, int H) {
  const std::size_t scale_row = static_cast<std::size_t>(H / kFp8BlockSize);
  if (v == kBf16) return 2 * H;
  if (v == kFp8F32) return static_cast<int64_t>((H + 4 * scale_row + 7) / 8 * 8);
  if (v == kFp8Ue8m0) return static_cast<int64_t>((H + scale_row + 7) / 8 * 8);
  return 0;
}

// Variant `v`'s bytes summed over ranks and its time per timed round (last
// rank's end - first rank's start).
Fp8Variant summarize_variant(const ExchangeBenchConfig& c, const Shared& shared, int v) {
  const int R = c.num_ranks;
  Fp8Variant fv;
  fv.name = kVariantName[v];
  fv.row_bytes = variant_row_bytes(v, c.hidden);
  for (int r = 0; r < R; ++r) {
    fv.payload_bytes += shared.payload_bytes[v * R + r];
    fv.inter_node_bytes += shared.inter_node_bytes[v * R + r];
  }
  for (int round = c.warmup; round < c.warmup + c.reps; ++round) {
    const std::size_t base = (static_cast<std::size_t>(round) * kNumVariants + v) * R;
    const int64_t first = *std::min_element(shared.begin.begin() + base, shared.begin.begin() + base + R);
    const int64_t last = *std::max_element(shared.end.begin() + base, shared.end.begin() + base + R);
    fv.samples_ms.push_back(static_cast<double>(last - first) * 1e-6);
  }
  fv.time_ms = median(fv.samples_ms);
  fv.min_ms = *std::min_element(fv.samples_ms.begin(), fv.samples_ms.end());
  return fv;
}

}  // namespace

Result<Fp8BenchResult> run_fp8_dispatch_bench(const ExchangeBenchConfig& config, const ProgressFn& progress) {
  ExchangeBenchConfig c = config;
  c.dtype = DType::kBF16;
  EPX_RETURN_IF_ERROR(validate_exchange_bench_config(c));
  if (c.hidden % kFp8BlockSize != 0)
    return invalid_argument("hidden = {} is not a multiple of {} (channels per fp8 scale)", c.hidden, kFp8BlockSize);
  if (c.verify && c.warmup < 1) return invalid_argument("verify needs at least one warm-up round");
  EPX_ASSIGN_OR_RETURN(Topology topo, Topology::create(c.num_ranks, c.num_nodes));
  EPX_ASSIGN_OR_RETURN(ExpertPlacement placement, ExpertPlacement::contiguous(c.num_experts, c.num_ranks));
  EPX_ASSIGN_OR_RETURN(RoutingPlan plan, plan_routing(c, placement));
  if (progress)
    progress(fmt::format("{} rows received in all, at most {} on one rank", plan.total_rows, plan.max_recv));

  Shared shared(c.num_ranks, c.warmup + c.reps);
  const CpuSnapshot cpu_before = cpu_snapshot();
  InprocWorld world(topo);
  EPX_RETURN_IF_ERROR(
      first_error(world.run([&](Transport& t) { return run_rank(t, c, plan, shared, progress); })));

  Fp8BenchResult out;
  out.config = c;
  out.config.tracer = nullptr;
  out.hierarchical = shared.hierarchical;
  out.other_cpu_share = other_cpu_share(cpu_before, cpu_snapshot());
  out.recv_rows = plan.total_rows;
  out.worst_error_vs_bound = *std::max_element(shared.worst.begin(), shared.worst.end());
  for (int v = 0; v < kNumVariants; ++v) out.variants.push_back(summarize_variant(c, shared, v));
  const Fp8Variant& bf16 = out.variants[kBf16];
  for (Fp8Variant& fv : out.variants) {
    fv.time_vs_bf16 = bf16.time_ms > 0 ? fv.time_ms / bf16.time_ms : 0;
    fv.bytes_vs_bf16 = bf16.payload_bytes > 0
                           ? static_cast<double>(fv.payload_bytes) / static_cast<double>(bf16.payload_bytes)
                           : 0;
  }
  return out;
}

}  // namespace epx::bench
