#include "epx/balance/placement.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <iterator>
#include <queue>
#include <tuple>
#include <utility>

namespace epx {

namespace {

constexpr double kNoCap = std::numeric_limits<double>::infinity();
// A cap factor under which nothing stays where it is (`current` only lays out slots).
constexpr double kNever = -1.0;

int num_ranks_of(const PlacementConfig& c) { return c.num_nodes * c.ranks_per_node; }

Status validate(const std::vector<double>& load, const PlacementConfig& c) {
  const int num_experts = static_cast<int>(load.size());
  if (num_experts == 0) return invalid_argument("load has 0 experts; at least 1 is needed");
  if (c.num_nodes < 1) return invalid_argument("num_nodes = {} is below the minimum 1", c.num_nodes);
  if (c.ranks_per_node < 1) return invalid_argument("ranks_per_node = {} is below the minimum 1", c.ranks_per_node);
  if (c.num_slots < num_experts)
    return invalid_argument("num_slots = {} is fewer than the {} experts", c.num_slots, num_experts);
  const int num_ranks = num_ranks_of(c);
  if (c.num_slots % num_ranks != 0)
    return invalid_argument("num_slots = {} is not a multiple of num_ranks = {} ({} nodes x {} ranks per node)",
                            c.num_slots, num_ranks, c.num_nodes, c.ranks_per_node);
  if (c.num_groups < 0) return invalid_argument("num_groups = {} is negative; 0 means no groups", c.num_groups);
  if (c.num_groups > 0 && num_experts % c.num_groups != 0)
    return invalid_argument("num_groups = {} does not divide the {} experts", c.num_groups, num_experts);
  for (int e = 0; e < num_experts; ++e) {
    if (!std::isfinite(load[e])) return invalid_argument("load[{}] = {} is not finite; loads must be finite and >= 0", e, load[e]);
    if (load[e] < 0) return invalid_argument("load[{}] = {} is negative; loads must be >= 0", e, load[e]);
  }
  return Status::ok();
}

bool uses_hierarchy(const PlacementConfig& c) {
  return c.policy == PlacementPolicy::kHierarchical && c.num_groups > 0 && c.num_groups % c.num_nodes == 0;
}

// A set of ranks that replicates and packs a set of experts on its own.
struct Domain {
  std::vector<int> ranks;
  std::vector<int> experts;
};

// Where `current` keeps most of expert e's replicas: node of each expert (-1 = none).
std::vector<int> current_node_of_expert(const RedundantPlacement& current, int ranks_per_node) {
  std::vector<int> node(current.num_experts(), -1);
  for (int e = 0; e < current.num_experts(); ++e)
    if (!current.replicas(e).empty()) node[e] = current.rank_of_slot(current.replicas(e).front()) / ranks_per_node;
  return node;
}

// Groups onto nodes (G/N each): heaviest group first onto the least loaded node
// with room, or onto its current node when that keeps the node under node_cap.
std::vector<Domain> make_domains(const std::vector<double>& load, const PlacementConfig& c,
                                 const RedundantPlacement* current, double node_cap) {
  const int num_experts = static_cast<int>(load.size());
  const int num_ranks = num_ranks_of(c);
  if (!uses_hierarchy(c)) {
    Domain d;
    d.ranks.resize(num_ranks);
    std::iota(d.ranks.begin(), d.ranks.end(), 0);
    d.experts.resize(num_experts);
    std::iota(d.experts.begin(), d.experts.end(), 0);
    return {d};
  }
  const int group_size = num_experts / c.num_groups;
  const int groups_per_node = c.num_groups / c.num_nodes;
  std::vector<double> group_load(c.num_groups, 0.0);
  for (int e = 0; e < num_experts; ++e) group_load[e / group_size] += load[e];
  std::vector<int> order(c.num_groups);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return group_load[a] > group_load[b]; });

