// A training run decided once, before step 1.
//
// plan_run checks a TrainConfig once and keeps what it decided: the settings
// (TrainConfig::validate's rules and messages), the model with the balancing
// applied and the buffers sized (TrainConfig::resolved_model), the topology
// and the EP x EDP layout, the data (opened once, so a bad file fails here),
// a resume's checkpoint (every file verified once: check_resume; its
// meta.json kept), the run id (resolve_run_id) and the save folder (probed
// once: check_save). Every later stage takes the plan:
// `epx train`'s start lines and memory estimate, train(plan) and its
// checkpoints, the summary's efficiency line; none checks or reads again.
// The plan is immutable; copies share one state.
//
//   EPX_ASSIGN_OR_RETURN(epx::RunPlan plan, epx::plan_run(config));
//   fmt::print("{}\n", plan.layout().describe());
//   EPX_ASSIGN_OR_RETURN(epx::TrainSummary summary, epx::train(plan, on_step));
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "epx/comm/parallel_layout.h"
#include "epx/train/trainer.h"

namespace epx {

namespace detail {
struct PlanState;  // train/run_plan_state.h
}

class RunPlan {
 public:
  // The settings as given, with run_id resolved.
  [[nodiscard]] const TrainConfig& config() const;
  // resolved_model(). EPLB's starting slot maps are train()'s to compute
  // (from resume()'s checkpoint): they are sized by the slots, after the
  // memory estimate.
  [[nodiscard]] const ModelConfig& model() const;
  [[nodiscard]] const Topology& topology() const;
  [[nodiscard]] const ParallelLayout& layout() const;
  // check_save's plan (empty folder: no save_dir).
  [[nodiscard]] const SavePlan& save() const;
  // Where a resume starts; empty without resume_dir.
  [[nodiscard]] const std::optional<ResumePoint>& resume() const;
  // resume_note and resume_data_note: a line each, or empty.
  [[nodiscard]] const std::string& resume_note() const;
  [[nodiscard]] const std::string& resume_data_note() const;
  // The trainer's view (private types: the resumed checkpoint's meta).
  [[nodiscard]] const detail::PlanState& state() const { return *state_; }

 private:
  friend Result<RunPlan> plan_run(const TrainConfig& config);
  explicit RunPlan(std::shared_ptr<const detail::PlanState> state) : state_(std::move(state)) {}
  std::shared_ptr<const detail::PlanState> state_;
};

// The checks in the order their errors are reported: the settings
// (TrainConfig::validate), the data, the resume (check_resume), the run id,
// the save folder (check_save). The first failure is returned with the same
// message those give.
[[nodiscard]] Result<RunPlan> plan_run(const TrainConfig& config);

// train() on a plan: nothing is checked or read again before the ranks start
// (train(config) is plan_run, then this).
Result<TrainSummary> train(const RunPlan& plan, const StepCallback& on_step = {}, bool keep_parameters = false);

}  // namespace epx
