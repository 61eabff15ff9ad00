#include "epx/sim/pipeline.h"

#include <algorithm>
#include <vector>

namespace epx::sim {
namespace {

struct Boundary {
  int inside = 0;             // pairs inside one node
  int across = 0;             // pairs across nodes
  int across_per_node = 0;    // the most of them sent from one node
};

// The pairs GPU g of stage `stage` -> GPU g of stage + 1 make.
Boundary boundary_of(const Scenario& s, int stage) {
  const int per_stage = s.num_gpus() / s.parallelism.pp_stages, per_node = s.cluster.gpus_per_node;
  std::vector<int> across(s.cluster.nodes, 0);
  Boundary b;
  for (int g = 0; g < per_stage; ++g) {
    const int from = stage * per_stage + g, to = from + per_stage;
    if (from / per_node == to / per_node) {
      ++b.inside;
    } else {
      ++b.across;
      b.across_per_node = std::max(b.across_per_node, ++across[from / per_node]);
    }
  }
  return b;
}

double transfer_seconds(const Boundary& b, double bytes, const HardwareProfile& h) {
  double link = 0;
  if (b.inside > 0) link = bytes / (h.nvlink_bandwidth * h.nvlink_efficiency);
  if (b.across > 0) {
    const double nic = h.nic_bandwidth * h.nic_efficiency;
    link = std::max(link, h.nic_shared_per_node ? b.across_per_node * bytes / nic : bytes / (nic * h.nics_per_gpu));
  }
  if (h.host_copy_bandwidth > 0)
    link = std::max(link, (b.inside + b.across * h.host_nic_copies) * bytes / h.host_copy_bandwidth);
  const double latency = b.across > 0 ? h.nic_latency : h.nvlink_latency;
  return link + latency + h.message_overhead;
}

}  // namespace

Result<PipelineTransfer> pipeline_transfer(const Scenario& s) {
  PipelineTransfer t;
  const int pp = s.parallelism.pp_stages;
  if (pp <= 1 || !s.parallelism.pp_transfers) return t;
  EPX_ASSIGN_OR_RETURN(int64_t row, row_bytes(s.model.activation_dtype, s.model.hidden));
  t.bytes = static_cast<double>(row) * static_cast<double>(s.parallelism.tokens_per_gpu);
  for (int stage = 0; stage + 1 < pp; ++stage) {
    const Boundary b = boundary_of(s, stage);
    const double seconds = transfer_seconds(b, t.bytes, s.hardware);
    if (seconds > t.seconds) {
      t.seconds = seconds;
      t.link = b.across > 0 ? "nic" : "nvlink";
    }
  }
  const int per_unit = s.schedule.overlap == "two_micro_batch" ? 2 : 1;
  t.per_unit_s = per_unit * (s.parallelism.mode == "train" ? 2 : 1) * t.seconds;
  return t;
}

}  // namespace epx::sim
