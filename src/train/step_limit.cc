#include "epx/train/step_limit.h"

#include <algorithm>
#include <cstring>
#include <barrier>
#include <thread>

#include <fmt/format.h>

#include "epx/core/buffer.h"
#include "epx/core/clock.h"
#include "experts/gemm.h"

namespace epx {
namespace {

// Bytes of one payload row of `hidden` channels in `dtype` (fp8: plus one f32
// scale per 128 channels).
double row_bytes(DType dtype, int hidden) {
  if (dtype == DType::kFP8E4M3) return hidden + 4.0 * ((hidden + 127) / 128);
  return static_cast<double>(hidden) * static_cast<double>(dtype_size(dtype));
}

// One layer's exchange bytes for a rank whose experts hold `tokens` tokens
// as `rows` (token, slot) pairs: dispatch, combine and their backward.
double layer_exchange_bytes(const MoELayerConfig& l, double tokens, double rows) {
  const double dispatch = tokens * row_bytes(l.dispatch_dtype.value_or(l.dtype), l.hidden);
  const double combine = l.combine_weights == CombineWeights::kReceiver
                             ? rows * row_bytes(l.dtype, l.hidden)
                             : tokens * row_bytes(l.combine_dtype, l.hidden);
  const double backward = 2 * tokens * row_bytes(l.dtype, l.hidden);
  return dispatch + combine + backward;
}

// One thread's share of measure_machine_rates: its operands and copy blocks.
struct ProbeMemory {
  AlignedBuffer a, b, c, src, dst;
};

constexpr std::size_t kCopyBytes = std::size_t{16} << 20;  // per thread: well past a core's caches

Result<ProbeMemory> probe_memory(const RateProbe& p) {
  const auto es = dtype_size(p.dtype);
  const auto rows = static_cast<std::size_t>(p.rows), H = static_cast<std::size_t>(p.hidden),
             F = static_cast<std::size_t>(p.ffn_hidden);
  ProbeMemory m;
  EPX_ASSIGN_OR_RETURN(m.a, AlignedBuffer::allocate(rows * H * es, "the GEMM probe's A"));
  EPX_ASSIGN_OR_RETURN(m.b, AlignedBuffer::allocate(H * F * es, "the GEMM probe's B"));
  EPX_ASSIGN_OR_RETURN(m.c, AlignedBuffer::allocate(rows * F * sizeof(float), "the GEMM probe's C", kCacheLine, true));
  EPX_ASSIGN_OR_RETURN(m.src, AlignedBuffer::allocate(kCopyBytes, "the memcpy probe's source"));
  EPX_ASSIGN_OR_RETURN(m.dst, AlignedBuffer::allocate(kCopyBytes, "the memcpy probe's target", kCacheLine, true));
  // 0x3c bytes: about 0.0115 as f32 and as bf16, a finite operand either way.
  std::memset(m.a.data(), 0x3c, m.a.size());
  std::memset(m.b.data(), 0x3c, m.b.size());
  std::memset(m.src.data(), 0x3c, m.src.size());
  return m;
}

// Repeats `once` (one warm-up call first) for about `seconds`; work per call
// over the time taken.
template <typename F>
Result<double> rate_of(double work_per_call, double seconds, F&& once) {
  EPX_RETURN_IF_ERROR(once());
  int64_t calls = 0;
  Stopwatch watch;
  do {
    EPX_RETURN_IF_ERROR(once());
    ++calls;
  } while (watch.seconds() < seconds);
  return work_per_call * static_cast<double>(calls) / watch.seconds();
}

struct ThreadRates {
  double gemm = 0, copy = 0;
};

// One thread's GEMMs, then its copies; with `together`, every thread starts
// each phase at once (they all arrive, even after a failure, so none waits
// for ever).
Result<ThreadRates> probe_thread(const RateProbe& p, ProbeMemory& m, std::barrier<>* together) {
  const detail::GemmArgs args{.dtype = p.dtype, .m = p.rows, .n = p.ffn_hidden, .k = p.hidden, .a = m.a.data(),
                              .lda = p.hidden, .b = m.b.data(), .ldb = p.ffn_hidden, .c = m.c.data(),
                              .ldc = p.ffn_hidden};
  const double flops = 2.0 * p.rows * p.hidden * p.ffn_hidden;
  if (together) together->arrive_and_wait();
  auto gemm = rate_of(flops, p.seconds, [&] { return detail::gemm(args, 1); });
  if (together) together->arrive_and_wait();
  EPX_RETURN_IF_ERROR(gemm.status());
  EPX_ASSIGN_OR_RETURN(const double copy, rate_of(static_cast<double>(kCopyBytes), p.seconds, [&] {
                         std::memcpy(m.dst.data(), m.src.data(), kCopyBytes);
                         return Status::ok();
                       }));
  return ThreadRates{*gemm, copy};
}

// Every thread at once: the sums of their rates.
Result<ThreadRates> probe_together(const RateProbe& p, std::vector<ProbeMemory>& memory) {
  std::vector<Result<ThreadRates>> rates(memory.size(), ThreadRates{});
  std::barrier together(static_cast<std::ptrdiff_t>(memory.size()));
  {
    std::vector<std::jthread> threads;
    for (std::size_t t = 0; t < memory.size(); ++t)
      threads.emplace_back([&, t] { rates[t] = probe_thread(p, memory[t], &together); });
  }
  ThreadRates sum;
  for (const Result<ThreadRates>& r : rates) {
    EPX_RETURN_IF_ERROR(r.status());
    sum.gemm += r->gemm, sum.copy += r->copy;
  }
  return sum;
}

}  // namespace

Result<std::vector<StepWork>> step_work(const ModelConfig& model, const std::vector<LoadStats>& layers,
                                        int num_groups, int64_t rank_tokens) {
  if (num_groups < 1) return invalid_argument("num_groups = {} is below 1", num_groups);
  if (layers.empty()) return std::vector<StepWork>{};
  const MoELayerConfig& l = model.layer;
  const auto num_ranks = layers.front().work_per_rank.size();
  const double H = l.hidden, F = l.ffn_hidden, E = l.router.num_experts, T = static_cast<double>(rank_tokens);
  // Per token, every layer: the router (6 H E) and the shared experts (18 H F each).
  const double dense_flops = T * (6 * H * E + 18.0 * l.num_shared_experts * H * F);
  std::vector<StepWork> work(num_ranks);
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const LoadStats& s = layers[i];
    if (s.work_per_rank.size() != num_ranks || s.tokens_per_rank.size() != num_ranks)
      return invalid_argument("layer {}'s load statistics cover {} ranks, layer 0's {}", i, s.work_per_rank.size(),
                              num_ranks);
    for (std::size_t r = 0; r < num_ranks; ++r) {
      const double rows = static_cast<double>(s.work_per_rank[r]) / num_groups;
      const double tokens = static_cast<double>(s.tokens_per_rank[r]) / num_groups;
      work[r].gemm_flops += 18 * rows * H * F + dense_flops;
      work[r].exchange_bytes += layer_exchange_bytes(l, tokens, rows);
    }
  }
  return work;
}

