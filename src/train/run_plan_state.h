// Private: what a RunPlan holds (epx/train/run_plan.h), for the trainer.
#pragma once

#include <optional>
#include <string>

#include "epx/comm/parallel_layout.h"
#include "epx/comm/topology.h"
#include "epx/train/run_plan.h"
#include "train/checkpoint.h"

namespace epx::detail {

struct PlanState {
  TrainConfig config;  // run_id resolved
  ModelConfig model;   // resolved
  std::optional<Topology> topology;
  std::optional<ParallelLayout> layout;
  SavePlan save;
  std::optional<CheckpointMeta> resumed;  // the resumed checkpoint's meta.json, every file verified
  std::optional<ResumePoint> resume;
  std::string resume_note, resume_data_note;
};

// The model's shape, without its layout (ranks, EP, nodes, slots): a
// checkpoint resumes on any layout of the same fingerprint.
[[nodiscard]] std::string fingerprint(const ModelConfig& m);

// The training data opens (trainer.cc, where the data source lives).
[[nodiscard]] Status check_data(const TrainConfig& config);

}  // namespace epx::detail
