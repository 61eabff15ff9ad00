#include "train/eplb_train.h"

#include <algorithm>
#include <array>
#include <numeric>

#include <fmt/format.h>

namespace epx::detail {
namespace {

// The first placement: the identity when slots == experts, else the balanced
// one for `load` (extra replicas to the lowest ids when the loads are equal).
Result<std::vector<int32_t>> place(const PlacementConfig& pc, std::vector<double> load) {
  const int E = static_cast<int>(load.size()), R = pc.num_nodes * pc.ranks_per_node;
  if (pc.num_slots == E) {
    EPX_ASSIGN_OR_RETURN(RedundantPlacement p, contiguous_placement(E, R));
    return p.slot_expert();
  }
  if (std::accumulate(load.begin(), load.end(), 0.0) <= 0) std::fill(load.begin(), load.end(), 1.0);
  EPX_ASSIGN_OR_RETURN(RedundantPlacement p, place_experts(load, pc));
  return p.slot_expert();
}

// The value, first and second moment of `p`, moments sized to the values.
std::array<std::vector<float>*, 3> state_of(AdamW& adam, Parameter& p) {
  AdamW::Moments& m = adam.moments_of(p);
  return {&p.value, &m.m, &m.v};
}

// Row e of `table` ([E, 9 x hf]) from the first replica of each logical
// expert this rank holds; other rows stay zero.
void pack_first_replicas(MoELayer& layer, AdamW& adam, const RedundantPlacement& current, int ep_rank, std::size_t hf,
                         std::vector<float>& table) {
  const std::size_t row = 9 * hf;
  for (int local = 0; local < layer.num_local_experts(); ++local) {
    const int e = layer.local_logical_expert(local);
    if (e < 0 || layer.buffer().placement().global_id(ep_rank, local) != current.replicas(e).front()) continue;
    float* dst = table.data() + static_cast<std::size_t>(e) * row;
    for (Parameter* p : layer.expert_parameters())
      for (std::vector<float>* v : state_of(adam, *p)) {
        std::copy_n(v->begin() + static_cast<std::ptrdiff_t>(local * hf), hf, dst);
        dst += hf;
      }
  }
}

// Every local slot of the (new) layer from its logical expert's row; empty slots zero.
void unpack_slots(MoELayer& layer, AdamW& adam, std::size_t hf, const std::vector<float>& table) {
  const std::size_t row = 9 * hf;
  for (int local = 0; local < layer.num_local_experts(); ++local) {
    const int e = layer.local_logical_expert(local);
    const float* src = e < 0 ? nullptr : table.data() + static_cast<std::size_t>(e) * row;
    for (Parameter* p : layer.expert_parameters())
      for (std::vector<float>* v : state_of(adam, *p)) {
        const auto at = v->begin() + static_cast<std::ptrdiff_t>(local * hf);
        if (src) {
          std::copy_n(src, hf, at);
          src += hf;
        } else {
          std::fill_n(at, hf, 0.0f);
        }
      }
  }
  for (Parameter* p : layer.expert_parameters()) p->mark_written();
}

}  // namespace

std::string RunLayout::describe() const {
  return fmt::format("{} ranks on {} node{} (EP {}, {} slots per layer{})", num_ranks, num_nodes,
                     num_nodes == 1 ? "" : "s", ep, num_slots, eplb ? ", eplb" : "");
}

RunLayout run_layout(const TrainConfig& config, const ModelConfig& model, int ep) {
  const int E = model.layer.router.num_experts;
  return {.num_ranks = config.num_ranks, .num_nodes = config.num_nodes, .ep = ep,
          .num_slots = config.balancing.eplb ? config.balancing.slots(E, ep) : E, .eplb = config.balancing.eplb};
}

RunLayout saved_layout(const CheckpointMeta& meta) {
  return {.num_ranks = meta.num_ranks, .num_nodes = meta.num_nodes, .ep = meta.ep, .num_slots = meta.num_slots,
          .eplb = !meta.layer_slots.empty()};
}

bool same_layout(const RunLayout& a, const RunLayout& b) {
  return a.num_ranks == b.num_ranks && a.num_nodes == b.num_nodes && a.ep == b.ep && a.num_slots == b.num_slots &&
         a.eplb == b.eplb;
}

PlacementConfig eplb_placement_config(const TrainConfig& config, const ModelConfig& m, int ep) {
  // One EP group's slots: it fills nodes before spanning them (ParallelLayout).
  const int E = m.layer.router.num_experts, per_node = config.num_ranks / config.num_nodes;
  const int N = ep > per_node ? ep / per_node : 1;
  const int G = m.layer.router.num_groups > 1 ? m.layer.router.num_groups : 0;
  return {.num_slots = config.balancing.slots(E, ep), .num_nodes = N, .ranks_per_node = ep / N, .num_groups = G,
          .policy = G > 0 && G % N == 0 ? PlacementPolicy::kHierarchical : PlacementPolicy::kGlobal};
}

Result<EplbStart> eplb_start(const EplbState& eplb, int num_layers, int num_experts, const CheckpointMeta* saved,
                             const RunLayout& mine) {
  EplbStart start;
  start.window.assign(static_cast<std::size_t>(num_layers), std::vector<int64_t>(num_experts, 0));
  const bool has_window = saved != nullptr && !saved->eplb_window.empty();
  if (has_window) {
    if (saved->eplb_window.size() != start.window.size())
      return invalid_argument("the checkpoint holds {} layers' eplb windows; this run has {} layers",
                              saved->eplb_window.size(), num_layers);
    for (std::size_t l = 0; l < saved->eplb_window.size(); ++l)
      if (saved->eplb_window[l].size() != static_cast<std::size_t>(num_experts))
        return invalid_argument("the checkpoint's layer {} eplb window has {} loads; the model has {} experts", l,
                                saved->eplb_window[l].size(), num_experts);
    start.window = saved->eplb_window;
  }
  if (saved != nullptr && same_layout(saved_layout(*saved), mine)) {
    if (saved->layer_slots.size() != start.window.size())
      return invalid_argument("the checkpoint holds {} layers' placements; this run has {} layers",
                              saved->layer_slots.size(), num_layers);
    start.layer_slots = saved->layer_slots;
    return start;
  }
  for (int l = 0; l < num_layers; ++l) {
    const std::vector<int64_t>& w = start.window[l];
    EPX_ASSIGN_OR_RETURN(std::vector<int32_t> slots, place(eplb.placement, std::vector<double>(w.begin(), w.end())));
    start.layer_slots.push_back(std::move(slots));
  }
  return start;
}

int64_t transfer_bytes(const std::vector<int32_t>& from, const std::vector<int32_t>& to, int num_ranks,
                       int64_t expert_bytes) {
  const std::size_t per_rank = to.size() / static_cast<std::size_t>(num_ranks);
  int64_t moved = 0;
  for (std::size_t s = 0; s < to.size(); ++s) {
    if (to[s] < 0 || to[s] == from[s]) continue;
    const auto first = from.begin() + static_cast<std::ptrdiff_t>(s / per_rank * per_rank);
    if (std::find(first, first + static_cast<std::ptrdiff_t>(per_rank), to[s]) == first + static_cast<std::ptrdiff_t>(per_rank))
      ++moved;  // not on this rank before: it crosses ranks
  }
  return moved * expert_bytes;
}

Status replace_experts(MoEModel& model, AdamW& adam, Transport& ep_group, EplbState& eplb, EplbReport* report,
                       const Deadline& deadline) {
  const int ep_rank = ep_group.rank(), ep = ep_group.num_ranks();
  const MoELayerConfig& lc = model.config().layer;
  const int E = lc.router.num_experts;
  const std::size_t hf = static_cast<std::size_t>(lc.hidden) * lc.ffn_hidden;
  for (int l = 0; l < model.config().num_layers; ++l) {
    MoELayer* layer = model.layers()[l];
    const std::vector<double> load(eplb.window[l].begin(), eplb.window[l].end());
    EPX_ASSIGN_OR_RETURN(RedundantPlacement current,
                         RedundantPlacement::from_slot_map(layer->slot_expert(), E, ep, eplb.placement.policy));
    EPX_ASSIGN_OR_RETURN(RebalancePlan plan, rebalance(current, load, eplb.placement, eplb.expert_bytes));
    report->balance_before.push_back(balance(rank_loads(current, load)));
    report->balance_after.push_back(plan.balance);
    report->num_moved_slots += plan.num_moved_slots;
    report->moved_bytes += transfer_bytes(current.slot_expert(), plan.placement.slot_expert(), ep, eplb.expert_bytes);
    std::fill(eplb.window[l].begin(), eplb.window[l].end(), 0);
    if (plan.num_moved_slots == 0) continue;

    std::vector<float> table(static_cast<std::size_t>(E) * 9 * hf, 0.0f);
    pack_first_replicas(*layer, adam, current, ep_rank, hf, table);
    EPX_RETURN_IF_ERROR(ep_group.all_reduce(std::span<float>(table), ReduceOp::kSum, deadline));
    EPX_RETURN_IF_ERROR(model.replace_layer(l, plan.placement.slot_expert()));
    unpack_slots(*model.layers()[l], adam, hf, table);
  }
  return Status::ok();
}

}  // namespace epx::detail
