#include "epx/sim/simulator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>
#include <thread>

#include "epx/balance/placement.h"
#include "epx/core/input_file.h"
#include "epx/core/random.h"
#include "epx/routing/expert_bias.h"
#include "epx/sim/cost.h"
#include "epx/sim/grad_sync.h"
#include "epx/sim/optimizer.h"
#include "epx/sim/pipeline.h"
#include "epx/sim/traffic.h"
#include "core/guard.h"
#include "core/thread_shares.h"
#include "sim/routing_trace.h"

namespace epx::sim {
namespace {

enum class Kind : uint8_t { kAttention, kRouter, kDispatch, kShared, kExperts, kCombine, kDense };
constexpr const char* kKindNames[] = {"attention", "router", "dispatch", "shared", "experts", "combine", "dense"};
constexpr int kNumKinds = 7;

bool is_comm(Kind k) { return k == Kind::kDispatch || k == Kind::kCombine; }

struct Task {
  Kind kind;
  int mb = 0;              // micro-batch of the pass (0, or 0/1 for two_micro_batch)
  double fraction = 1.0;   // share of the layer's work (chunks)
  std::vector<int> deps;   // program indices
  bool layer_input = false;  // also waits for the micro-batch's previous layer
};

// The program of one layer pass: tasks in issue order. Comm tasks are issued
// before the compute they overlap, which the slowdown model relies on.
std::vector<Task> build_program(const std::string& overlap, int chunks, bool has_shared, bool backward) {
  std::vector<Task> p;
  auto add = [&p](Kind k, int mb, std::vector<int> deps, double fraction = 1.0, bool input = false) {
    p.push_back(Task{k, mb, fraction, std::move(deps), input});
    return static_cast<int>(p.size()) - 1;
  };
  const int num_mb = overlap == "two_micro_batch" ? 2 : 1;
  if (!backward) {
    std::vector<int> router(num_mb), disp(num_mb);
    for (int mb = 0; mb < num_mb; ++mb) {
      const int attn = add(Kind::kAttention, mb, {}, 1.0, true);
      router[mb] = add(Kind::kRouter, mb, {attn});
      if (overlap != "chunked") disp[mb] = add(Kind::kDispatch, mb, {router[mb]});
    }
    if (overlap == "chunked") {
      std::vector<int> d(chunks);
      d[0] = add(Kind::kDispatch, 0, {router[0]}, 1.0 / chunks);
      if (has_shared) add(Kind::kShared, 0, {router[0]});
      for (int i = 0; i < chunks; ++i) {
        if (i + 1 < chunks) d[i + 1] = add(Kind::kDispatch, 0, {router[0]}, 1.0 / chunks);
        const int e = add(Kind::kExperts, 0, {d[i]}, 1.0 / chunks);
        add(Kind::kCombine, 0, {e}, 1.0 / chunks);
      }
      return p;
    }
    for (int mb = 0; mb < num_mb; ++mb) {
      // none: the shared experts wait for dispatch, so nothing overlaps.
      if (has_shared) add(Kind::kShared, mb, {overlap == "none" ? disp[mb] : router[mb]});
      const int e = add(Kind::kExperts, mb, {disp[mb]});
      add(Kind::kCombine, mb, {e});
    }
    return p;
  }
  // Backward: gradient of combine (dispatch-shaped), experts, gradient of
  // dispatch (combine-shaped), then attention and router.
  if (overlap == "chunked") {
    std::vector<int> d(chunks), c(chunks);
    d[0] = add(Kind::kDispatch, 0, {}, 1.0 / chunks, true);
    if (has_shared) add(Kind::kShared, 0, {}, 1.0, true);
    for (int i = 0; i < chunks; ++i) {
      if (i + 1 < chunks) d[i + 1] = add(Kind::kDispatch, 0, {}, 1.0 / chunks, true);
      const int e = add(Kind::kExperts, 0, {d[i]}, 1.0 / chunks);
      c[i] = add(Kind::kCombine, 0, {e}, 1.0 / chunks);
    }
    const int r = add(Kind::kRouter, 0, c);
    add(Kind::kAttention, 0, {r});
    return p;
  }
  std::vector<int> disp(num_mb), comb(num_mb);
  for (int mb = 0; mb < num_mb; ++mb) disp[mb] = add(Kind::kDispatch, mb, {}, 1.0, true);
  for (int mb = 0; mb < num_mb; ++mb) {
    if (has_shared) add(Kind::kShared, mb, {overlap == "none" ? disp[mb] : -1}, 1.0, true);
    const int e = add(Kind::kExperts, mb, {disp[mb]});
    comb[mb] = add(Kind::kCombine, mb, {e});
  }
  for (int mb = 0; mb < num_mb; ++mb) {
    const int r = add(Kind::kRouter, mb, {comb[mb]});
    add(Kind::kAttention, mb, {r});
  }
  return p;
}

struct Interval {
  double begin, end;
};

// Finish time of `work` seconds of compute started at `start` on a GPU whose
// communication is busy during `comm` (sorted by begin and by end, disjoint: one
// stream): slower by `slow` there.
double run_compute(double start, double work, const std::vector<Interval>& comm, double slow) {
  double t = start;
  auto first = std::upper_bound(comm.begin(), comm.end(), start,
                                [](double v, const Interval& c) { return v < c.end; });
  for (auto it = first; it != comm.end(); ++it) {
    const Interval& c = *it;
    if (work <= 0) break;
    if (c.end <= t) continue;
    if (c.begin > t) {
      const double free = std::min(work, c.begin - t);
      work -= free;
      t += free;
      if (work <= 0) break;
    }
    const double capacity = (c.end - t) / slow;
    if (work <= capacity) return t + work * slow;
    work -= capacity;
    t = c.end;
  }
  return t + work;
}

double overlap_of(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  double total = 0;
  std::size_t j = 0;
  for (const Interval& x : a) {
    while (j < b.size() && b[j].end <= x.begin) ++j;
    for (std::size_t k = j; k < b.size() && b[k].begin < x.end; ++k)
      total += std::max(0.0, std::min(x.end, b[k].end) - std::max(x.begin, b[k].begin));
  }
  return total;
}

// Costs of one MoE layer for one EP group, forward and backward.
struct LayerCosts {
  AllToAllCost dispatch, combine, dispatch_bwd, combine_bwd;
  std::vector<double> slot_rows;  // [slots]
  int slots_per_gpu = 0;
  bool moe = true;
};

// Per-GPU state of one EP group walking through its stage's layers.
struct GroupClock {
  std::vector<double> compute_free, comm_free;
  std::vector<std::vector<double>> ready;  // [mb][gpu]: the micro-batch's last layer output
  std::vector<double> busy, comm_time;
  std::vector<std::array<double, kNumKinds>> kind_s;
  // Every interval of the stage on each GPU's streams, in time order (each
  // stream runs one task at a time): later layers' compute can overlap an
  // earlier layer's communication.
  std::vector<std::vector<Interval>> comm, compute;
};

// What one EP group of one stage did in one step (a unit of the step's work:
// units run on the simulator's threads, each writing only its own).
struct UnitResult {
  Status status = Status::ok();
  int first_layer = 0;                      // the stage's first layer
  double fwd_end = 0;                       // the forward's last layer output, any GPU
  double end = 0;                           // both streams idle on every GPU
  std::vector<double> layer_bwd_end;        // [stage layer]: its backward ended on every GPU
  std::vector<double> busy, comm_time, exposed;        // [gpu]
  std::vector<std::array<double, kNumKinds>> kind_s;  // [gpu]
  std::vector<std::vector<int64_t>> load;   // [stage layer][expert]: kept pairs (MoE layers)
  std::vector<int64_t> dropped;             // [stage layer]
  int64_t routed = 0;                       // route + layout calls
  std::vector<TraceSpan> trace;             // the traced unit only
};

class Simulator {
 public:
  Simulator(const Scenario& s, const SimOptions& o) : s_(s), o_(o) {}
  Result<SimResult> run();

