// How far a training step is from its limit on this machine.
//
// A step's limit is the time its GEMMs take at the GEMM rate measured here
// plus the time its exchange bytes take at the memcpy rate measured here, the
// larger of two bounds: the busiest rank alone (one thread's rates: a rank
// runs on one thread) and the machine (the work of every rank it runs at the
// rates of that many threads running at once, summed: where ranks outnumber
// cores they share them). `epx train` prints it under its summary
// (docs/operations.md, "How far a step is from its limit").
//
// What is counted per rank and step, every MoE layer, forward and backward
// (a GEMM of [m, k] x [k, n] is 2 m k n FLOPs):
//   routed experts  rows = the (token, slot) pairs the rank's experts ran
//                   (LoadStats::work_per_rank, padding rows not counted):
//                   forward gate, up, down (3 GEMMs), backward grad_a, grad_x
//                   through W1 and W3 (3), grad W1, W3, W2 (3): 18 rows H F;
//   shared experts  the same 18 T H F per shared expert, T = the rank's tokens;
//   router          scores T x H x E forward, grad_x and grad_W backward: 6 T H E.
// Not counted: the input projection, the output head and the elementwise work
// (norms, SwiGLU's activation, softmax, optimizer).
// Exchange bytes are the payload rows of the tokens the rank's experts hold
// (LoadStats::tokens_per_rank rows of H): dispatch (the dispatch dtype; fp8
// with one f32 scale per 128 channels), combine (combine_dtype partials; the
// receiver-weighted combine sends one row per (token, slot) in dtype), and
// their backward (dtype each way). Summed over ranks, that is every byte the
// exchanges move; metadata is not counted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/core/status.h"
#include "epx/routing/load_stats.h"
#include "epx/train/model.h"

namespace epx {

struct StepWork {
  double gemm_flops = 0;
  double exchange_bytes = 0;
};

// The work of each rank of an EP group in one step: `layers` are the step's
// global load statistics (StepReport::layers, summed over the num_groups EP
// groups, so each rank's share is their mean), `rank_tokens` the tokens of
// the largest rank's share of the batch. InvalidArgument when a layer's
// statistics are not over `model`'s EP ranks.
[[nodiscard]] Result<std::vector<StepWork>> step_work(const ModelConfig& model, const std::vector<LoadStats>& layers,
                                                      int num_groups, int64_t rank_tokens);

// The rates of the experts' GEMM (detail::gemm on one thread, the experts'
// compute dtype, a [rows, hidden] x [hidden, ffn_hidden] product) and of a
// memcpy of a block larger than the caches: on one thread alone, and summed
// over num_threads threads running at once (one per rank of the machine).
struct MachineRates {
  double gemm_alone = 0, memcpy_alone = 0;  // FLOP/s, bytes/s
  double gemm_all = 0, memcpy_all = 0;
};
struct RateProbe {
  DType dtype = DType::kF32;  // kF32 or kBF16
  int hidden = 0, ffn_hidden = 0;
  int rows = 256;
  int num_threads = 1;
  double seconds = 0.05;  // per phase (threads at once, one alone; GEMM, memcpy), after one warm-up call
};
[[nodiscard]] Result<MachineRates> measure_machine_rates(const RateProbe& probe);

// The step's limit: the larger of the busiest rank's bound and the machine's.
struct StepLimit {
  double step_seconds = 0;      // the measured step (a median)
  double gemm_seconds = 0;      // the bound's GEMMs at gemm_rate
  double exchange_seconds = 0;  // its exchange bytes at memcpy_rate
  double gemm_rate = 0;         // FLOP/s, measured
  double memcpy_rate = 0;       // bytes/s, measured
  int rank = 0;                 // the EP rank that bounds it; -1: the machine does
  int machine_ranks = 0;        // ranks on the machine (the machine bound's threads)
  [[nodiscard]] double limit_seconds() const { return gemm_seconds + exchange_seconds; }
  // limit / step: 1 = the step runs at its limit.
  [[nodiscard]] double fraction() const { return step_seconds > 0 ? limit_seconds() / step_seconds : 0; }
  // "efficiency: step 12.3 ms median; limit 4.1 ms, bound by ...: 33% of the limit".
  [[nodiscard]] std::string describe() const;
};
// `work` per EP rank (step_work); the machine runs `machine_ranks` ranks
// whose work is machine_share x the sum of `work` (in-process: every rank,
// share = the number of EP groups; one node of several: its ranks' part).
[[nodiscard]] StepLimit step_limit(const std::vector<StepWork>& work, double machine_share, int machine_ranks,
                                   const MachineRates& rates, double step_seconds);

}  // namespace epx
