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
  std::vector<int64_t> recv_rows;
  bool hierarchical = false;
};

}  // namespace

Result<Fp8BenchResult> run_fp8_dispatch_bench(const ExchangeBenchConfig& config, const ProgressFn& progress) {
  ExchangeBenchConfig c = config;
  c.dtype = DType::kBF16;
  EPX_RETURN_IF_ERROR(validate_exchange_bench_config(c));
  if (c.hidden % kFp8BlockSize != 0)
    return invalid_argument("hidden = {} is not a multiple of {} (channels per fp8 scale)", c.hidden, kFp8BlockSize);
  if (c.verify && c.warmup < 1) return invalid_argument("verify needs at least one warm-up round");
  const int R = c.num_ranks, T = c.num_tokens, H = c.hidden;
  EPX_ASSIGN_OR_RETURN(Topology topo, Topology::create(R, c.num_nodes));
  EPX_ASSIGN_OR_RETURN(ExpertPlacement placement, ExpertPlacement::contiguous(c.num_experts, R));

  // Routing of every rank, and the most rows one rank receives (sizes the Buffers).
  const RoutingSpec spec{.num_tokens = T, .num_experts = c.num_experts, .topk = c.topk, .skew = c.skew, .seed = c.seed};
  std::vector<RankRouting> routing;
  std::vector<int64_t> recv_rows(R, 0);
  for (int r = 0; r < R; ++r) {
    EPX_ASSIGN_OR_RETURN(RankRouting rr, make_routing(spec, r));
    std::vector<char> seen(R);
    for (int t = 0; t < T; ++t) {
      std::fill(seen.begin(), seen.end(), 0);
      for (int k = 0; k < c.topk; ++k) {
        const int d = placement.rank_of(rr.topk_idx[static_cast<std::size_t>(t) * c.topk + k]);
        if (!seen[d]) ++recv_rows[d];
        seen[d] = 1;
      }
    }
    routing.push_back(std::move(rr));
  }
  const int64_t max_recv = std::max<int64_t>(1, *std::max_element(recv_rows.begin(), recv_rows.end()));
  int64_t total_rows = 0;
  for (int64_t n : recv_rows) total_rows += n;
  if (progress) progress(fmt::format("{} rows received in all, at most {} on one rank", total_rows, max_recv));

  const int rounds = c.warmup + c.reps;
  Shared shared(R, rounds);
  shared.recv_rows = recv_rows;
  const CpuSnapshot cpu_before = cpu_snapshot();
  InprocWorld world(topo);
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int rank = t.rank();
    const Deadline deadline = Deadline::after(c.timeout);
    AlignedBuffer x(static_cast<std::size_t>(T) * H * 2, 4096);
    for (int64_t i = 0; i < T; ++i)
      for (int64_t col = 0; col < H; ++col)
        reinterpret_cast<uint16_t*>(x.data())[i * H + col] = f32_to_bf16(x_value(rank, i, col));
    const TensorView x_view = TensorView::contiguous(x.data(), DType::kBF16, {T, H});
    DispatchInputs in;
    in.x = x_view;
    in.topk_idx = routing[rank].idx();
    in.topk_weights = routing[rank].weights();
    std::unique_ptr<Buffer> buffers[3];
    for (int v = 0; v < 3; ++v) {
      BufferConfig b;
      b.num_experts = c.num_experts;
      b.hidden = H;
      b.dtype = v == kBf16 ? DType::kBF16 : DType::kFP8E4M3;
      b.fp8_scales = v == kFp8Ue8m0 ? Fp8ScaleFormat::kUE8M0 : Fp8ScaleFormat::kF32;
      b.max_topk = c.topk;
      b.max_tokens_per_rank = T;
      b.max_recv_tokens = max_recv;
      b.max_combine_dtype = DType::kBF16;
      b.timeout = c.timeout;
      EPX_ASSIGN_OR_RETURN(buffers[v], Buffer::create(t, b));
    }
    if (rank == 0) shared.hierarchical = buffers[0]->hierarchical();
    AlignedBuffer q(static_cast<std::size_t>(T) * H), scales(static_cast<std::size_t>(T) * (H / kFp8BlockSize) * 4);
    const TensorView q_view = TensorView::contiguous(q.data(), DType::kFP8E4M3, {T, H});
    const TensorView s_view = TensorView::contiguous(scales.data(), DType::kF32, {T, H / kFp8BlockSize});
    DispatchResult results[3];
    for (int round = 0; round < rounds; ++round) {
      for (int v = 0; v < kNumVariants; ++v) {
        EPX_RETURN_IF_ERROR(t.barrier(deadline));
        const uint64_t inter_before = t.counters().inter_node_bytes;
        const std::size_t slot = (static_cast<std::size_t>(round) * kNumVariants + v) * R + rank;
        shared.begin[slot] = now_ns();
        const Status s = v == kQuantise ? quantize_fp8(x_view, Fp8ScaleFormat::kF32, q_view, s_view)
                                        : buffers[v]->dispatch(in, &results[v]);
        shared.end[slot] = now_ns();
        EPX_RETURN_IF_ERROR(s);
        if (round == 0 && v != kQuantise) {
          shared.payload_bytes[v * R + rank] =
              results[v].stats.intra_node_payload_bytes + results[v].stats.inter_node_payload_bytes;
          shared.inter_node_bytes[v * R + rank] = static_cast<int64_t>(t.counters().inter_node_bytes - inter_before);
        }
      }
      if (round == 0 && c.verify) {
        // The fp8 rows, dequantised, against the bf16 rows: within the stated bound.
        const TensorView& ref = results[kBf16].recv_x;
        std::vector<float> back(static_cast<std::size_t>(ref.size(0)) * H);
        for (int v : {kFp8F32, kFp8Ue8m0}) {
          const DispatchResult& d = results[v];
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
              shared.worst[rank] = std::max(shared.worst[rank], ratio);
              if (ratio > 1)
                return internal_error("{}: row {} col {} came back {} from {} (bound {})", kVariantName[v], i, col,
                                      back[i * H + col], want, bound);
            }
        }
      }
      if (rank == 0 && progress && round + 1 == c.warmup) progress(c.verify ? "warm-up done, fp8 rows checked" : "warm-up done");
    }
    return Status::ok();
  });
  EPX_RETURN_IF_ERROR(first_error(statuses));

  Fp8BenchResult out;
  out.config = c;
  out.config.tracer = nullptr;
  out.hierarchical = shared.hierarchical;
  out.other_cpu_share = other_cpu_share(cpu_before, cpu_snapshot());
  for (int64_t n : recv_rows) out.recv_rows += n;
  out.worst_error_vs_bound = *std::max_element(shared.worst.begin(), shared.worst.end());
  const std::size_t scale_row = static_cast<std::size_t>(H / kFp8BlockSize);
  for (int v = 0; v < kNumVariants; ++v) {
    Fp8Variant fv;
    fv.name = kVariantName[v];
    if (v == kBf16) fv.row_bytes = 2 * H;
    if (v == kFp8F32) fv.row_bytes = static_cast<int64_t>((H + 4 * scale_row + 7) / 8 * 8);
    if (v == kFp8Ue8m0) fv.row_bytes = static_cast<int64_t>((H + scale_row + 7) / 8 * 8);
    for (int r = 0; r < R; ++r) {
      fv.payload_bytes += shared.payload_bytes[v * R + r];
      fv.inter_node_bytes += shared.inter_node_bytes[v * R + r];
    }
    for (int round = c.warmup; round < rounds; ++round) {
      const std::size_t base = (static_cast<std::size_t>(round) * kNumVariants + v) * R;
      const int64_t first = *std::min_element(shared.begin.begin() + base, shared.begin.begin() + base + R);
      const int64_t last = *std::max_element(shared.end.begin() + base, shared.end.begin() + base + R);
      fv.samples_ms.push_back(static_cast<double>(last - first) * 1e-6);
    }
    fv.time_ms = median(fv.samples_ms);
    fv.min_ms = *std::min_element(fv.samples_ms.begin(), fv.samples_ms.end());
    out.variants.push_back(std::move(fv));
  }
  for (Fp8Variant& fv : out.variants) {
    fv.time_vs_bf16 = out.variants[kBf16].time_ms > 0 ? fv.time_ms / out.variants[kBf16].time_ms : 0;
    fv.bytes_vs_bf16 = out.variants[kBf16].payload_bytes > 0
                           ? static_cast<double>(fv.payload_bytes) / static_cast<double>(out.variants[kBf16].payload_bytes)
                           : 0;
  }
  return out;
}

}  // namespace epx::bench
