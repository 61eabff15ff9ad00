// EPLB in training: where each layer's redundant experts start, and the
// re-placements that move them during a run.
//
// Replicas learn as one logical expert: every replica holds the same weights
// and AdamW moments (MoELayer::sum_replica_gradients gives them the same
// summed gradient, so the same update); a re-placement copies each logical
// expert's weights and moments together from its first replica to every slot
// that holds it afterwards, so the math of the run does not change (only the
// order of fp32 sums over the split tokens).
//
// A run starts from the balanced placement for equal loads, or from a
// checkpoint: its own placement when it was written by the same layout
// (ranks, nodes, EP, slots: the same bits as a run that never stopped), else
// one placed anew from the checkpoint's window loads (resharding).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/balance/placement.h"
#include "epx/train/trainer.h"
#include "train/checkpoint.h"

namespace epx::detail {

// What re-placing the experts needs, the same on every rank.
struct EplbState {
  PlacementConfig placement;
  int64_t expert_bytes = 0;                  // w1, w3, w2 with their two AdamW moments, f32
  std::vector<std::vector<int64_t>> window;  // per layer, per logical expert: load since the last re-placement
};

// The run's layout as a checkpoint records it: ranks, nodes, ep, slots per
// layer (eplb slots, or the experts), and whether eplb placed them.
struct RunLayout {
  int num_ranks = 0, num_nodes = 0, ep = 0, num_slots = 0;
  bool eplb = false;
  [[nodiscard]] std::string describe() const;  // "4 ranks on 1 node (EP 4, 12 slots per layer, eplb)"
};
[[nodiscard]] RunLayout run_layout(const TrainConfig& config, const ModelConfig& model, int ep);
[[nodiscard]] RunLayout saved_layout(const CheckpointMeta& meta);
[[nodiscard]] bool same_layout(const RunLayout& a, const RunLayout& b);

// The placement problem of one EP group of `ep` ranks.
[[nodiscard]] PlacementConfig eplb_placement_config(const TrainConfig& config, const ModelConfig& model, int ep);

// The slot maps and window loads an eplb run starts with. `saved`: the
// checkpoint's meta.json (null: a fresh run). Kept from it when it was
// written by the same layout with eplb; otherwise placed from its window
// loads per layer (equal loads where the window is empty or absent).
struct EplbStart {
  std::vector<std::vector<int32_t>> layer_slots;
  std::vector<std::vector<int64_t>> window;
};
[[nodiscard]] Result<EplbStart> eplb_start(const EplbState& eplb, int num_layers, int num_experts,
                                           const CheckpointMeta* saved, const RunLayout& mine);

// Bytes a re-placement from `from` to `to` (slot -> logical expert maps of one
// layer, slots rank-major over `num_ranks` ranks) sends between ranks: one
// expert (expert_bytes) per slot that holds another expert afterwards, unless
// that rank already held a replica of it (then it is a local copy).
[[nodiscard]] int64_t transfer_bytes(const std::vector<int32_t>& from, const std::vector<int32_t>& to, int num_ranks,
                                     int64_t expert_bytes);

// Re-places every layer's experts from the window's loads (and zeroes the
// window) within one EP group (`ep_group`: its transport; every EP group
// does the same). Weights and AdamW moments travel as one all-reduce of a
// [E, 3 x 3 x H x F] logical table per changed layer, to which only each
// expert's first replica contributes. The report counts, for this EP group,
// the slots whose expert changed and transfer_bytes (the caller scales both
// by the EP groups). Collective over the EP group.
[[nodiscard]] Status replace_experts(MoEModel& model, AdamW& adam, Transport& ep_group, EplbState& eplb,
                                     EplbReport* report, const Deadline& deadline);

}  // namespace epx::detail
