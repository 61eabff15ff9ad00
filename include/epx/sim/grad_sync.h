// The gradient all-reduces of an EP x EDP training step: what they move and
// how much of them the backward hides.
//
// Layout (epx::ParallelLayout, per pipeline stage): EP groups of
// parallelism.ep ranks fill nodes first; the EDP group of a rank is the ranks
// holding the same experts (ranks / ep of them). Each rank all-reduces
//   - its routed experts' gradients (the experts it holds, every MoE layer of
//     its stage) over its EDP group, and
//   - the dense gradients (attention, router, norms, shared experts, dense
//     FFNs, embeddings and head) over all ranks of its stage,
// in buckets of parallelism.grad_bucket_bytes, each started when the backward
// of the layer that fills it has ended on every rank (overlap on) or after the
// whole backward (overlap off), one after another on a communication stream of
// their own. Exposed time = the last bucket's end - the backward's end (>= 0).
//
// All-reduce of B bytes over a group of n ranks on m nodes, k per node:
//   ring:          each rank sends 2 (n-1)/n x B over the slowest link the
//                  ring crosses (a NIC when m > 1, else NVLink), 2 (n-1) steps
//                  of latency;
//   hierarchical:  reduce-scatter inside the node ((k-1)/k x B over NVLink),
//                  ring all-reduce of B/k across the m nodes, all-gather
//                  inside the node ((k-1)/k x B);
//   auto:          the faster of the two;
//   allgather:     what epx's in-process transport runs (deterministic:
//                  every rank gathers all n contributions and sums them in
//                  rank order): each rank receives (n-1) x B, (n-k) x B of it
//                  across nodes, then reads n x B to sum;
//   chunked:       what epx's MPI transport runs for large data (the same
//                  rank-order bits): an all-to-all of B/n chunks, each rank
//                  sums its chunk, an all-gather of the sums: 2 (n-1)/n x B
//                  sent per rank (a ring's), 2 (n-k)/n x B across nodes.
// Every group of the stage reduces at once: when the node's ranks share one
// NIC (hardware.nic.shared_per_node, emulated hosts) the bytes that all of
// them send across nodes share its bandwidth; on an emulated host
// (hardware.host.copy_bandwidth > 0) every byte sent is also a copy that all
// ranks' copies share.
#pragma once

#include <string>
#include <vector>

#include "epx/comm/parallel_layout.h"
#include "epx/core/status.h"
#include "epx/sim/scenario.h"

namespace epx::sim {

// Gradient bytes of one rank of pipeline stage `stage`.
struct GradientBytes {
  std::vector<double> expert_per_layer;  // [layer of the stage, in forward order]: routed experts held
  std::vector<double> dense_per_layer;   // [layer of the stage]
  double embedding = 0;                  // input embedding (first stage; ready last in the backward)
  double head = 0;                       // output head and final norm (last stage; ready first)
  [[nodiscard]] double expert() const;
  [[nodiscard]] double dense() const;    // layers + embedding + head
};
GradientBytes gradient_bytes(const Scenario& scenario, int stage);
// The same shape in parameters (one per element): what one rank of `stage`
// holds and its optimizer updates.
GradientBytes parameters_held(const Scenario& scenario, int stage);

// The shape of one all-reduce group and how many like it share a node's NIC.
struct GroupShape {
  int num_ranks = 1;
  int num_nodes = 1;
  int ranks_per_node = 1;       // of this group
  int groups_per_node = 1;      // groups of this kind with members on one node (they reduce at once)
  int world_ranks = 1;          // ranks of the stage (all reduce at once: host copies)
};
// EDP group 0 / the all-ranks group of the layout.
GroupShape edp_shape(const ParallelLayout& layout, const Topology& topology);
GroupShape world_shape(const Topology& topology);

struct AllReduceCost {
  std::string algorithm;     // "ring", "hierarchical", "allgather", "chunked" or "none" (one rank)
  double seconds = 0;
  double bytes_sent = 0;     // per rank, all links
  double nic_bytes_sent = 0; // per rank, across nodes
};
// algorithm: "ring", "hierarchical", "auto", "allgather" or "chunked".
AllReduceCost all_reduce_cost(double bytes, const GroupShape& group, const HardwareProfile& hardware,
                              const std::string& algorithm);
// A reduce-scatter or an all-gather of B bytes (ZeRO-1): each is one half of
// the algorithm's all-reduce (ring, chunked, hierarchical are a reduce-scatter
// then an all-gather), so half its time and bytes; algorithm "... reduce-scatter"
// or "... all-gather".
AllReduceCost half_all_reduce_cost(double bytes, const GroupShape& group, const HardwareProfile& hardware,
                                   const std::string& algorithm, const char* which);
// What a gradient bucket costs: the all-reduce, or with optimizer.zero the reduce-scatter.
AllReduceCost gradient_reduce_cost(double bytes, const GroupShape& group, const Scenario& scenario);

// One bucket on the gradient stream.
struct Bucket {
  bool expert = false;  // EDP group (true) or all ranks
  double bytes = 0;
  double ready_s = 0;   // the backward of its last layer has ended
  double start_s = 0, end_s = 0;
};

struct GradSyncResult {
  std::vector<Bucket> buckets;   // in issue order
  double busy_s = 0;             // sum of the buckets' all-reduce times
  double exposed_s = 0;          // after the backward's end
  double hidden_share = 0;       // 1 - exposed / busy (1 when nothing to send)
  AllReduceCost edp, dense;      // each group's whole gradient at once (what the buckets add up to in bytes)
};

struct GradSyncInput {
  GradientBytes bytes;
  // [layer of the stage]: when its backward ends (the slowest rank), seconds
  // from the stage's start; backward_end_s: when the whole backward ends.
  std::vector<double> layer_backward_end_s;
  double backward_start_s = 0;
  double backward_end_s = 0;
  GroupShape edp, world;
};
// The bucket schedule of one step (scenario: hardware, bucket size, overlap, algorithm).
GradSyncResult schedule_grad_sync(const GradSyncInput& input, const Scenario& scenario);

}  // namespace epx::sim