 private:
  Status prepare();
  Status load_trace();
  void step_popularity(int step);
  Status route_layer(int step, int layer, int group, const Topology& topo, LayerCosts* costs, GroupTraffic* traffic,
                     UnitResult* unit) const;
  void run_pass(const LayerCosts& costs, bool backward, GroupClock& clock, std::vector<TraceSpan>* trace) const;
  double compute_seconds(Kind kind, const LayerCosts& costs, int gpu, double fraction, bool backward) const;
  void run_unit(int step, int stage, int group, const Topology& topo, UnitResult* unit) const;
  Status run_units(int step, const Topology& topo, std::vector<UnitResult>* units) const;
  Status run_step(int step, const Topology& topo, SimResult* result, std::array<double, kNumKinds>* kind_total);
  Status end_of_step(int step);
  Status prepare_grad_sync();
  [[nodiscard]] int pp_units() const { return s_.parallelism.pp_stages * groups_; }

  // The gradient all-reduce of each pipeline stage: its layout's group shapes
  // and one rank's gradient bytes.
  struct StageSync {
    GroupShape edp, world;
    GradientBytes bytes;
    OptimizerCost optimizer;
  };
  std::vector<StageSync> stage_sync_;

  const Scenario& s_;
  const SimOptions& o_;
  int R_ = 0, nodes_per_group_ = 1, groups_ = 0, units_ = 1, num_mb_ = 1;
  double peak_ = 0;
  int64_t T_ = 0;
  RouterConfig router_;
  std::vector<std::vector<double>> log_pop_;     // [layer][expert], drifting
  std::vector<std::vector<double>> trace_pop_;   // [line * moe_layers + layer][expert]
  int trace_layers_ = 0;
  std::vector<ExpertBias> bias_;                 // [layer]
  std::vector<std::optional<RedundantPlacement>> redundant_;  // [layer] (eplb)
  std::vector<std::optional<ExpertPlacement>> placement_;     // [layer]
  std::vector<std::vector<double>> eplb_load_;   // [layer][expert] since the last placement
  std::vector<std::vector<int64_t>> step_load_;  // [layer][expert] this step, all groups
  std::vector<int64_t> dropped_;                 // [layer] this step, all groups (sampled pairs)
  std::vector<Task> fwd_, bwd_;
  int64_t routed_ = 0;
  int threads_ = 1;        // the simulator's threads (run.threads, 0 = the machine's cores)
};

Status Simulator::load_trace() {
  EPX_ASSIGN_OR_RETURN(std::string text, read_input_file(s_.routing.trace, "routing.trace", kMaxTraceBytes));
  std::istringstream in(std::move(text));
  EPX_ASSIGN_OR_RETURN(RoutingTrace trace, read_routing_trace(in, s_.routing.trace, s_.model.experts, s_.model.topk,
                                                              s_.routing.trace_format));
  trace_layers_ = trace.num_layers;
  trace_pop_ = std::move(trace.log_popularity);
  return Status::ok();
}

Status Simulator::prepare() {
  const ModelConfig& m = s_.model;
  const ParallelismConfig& p = s_.parallelism;
  R_ = p.ep;
  nodes_per_group_ = std::max(1, p.ep / s_.cluster.gpus_per_node);
  const int per_stage = s_.ep_groups_per_stage();
  groups_ = s_.run.ep_groups > 0 ? std::min(s_.run.ep_groups, per_stage) : per_stage;
  num_mb_ = s_.schedule.overlap == "two_micro_batch" ? 2 : 1;
  units_ = p.micro_batches / num_mb_;
  peak_ = m.compute_dtype == "fp8" ? s_.hardware.fp8_flops : s_.hardware.bf16_flops;
  T_ = p.tokens_per_gpu;
  router_ = make_router_config(m);
  EPX_RETURN_IF_ERROR(router_.validate());
  threads_ = s_.run.threads > 0 ? s_.run.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  const int L = m.layers;
  log_pop_.assign(L, std::vector<double>(m.experts, 0.0));
  const uint64_t seed = s_.routing.seed;
  for (int l = 0; l < L; ++l) {
    std::vector<double>& pop = log_pop_[l];
    if (s_.routing.distribution == "zipf") {
      std::vector<int> perm(m.experts);
      std::iota(perm.begin(), perm.end(), 0);
      for (int i = m.experts - 1; i > 0; --i)  // Fisher-Yates, the layer's own order
        std::swap(perm[i], perm[static_cast<int>(uniform01(seed, 7000 + l, i) * (i + 1))]);
      for (int i = 0; i < m.experts; ++i) pop[perm[i]] = -s_.routing.zipf_s * std::log(i + 1.0);
    } else if (s_.routing.distribution == "lognormal") {
      for (int e = 0; e < m.experts; ++e) pop[e] = s_.routing.lognormal_sigma * standard_normal(seed, 9000 + l, e);
    }
  }
  if (s_.routing.distribution == "trace") EPX_RETURN_IF_ERROR(load_trace());

  const float rate = static_cast<float>(s_.balancing.bias_rate);
  bias_.assign(L, ExpertBias(m.experts, rate));
  redundant_.assign(L, std::nullopt);
  placement_.assign(L, std::nullopt);
  eplb_load_.assign(L, std::vector<double>(m.experts, 0.0));
  step_load_.assign(L, std::vector<int64_t>(m.experts, 0));
  dropped_.assign(L, 0);
  for (int l = m.dense_layers; l < L; ++l) {
    if (s_.balancing.strategy == "eplb") {
      std::vector<double> even(m.experts, 1.0);
      PlacementConfig pc;
      pc.num_slots = m.experts + s_.balancing.eplb_redundant * R_;
      if (pc.num_slots % R_ != 0) pc.num_slots += R_ - pc.num_slots % R_;
      pc.num_nodes = nodes_per_group_;
      pc.ranks_per_node = R_ / nodes_per_group_;
      pc.num_groups = m.groups > 1 ? m.groups : 0;
      auto placed = place_experts(even, pc);
      if (!placed.is_ok()) return invalid_argument("balancing.strategy = 'eplb': {}", placed.status().message());
      redundant_[l] = std::move(placed).value();
      EPX_ASSIGN_OR_RETURN(ExpertPlacement ep, redundant_[l]->to_expert_placement());
      placement_[l] = std::move(ep);
    } else {
      EPX_ASSIGN_OR_RETURN(ExpertPlacement ep, ExpertPlacement::contiguous(m.experts, R_));
      placement_[l] = std::move(ep);
    }
  }
  const bool shared = m.shared_experts > 0;
  fwd_ = build_program(s_.schedule.overlap, s_.schedule.chunks, shared, false);
  bwd_ = build_program(s_.schedule.overlap, s_.schedule.chunks, shared, true);
  return Status::ok();
}

void Simulator::step_popularity(int step) {
  if (s_.routing.drift <= 0 || step == 0) return;
  for (int l = 0; l < s_.model.layers; ++l)
    for (int e = 0; e < s_.model.experts; ++e)
      log_pop_[l][e] += s_.routing.drift * standard_normal(s_.routing.seed, 11000 + l, uint64_t(step) * 65536 + e);
}

Status Simulator::route_layer(int step, int layer, int group, const Topology& topo, LayerCosts* costs,
                              GroupTraffic* traffic, UnitResult* unit) const {
  const ModelConfig& m = s_.model;
  std::vector<double> pop;
  if (!trace_pop_.empty()) {
    const int lines = static_cast<int>(trace_pop_.size()) / trace_layers_;
    const int moe_layer = (layer - m.dense_layers) % trace_layers_;
    pop = trace_pop_[static_cast<std::size_t>(step % lines) * trace_layers_ + moe_layer];
  } else {
    pop = log_pop_[layer];
  }
  if (s_.balancing.strategy == "aux")
    for (double& v : pop) v *= 1.0 - s_.balancing.aux_skew_reduction;
  RouteRequest q;
  q.router = &router_;
  q.placement = &*placement_[layer];
  q.topology = &topo;
  if (redundant_[layer]) q.replicas = redundant_[layer]->replica_table();
  q.log_popularity = pop;
  if (s_.balancing.strategy == "bias") q.expert_bias = bias_[layer].values();
  q.tokens_per_gpu = T_;
  q.sample_tokens = s_.routing.sample_tokens;
  q.seed = s_.routing.seed;
  q.stream = (static_cast<uint64_t>(step) * s_.model.layers + layer) * 65536 + group;
  // The step's units share the threads; a step of fewer units than threads routes each group on them all.
  q.threads = std::max(1, threads_ / pp_units());
  EPX_RETURN_IF_ERROR(route_group(q, traffic));
  unit->routed += R_;
  const int slot = layer - unit->first_layer;
  for (int e = 0; e < m.experts; ++e) unit->load[slot][e] += traffic->expert_load[e];
  unit->dropped[slot] += traffic->num_dropped;

  const Kernel kernel = kernel_of(s_.parallelism.dispatch, topo.num_nodes());
  EPX_ASSIGN_OR_RETURN(int64_t disp_bytes, row_bytes(m.dispatch_dtype, m.hidden));
  EPX_ASSIGN_OR_RETURN(int64_t comb_bytes, row_bytes(m.combine_dtype, m.hidden));
  EPX_ASSIGN_OR_RETURN(int64_t remote_bytes,
                       row_bytes(m.combine_remote_dtype.empty() ? m.combine_dtype : m.combine_remote_dtype, m.hidden));
  const HardwareProfile& h = s_.hardware;
  const bool per_rank = s_.parallelism.combine_per_rank;
  costs->dispatch = all_to_all(*traffic, topo, h, {kernel, false, double(disp_bytes), 0, per_rank});
  costs->combine = all_to_all(*traffic, topo, h, {kernel, true, double(comb_bytes), double(remote_bytes), per_rank});
  // Backward moves gradients in the combine dtype both ways.
  costs->dispatch_bwd = all_to_all(*traffic, topo, h, {kernel, false, double(comb_bytes), double(remote_bytes), per_rank});
  costs->combine_bwd = all_to_all(*traffic, topo, h, {kernel, true, double(comb_bytes), double(remote_bytes), per_rank});
  costs->slot_rows = traffic->slot_rows;
  costs->slots_per_gpu = static_cast<int>(traffic->slot_rows.size()) / R_;
  costs->moe = true;
  return Status::ok();
}

double Simulator::compute_seconds(Kind kind, const LayerCosts& c, int gpu, double fraction, bool backward) const {
  const ModelConfig& m = s_.model;
  const HardwareProfile& h = s_.hardware;
  const double tokens = static_cast<double>(T_) * fraction;
  const double dense_rate = peak_ * gemm_efficiency(tokens, h);
  const double attn = attention_flops(m);
  const double expert_row = 6.0 * m.hidden * m.expert_hidden;
  double seconds = 0;
  switch (kind) {
    case Kind::kAttention: seconds = tokens * attn / dense_rate; break;
    case Kind::kRouter: seconds = tokens * 2.0 * m.hidden * m.experts / dense_rate; break;
    case Kind::kShared: seconds = tokens * m.shared_experts * expert_row / dense_rate; break;
    case Kind::kDense: seconds = tokens * (attn + 6.0 * m.hidden * m.dense_hidden) / dense_rate; break;
    case Kind::kExperts: {
      const std::span<const double> rows(c.slot_rows.data() + static_cast<std::size_t>(gpu) * c.slots_per_gpu,
                                         c.slots_per_gpu);
      seconds = grouped_gemm_time(rows, expert_row, peak_, h, fraction);
      break;
    }
    default: break;
  }
  // An emulated cluster's ranks share the host's cores.
  const double cores = s_.hardware.host_cores;
  if (cores > 0) seconds *= std::max(1.0, s_.num_gpus() / cores);
  return backward ? 2.0 * seconds : seconds;
}

void Simulator::run_pass(const LayerCosts& c, bool backward, GroupClock& clk, std::vector<TraceSpan>* trace) const {
  const std::vector<Task>& prog = backward ? bwd_ : fwd_;
  const std::vector<Task> dense_prog = {Task{Kind::kDense, 0, 1.0, {}, true}};
  const std::vector<Task>& program = c.moe ? prog : dense_prog;
  const int n = static_cast<int>(program.size());
  const double slow = compute_slowdown(s_.hardware, kernel_of(s_.parallelism.dispatch, s_.cluster.nodes));
  std::vector<std::vector<double>> finish(n, std::vector<double>(R_, 0.0));
  for (int i = 0; i < n; ++i) {
    const Task& t = program[i];
    auto ready_of = [&](int g) {
      double r = t.layer_input ? clk.ready[t.mb][g] : 0.0;
      for (int d : t.deps)
        if (d >= 0) r = std::max(r, finish[d][g]);
      return r;
    };
    if (is_comm(t.kind)) {
      const AllToAllCost& a2a = (t.kind == Kind::kDispatch) ? (backward ? c.dispatch_bwd : c.dispatch)
                                                            : (backward ? c.combine_bwd : c.combine);
      double start = 0;
      for (int g = 0; g < R_; ++g) start = std::max(start, std::max(clk.comm_free[g], ready_of(g)));
      for (int g = 0; g < R_; ++g) {
        const double end = start + a2a.time(g, t.fraction);
        finish[i][g] = end;
        clk.comm_free[g] = end;
        clk.comm[g].push_back({start, end});
        clk.comm_time[g] += end - start;
        clk.kind_s[g][static_cast<int>(t.kind)] += end - start;
        if (trace) trace->push_back({kKindNames[static_cast<int>(t.kind)], 2 * g + 1, int64_t(start * 1e9), int64_t(end * 1e9)});
      }
    } else {
      for (int g = 0; g < R_; ++g) {
        const double start = std::max(clk.compute_free[g], ready_of(g));
        const double work = compute_seconds(t.kind, c, g, t.fraction, backward);
        const double end = run_compute(start, work, clk.comm[g], slow);
        finish[i][g] = end;
        clk.compute_free[g] = end;
        clk.compute[g].push_back({start, end});
        clk.busy[g] += end - start;
        clk.kind_s[g][static_cast<int>(t.kind)] += end - start;
        if (trace) trace->push_back({kKindNames[static_cast<int>(t.kind)], 2 * g, int64_t(start * 1e9), int64_t(end * 1e9)});
      }
    }
  }
  for (int g = 0; g < R_; ++g) {
    for (int mb = 0; mb < num_mb_; ++mb) {
      double out = 0;
      for (int i = 0; i < n; ++i)
        if (program[i].mb == mb) out = std::max(out, finish[i][g]);
      clk.ready[mb][g] = out;
    }
  }
}

Status Simulator::end_of_step(int step) {
  for (int l = s_.model.dense_layers; l < s_.model.layers; ++l) {
    if (s_.balancing.strategy == "bias") EPX_RETURN_IF_ERROR(bias_[l].update(step_load_[l]));
    if (s_.balancing.strategy == "eplb") {
      for (int e = 0; e < s_.model.experts; ++e) eplb_load_[l][e] += static_cast<double>(step_load_[l][e]);
      if ((step + 1) % s_.balancing.eplb_every == 0) {
        PlacementConfig pc;
        pc.num_slots = redundant_[l]->num_slots();
        pc.num_nodes = nodes_per_group_;
        pc.ranks_per_node = R_ / nodes_per_group_;
        pc.num_groups = s_.model.groups > 1 ? s_.model.groups : 0;
        EPX_ASSIGN_OR_RETURN(RedundantPlacement placed, place_experts(eplb_load_[l], pc));
        EPX_ASSIGN_OR_RETURN(ExpertPlacement ep, placed.to_expert_placement());
        redundant_[l] = std::move(placed);
        placement_[l] = std::move(ep);
        std::fill(eplb_load_[l].begin(), eplb_load_[l].end(), 0.0);
      }
    }
  }
  return Status::ok();
}

// The latest layer output of any micro-batch on any GPU of the group.
double latest_ready(const GroupClock& clk) {
  double t = 0;
  for (const std::vector<double>& mb : clk.ready)
    for (double v : mb) t = std::max(t, v);
  return t;
}

// The compute streams' gaps in a traced unit, named "idle" (track 2g is GPU g's compute).
void add_idle_gaps(int gpus, double end, std::vector<TraceSpan>* trace) {
  std::vector<TraceSpan> gaps;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> busy(gpus);
  for (const TraceSpan& sp : *trace)
    if (sp.rank % 2 == 0) busy[sp.rank / 2].push_back({sp.begin_ns, sp.end_ns});
  for (int g = 0; g < gpus; ++g) {
    std::sort(busy[g].begin(), busy[g].end());
    int64_t t = 0;
    for (auto [b, e] : busy[g]) {
      if (b > t) gaps.push_back({"idle", 2 * g, t, b});
      t = std::max(t, e);
    }
    if (int64_t(end * 1e9) > t) gaps.push_back({"idle", 2 * g, t, int64_t(end * 1e9)});
  }
  trace->insert(trace->end(), gaps.begin(), gaps.end());
}

// The ranks of one pipeline stage as a Topology: its share of the nodes (a
// stage inside one node when there are more stages than nodes).
Result<Topology> stage_topology(const Scenario& s) {
  const int pp = s.parallelism.pp_stages, nodes = s.cluster.nodes;
  const int ranks = s.num_gpus() / pp;
  const int stage_nodes = nodes % pp == 0 ? nodes / pp : (pp % nodes == 0 ? 1 : std::gcd(nodes, ranks));
  return Topology::create(ranks, std::max(1, stage_nodes));
}

Status Simulator::prepare_grad_sync() {
  EPX_ASSIGN_OR_RETURN(Topology topo, stage_topology(s_));
  EPX_ASSIGN_OR_RETURN(ParallelLayout layout, ParallelLayout::create(topo, s_.parallelism.ep));
  stage_sync_.clear();
  for (int stage = 0; stage < s_.parallelism.pp_stages; ++stage) {
    StageSync ss{edp_shape(layout, topo), world_shape(topo), gradient_bytes(s_, stage), {}};
    ss.optimizer = optimizer_cost(s_, parameters_held(s_, stage), ss.edp, ss.world);
    stage_sync_.push_back(std::move(ss));
  }
  return Status::ok();
}

double max_vio_of(const std::vector<int64_t>& load) {
  if (load.empty()) return 0.0;
  const double total = std::accumulate(load.begin(), load.end(), 0.0);
  if (total <= 0) return 0.0;
  const double mx = static_cast<double>(*std::max_element(load.begin(), load.end()));
  return mx / (total / static_cast<double>(load.size())) - 1.0;
}

// One EP group of one stage through the stage's layers, forward then (when
// training) backward: its GPUs' clocks, reduced to what the step needs.
void Simulator::run_unit(int step, int stage, int group, const Topology& topo, UnitResult* u) const {
  const ModelConfig& m = s_.model;
  const int pp = s_.parallelism.pp_stages;
  const int l0 = stage * m.layers / pp, l1 = (stage + 1) * m.layers / pp;
  u->first_layer = l0;
  u->layer_bwd_end.assign(l1 - l0, 0.0);
  u->load.assign(l1 - l0, std::vector<int64_t>(m.experts, 0));
  u->dropped.assign(l1 - l0, 0);
  // The trace shows the first stage that holds an MoE layer.
  const bool moe_stage = l0 <= m.dense_layers && m.dense_layers < l1;
  const bool tracing = o_.keep_trace && step == s_.run.trace_step && moe_stage && group == 0;
  std::vector<TraceSpan>* trace = tracing ? &u->trace : nullptr;
  GroupClock clk;
  clk.compute_free.assign(R_, 0.0);
  clk.comm_free.assign(R_, 0.0);
  clk.ready.assign(num_mb_, std::vector<double>(R_, 0.0));
  clk.busy.assign(R_, 0.0);
  clk.comm_time.assign(R_, 0.0);
  clk.comm.assign(R_, {});
  clk.compute.assign(R_, {});
  clk.kind_s.assign(R_, {});
  std::vector<LayerCosts> costs(l1 - l0);
  GroupTraffic traffic;
  const int global_group = stage * s_.ep_groups_per_stage() + group;
  for (int l = l0; l < l1; ++l) {
    if (l < m.dense_layers) {
      costs[l - l0].moe = false;
    } else {
      u->status = route_layer(step, l, global_group, topo, &costs[l - l0], &traffic, u);
      if (!u->status.is_ok()) return;
    }
    run_pass(costs[l - l0], false, clk, trace);
  }
  u->fwd_end = latest_ready(clk);
  if (s_.parallelism.mode == "train") {
    for (int l = l1 - 1; l >= l0; --l) {
      run_pass(costs[l - l0], true, clk, trace);
      u->layer_bwd_end[l - l0] = latest_ready(clk);
    }
  }
  double end = 0;
  for (int g = 0; g < R_; ++g) end = std::max({end, clk.compute_free[g], clk.comm_free[g]});
  u->end = end;
  u->busy = clk.busy;
  u->comm_time = clk.comm_time;
  u->kind_s = clk.kind_s;
  u->exposed.resize(R_);
  for (int g = 0; g < R_; ++g) u->exposed[g] = clk.comm_time[g] - overlap_of(clk.comm[g], clk.compute[g]);
  if (tracing) add_idle_gaps(R_, end, &u->trace);
}

// Every unit of the step (stage-major), on the simulator's threads: each
// thread takes the next unit not yet taken (a thread the machine delays takes
// fewer), and each unit writes only its own result, so nothing depends on the
// number of threads or on which thread ran which unit.
Status Simulator::run_units(int step, const Topology& topo, std::vector<UnitResult>* units) const {
  const int n = pp_units();
  units->assign(n, UnitResult{});
  const int threads = std::max(1, std::min(threads_, n));
  std::atomic<int> next{0};
  detail::run_shares(threads, "a simulator thread", [&](int) {
    for (int i = next++; i < n; i = next++) run_unit(step, i / groups_, i % groups_, topo, &(*units)[i]);
  });
  for (const UnitResult& u : *units) EPX_RETURN_IF_ERROR(u.status);
  return Status::ok();
}

Status Simulator::run_step(int step, const Topology& topo, SimResult* result,
                           std::array<double, kNumKinds>* kind_total) {
  const ModelConfig& m = s_.model;
  const int pp = s_.parallelism.pp_stages;
  const bool train = s_.parallelism.mode == "train";
  step_popularity(step);
  std::vector<UnitResult> units;
  EPX_RETURN_IF_ERROR(run_units(step, topo, &units));
  StepStats st;
  std::vector<double> idle;
  double exposed_sum = 0, comm_sum = 0;
  int64_t gpus = 0;
  std::array<double, kNumKinds> kinds{};
  for (auto& v : step_load_) std::fill(v.begin(), v.end(), 0);
  std::fill(dropped_.begin(), dropped_.end(), 0);
  double tail_s = 0;  // after the last unit: exposed all-reduce + optimizer, the stage that ends last
  for (int stage = 0; stage < pp; ++stage) {
    const int l0 = stage * m.layers / pp, l1 = (stage + 1) * m.layers / pp;
    // When each layer's backward has ended on every simulated GPU (its gradients are ready).
    std::vector<double> layer_bwd_end(l1 - l0, 0.0);
    double bwd_start = 0, stage_end = 0;
    for (int group = 0; group < groups_; ++group) {
      UnitResult& u = units[stage * groups_ + group];
      for (int l = l0; l < l1; ++l) {
        layer_bwd_end[l - l0] = std::max(layer_bwd_end[l - l0], u.layer_bwd_end[l - l0]);
        for (int e = 0; e < m.experts; ++e) step_load_[l][e] += u.load[l - l0][e];
        dropped_[l] += u.dropped[l - l0];
      }
      routed_ += u.routed;
      bwd_start = std::max(bwd_start, u.fwd_end);
      const double end = u.end;
      st.stage_s = std::max(st.stage_s, end);
      stage_end = std::max(stage_end, end);
      for (int g = 0; g < R_; ++g) {
        idle.push_back(end > 0 ? 1.0 - u.busy[g] / end : 0.0);
        exposed_sum += end > 0 ? u.exposed[g] / end : 0.0;
        comm_sum += end > 0 ? u.comm_time[g] / end : 0.0;
        for (int k = 0; k < kNumKinds; ++k) kinds[k] += u.kind_s[g][k];
      }
      gpus += R_;
      if (!u.trace.empty()) result->trace = std::move(u.trace);
    }
    if (train) {
      const StageSync& ss = stage_sync_[stage];
      GradSyncResult sync = schedule_grad_sync({ss.bytes, layer_bwd_end, bwd_start, stage_end, ss.edp, ss.world}, s_);
      const double tail = sync.exposed_s + ss.optimizer.seconds();
      if (stage == 0 || tail > tail_s) {
        tail_s = tail;
        st.grad_sync_s = sync.busy_s;
        st.grad_exposed_s = sync.exposed_s;
        st.grad_hidden = sync.hidden_share;
        st.optimizer_s = ss.optimizer.update_s;
        st.param_gather_s = ss.optimizer.gather_s;
      }
      if (step == 0 && stage == 0) result->grad_sync = std::move(sync);
    }
  }
  // 1F1B with the transfers between stages; then what the last unit's
  // backward does not hide of the all-reduce, and the optimizer.
  st.pp_transfer_s = (units_ + pp - 1) * result->pipeline.per_unit_s;
  st.step_s = (units_ + pp - 1) * st.stage_s + st.pp_transfer_s + st.grad_exposed_s + st.optimizer_s +
              st.param_gather_s;
  st.worst_idle = *std::max_element(idle.begin(), idle.end());
  st.mean_idle = std::accumulate(idle.begin(), idle.end(), 0.0) / static_cast<double>(idle.size());
  st.exposed_comm = exposed_sum / static_cast<double>(gpus);
  st.comm_share = comm_sum / static_cast<double>(gpus);
  st.tokens_per_s_per_gpu = static_cast<double>(T_) * s_.parallelism.micro_batches / pp / st.step_s;
  st.mfu = (train ? 3.0 : 1.0) * result->model_flops_per_token * st.tokens_per_s_per_gpu / peak_;
  for (int l = m.dense_layers; l < m.layers; ++l) st.max_vio = std::max(st.max_vio, max_vio_of(step_load_[l]));
  for (int k = 0; k < kNumKinds; ++k) (*kind_total)[k] += kinds[k] / static_cast<double>(gpus);
  for (int l = m.dense_layers; l < m.layers; ++l) st.dropped += dropped_[l];
  EPX_RETURN_IF_ERROR(end_of_step(step));
  result->steps.push_back(st);
  return Status::ok();
}

Result<SimResult> Simulator::run() {
  const auto wall_start = std::chrono::steady_clock::now();
  EPX_RETURN_IF_ERROR(prepare());
  EPX_RETURN_IF_ERROR(prepare_grad_sync());
  const ModelConfig& m = s_.model;
  const bool train = s_.parallelism.mode == "train";
  EPX_ASSIGN_OR_RETURN(Topology topo, Topology::create(R_, nodes_per_group_));
  SimResult result;
  EPX_ASSIGN_OR_RETURN(result.pipeline, pipeline_transfer(s_));
  result.sampled_tokens = static_cast<int>(std::min<int64_t>(T_, s_.routing.sample_tokens));
  result.sample_scale = static_cast<double>(T_) / result.sampled_tokens;
  result.simulated_groups = groups_;
  {
    const double attn = attention_flops(m);
    const double moe = attn + 2.0 * m.hidden * m.experts + (m.topk + m.shared_experts) * 6.0 * m.hidden * m.expert_hidden;
    const double dense = attn + 6.0 * m.hidden * m.dense_hidden;
    result.model_flops_per_token = m.dense_layers * dense + (m.layers - m.dense_layers) * moe;
  }
  std::array<double, kNumKinds> kind_total{};
  for (int step = 0; step < s_.run.steps; ++step) {
    EPX_RETURN_IF_ERROR(run_step(step, topo, &result, &kind_total));
    if (o_.on_step) o_.on_step(step + 1, s_.run.steps);
  }
  auto collect = [&](auto member) {
    std::vector<double> v;
    for (const StepStats& st : result.steps) v.push_back(st.*member);
    return percentiles(std::move(v));
  };
  Summary& sum = result.summary;
  sum.step_s = collect(&StepStats::step_s);
  sum.worst_idle = collect(&StepStats::worst_idle);
  sum.exposed_comm = collect(&StepStats::exposed_comm);
  sum.comm_share = collect(&StepStats::comm_share);
  sum.tokens_per_s_per_gpu = collect(&StepStats::tokens_per_s_per_gpu);
  sum.mfu = collect(&StepStats::mfu);
  sum.max_vio = collect(&StepStats::max_vio);
  sum.grad_sync_s = collect(&StepStats::grad_sync_s);
  sum.grad_exposed_s = collect(&StepStats::grad_exposed_s);
  sum.grad_hidden = collect(&StepStats::grad_hidden);
  sum.pp_transfer_s = collect(&StepStats::pp_transfer_s);
  sum.optimizer_s = collect(&StepStats::optimizer_s);
  sum.param_gather_s = collect(&StepStats::param_gather_s);
  if (train) {
    result.edp_ranks = stage_sync_[0].edp.num_ranks;
    result.dp_ranks = stage_sync_[0].world.num_ranks;
    result.expert_grad_bytes = stage_sync_[0].bytes.expert();
    result.dense_grad_bytes = stage_sync_[0].bytes.dense();
    result.optimizer = stage_sync_[0].optimizer;
  }
  for (int k = 0; k < kNumKinds; ++k)
    if (kind_total[k] > 0) sum.phase_s.emplace_back(kKindNames[k], kind_total[k] / s_.run.steps);
  result.routed_gpu_layers = routed_;
  result.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  return result;
}

}  // namespace

Percentiles percentiles(std::vector<double> values) {
  Percentiles p;
  if (values.empty()) return p;
  std::sort(values.begin(), values.end());
  auto at = [&](double q) {
    const double rank = std::ceil(q * static_cast<double>(values.size()));
    const std::size_t idx = rank < 1 ? 0 : static_cast<std::size_t>(rank) - 1;
    return values[std::min(values.size() - 1, idx)];
  };
  p.p50 = at(0.5);
  p.p99 = at(0.99);
  p.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  return p;
}

Result<SimResult> simulate(const Scenario& scenario, const SimOptions& options) {
  EPX_RETURN_IF_ERROR(scenario.validate());
  return detail::guard("simulate", [&] {
    Simulator sim(scenario, options);
    return sim.run();
  });
}

}  // namespace epx::sim
