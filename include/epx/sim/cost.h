// Cost models of the cluster simulator: the all-to-all as bytes on each GPU's
// links and stages, one model per kernel family (docs/simulator.md "Kernel
// models" cites the DeepEP code each comes from), and the experts' grouped GEMM.
//
// Every (token, rank) pair of the traffic is a row of `row_bytes`.
// - kFlat (DeepEP's intranode kernel; epx's own backends): a row to a GPU of
//   the same node crosses NVLink, to another node the GPU's NICs, to itself
//   HBM (a copy: hbm_bandwidth / 2).
// - kTwoHop (DeepEP's normal internode kernel): a token crosses the network
//   once per *other* destination node, to the GPU of the same local rank
//   there; rows for the sender's own node never touch the NIC. On each node
//   the GPU of local rank l forwards every (token, rank) row that arrived from
//   local rank l of any node (its own rows included) to the GPUs that need it:
//   bytes `fwd` through its forwarding SMs, limited to forward_bandwidth(h),
//   and its NVLink. At one node it is kFlat (DeepEP runs the intranode kernel).
// - kLowLatency (DeepEP's low-latency kernels): one message per (token,
//   expert) of row_bytes (+ a 16 B header in dispatch), sent directly: to the
//   same node over NVLink, to other nodes through the NIC (no forwarding),
//   each NIC message occupying the NIC for max(its bytes / B_nic,
//   message_overhead); then the receive phase copies what arrived (HBM).
// - kLowLatencyEpx (epx's CPU LowLatencyBuffer, src/exchange/cpu/low_latency.cc):
//   dispatch sends one row per (token, destination rank) with its (local
//   expert, k) pairs (8 B per row, 8 B per pair, + a 4 B weight per pair with
//   combine_per_rank), none to itself (the owner reads x); the owner's
//   receive phase copies one row per (token, expert) into its experts' rows.
//   Combine sends one row per (token, expert) back (own experts read in
//   place) and the source reduces its (token, expert) rows; with
//   combine_per_rank, the owner first sums each token's rows (one read per
//   (token, expert)) and sends one row per (token, rank), which the source
//   adds. Links, messages and latency as kFlat: one message per (source,
//   destination) pair, inside a node a write into the peer's inbox.
// Each GPU g gets
//   own(g)  = max(nvl_out / B_nvl, nvl_in / B_nvl, nic_out / B_nic, nic_in / B_nic,
//                 fwd / B_fwd, nic messages x message_overhead, self / (hbm / 2))
//   time(g) = max(own(g), own(p) for every peer p that sends to or receives
//             from g, and in two-hop every GPU of g's node) + latency(g)
//   latency(g) = nvlink_latency (if g uses NVLink) + nic_latency (if g uses a NIC)
//                + message_overhead x the (source, destination) messages g
//                  sends (normal kernels and kLowLatencyEpx; DeepEP's
//                  low-latency: none, they are above)
//   and, for both low-latency kernels, + the receive phase: its bytes /
//   (hbm / 2), after the last row is in.
// with B_nvl = nvlink_bandwidth x nvlink_efficiency, B_nic = nic_bandwidth x
// nic_efficiency x nics_per_gpu, B_fwd = forward_sm_bandwidth x comm_sms / 2.
// An emulated cluster (host_copy_bandwidth > 0) also needs every copy of the
// whole group to fit through the host: time(g) >= bytes copied /
// host_copy_bandwidth. Combine is the same matrix transposed (two-hop: the
// node-level reduction first), with the combine row bytes.
//
// Grouped GEMM: expert e with n rows costs ceil(n / tile) x tile x
// flops_per_row / (peak x efficiency(n)), efficiency(n) = gemm_efficiency x n
// / (n + gemm_half_rows): few rows per expert waste the tile and the machine.
//
//   auto a2a = epx::sim::all_to_all(traffic, topology, hardware, {.kernel = Kernel::kTwoHop, .row_bytes = 7392});
//   double t = a2a.time(g, /*fraction=*/1.0);
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "epx/comm/topology.h"
#include "epx/sim/scenario.h"
#include "epx/sim/traffic.h"

namespace epx::sim {

enum class Kernel { kFlat, kTwoHop, kLowLatency, kLowLatencyEpx };

// The kernel `parallelism.dispatch` names (flat, two_hop, low_latency,
// low_latency_epx) on a group spanning `nodes` nodes: two_hop on one node is flat.
Kernel kernel_of(std::string_view dispatch, int nodes);

// How much slower compute runs while an all-to-all of `kernel` is in flight:
// the normal kernels hold comm_sms SMs (sms / (sms - comm_sms)); the
// low-latency kernels in hook mode hold none while the data moves (1).
double compute_slowdown(const HardwareProfile& hardware, Kernel kernel);

// The two-hop forwarding SMs: comm_sms / 2 (DeepEP's even SMs), at least 1.
int forwarding_sms(const HardwareProfile& hardware);
// Bytes per second the two-hop forwarding stage of one GPU moves:
// forward_sm_bandwidth x forwarding_sms; 0 = no such limit.
double forward_bandwidth(const HardwareProfile& hardware);

// Header of a low-latency dispatch message (internode_ll.cu: sizeof(int4)).
inline constexpr double kLowLatencyHeaderBytes = 16;
// Metadata of epx's low-latency dispatch (low_latency.cc, DispatchBlock): per
// (token, rank) row (token, pair count), per (local expert, k) pair, and the
// pair's weight with combine_per_rank.
inline constexpr double kEpxRowMetaBytes = 8;
inline constexpr double kEpxPairMetaBytes = 8;
inline constexpr double kEpxPairWeightBytes = 4;

// Experts per deduplicated (token, rank) row at each GPU (its slots' rows
// over the rows it receives; 1 where unknown): a low-latency dispatch sends
// pair(s, d) x this[d] (token, expert) messages from s to d.
std::vector<double> experts_per_row(const GroupTraffic& traffic);

struct LinkLoad {
  double nvl_out = 0, nvl_in = 0, nic_out = 0, nic_in = 0, self = 0;  // bytes
  double fwd = 0;           // bytes its two-hop forwarding SMs copy
  double nic_messages = 0;  // low-latency: messages out and in through its NIC
  double nic_messages_in = 0;
  int messages = 0;       // messages this GPU sends
  int messages_in = 0;    // messages it receives (it sends them in the transposed direction)
  // Low-latency kernels: bytes the receive phase copies or reduces at this
  // GPU after the last row is in, in this direction and in the transposed one.
  double receive = 0, receive_transposed = 0;
};

struct AllToAllOptions {
  Kernel kernel = Kernel::kFlat;
  bool combine = false;         // the transposed direction
  double row_bytes = 0;         // per (token, rank) row; low-latency: per (token, expert)
  double remote_row_bytes = 0;  // between nodes; 0 = row_bytes
  // kLowLatencyEpx: LowLatencyConfig::combine_per_rank (dispatch carries the
  // weights; combine sends one row per (token, rank)).
  bool combine_per_rank = false;
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
