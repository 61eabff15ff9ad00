#include "epx/sim/cost.h"

#include <algorithm>
#include <cmath>

namespace epx::sim {

Kernel kernel_of(std::string_view dispatch, int nodes) {
  if (dispatch == "low_latency") return Kernel::kLowLatency;
  if (dispatch == "low_latency_epx") return Kernel::kLowLatencyEpx;
  return dispatch == "two_hop" && nodes > 1 ? Kernel::kTwoHop : Kernel::kFlat;
}

double compute_slowdown(const HardwareProfile& h, Kernel kernel) {
  if (kernel == Kernel::kLowLatency || kernel == Kernel::kLowLatencyEpx) return 1.0;
  return static_cast<double>(h.sms) / (h.sms - h.comm_sms);
}

int forwarding_sms(const HardwareProfile& h) { return std::max(1, h.comm_sms / 2); }

double forward_bandwidth(const HardwareProfile& h) { return h.forward_sm_bandwidth * forwarding_sms(h); }

std::vector<double> experts_per_row(const GroupTraffic& tr) {
  const int R = tr.num_ranks;
  std::vector<double> ratio(R, 1.0);
  if (tr.slot_rows.empty() || tr.slot_rows.size() % R != 0) return ratio;
  const std::size_t per_gpu = tr.slot_rows.size() / R;
  for (int d = 0; d < R; ++d) {
    double expert_rows = 0, rank_rows = 0;
    for (std::size_t e = 0; e < per_gpu; ++e) expert_rows += tr.slot_rows[d * per_gpu + e];
    for (int s = 0; s < R; ++s) rank_rows += tr.pair(s, d);
    if (rank_rows > 0) ratio[d] = std::max(1.0, expert_rows / rank_rows);
  }
  return ratio;
}

namespace {

double own_time(const LinkLoad& l, const HardwareProfile& h) {
  const double nvl = h.nvlink_bandwidth * h.nvlink_efficiency;
  const double nic = h.nic_bandwidth * h.nic_efficiency * h.nics_per_gpu;
  double t = std::max(l.nvl_out, l.nvl_in) / nvl;
  if (l.nic_out > 0 || l.nic_in > 0) t = std::max(t, std::max(l.nic_out, l.nic_in) / nic);
  if (l.fwd > 0 && h.forward_sm_bandwidth > 0) t = std::max(t, l.fwd / forward_bandwidth(h));
  t = std::max(t, std::max(l.nic_messages, l.nic_messages_in) * h.message_overhead);
  return std::max(t, l.self / (h.hbm_bandwidth / 2));
}

void add_nvlink(std::vector<LinkLoad>& loads, int from, int to, double bytes) {
  loads[from].nvl_out += bytes;
  loads[to].nvl_in += bytes;
  ++loads[from].messages;
  ++loads[to].messages_in;
}

void add_nic(std::vector<LinkLoad>& loads, int from, int to, double bytes) {
  loads[from].nic_out += bytes;
  loads[to].nic_in += bytes;
  ++loads[from].messages;
  ++loads[to].messages_in;
}

// Flat (DeepEP intranode, epx's backends): each (token, rank) row straight
// over the link between the two GPUs.
void flat_loads(const GroupTraffic& tr, const Topology& topo, const AllToAllOptions& o, double remote,
                std::vector<LinkLoad>& loads) {
  const int R = topo.num_ranks();
  for (int s = 0; s < R; ++s)
    for (int d = 0; d < R; ++d) {
      const double rows = tr.pair(s, d);
      if (rows <= 0) continue;
      if (d == s) loads[s].self += rows * o.row_bytes;
      else if (topo.node_of(d) == topo.node_of(s)) add_nvlink(loads, s, d, rows * o.row_bytes);
      else add_nic(loads, s, d, rows * remote);
    }
}

// Two-hop (DeepEP internode.cu dispatch): the RDMA stage puts one row per
// (token, other node) to the GPU of the same local rank there; own-node rows
// are written straight into the local receive buffer (no NIC). The forwarder
// of each node (local rank of the source) copies every arriving (token, rank)
// row to its destination: its forwarding SMs (fwd) and its NVLink.
void two_hop_loads(const GroupTraffic& tr, const Topology& topo, const AllToAllOptions& o, double remote,
                   std::vector<LinkLoad>& loads) {
  const int R = topo.num_ranks();
  for (int s = 0; s < R; ++s) {
    const int node = topo.node_of(s);
    for (int d = 0; d < R; ++d) {
      const double rows = tr.pair(s, d);
      if (rows <= 0) continue;
      const int f = topo.rank_of(topo.node_of(d), topo.local_rank_of(s));
      loads[f].fwd += rows * o.row_bytes;
      if (f == d) loads[d].self += rows * o.row_bytes;
      else add_nvlink(loads, f, d, rows * o.row_bytes);
    }
    for (int n = 0; n < topo.num_nodes(); ++n) {
      const double rows = tr.node_pair(s, n);
      if (rows > 0 && n != node) add_nic(loads, s, topo.rank_of(n, topo.local_rank_of(s)), rows * remote);
    }
  }
}

// Low latency (DeepEP internode_ll.cu): one message per (token, expert),
// directly: to itself a copy, to its node over NVLink, to others the NIC.
void low_latency_loads(const GroupTraffic& tr, const Topology& topo, const AllToAllOptions& o,
                       std::vector<LinkLoad>& loads) {
  const int R = topo.num_ranks();
  const double bytes = o.row_bytes + (o.combine ? 0.0 : kLowLatencyHeaderBytes);
  const std::vector<double> ratio = experts_per_row(tr);
  for (int s = 0; s < R; ++s)
    for (int d = 0; d < R; ++d) {
      const double messages = tr.pair(s, d) * ratio[d];
      if (messages <= 0) continue;
      loads[d].receive += messages * bytes;
      loads[s].receive_transposed += messages * bytes;
      if (d == s) {
        loads[s].self += messages * bytes;
      } else if (topo.node_of(d) == topo.node_of(s)) {
        loads[s].nvl_out += messages * bytes;
        loads[d].nvl_in += messages * bytes;
      } else {
        loads[s].nic_out += messages * bytes;
        loads[d].nic_in += messages * bytes;
        loads[s].nic_messages += messages;
        loads[d].nic_messages_in += messages;
      }
    }
}

// epx's CPU low latency (src/exchange/cpu/low_latency.cc), in dispatch's
// orientation s -> d (combine is transposed after): `rows` (token, rank) rows
// carry rows x ratio[d] (token, expert) pairs. Links as flat.
void low_latency_epx_loads(const GroupTraffic& tr, const Topology& topo, const AllToAllOptions& o, double remote,
                           std::vector<LinkLoad>& loads) {
  const int R = topo.num_ranks();
  const std::vector<double> ratio = experts_per_row(tr);
  const double pair_meta = kEpxPairMetaBytes + (o.combine_per_rank ? kEpxPairWeightBytes : 0.0);
  for (int s = 0; s < R; ++s)
    for (int d = 0; d < R; ++d) {
      const double rows = tr.pair(s, d), pairs = rows * ratio[d];
      if (rows <= 0) continue;
      // Rows on the link and bytes per row (near, across nodes).
      double sent_rows = rows, per_row = o.row_bytes, per_row_remote = remote;
      if (!o.combine) {  // a row per (token, rank) with its pairs; the owner copies each pair's row
        per_row = per_row_remote = o.row_bytes + kEpxRowMetaBytes + ratio[d] * pair_meta;
        loads[d].receive += pairs * o.row_bytes;
      } else if (!o.combine_per_rank) {  // a row per (token, expert), reduced by the source
        sent_rows = pairs;
        loads[s].receive_transposed += pairs * o.row_bytes;
      } else if (d == s) {  // per rank: the source reads its own experts' rows
        loads[s].receive_transposed += pairs * o.row_bytes;
      } else {  // per rank: the owner sums each token's rows, the source adds one per (token, rank)
        loads[d].receive_transposed += pairs * o.row_bytes;
        loads[s].receive_transposed += rows * o.row_bytes;
      }
      if (d == s) continue;  // the owner reads x, the source reads y in place
      if (topo.node_of(d) == topo.node_of(s)) add_nvlink(loads, s, d, sent_rows * per_row);
      else add_nic(loads, s, d, sent_rows * per_row_remote);
    }
}

std::vector<LinkLoad> dispatch_loads(const GroupTraffic& tr, const Topology& topo, const AllToAllOptions& o) {
  const double remote = o.remote_row_bytes > 0 ? o.remote_row_bytes : o.row_bytes;
  std::vector<LinkLoad> loads(topo.num_ranks());
  if (o.kernel == Kernel::kLowLatency) low_latency_loads(tr, topo, o, loads);
  else if (o.kernel == Kernel::kLowLatencyEpx) low_latency_epx_loads(tr, topo, o, remote, loads);
  else if (o.kernel == Kernel::kTwoHop && topo.num_nodes() > 1) two_hop_loads(tr, topo, o, remote, loads);
  else flat_loads(tr, topo, o, remote, loads);
  return loads;
}

void transpose(std::vector<LinkLoad>& loads) {
  for (LinkLoad& l : loads) {
    std::swap(l.nvl_out, l.nvl_in);
    std::swap(l.nic_out, l.nic_in);
    std::swap(l.nic_messages, l.nic_messages_in);
    std::swap(l.messages, l.messages_in);
    std::swap(l.receive, l.receive_transposed);
  }
}

double latency_of(const LinkLoad& l, const HardwareProfile& h, Kernel kernel) {
  double latency = kernel == Kernel::kLowLatency ? 0.0 : l.messages * h.message_overhead;
  if (l.nvl_out > 0 || l.nvl_in > 0) latency += h.nvlink_latency;
  if (l.nic_out > 0 || l.nic_in > 0) latency += h.nic_latency;
  return latency;
}

}  // namespace

AllToAllCost all_to_all(const GroupTraffic& traffic, const Topology& topology, const HardwareProfile& hardware,
                        const AllToAllOptions& options) {
  const int R = topology.num_ranks();
  const bool two_hop = options.kernel == Kernel::kTwoHop && topology.num_nodes() > 1;
  const bool low_latency = options.kernel == Kernel::kLowLatency || options.kernel == Kernel::kLowLatencyEpx;
  AllToAllCost cost;
  cost.loads = dispatch_loads(traffic, topology, options);
  if (options.combine) transpose(cost.loads);
  std::vector<double> own(R);
  double host_bytes = 0;
  for (int g = 0; g < R; ++g) {
    own[g] = own_time(cost.loads[g], hardware);
    const LinkLoad& l = cost.loads[g];
    host_bytes += l.nvl_out + l.self + l.nic_out * hardware.host_nic_copies;
  }
  const double host_time = hardware.host_copy_bandwidth > 0 ? host_bytes / hardware.host_copy_bandwidth : 0.0;
  cost.bandwidth_s.assign(R, 0.0);
  cost.latency_s.assign(R, 0.0);
  const int per_node = topology.ranks_per_node();
  for (int g = 0; g < R; ++g) {
    double t = std::max(own[g], host_time);
    for (int p = 0; p < R; ++p)
      if (traffic.pair(p, g) > 0 || traffic.pair(g, p) > 0) t = std::max(t, own[p]);
    if (two_hop) {
      const int first = topology.node_of(g) * per_node;
      for (int p = first; p < first + per_node; ++p) t = std::max(t, own[p]);
    }
    const LinkLoad& l = cost.loads[g];
    // The low-latency receive phase copies (dispatch) or reduces (combine)
    // what arrived after the last message is in.
    if (low_latency) t += l.receive / (hardware.hbm_bandwidth / 2);
    cost.bandwidth_s[g] = t;
    cost.latency_s[g] = latency_of(l, hardware, options.kernel);
  }
  return cost;
}

double gemm_efficiency(double rows, const HardwareProfile& h) {
  if (rows <= 0) return 0.0;
  return h.gemm_efficiency * rows / (rows + h.gemm_half_rows);
}

double grouped_gemm_time(std::span<const double> rows_per_expert, double flops_per_row, double peak,
                         const HardwareProfile& h, double fraction) {
  double seconds = 0;
  for (double rows : rows_per_expert) {
    const double n = rows * fraction;
    if (n <= 0) continue;
    const double padded = std::ceil(n / h.gemm_tile - 1e-9) * h.gemm_tile;
    seconds += padded * flops_per_row / (peak * gemm_efficiency(n, h));
  }
  return seconds;
}

}  // namespace epx::sim
