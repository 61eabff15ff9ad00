#include "epx/sim/grad_sync.h"

#include <algorithm>
#include <numeric>
#include <set>

namespace epx::sim {
namespace {

// Q, K, V, O: 2 FLOPs per parameter per token.
double attention_params(const ModelConfig& m) { return attention_flops(m) / 2.0; }

// Routed-expert slots one rank holds per MoE layer.
double experts_per_rank(const Scenario& s) {
  const int ep = s.parallelism.ep;
  int slots = s.model.experts;
  if (s.balancing.strategy == "eplb") {
    slots += s.balancing.eplb_redundant * ep;
    if (slots % ep != 0) slots += ep - slots % ep;  // as the simulator places them
  }
  return static_cast<double>(slots) / ep;
}

double nvlink_rate(const HardwareProfile& h) { return h.nvlink_bandwidth * h.nvlink_efficiency; }

// Seconds for `senders` ranks of a node, `bytes` each, to cross to other nodes.
double nic_seconds(double bytes, int senders, const HardwareProfile& h) {
  if (h.nic_shared_per_node) return senders * bytes / (h.nic_bandwidth * h.nic_efficiency);
  return bytes / (h.nic_bandwidth * h.nic_efficiency * h.nics_per_gpu);
}

// Every rank of the stage copies what it sends (emulated hosts only); bytes
// across nodes are copied host_nic_copies times.
double host_seconds(double sent, double nic_sent, int world_ranks, const HardwareProfile& h) {
  if (h.host_copy_bandwidth <= 0) return 0.0;
  return world_ranks * (sent + (h.host_nic_copies - 1) * nic_sent) / h.host_copy_bandwidth;
}

AllReduceCost ring(double bytes, const GroupShape& g, const HardwareProfile& h) {
  AllReduceCost c{"ring", 0, 0, 0};
  const int n = g.num_ranks, m = g.num_nodes;
  c.bytes_sent = 2.0 * (n - 1) / n * bytes;
  double link = 0, latency = 0;
  if (g.ranks_per_node > 1) link = c.bytes_sent / nvlink_rate(h);
  if (m > 1) {
    // Node-major ring: one member per node sends across, for every group on the node.
    link = std::max(link, nic_seconds(c.bytes_sent, g.groups_per_node, h));
    c.nic_bytes_sent = c.bytes_sent * m / n;
    latency = 2.0 * (n - 1) * h.nic_latency;
  } else {
    latency = 2.0 * (n - 1) * h.nvlink_latency;
  }
  latency += 2.0 * (n - 1) * h.message_overhead;
  c.seconds = std::max(link, host_seconds(c.bytes_sent, c.nic_bytes_sent, g.world_ranks, h)) + latency;
  return c;
}

AllReduceCost hierarchical(double bytes, const GroupShape& g, const HardwareProfile& h) {
  const int k = g.ranks_per_node, m = g.num_nodes;
  AllReduceCost c{"hierarchical", 0, 0, 0};
  const double inside = (k - 1.0) / k * bytes;  // reduce-scatter, then all-gather
  const double across = 2.0 * (m - 1) / m * bytes / k;
  c.bytes_sent = 2 * inside + across;
  c.nic_bytes_sent = across;
  const double link = 2 * inside / nvlink_rate(h) + nic_seconds(across, k * g.groups_per_node, h);
  const double latency = 2.0 * (k - 1) * h.nvlink_latency + 2.0 * (m - 1) * h.nic_latency +
                         (2.0 * (k - 1) + 2.0 * (m - 1)) * h.message_overhead;
  c.seconds = std::max(link, host_seconds(c.bytes_sent, c.nic_bytes_sent, g.world_ranks, h)) + latency;
  return c;
}

// epx's own all-reduce (both transports): every rank gathers every rank's
// contribution (MPI_Iallgather, recursive doubling) and sums them in rank
// order, so every rank and layout gets the same bits. Each rank receives
// (n-1) x B; the (n-k) x B of the other nodes' members cross into its node
// once per member; it then reads all n contributions to sum them.
AllReduceCost allgather(double bytes, const GroupShape& g, const HardwareProfile& h) {
  const int n = g.num_ranks, k = g.ranks_per_node, m = g.num_nodes;
  AllReduceCost c{"allgather", 0, 0, 0};
  c.bytes_sent = (n - 1.0) * bytes;
  c.nic_bytes_sent = m > 1 ? (n - k) * bytes : 0.0;
  double link = k > 1 ? (k - 1.0) * bytes / nvlink_rate(h) : 0.0;
  if (m > 1) link = std::max(link, nic_seconds(c.nic_bytes_sent, k * g.groups_per_node, h));
  int steps = 0;
  while ((1 << steps) < n) ++steps;
  const double latency = steps * ((m > 1 ? h.nic_latency : h.nvlink_latency) + h.message_overhead);
  // The sum reads n contributions and writes one: a copy's worth of traffic per contribution.
  const double reduce = h.host_copy_bandwidth > 0 ? g.world_ranks * n * bytes / h.host_copy_bandwidth : 0.0;
  c.seconds = std::max(link, host_seconds(c.bytes_sent, c.nic_bytes_sent, g.world_ranks, h)) + reduce + latency;
  return c;
}

// epx's MPI all-reduce of data larger than its first round's slots: one
// chunk of B/n per rank; rank c receives chunk c of every rank
// (all-to-all), sums them in rank order, and every rank gathers the n
// reduced chunks (all-gather). Each rank sends 2 (n-1)/n x B, as a ring
// does, in two rounds of n-1 messages; 2 (n-k)/n x B of it to the other
// nodes' members; the sum reads n chunks of B/n.
AllReduceCost chunked(double bytes, const GroupShape& g, const HardwareProfile& h) {
  const int n = g.num_ranks, k = g.ranks_per_node, m = g.num_nodes;
  AllReduceCost c{"chunked", 0, 0, 0};
  c.bytes_sent = 2.0 * (n - 1) / n * bytes;
  c.nic_bytes_sent = m > 1 ? 2.0 * (n - k) / n * bytes : 0.0;
  double link = k > 1 ? 2.0 * (k - 1) / n * bytes / nvlink_rate(h) : 0.0;
  if (m > 1) link = std::max(link, nic_seconds(c.nic_bytes_sent, k * g.groups_per_node, h));
  const double latency = 2.0 * ((m > 1 ? h.nic_latency : h.nvlink_latency) + (n - 1) * h.message_overhead);
  const double reduce = h.host_copy_bandwidth > 0 ? g.world_ranks * bytes / h.host_copy_bandwidth : 0.0;
  c.seconds = std::max(link, host_seconds(c.bytes_sent, c.nic_bytes_sent, g.world_ranks, h)) + reduce + latency;
  return c;
}

// Buckets of one group, walked in backward order (last layer first): a
// bucket takes layers while they fit in bucket_bytes (a layer larger than
// that is a bucket of its own) and is ready when its last layer's backward
// has ended. first_extra (the head) joins the first bucket, last_extra (the
// embedding) the last, ready when the whole backward has ended.
void add_buckets(const std::vector<double>& per_layer, double first_extra, double last_extra, bool expert,
                 const GradSyncInput& in, double bucket_bytes, std::vector<Bucket>* out) {
  const int layers = static_cast<int>(per_layer.size());
  double pending = first_extra, ready = in.backward_start_s;
  auto close = [&] {
    if (pending > 0) out->push_back({expert, pending, ready, 0, 0});
    pending = 0;
  };
  for (int l = layers - 1; l >= 0; --l) {
    if (per_layer[l] <= 0) continue;
    if (bucket_bytes > 0 && pending > 0 && pending + per_layer[l] > bucket_bytes) close();
    pending += per_layer[l];
    ready = in.layer_backward_end_s[l];
  }
  if (last_extra > 0) {
    if (bucket_bytes > 0 && pending > 0 && pending + last_extra > bucket_bytes) close();
    pending += last_extra;
    ready = in.backward_end_s;
  }
  close();
}

}  // namespace

double GradientBytes::expert() const { return std::accumulate(expert_per_layer.begin(), expert_per_layer.end(), 0.0); }
double GradientBytes::dense() const {
  return std::accumulate(dense_per_layer.begin(), dense_per_layer.end(), 0.0) + embedding + head;
}

GradientBytes parameters_held(const Scenario& s, int stage) {
  const ModelConfig& m = s.model;
  const int pp = s.parallelism.pp_stages;
  const int l0 = stage * m.layers / pp, l1 = (stage + 1) * m.layers / pp;
  const double H = m.hidden;
  const double norms = (m.attention ? 2.0 : 1.0) * H;
  const double expert_params = 3.0 * H * m.expert_hidden;
  GradientBytes b;
  for (int l = l0; l < l1; ++l) {
    if (l < m.dense_layers) {
      b.expert_per_layer.push_back(0);
      b.dense_per_layer.push_back(norms + attention_params(m) + 3.0 * H * m.dense_hidden);
      continue;
    }
    b.expert_per_layer.push_back(experts_per_rank(s) * expert_params);
    b.dense_per_layer.push_back(norms + attention_params(m) + H * m.experts + m.shared_experts * expert_params);
  }
  if (stage == 0) b.embedding = static_cast<double>(m.embedding_params);
  if (stage == pp - 1) b.head = static_cast<double>(m.head_params) + H;  // + the final norm
  return b;
}

GradientBytes gradient_bytes(const Scenario& s, int stage) {
  GradientBytes b = parameters_held(s, stage);
  const double e = dtype_bytes(s.model.grad_dtype);  // f32 or bf16 (validated)
  for (double& v : b.expert_per_layer) v *= e;
  for (double& v : b.dense_per_layer) v *= e;
  b.embedding *= e;
  b.head *= e;
  return b;
}

GroupShape edp_shape(const ParallelLayout& layout, const Topology& topology) {
  GroupShape g;
  const std::vector<int> members = layout.edp_members(0);
  std::set<int> nodes;
  for (int r : members) nodes.insert(topology.node_of(r));
  g.num_ranks = static_cast<int>(members.size());
  g.num_nodes = static_cast<int>(nodes.size());
  g.ranks_per_node = g.num_ranks / g.num_nodes;
  std::set<int> groups_on_node0;
  for (int local = 0; local < topology.ranks_per_node(); ++local)
    groups_on_node0.insert(layout.edp_group(topology.rank_of(0, local)));
  g.groups_per_node = static_cast<int>(groups_on_node0.size());
  g.world_ranks = topology.num_ranks();
  return g;
}

GroupShape world_shape(const Topology& topology) {
  return {topology.num_ranks(), topology.num_nodes(), topology.ranks_per_node(), 1, topology.num_ranks()};
}

AllReduceCost all_reduce_cost(double bytes, const GroupShape& group, const HardwareProfile& hardware,
                              const std::string& algorithm) {
  if (group.num_ranks <= 1 || bytes <= 0) return {"none", 0, 0, 0};
  if (algorithm == "allgather") return allgather(bytes, group, hardware);
  if (algorithm == "chunked") return chunked(bytes, group, hardware);
  const bool two_levels = group.num_nodes > 1 && group.ranks_per_node > 1;
  if (algorithm == "ring" || !two_levels) return ring(bytes, group, hardware);
  if (algorithm == "hierarchical") return hierarchical(bytes, group, hardware);
  AllReduceCost r = ring(bytes, group, hardware), h = hierarchical(bytes, group, hardware);
  return h.seconds < r.seconds ? h : r;
}

AllReduceCost half_all_reduce_cost(double bytes, const GroupShape& group, const HardwareProfile& hardware,
                                   const std::string& algorithm, const char* which) {
  AllReduceCost c = all_reduce_cost(bytes, group, hardware, algorithm);
  if (c.algorithm == "none") return c;
  c.algorithm += std::string(" ") + which;
  c.seconds /= 2;
  c.bytes_sent /= 2;
  c.nic_bytes_sent /= 2;
  return c;
}

AllReduceCost gradient_reduce_cost(double bytes, const GroupShape& group, const Scenario& s) {
  if (s.optimizer.zero && s.optimizer.kind != "none")
    return half_all_reduce_cost(bytes, group, s.hardware, s.parallelism.allreduce, "reduce-scatter");
  return all_reduce_cost(bytes, group, s.hardware, s.parallelism.allreduce);
}

GradSyncResult schedule_grad_sync(const GradSyncInput& in, const Scenario& s) {
  const ParallelismConfig& p = s.parallelism;
  GradSyncResult r;
  r.edp = gradient_reduce_cost(in.bytes.expert(), in.edp, s);
  r.dense = gradient_reduce_cost(in.bytes.dense(), in.world, s);
  const auto bucket_bytes = static_cast<double>(p.grad_bucket_bytes);
  if (in.edp.num_ranks > 1) add_buckets(in.bytes.expert_per_layer, 0, 0, true, in, bucket_bytes, &r.buckets);
  if (in.world.num_ranks > 1)
    add_buckets(in.bytes.dense_per_layer, in.bytes.head, in.bytes.embedding, false, in, bucket_bytes, &r.buckets);
  for (Bucket& b : r.buckets)
    if (!p.grad_overlap) b.ready_s = in.backward_end_s;
  std::stable_sort(r.buckets.begin(), r.buckets.end(),
                   [](const Bucket& a, const Bucket& b) { return a.ready_s < b.ready_s; });
  double free_s = in.backward_start_s;
  for (Bucket& b : r.buckets) {
    b.start_s = std::max(b.ready_s, free_s);
    b.end_s = b.start_s + gradient_reduce_cost(b.bytes, b.expert ? in.edp : in.world, s).seconds;
    free_s = b.end_s;
    r.busy_s += b.end_s - b.start_s;
  }
  r.exposed_s = std::max(0.0, free_s - in.backward_end_s);
  r.hidden_share = r.busy_s > 0 ? 1.0 - r.exposed_s / r.busy_s : 1.0;
  return r;
}

}  // namespace epx::sim
