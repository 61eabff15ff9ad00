// Checkpoint files of the trainer: one binary file per rank (parameters,
// AdamW moments, expert biases) and a JSON meta file, written into a
// temporary folder that replaces the target only when every rank is done.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/layer/moe_layer.h"
#include "epx/train/optimizer.h"

namespace epx::detail {

struct CheckpointMeta {
  int64_t step = 0;  // steps done
  int num_ranks = 0;
  int num_nodes = 0;
  std::string fingerprint;  // the model's shape; a resume must match it
  // EPLB (meta.json, the same for every rank): each layer's slot -> logical
  // expert map and the per-expert loads of the unfinished window. Empty without eplb.
  std::vector<std::vector<int32_t>> layer_slots;
  std::vector<std::vector<int64_t>> eplb_window;
};

// Collective.
[[nodiscard]] Status save_checkpoint(const std::string& dir, const CheckpointMeta& meta, Transport& transport,
                                     std::span<Parameter* const> params, AdamW& adam,
                                     std::span<MoELayer* const> layers, const Deadline& deadline);
// Reads meta.json and checks it against `expected` (ranks, nodes, model) and
// that every rank's file is there; fills step, layer_slots and eplb_window.
// No rank file is read.
[[nodiscard]] Status read_checkpoint_meta(const std::string& dir, CheckpointMeta* expected);
// Reads this rank's part; checks the meta against `expected` (step is read).
[[nodiscard]] Status load_checkpoint(const std::string& dir, CheckpointMeta* expected, int rank,
                                     std::span<Parameter* const> params, AdamW& adam,
                                     std::span<MoELayer* const> layers);

}  // namespace epx::detail
