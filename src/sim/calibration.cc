#include "epx/sim/calibration.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "epx/comm/topology.h"
#include "epx/exchange/placement.h"
#include "epx/sim/cost.h"
#include "epx/sim/traffic.h"
#include "core/guard.h"

namespace epx::sim {

namespace {

// A scenario's routed traffic, kept so that the link parameters can change
// without routing again.
struct Prepared {
  Topology topology;
  GroupTraffic traffic;
  int64_t dispatch_bytes = 0, combine_bytes = 0, remote_bytes = 0;
  Kernel kernel = Kernel::kFlat;
  bool combine_per_rank = false;
};

Result<Prepared> prepare(const Scenario& s) {
  EPX_RETURN_IF_ERROR(s.validate());
  const ModelConfig& m = s.model;
  const int R = s.parallelism.ep;
  const int nodes = std::max(1, R / s.cluster.gpus_per_node);
  EPX_ASSIGN_OR_RETURN(Topology topo, Topology::create(R, nodes));
  EPX_ASSIGN_OR_RETURN(ExpertPlacement placement, ExpertPlacement::contiguous(m.experts, R));
  const RouterConfig router = make_router_config(m);
  const std::vector<double> uniform(m.experts, 0.0);
  RouteRequest q;
  q.router = &router;
  q.placement = &placement;
  q.topology = &topo;
  q.log_popularity = uniform;
  q.tokens_per_gpu = s.parallelism.tokens_per_gpu;
  q.sample_tokens = s.routing.sample_tokens;
  q.seed = s.routing.seed;
  q.threads = s.run.threads > 0 ? s.run.threads : std::max(1u, std::thread::hardware_concurrency());
  Prepared p{topo, {}, 0, 0, 0, kernel_of(s.parallelism.dispatch, nodes), s.parallelism.combine_per_rank};
  EPX_RETURN_IF_ERROR(route_group(q, &p.traffic));
  EPX_ASSIGN_OR_RETURN(p.dispatch_bytes, row_bytes(m.dispatch_dtype, m.hidden));
  EPX_ASSIGN_OR_RETURN(p.combine_bytes, row_bytes(m.combine_dtype, m.hidden));
  EPX_ASSIGN_OR_RETURN(p.remote_bytes,
                       row_bytes(m.combine_remote_dtype.empty() ? m.combine_dtype : m.combine_remote_dtype, m.hidden));
  return p;
}

ExchangeEstimate estimate(const Prepared& p, const HardwareProfile& h) {
  const GroupTraffic& t = p.traffic;
  const int R = t.num_ranks;
  const double disp = static_cast<double>(p.dispatch_bytes), comb = static_cast<double>(p.combine_bytes);
  const AllToAllCost d = all_to_all(t, p.topology, h, {p.kernel, false, disp, 0, p.combine_per_rank});
  const AllToAllCost c =
      all_to_all(t, p.topology, h, {p.kernel, true, comb, static_cast<double>(p.remote_bytes), p.combine_per_rank});
  const std::vector<double> per_row = experts_per_row(t);
  ExchangeEstimate e;
  for (int g = 0; g < R; ++g) {
    double ranks = 0, node_pairs = 0, selections = 0;
    for (int r = 0; r < R; ++r) ranks += t.pair(g, r);
    for (int r = 0; r < R; ++r) selections += t.pair(g, r) * per_row[r];
    for (int n = 0; n < t.num_nodes; ++n) node_pairs += t.node_pair(g, n);
    e.dispatch_s = std::max(e.dispatch_s, d.time(g));
    e.combine_s = std::max(e.combine_s, c.time(g));
    e.dispatch_rank_bw += ranks * disp / d.time(g) / R;
    e.combine_rank_bw += ranks * comb / c.time(g) / R;
    e.dispatch_node_bw += node_pairs * disp / d.time(g) / R;
    e.combine_node_bw += node_pairs * comb / c.time(g) / R;
    e.dispatch_selection_bw += selections * (disp + kLowLatencyHeaderBytes) / d.time(g) / R;
    e.combine_selection_bw += selections * comb / c.time(g) / R;
    e.rank_pairs += ranks / R;
    e.node_pairs += node_pairs / R;
    e.selections += selections / R;
    e.bytes_dispatched += ranks * disp;
  }
  return e;
}

// The value of h.*param in [lo, hi] at which `measure` of the model's
// estimate equals `target`, by bisection on a log scale: the bandwidth grows
// with the parameter. An error if the target is out of reach there.
Result<double> bisect(const Prepared& p, HardwareProfile h, double HardwareProfile::*param, double lo, double hi,
                      double target, double (*measure)(const ExchangeEstimate&), const char* name) {
  h.*param = hi;
  if (measure(estimate(p, h)) < target * (1 - 1e-6))
    return invalid_argument("{} = {:.4g} (its upper limit) gives {:.2f} GB/s, below the {:.2f} GB/s to fit: another "
                            "stage binds there",
                            name, hi, measure(estimate(p, h)) / 1e9, target / 1e9);
  for (int i = 0; i < 60; ++i) {
    h.*param = std::sqrt(lo * hi);
    (measure(estimate(p, h)) < target ? lo : hi) = h.*param;
  }
  return std::sqrt(lo * hi);
}

double mean_rank_bw(const ExchangeEstimate& e) { return 0.5 * (e.dispatch_rank_bw + e.combine_rank_bw); }
double mean_node_bw(const ExchangeEstimate& e) { return 0.5 * (e.dispatch_node_bw + e.combine_node_bw); }

}  // namespace

Result<ExchangeEstimate> estimate_exchange(const Scenario& s) {
  return detail::guard("estimate_exchange", [&]() -> Result<ExchangeEstimate> {
    EPX_ASSIGN_OR_RETURN(Prepared p, prepare(s));
    return estimate(p, s.hardware);
  });
}

Scenario deepep_scenario(const HardwareProfile& hardware, int nodes, int tokens, const std::string& kernel) {
  Scenario s;
  s.hardware = hardware;
  s.cluster.nodes = nodes;
  s.cluster.gpus_per_node = 8;
  s.model.layers = 1;
  s.model.hidden = 7168;
  s.model.experts = 256;
  s.model.topk = 8;
  // The normal kernels' test routes node-limited (4 nodes per token); the
  // low-latency test takes the top-8 of all experts.
  const bool limited = kernel != "low_latency";
  s.model.groups = limited ? nodes : 1;  // a group is a node's experts
  s.model.topk_groups = limited ? std::min(4, nodes) : 1;
  s.model.dispatch_dtype = "fp8";
  s.model.combine_dtype = "bf16";
  s.parallelism.ep = nodes * 8;
  s.parallelism.tokens_per_gpu = tokens;
  s.parallelism.dispatch = kernel;
  s.parallelism.mode = "forward";
  s.routing.sample_tokens = tokens;  // every token routed: no sampling noise
  return s;
}

Result<LinkFit> fit_deepep(const HardwareProfile& hardware) {
  constexpr double kGB = 1e9;
  // EP8 (one node, the intranode kernel) sets the NVLink efficiency so that
  // the mean of dispatch's and combine's per-rank bandwidth is the mean of
  // the published ones; then EP16 (two nodes, two-hop) sets the forwarding
  // SMs' copy rate from DeepEP's per-node (RDMA) figure. The NIC efficiency,
  // latencies and overheads stay the profile's: nothing else is fitted.
  HardwareProfile h = hardware;
  EPX_ASSIGN_OR_RETURN(Prepared ep8, prepare(deepep_scenario(h, 1, 4096)));
  EPX_ASSIGN_OR_RETURN(Prepared ep16, prepare(deepep_scenario(h, 2, 4096)));
  EPX_ASSIGN_OR_RETURN(h.nvlink_efficiency, bisect(ep8, h, &HardwareProfile::nvlink_efficiency, 1e-3, 1.0,
                                                   0.5 * (153 + 158) * kGB, mean_rank_bw, "nvlink.efficiency"));
  EPX_ASSIGN_OR_RETURN(h.forward_sm_bandwidth, bisect(ep16, h, &HardwareProfile::forward_sm_bandwidth, 1e6, 1e13,
                                                      43 * kGB, mean_node_bw, "comm.forward_sm_bandwidth"));
  LinkFit fit;
  fit.nvlink_efficiency = h.nvlink_efficiency;
  fit.forward_sm_bandwidth = h.forward_sm_bandwidth;
  const ExchangeEstimate a = estimate(ep8, h), b = estimate(ep16, h);
  fit.points.push_back({"EP8 dispatch (NVLink)", 153, a.dispatch_rank_bw / kGB});
  fit.points.push_back({"EP8 combine (NVLink)", 158, a.combine_rank_bw / kGB});
  fit.points.push_back({"EP16 dispatch (RDMA)", 43, b.dispatch_node_bw / kGB});
  fit.points.push_back({"EP16 combine (RDMA)", 43, b.combine_node_bw / kGB});
  return fit;
}

CopyBandwidth measure_copy_bandwidth(int64_t bytes, int threads) {
  threads = std::max(1, threads);
  const std::size_t n = static_cast<std::size_t>(std::max<int64_t>(bytes, 1 << 20));
  std::vector<std::vector<char>> src(threads, std::vector<char>(n, 1)), dst(threads, std::vector<char>(n, 0));
  auto timed = [&](int count) {
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      {
        std::vector<std::jthread> pool;
        for (int i = 0; i < count; ++i)
          pool.emplace_back([&, i] { std::memcpy(dst[i].data(), src[i].data(), n); });
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return static_cast<double>(n) * count / best;
  };
  CopyBandwidth bw;
  bw.threads = threads;
  bw.one_thread = timed(1);
  bw.all_threads = timed(threads);
  return bw;
}

std::string machine_profile_toml(const CopyBandwidth& bw, const std::string& when) {
  return fmt::format(
      "# In-process ranks on this machine, written by `epx sim calibrate` ({when}).\n"
      "# Every \"link\" of the in-process backend is a CPU copy: one rank's link is one\n"
      "# thread's copy rate; all ranks share the host's cores, whose copy rate ({threads}\n"
      "# threads together) bounds the sum; a byte between emulated nodes is copied twice\n"
      "# (staged, then copied as the message) before it is forwarded.\n"
      "name = \"in-process, this machine\"\n\n"
      "[compute]\n"
      "bf16_flops = 1e11   # not measured: the exchange prediction does not use it\n"
      "fp8_flops = 1e11\n"
      "sms = {threads}\n\n"
      "[memory]\n"
      "hbm_bandwidth = {hbm:.4g}   # 2 x one thread's copy rate (read + write)\n\n"
      "[nvlink]\n"
      "bandwidth = {one:.4g}   # one thread's memcpy rate, measured\n"
      "efficiency = 1.0\n"
      "latency = 0.0\n\n"
      "[nic]\n"
      "per_gpu = 1\n"
      "bandwidth = {one:.4g}\n"
      "efficiency = 1.0\n"
      "latency = 0.0\n\n"
      "[comm]\n"
      "sms = 0\n"
      "message_overhead = 0.0\n\n"
      "[host]\n"
      "copy_bandwidth = {all:.4g}   # {threads} threads' memcpy rate together, measured\n"
      "nic_copies = 2\n",
      fmt::arg("when", when), fmt::arg("threads", bw.threads), fmt::arg("hbm", 2 * bw.one_thread),
      fmt::arg("one", bw.one_thread), fmt::arg("all", bw.all_threads));
}

}  // namespace epx::sim
