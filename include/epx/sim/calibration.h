// Calibration of the simulator's link model.
//
// `estimate_exchange` predicts one dispatch and one combine of a scenario
// (step 0, EP group 0 of stage 0, its first MoE layer) and DeepEP's "logical"
// bandwidth for them. `fit_deepep` fits two physical parameters
// (nvlink.efficiency, comm.forward_sm_bandwidth) of a profile on DeepEP's published
// calibration points (H800, 4096 tokens per rank, hidden 7168, top-8 of 256,
// fp8 dispatch, bf16 combine: EP8 on NVLink, EP16 over RDMA), so that other
// shapes can then be predicted without fitting. `measure_copy_bandwidth`
// measures this machine's memory copy rate, the figure from which a profile of
// the in-process backend (its "links" are CPU copies) is written.
//
//   EPX_ASSIGN_OR_RETURN(epx::sim::LinkFit fit, epx::sim::fit_deepep(profile));
//   profile.nvlink_efficiency = fit.nvlink_efficiency;
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/core/status.h"
#include "epx/sim/scenario.h"

namespace epx::sim {

struct ExchangeEstimate {
  double dispatch_s = 0;        // max over GPUs
  double combine_s = 0;
  double rank_pairs = 0;        // mean over GPUs: (token, rank) pairs sent, own rank included
  double node_pairs = 0;        // mean over GPUs: (token, node) pairs, own node included
  double dispatch_rank_bw = 0;  // rank_pairs x dispatch row bytes / dispatch_s (DeepEP's NVLink figure)
  double combine_rank_bw = 0;
  double dispatch_node_bw = 0;  // node_pairs x row bytes / time (DeepEP's RDMA figure)
  double combine_node_bw = 0;
  double selections = 0;        // mean over GPUs: (token, expert) pairs sent
  double dispatch_selection_bw = 0;  // selections x (row + 16 B header) / time (DeepEP's low-latency figure)
  double combine_selection_bw = 0;   // selections x combine row bytes / time
  double bytes_dispatched = 0;  // all GPUs: (token, rank) pairs x dispatch row bytes
};

Result<ExchangeEstimate> estimate_exchange(const Scenario& scenario);

// DeepEP's benchmark shape on `nodes` x 8 GPUs of `hardware`, `tokens` per
// rank, through `kernel` (a parallelism.dispatch value): node-limited to 4
// nodes per token as its normal kernels' test routes, or (low_latency) the
// top-8 of all experts as its low-latency test does.
Scenario deepep_scenario(const HardwareProfile& hardware, int nodes, int tokens,
                         const std::string& kernel = "two_hop");

struct LinkFit {
  double nvlink_efficiency = 1;     // fitted on EP8
  double forward_sm_bandwidth = 0;  // fitted on EP16 (the NIC efficiency is the profile's)
  // The calibration points and what the fitted model gives for them (GB/s).
  struct Point {
    std::string name;
    double published_gbs = 0;
    double fitted_gbs = 0;
  };
  std::vector<Point> points;
};

Result<LinkFit> fit_deepep(const HardwareProfile& hardware);

struct CopyBandwidth {
  double one_thread = 0;  // bytes copied per second by one thread
  double all_threads = 0; // by `threads` threads together
  int threads = 0;
};

// Best of 5 memcpy passes over `bytes` per thread (buffers faulted in first).
CopyBandwidth measure_copy_bandwidth(int64_t bytes, int threads);

// A hardware profile (TOML) for in-process ranks on this machine, from its
// measured copy rates: each rank's link is one thread's copy rate, the host's
// cores bound the sum, a byte between emulated nodes costs two copies.
std::string machine_profile_toml(const CopyBandwidth& bw, const std::string& when);

}  // namespace epx::sim