  std::vector<int> preferred(c.num_groups, -1);
  if (current != nullptr) {
    const auto node_of = current_node_of_expert(*current, c.ranks_per_node);
    for (int g = 0; g < c.num_groups; ++g) preferred[g] = node_of[g * group_size];
  }
  std::vector<double> node_load(c.num_nodes, 0.0);
  std::vector<int> node_groups(c.num_nodes, 0);
  std::vector<Domain> domains(c.num_nodes);
  for (int g : order) {
    int best = -1;
    const int p = preferred[g];
    if (node_cap >= 0 && p >= 0 && node_groups[p] < groups_per_node && node_load[p] + group_load[g] <= node_cap) best = p;
    if (best < 0) {
      for (int m = 0; m < c.num_nodes; ++m)
        if (node_groups[m] < groups_per_node && (best < 0 || node_load[m] < node_load[best])) best = m;
    }
    node_load[best] += group_load[g];
    ++node_groups[best];
    for (int e = g * group_size; e < (g + 1) * group_size; ++e) domains[best].experts.push_back(e);
  }
  for (int n = 0; n < c.num_nodes; ++n) {
    for (int r = 0; r < c.ranks_per_node; ++r) domains[n].ranks.push_back(n * c.ranks_per_node + r);
    std::sort(domains[n].experts.begin(), domains[n].experts.end());
  }
  return domains;
}

// Replica counts inside one domain: one each, then one more for the expert with
// the heaviest load per replica until the slots are used or every expert has
// one replica per rank.
void replicate(const std::vector<double>& load, const Domain& d, int slots_per_rank, std::vector<int>& count) {
  const int cap = static_cast<int>(d.ranks.size());
  int free_slots = cap * slots_per_rank - static_cast<int>(d.experts.size());
  auto heavier = [&](int a, int b) {  // priority: load per replica, then lower id
    const double la = load[a] / count[a], lb = load[b] / count[b];
    return la != lb ? la < lb : a > b;
  };
  std::priority_queue<int, std::vector<int>, decltype(heavier)> queue(heavier);
  for (int e : d.experts) {
    count[e] = 1;
    if (cap > 1) queue.push(e);
  }
  while (free_slots > 0 && !queue.empty()) {
    const int e = queue.top();
    queue.pop();
    ++count[e];
    --free_slots;
    if (count[e] < cap) queue.push(e);
  }
}

struct Packing {
  int num_experts = 0;
  int slots_per_rank = 0;
  std::vector<double> rank_load;
  std::vector<std::vector<int>> rank_experts;
  std::vector<char> holds;  // [rank * num_experts + expert]

  bool has(int r, int e) const { return holds[static_cast<size_t>(r) * num_experts + e] != 0; }
  bool has_room(int r) const { return static_cast<int>(rank_experts[r].size()) < slots_per_rank; }
  void add(int r, int e, double w) {
    rank_experts[r].push_back(e);
    holds[static_cast<size_t>(r) * num_experts + e] = 1;
    rank_load[r] += w;
  }
  void remove(int r, int e, double w) {
    auto& v = rank_experts[r];
    v.erase(std::find(v.begin(), v.end(), e));
    holds[static_cast<size_t>(r) * num_experts + e] = 0;
    rank_load[r] -= w;
  }
};

// Replicas onto the domain's ranks, heaviest first, each onto the least loaded
// rank with a free slot that lacks the expert; with `current`, onto a rank that
// holds it now when that keeps the rank under cap_factor x the domain's mean rank
// load and under max_rank_load.
void pack(const std::vector<double>& load, const Domain& d, const std::vector<int>& count,
          const RedundantPlacement* current, double cap_factor, double max_rank_load, Packing& p) {
  double domain_load = 0;
  for (int e : d.experts) domain_load += load[e];
  const double rank_cap = std::min(cap_factor * domain_load / static_cast<double>(d.ranks.size()), max_rank_load);
  std::vector<std::pair<int, double>> items;  // (expert, load per replica)
  for (int e : d.experts)
    for (int i = 0; i < count[e]; ++i) items.emplace_back(e, load[e] / count[e]);
  std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  auto weight = [&](int e) { return load[e] / count[e]; };
  for (const auto& [e, w] : items) {
    int best = -1;
    if (current != nullptr && cap_factor >= 0) {
      for (int s : current->replicas(e)) {
        const int r = current->rank_of_slot(s);
        if (std::find(d.ranks.begin(), d.ranks.end(), r) == d.ranks.end()) continue;
        if (!p.has_room(r) || p.has(r, e) || p.rank_load[r] + w > rank_cap) continue;
        if (best < 0 || p.rank_load[r] < p.rank_load[best]) best = r;
      }
    }
    if (best < 0) {
      for (int r : d.ranks)
        if (p.has_room(r) && !p.has(r, e) && (best < 0 || p.rank_load[r] < p.rank_load[best])) best = r;
    }
    if (best < 0) {
      // Every rank with room holds e. Move some x from a full rank p_r that lacks
      // e to a rank q with room that lacks x (one exists: q holds e, p_r does
      // not, and q holds fewer experts), then put e on p_r.
      int q = -1;
      for (int r : d.ranks)
        if (p.has_room(r)) { q = r; break; }
      EPX_CHECK(q >= 0);
      for (int r : d.ranks) {
        if (p.has(r, e)) continue;
        for (int x : p.rank_experts[r]) {
          if (p.has(q, x)) continue;
          p.remove(r, x, weight(x));
          p.add(q, x, weight(x));
          best = r;
          break;
        }
        if (best >= 0) break;
      }
      EPX_CHECK(best >= 0);
    }
    p.add(best, e, w);
  }
}