StepLimit step_limit(const std::vector<StepWork>& work, double machine_share, int machine_ranks,
                     const MachineRates& rates, double step_seconds) {
  StepLimit best{.step_seconds = step_seconds, .machine_ranks = machine_ranks};
  if (rates.gemm_alone <= 0 || rates.memcpy_alone <= 0 || rates.gemm_all <= 0 || rates.memcpy_all <= 0) return best;
  StepWork total;
  for (std::size_t r = 0; r < work.size(); ++r) {
    StepLimit l = best;
    l.gemm_rate = rates.gemm_alone, l.memcpy_rate = rates.memcpy_alone, l.rank = static_cast<int>(r);
    l.gemm_seconds = work[r].gemm_flops / l.gemm_rate;
    l.exchange_seconds = work[r].exchange_bytes / l.memcpy_rate;
    if (l.limit_seconds() > best.limit_seconds()) best = l;
    total.gemm_flops += work[r].gemm_flops * machine_share;
    total.exchange_bytes += work[r].exchange_bytes * machine_share;
  }
  StepLimit machine = best;
  machine.gemm_rate = rates.gemm_all, machine.memcpy_rate = rates.memcpy_all, machine.rank = -1;
  machine.gemm_seconds = total.gemm_flops / machine.gemm_rate;
  machine.exchange_seconds = total.exchange_bytes / machine.memcpy_rate;
  return machine.limit_seconds() > best.limit_seconds() ? machine : best;
}

std::string StepLimit::describe() const {
  const std::string bound = rank >= 0 ? fmt::format("rank {} alone", rank)
                                      : fmt::format("the machine ({} ranks at once)", machine_ranks);
  const std::string threads = rank >= 0 ? "one thread" : fmt::format("{} threads", machine_ranks);
  return fmt::format(
      "efficiency: step {:.3g} ms median; limit {:.3g} ms, bound by {}: GEMMs {:.3g} ms at {:.3g} GFLOP/s + "
      "exchange {:.3g} ms at {:.3g} GB/s memcpy ({} measured): {:.0f}% of the limit",
      step_seconds * 1e3, limit_seconds() * 1e3, bound, gemm_seconds * 1e3, gemm_rate * 1e-9,
      exchange_seconds * 1e3, memcpy_rate * 1e-9, threads, 100 * fraction());
}

Result<MachineRates> measure_machine_rates(const RateProbe& p) {
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16)
    return invalid_argument("the GEMM probe's dtype {} is not f32 or bf16", dtype_name(p.dtype));
  if (p.hidden < 1 || p.ffn_hidden < 1 || p.rows < 1 || p.num_threads < 1 || p.num_threads > 4096)
    return invalid_argument(
        "the rate probe needs hidden, ffn_hidden, rows >= 1 and 1..4096 threads; got {}, {}, {}, {}", p.hidden,
        p.ffn_hidden, p.rows, p.num_threads);
  std::vector<ProbeMemory> memory;
  for (int t = 0; t < p.num_threads; ++t) {
    EPX_ASSIGN_OR_RETURN(ProbeMemory m, probe_memory(p));
    memory.push_back(std::move(m));
  }
  EPX_ASSIGN_OR_RETURN(const ThreadRates all, probe_together(p, memory));
  EPX_ASSIGN_OR_RETURN(const ThreadRates alone, probe_thread(p, memory.front(), nullptr));
  return MachineRates{.gemm_alone = alone.gemm, .memcpy_alone = alone.copy, .gemm_all = all.gemm,
                      .memcpy_all = all.copy};
}

}  // namespace epx
