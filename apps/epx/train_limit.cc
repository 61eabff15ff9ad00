#include "train_limit.h"

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

#include "stats.h"

namespace epx::app {
namespace {

// The tokens of the largest rank's share of a step's batch.
int64_t largest_share(const TrainConfig& c) { return (c.batch_tokens + c.num_ranks - 1) / c.num_ranks; }

// The ranks of one machine: every rank in-process, a node's under MPI (one
// rank per process).
int machine_ranks(const TrainConfig& c) {
  return c.transport ? std::max(1, c.num_ranks / std::max(1, c.num_nodes)) : c.num_ranks;
}

// The experts' GEMM at the rows an expert sees on average in a step, within
// [16, 1024].
RateProbe probe_of(const TrainConfig& c, const ModelConfig& m) {
  const int64_t per_group = c.batch_tokens / (c.num_ranks / c.ep_size());
  const int64_t rows = per_group * m.layer.router.topk / std::max(1, m.layer.router.num_experts);
  return RateProbe{.dtype = m.layer.compute_dtype.value_or(m.layer.dtype),
                   .hidden = m.layer.hidden,
                   .ffn_hidden = m.layer.ffn_hidden,
                   .rows = static_cast<int>(std::clamp<int64_t>(rows, 16, 1024)),
                   .num_threads = machine_ranks(c)};
}

}  // namespace

StepLimitWindow::StepLimitWindow(const RunPlan& plan, std::size_t window) : plan_(plan), window_(window) {}

void StepLimitWindow::add(const StepReport& r) {
  if (Status s = count(r); !s.is_ok() && error_.is_ok()) error_ = s;
}

Status StepLimitWindow::count(const StepReport& r) {
  if (r.step == 0 || r.layers.empty()) return Status::ok();
  const TrainConfig& c = plan_.config();
  EPX_ASSIGN_OR_RETURN(std::vector<StepWork> work,
                       step_work(plan_.model(), r.layers, c.num_ranks / c.ep_size(), largest_share(c)));
  seconds_.push_back(r.seconds);
  work_.push_back(std::move(work));
  if (seconds_.size() > window_) {
    seconds_.pop_front();
    work_.pop_front();
  }
  return Status::ok();
}

Result<StepLimit> StepLimitWindow::measure() const {
  EPX_RETURN_IF_ERROR(error_);
  if (seconds_.empty()) return failed_precondition("no step after the first to compare with its limit");
  std::vector<StepWork> mean(work_.front().size());
  for (const std::vector<StepWork>& step : work_)
    for (std::size_t r = 0; r < mean.size() && r < step.size(); ++r) {
      mean[r].gemm_flops += step[r].gemm_flops / static_cast<double>(work_.size());
      mean[r].exchange_bytes += step[r].exchange_bytes / static_cast<double>(work_.size());
    }
  const TrainConfig& c = plan_.config();
  EPX_ASSIGN_OR_RETURN(const MachineRates rates, measure_machine_rates(probe_of(c, plan_.model())));
  const int ranks = machine_ranks(c);
  const double share = static_cast<double>(ranks) / c.ep_size();  // EP-rank works summed per machine
  return step_limit(mean, share, ranks, rates, bench::median({seconds_.begin(), seconds_.end()}));
}

void print_step_limit(std::FILE* out, const StepLimitWindow& window) {
  Result<StepLimit> limit = window.measure();
  if (limit.is_ok())
    fmt::print(out, "{} (over the last {} steps)\n", limit->describe(), window.size());
  else
    fmt::print(out, "efficiency: not measured: {}\n", limit.status().message());
}

}  // namespace epx::app