// Lays each rank's experts into its slots: an expert stays in the slot that
// holds it in `current`; the rest fill the free slots in ascending id.
std::vector<int32_t> lay_out(const Packing& p, int num_ranks, const RedundantPlacement* current) {
  const int spr = p.slots_per_rank;
  std::vector<int32_t> slot_expert(static_cast<size_t>(num_ranks) * spr, -1);
  for (int r = 0; r < num_ranks; ++r) {
    std::vector<int> rest = p.rank_experts[r];
    std::sort(rest.begin(), rest.end());
    if (current != nullptr) {
      for (int j = 0; j < spr; ++j) {
        const int e = current->slot_expert()[r * spr + j];
        auto it = std::find(rest.begin(), rest.end(), e);
        if (e < 0 || it == rest.end()) continue;
        slot_expert[r * spr + j] = e;
        rest.erase(it);
      }
    }
    size_t next = 0;
    for (int j = 0; j < spr && next < rest.size(); ++j)
      if (slot_expert[r * spr + j] < 0) slot_expert[r * spr + j] = rest[next++];
  }
  return slot_expert;
}

// The placement with the given caps, as factors of the mean node and domain rank
// load, and as the largest rank load a kept replica may lead to (kNever with
// `current`: from scratch, laid out into current's slots).
Result<RedundantPlacement> build(const std::vector<double>& load, const PlacementConfig& c,
                                 const RedundantPlacement* current, double node_cap_factor, double rank_cap_factor,
                                 double max_rank_load = kNoCap) {
  const int num_experts = static_cast<int>(load.size());
  const int num_ranks = num_ranks_of(c);
  const double total = std::accumulate(load.begin(), load.end(), 0.0);
  const double node_cap = node_cap_factor * total / c.num_nodes;
  const auto domains = make_domains(load, c, current, node_cap);
  Packing p;
  p.num_experts = num_experts;
  p.slots_per_rank = c.num_slots / num_ranks;
  p.rank_load.assign(num_ranks, 0.0);
  p.rank_experts.assign(num_ranks, {});
  p.holds.assign(static_cast<size_t>(num_ranks) * num_experts, 0);
  std::vector<int> count(num_experts, 0);
  for (const auto& d : domains) {
    replicate(load, d, p.slots_per_rank, count);
    pack(load, d, count, current, rank_cap_factor, max_rank_load, p);
  }
  return RedundantPlacement::from_slot_map(lay_out(p, num_ranks, current), num_experts, num_ranks,
                                           uses_hierarchy(c) ? PlacementPolicy::kHierarchical : PlacementPolicy::kGlobal);
}

// Greedy matching of `num` rows to `num` columns, largest score first (ties to
// the lower row, then column): perm[row] = column.
std::vector<int> greedy_match(const std::vector<std::vector<int>>& score) {
  const int num = static_cast<int>(score.size());
  std::vector<std::tuple<int, int, int>> pairs;  // (-score, row, column)
  for (int a = 0; a < num; ++a)
    for (int b = 0; b < num; ++b) pairs.emplace_back(-score[a][b], a, b);
  std::sort(pairs.begin(), pairs.end());
  std::vector<int> perm(num, -1);
  std::vector<char> taken(num, 0);
  for (const auto& [neg, a, b] : pairs) {
    (void)neg;
    if (perm[a] >= 0 || taken[b]) continue;
    perm[a] = b;
    taken[b] = 1;
  }
  return perm;
}

