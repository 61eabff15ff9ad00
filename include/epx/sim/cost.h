// Cost models of the cluster simulator: the all-to-all as a byte matrix on
// each GPU's links, and the experts' grouped GEMM.
//
// All-to-all (dispatch or combine of one layer, one EP group). Every (token,
// rank) pair of the traffic is a row of `row_bytes`. Flat: a row to a GPU on
// the same node crosses NVLink, to another node the GPU's NICs, to itself HBM
// (a copy: hbm_bandwidth / 2). Two-hop (DeepEP's internode path): a token
// crosses the network once per destination node, to the GPU of the same local
// rank there, which forwards it over NVLink (with nic_stages_local_node the
// rows for its own node pass its NIC stage too, as a loopback). Each GPU g gets
//   own(g)  = max(nvl_out / B_nvl, nvl_in / B_nvl, nic_out / B_nic, nic_in / B_nic, self / (hbm / 2))
//   time(g) = max(own(g), own(p) for every peer p that sends to or receives
//             from g, and in two-hop every GPU of g's node) + latency(g)
//   latency(g) = nvlink_latency (if g uses NVLink) + nic_latency (if g uses a NIC)
//                + message_overhead x the messages g sends
// with B_nvl = nvlink_bandwidth x nvlink_efficiency and B_nic = nic_bandwidth x
// nic_efficiency x nics_per_gpu, so the slowest link and the hottest receiver
// set the time. An emulated cluster (host_copy_bandwidth > 0) also needs every
// copy of the whole group to fit through the host: time(g) >= bytes copied /
// host_copy_bandwidth. Combine is the same matrix transposed (two-hop: the
// node-level reduction first), with the combine row bytes.
//
// Grouped GEMM: expert e with n rows costs ceil(n / tile) x tile x
// flops_per_row / (peak x efficiency(n)), efficiency(n) = gemm_efficiency x n
// / (n + gemm_half_rows): few rows per expert waste the tile and the machine.
//
//   auto a2a = epx::sim::all_to_all(traffic, topology, hardware, {.two_hop = true, .row_bytes = 7392});
//   double t = a2a.time(g, /*fraction=*/1.0);
#pragma once

#include <span>
#include <vector>

#include "epx/comm/topology.h"
#include "epx/sim/scenario.h"
#include "epx/sim/traffic.h"

namespace epx::sim {

struct LinkLoad {
  double nvl_out = 0, nvl_in = 0, nic_out = 0, nic_in = 0, self = 0;  // bytes
  int messages = 0;       // messages this GPU sends
  int messages_in = 0;    // messages it receives (it sends them in the transposed direction)
};

struct AllToAllOptions {
  bool two_hop = false;
  bool combine = false;         // the transposed direction
  double row_bytes = 0;         // per (token, rank) row
  double remote_row_bytes = 0;  // between nodes; 0 = row_bytes
};

struct AllToAllCost {
  std::vector<LinkLoad> loads;      // per GPU
  std::vector<double> bandwidth_s;  // per GPU: the bandwidth part of time(g)
  std::vector<double> latency_s;    // per GPU: the latency part
  // time(g) for a piece carrying `fraction` of the bytes (chunked pipelines
  // pay the latency once per piece).
  [[nodiscard]] double time(int gpu, double fraction = 1.0) const {
    return bandwidth_s[gpu] * fraction + latency_s[gpu];
  }
};

AllToAllCost all_to_all(const GroupTraffic& traffic, const Topology& topology, const HardwareProfile& hardware,
                        const AllToAllOptions& options);

// efficiency(n) above; 0 for n <= 0.
double gemm_efficiency(double rows, const HardwareProfile& hardware);
// Seconds for one GEMM pass over every expert's rows (a fraction of each).
double grouped_gemm_time(std::span<const double> rows_per_expert, double flops_per_row, double peak,
                         const HardwareProfile& hardware, double fraction = 1.0);

}  // namespace epx::sim
