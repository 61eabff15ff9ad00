#include "epx/sim/cost.h"

#include <algorithm>
#include <cmath>

namespace epx::sim {
namespace {

double own_time(const LinkLoad& l, const HardwareProfile& h) {
  const double nvl = h.nvlink_bandwidth * h.nvlink_efficiency;
  const double nic = h.nic_bandwidth * h.nic_efficiency * h.nics_per_gpu;
  double t = std::max(l.nvl_out, l.nvl_in) / nvl;
  if (l.nic_out > 0 || l.nic_in > 0) t = std::max(t, std::max(l.nic_out, l.nic_in) / nic);
  return std::max(t, l.self / (h.hbm_bandwidth / 2));
}

// Bytes on each GPU's links for the dispatch direction.
std::vector<LinkLoad> dispatch_loads(const GroupTraffic& tr, const Topology& topo, const AllToAllOptions& o,
                                     bool stage_local) {
  const int R = topo.num_ranks();
  const double remote = o.remote_row_bytes > 0 ? o.remote_row_bytes : o.row_bytes;
  std::vector<LinkLoad> loads(R);
  for (int s = 0; s < R; ++s) {
    const int node = topo.node_of(s);
    for (int d = 0; d < R; ++d) {
      const double rows = tr.pair(s, d);
      if (rows <= 0) continue;
      if (d == s) {
        loads[s].self += rows * o.row_bytes;
      } else if (topo.node_of(d) == node) {
        loads[s].nvl_out += rows * o.row_bytes;
        loads[d].nvl_in += rows * o.row_bytes;
        ++loads[s].messages;
        ++loads[d].messages_in;
      } else if (!o.two_hop) {
        loads[s].nic_out += rows * remote;
        loads[d].nic_in += rows * remote;
        ++loads[s].messages;
        ++loads[d].messages_in;
      } else {
        // Forwarded by the GPU of s's local rank on d's node.
        const int f = topo.rank_of(topo.node_of(d), topo.local_rank_of(s));
        if (f == d) {
          loads[d].self += rows * o.row_bytes;
        } else {
          loads[f].nvl_out += rows * o.row_bytes;
          loads[d].nvl_in += rows * o.row_bytes;
          ++loads[f].messages;
          ++loads[d].messages_in;
        }
      }
    }
    if (o.two_hop) {
      for (int n = 0; n < topo.num_nodes(); ++n) {
        const double rows = tr.node_pair(s, n);
        if (rows <= 0) continue;
        if (n == node) {
          if (stage_local) {  // a loopback through the NIC stage
            loads[s].nic_out += rows * remote;
            loads[s].nic_in += rows * remote;
          }
          continue;
        }
        const int f = topo.rank_of(n, topo.local_rank_of(s));
        loads[s].nic_out += rows * remote;
        loads[f].nic_in += rows * remote;
        ++loads[s].messages;
        ++loads[f].messages_in;
      }
    }
  }
  return loads;
}

}  // namespace

AllToAllCost all_to_all(const GroupTraffic& traffic, const Topology& topology, const HardwareProfile& hardware,
                        const AllToAllOptions& options) {
  const int R = topology.num_ranks();
  AllToAllCost cost;
  cost.loads = dispatch_loads(traffic, topology, options, hardware.nic_stages_local_node);
  if (options.combine)
    for (LinkLoad& l : cost.loads) {
      std::swap(l.nvl_out, l.nvl_in);
      std::swap(l.nic_out, l.nic_in);
      std::swap(l.messages, l.messages_in);
    }
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
    if (options.two_hop) {
      const int first = topology.node_of(g) * per_node;
      for (int p = first; p < first + per_node; ++p) t = std::max(t, own[p]);
    }
    const LinkLoad& l = cost.loads[g];
    double latency = l.messages * hardware.message_overhead;
    if (l.nvl_out > 0 || l.nvl_in > 0) latency += hardware.nvlink_latency;
    if (l.nic_out > 0 || l.nic_in > 0) latency += hardware.nic_latency;
    cost.bandwidth_s[g] = t;
    cost.latency_s[g] = latency;
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