// `placement` with its nodes (when `by_node`) and then the ranks inside each node
// renumbered to overlap `current` the most, laid out into current's slots. The
// rank loads are only permuted, so the balance is the same.
Result<RedundantPlacement> relabel(const RedundantPlacement& placement, const RedundantPlacement& current,
                                   int num_nodes, int ranks_per_node, bool by_node) {
  const int num_ranks = placement.num_ranks();
  const int spr = placement.slots_per_rank();
  const int num_experts = placement.num_experts();
  auto experts_on = [&](const RedundantPlacement& p, int r) {
    std::vector<int> v;
    for (int j = 0; j < spr; ++j)
      if (p.slot_expert()[r * spr + j] >= 0) v.push_back(p.slot_expert()[r * spr + j]);
    std::sort(v.begin(), v.end());
    return v;
  };
  auto overlap = [](const std::vector<int>& a, const std::vector<int>& b) {
    std::vector<int> both;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
    return static_cast<int>(both.size());
  };
  std::vector<std::vector<int>> mine(num_ranks), theirs(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    mine[r] = experts_on(placement, r);
    theirs[r] = experts_on(current, r);
  }
  const int group_size = by_node ? ranks_per_node : num_ranks;
  const int num_rank_groups = num_ranks / group_size;
  std::vector<int> group_perm(num_rank_groups, 0);
  if (by_node && num_nodes > 1) {
    std::vector<std::vector<int>> score(num_nodes, std::vector<int>(num_nodes, 0));
    for (int a = 0; a < num_nodes; ++a) {
      std::vector<int> in_a(num_experts, 0);
      for (int r = a * ranks_per_node; r < (a + 1) * ranks_per_node; ++r)
        for (int e : mine[r]) ++in_a[e];
      for (int b = 0; b < num_nodes; ++b) {
        std::vector<int> in_b(num_experts, 0);
        for (int r = b * ranks_per_node; r < (b + 1) * ranks_per_node; ++r)
          for (int e : theirs[r]) ++in_b[e];
        for (int e = 0; e < num_experts; ++e) score[a][b] += std::min(in_a[e], in_b[e]);
      }
    }
    group_perm = greedy_match(score);
  }
  Packing p;
  p.slots_per_rank = spr;
  p.rank_experts.assign(num_ranks, {});
  for (int a = 0; a < num_rank_groups; ++a) {
    const int b = group_perm[a];
    std::vector<std::vector<int>> score(group_size, std::vector<int>(group_size, 0));
    for (int i = 0; i < group_size; ++i)
      for (int j = 0; j < group_size; ++j)
        score[i][j] = overlap(mine[a * group_size + i], theirs[b * group_size + j]);
    const auto rank_perm = greedy_match(score);
    for (int i = 0; i < group_size; ++i) p.rank_experts[b * group_size + rank_perm[i]] = mine[a * group_size + i];
  }
  return RedundantPlacement::from_slot_map(lay_out(p, num_ranks, &current), num_experts, num_ranks,
                                           placement.policy());
}

// `current` with its replica counts kept, improved by swapping the contents of
// two slots on ranks of one node (`by_node`) or anywhere: each step takes the
// swap off the most loaded rank that lowers the larger of the two ranks' loads
// the most, until the balance is at most `target` or no swap helps.
Result<RedundantPlacement> swap_repair(const RedundantPlacement& current, const std::vector<double>& load,
                                       int ranks_per_node, bool by_node, double target) {
  const int num_ranks = current.num_ranks();
  const int spr = current.slots_per_rank();
  std::vector<int32_t> se = current.slot_expert();
  auto weight = [&](int e) { return e < 0 ? 0.0 : load[e] / current.num_replicas(e); };
  std::vector<double> rank_load = rank_loads(current, load);
  auto holds = [&](int r, int e) {
    for (int j = 0; j < spr; ++j)
      if (se[r * spr + j] == e) return true;
    return false;
  };
  const double mean = std::accumulate(rank_load.begin(), rank_load.end(), 0.0) / num_ranks;
  for (int step = 0; step < current.num_slots() && mean > 0; ++step) {
    const int r = static_cast<int>(std::max_element(rank_load.begin(), rank_load.end()) - rank_load.begin());
    if (rank_load[r] <= target * mean) break;
    int best_i = -1, best_j = -1;
    double best_max = rank_load[r] * (1 - 1e-9);
    const int q_begin = by_node ? r / ranks_per_node * ranks_per_node : 0;
    const int q_end = by_node ? q_begin + ranks_per_node : num_ranks;
    for (int i = r * spr; i < (r + 1) * spr; ++i) {
      const int a = se[i];
      if (a < 0) continue;
      for (int q = q_begin; q < q_end; ++q) {
        if (q == r || holds(q, a)) continue;
        for (int j = q * spr; j < (q + 1) * spr; ++j) {
          const int b = se[j];
          if (b >= 0 && holds(r, b)) continue;
          const double new_max = std::max(rank_load[r] - weight(a) + weight(b), rank_load[q] - weight(b) + weight(a));
          if (new_max < best_max) {
            best_max = new_max;
            best_i = i;
            best_j = j;
          }
        }
      }
    }
    if (best_i < 0) break;
    const double wa = weight(se[best_i]), wb = weight(se[best_j]);
    rank_load[best_i / spr] += wb - wa;
    rank_load[best_j / spr] += wa - wb;
    std::swap(se[best_i], se[best_j]);
  }
  return RedundantPlacement::from_slot_map(std::move(se), current.num_experts(), num_ranks, current.policy());
}

// `current` with the replica counts of `counts_from`: replicas dropped from the
// most loaded ranks, added on the least loaded rank of the expert's node
// (`by_node`) or anywhere that lacks it, and a slot left free given to the
// expert there with the heaviest load per replica. Other slots keep their expert.
Result<RedundantPlacement> recount(const RedundantPlacement& current, const RedundantPlacement& counts_from,
                                   const std::vector<double>& load, int ranks_per_node, bool by_node) {
  const int num_experts = current.num_experts();
  const int spr = current.slots_per_rank();
  std::vector<int32_t> se = current.slot_expert();
  const auto current_counts = current.replica_counts();
  std::vector<int> count(current_counts.begin(), current_counts.end());
  auto rank_load = [&](int r) {
    double sum = 0;
    for (int j = 0; j < spr; ++j)
      if (se[r * spr + j] >= 0) sum += load[se[r * spr + j]] / count[se[r * spr + j]];
    return sum;
  };
  auto holds = [&](int r, int e) {
    for (int j = 0; j < spr; ++j)
      if (se[r * spr + j] == e) return true;
    return false;
  };
  // Node of each expert (of its first replica; with by_node all are there).
  std::vector<int> node(num_experts, -1);
  for (int e = 0; e < num_experts; ++e)
    if (current.num_replicas(e) > 0) node[e] = current.rank_of_slot(current.replicas(e).front()) / ranks_per_node;
  // Fewer replicas: free the slot on the most loaded rank, one at a time.
  for (int e = 0; e < num_experts; ++e) {
    while (count[e] > std::max(1, counts_from.num_replicas(e))) {
      int worst = -1;
      for (int s = 0; s < static_cast<int>(se.size()); ++s)
        if (se[s] == e && (worst < 0 || rank_load(s / spr) > rank_load(worst / spr))) worst = s;
      se[worst] = -1;
      --count[e];
    }
  }
  // More replicas, heaviest load per replica first.
  std::vector<int> order(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return load[a] / count[a] > load[b] / count[b]; });
  for (int e : order) {
    while (count[e] < counts_from.num_replicas(e)) {
      int best = -1;
      for (int s = 0; s < static_cast<int>(se.size()); ++s) {
        const int r = s / spr;
        if (se[s] >= 0 || holds(r, e) || (by_node && r / ranks_per_node != node[e])) continue;
        if (best < 0 || rank_load(r) < rank_load(best / spr)) best = s;
      }
      if (best < 0) break;
      se[best] = e;
      ++count[e];
    }
  }
  // Slots still free.
  for (int s = 0; s < static_cast<int>(se.size()); ++s) {
    if (se[s] >= 0) continue;
    const int r = s / spr;
    int best = -1;
    for (int e = 0; e < num_experts; ++e) {
      if (holds(r, e) || (by_node && node[e] != r / ranks_per_node)) continue;
      if (best < 0 || load[e] / (count[e] + 1) > load[best] / (count[best] + 1)) best = e;
    }
    if (best < 0) continue;
    se[s] = best;
    ++count[best];
  }
  return RedundantPlacement::from_slot_map(std::move(se), num_experts, current.num_ranks(), current.policy());
}

int count_moved(const RedundantPlacement& from, const RedundantPlacement& to) {
  int moved = 0;
  for (int s = 0; s < to.num_slots(); ++s) {
    const int e = to.slot_expert()[s];
    if (e >= 0 && e != from.slot_expert()[s]) ++moved;
  }
  return moved;
}

}  // namespace

Result<RedundantPlacement> RedundantPlacement::from_slot_map(std::vector<int32_t> slot_expert, int num_experts,
                                                             int num_ranks, PlacementPolicy policy) {
  const int num_slots = static_cast<int>(slot_expert.size());
  if (num_ranks < 1) return invalid_argument("num_ranks = {} is below the minimum 1", num_ranks);
  if (num_experts < 1) return invalid_argument("num_experts = {} is below the minimum 1", num_experts);
  if (num_slots % num_ranks != 0)
    return invalid_argument("num_slots = {} is not a multiple of num_ranks = {}", num_slots, num_ranks);
  RedundantPlacement p;
  p.num_ranks_ = num_ranks;
  p.policy_ = policy;
  p.replicas_.assign(num_experts, {});
  const int spr = num_slots / num_ranks;
  for (int s = 0; s < num_slots; ++s) {
    const int e = slot_expert[s];
    if (e < -1 || e >= num_experts)
      return invalid_argument("slot_expert[{}] = {} is outside [-1, {})", s, e, num_experts);
    if (e < 0) continue;
    if (!p.replicas_[e].empty() && p.replicas_[e].back() / spr == s / spr)
      return invalid_argument("slot_expert[{}] = {}: rank {} already holds expert {} (one replica per rank at most)", s,
                              e, s / spr, e);
    p.replicas_[e].push_back(s);
  }
  for (int e = 0; e < num_experts; ++e)
    if (p.replicas_[e].empty()) return invalid_argument("expert {} has no slot; every expert needs at least 1", e);
  p.slot_expert_ = std::move(slot_expert);
  return p;
}

std::vector<int32_t> RedundantPlacement::replica_counts() const {
  std::vector<int32_t> counts(replicas_.size());
  for (size_t e = 0; e < replicas_.size(); ++e) counts[e] = static_cast<int32_t>(replicas_[e].size());
  return counts;
}

std::vector<int32_t> RedundantPlacement::slot_rank() const {
  std::vector<int32_t> ranks(slot_expert_.size());
  for (int s = 0; s < num_slots(); ++s) ranks[s] = rank_of_slot(s);
  return ranks;
}

Result<ExpertPlacement> RedundantPlacement::to_expert_placement() const {
  return ExpertPlacement::from_map(slot_rank(), num_ranks_);
}

Result<RedundantPlacement> place_experts(const std::vector<double>& load, const PlacementConfig& config) {
  EPX_RETURN_IF_ERROR(validate(load, config));
  return build(load, config, nullptr, kNever, kNever);
}

Result<RedundantPlacement> contiguous_placement(int num_experts, int num_ranks) {
  if (num_ranks < 1 || num_experts < 1 || num_experts % num_ranks != 0)
    return invalid_argument("num_experts = {} is not a positive multiple of num_ranks = {}", num_experts, num_ranks);
  std::vector<int32_t> slot_expert(num_experts);
  std::iota(slot_expert.begin(), slot_expert.end(), 0);
  return RedundantPlacement::from_slot_map(std::move(slot_expert), num_experts, num_ranks);
}

std::vector<double> rank_loads(const RedundantPlacement& placement, const std::vector<double>& load) {
  std::vector<double> out(placement.num_ranks(), 0.0);
  for (int e = 0; e < placement.num_experts() && e < static_cast<int>(load.size()); ++e)
    for (int s : placement.replicas(e)) out[placement.rank_of_slot(s)] += load[e] / placement.num_replicas(e);
  return out;
}

double balance(const std::vector<double>& rank_load) {
  if (rank_load.empty()) return 1.0;
  const double mean = std::accumulate(rank_load.begin(), rank_load.end(), 0.0) / static_cast<double>(rank_load.size());
  return mean > 0 ? *std::max_element(rank_load.begin(), rank_load.end()) / mean : 1.0;
}

int64_t moved_bytes(const RedundantPlacement& from, const RedundantPlacement& to, int64_t expert_bytes) {
  EPX_CHECK_EQ(from.num_slots(), to.num_slots());
  return static_cast<int64_t>(count_moved(from, to)) * expert_bytes;
}

Result<RebalancePlan> rebalance(const RedundantPlacement& current, const std::vector<double>& load,
                                const PlacementConfig& config, int64_t expert_bytes, double tolerance) {
  EPX_RETURN_IF_ERROR(validate(load, config));
  if (current.num_slots() != config.num_slots)
    return invalid_argument("current placement has {} slots; the config asks for {}", current.num_slots(),
                            config.num_slots);
  if (current.num_ranks() != num_ranks_of(config))
    return invalid_argument("current placement has {} ranks; the config asks for {}", current.num_ranks(),
                            num_ranks_of(config));
  if (current.num_experts() != static_cast<int>(load.size()))
    return invalid_argument("current placement has {} experts; load has {}", current.num_experts(), load.size());
  if (expert_bytes < 0) return invalid_argument("expert_bytes = {} is negative", expert_bytes);
  if (!(tolerance >= 0)) return invalid_argument("tolerance = {} is below the minimum 0", tolerance);

  EPX_ASSIGN_OR_RETURN(auto scratch, build(load, config, nullptr, kNever, kNever));
  const double scratch_balance = balance(rank_loads(scratch, load));
  const double target = scratch_balance * (1 + tolerance);
  auto plan_of = [&](RedundantPlacement p) {
    const int moved = count_moved(current, p);
    const double b = balance(rank_loads(p, load));
    return RebalancePlan{std::move(p), b, scratch_balance, moved, static_cast<int64_t>(moved) * expert_bytes};
  };
  // From scratch, nodes and ranks renumbered to overlap the current placement
  // and laid into the slots they hold now: the same balance, so the fallback.
  EPX_ASSIGN_OR_RETURN(auto aligned, relabel(scratch, current, config.num_nodes, config.ranks_per_node,
                                             scratch.policy() == PlacementPolicy::kHierarchical));
  RebalancePlan best = plan_of(std::move(aligned));
  auto consider = [&](RebalancePlan candidate) {
    if (candidate.balance <= target * (1 + 1e-12) && candidate.num_moved_slots < best.num_moved_slots)
      best = std::move(candidate);
  };
  consider(plan_of(current));
  EPX_ASSIGN_OR_RETURN(auto repaired, swap_repair(current, load, config.ranks_per_node,
                                                  scratch.policy() == PlacementPolicy::kHierarchical, target));
  consider(plan_of(std::move(repaired)));
  // The same after taking the from-scratch replica counts.
  EPX_ASSIGN_OR_RETURN(auto recounted, recount(current, scratch, load, config.ranks_per_node,
                                               scratch.policy() == PlacementPolicy::kHierarchical));
  EPX_ASSIGN_OR_RETURN(auto recounted_repaired, swap_repair(recounted, load, config.ranks_per_node,
                                                            scratch.policy() == PlacementPolicy::kHierarchical, target));
  consider(plan_of(std::move(recounted_repaired)));
  const double max_rank_load =
      target * std::accumulate(load.begin(), load.end(), 0.0) / static_cast<double>(current.num_ranks());
  for (double node_cap : {kNoCap, target}) {
    for (double rank_cap : {target, scratch_balance, 1.0}) {
      EPX_ASSIGN_OR_RETURN(auto sticky, build(load, config, &current, node_cap, rank_cap, max_rank_load));
      consider(plan_of(std::move(sticky)));
    }
  }
  return best;
}

Result<std::vector<int32_t>> choose_replicas(const RedundantPlacement& placement, std::span<const int32_t> topk_idx,
                                             int topk, ReplicaChoice choice) {
  return map_to_replicas(placement.replica_table(), topk_idx, topk, choice);
}

}  // namespace epx
