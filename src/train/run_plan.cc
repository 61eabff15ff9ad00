// plan_run: every check of a training run, once, before step 1 (epx/train/run_plan.h).
#include "epx/train/run_plan.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/core/memory.h"
#include "core/guard.h"
#include "train/checkpoint.h"
#include "train/eplb_train.h"
#include "train/run_plan_state.h"

namespace epx {

namespace detail {

std::string fingerprint(const ModelConfig& m) {
  const MoELayerConfig& l = m.layer;
  return fmt::format("task={} in={} out={} layers={} hidden={} ffn={} experts={} topk={} shared={} dtype={}",
                     m.task == TaskKind::kRegression ? "regression" : "next-byte", m.num_inputs(), m.num_outputs(),
                     m.num_layers, l.hidden, l.ffn_hidden, l.router.num_experts, l.router.topk, l.num_shared_experts,
                     dtype_name(l.dtype));
}

}  // namespace detail

using detail::fingerprint;

Result<ModelConfig> TrainConfig::resolved_model() const {
  ModelConfig m = model;
  if (num_ranks < 1) return invalid_argument("ranks = {} must be at least 1", num_ranks);
  if (batch_tokens < 1) return invalid_argument("batch_tokens = {} must be at least 1", batch_tokens);
  const int64_t per_rank = batch_tokens / num_ranks + (batch_tokens % num_ranks != 0 ? 1 : 0);
  if (per_rank > std::numeric_limits<int>::max())
    return invalid_argument("batch_tokens = {} is above the limit {} for ranks = {} ({} tokens per rank at most)",
                            batch_tokens, int64_t{std::numeric_limits<int>::max()} * num_ranks, num_ranks,
                            std::numeric_limits<int>::max());
  m.max_tokens_per_rank = static_cast<int>(per_rank);
  m.layer.aux_loss_coeff = balancing.aux_loss_coeff;
  m.layer.aux_loss = balancing.aux_loss;
  m.layer.expert_bias = balancing.expert_bias;
  m.layer.bias_rate = balancing.bias_rate;
  m.layer.router.capacity_factor = balancing.capacity_factor;
  m.layer.router.drop_policy = balancing.drop_policy;
  if (m.task == TaskKind::kNextByte) m.window = text.window;
  if (m.task == TaskKind::kRegression) {
    if (synthetic.input_dim != m.input_dim || synthetic.output_dim != m.output_dim)
      return invalid_argument("the data has {} inputs and {} outputs, the model {} and {}", synthetic.input_dim,
                              synthetic.output_dim, m.input_dim, m.output_dim);
  }
  EPX_RETURN_IF_ERROR(m.validate());
  return m;
}

namespace {

// Bytes of one checkpoint (dense.bin, the ep expert files, meta.json), from
// the shapes: each dense parameter and each logical expert once, values and
// two AdamW moments in f32 with a name and counts, the expert biases, the
// headers, meta.json's expert lists and eplb state. An upper bound within a
// few percent.
int64_t checkpoint_bytes(const TrainConfig& config, const ModelConfig& m) {
  // Saturating, so an absurd shape gives a huge size rather than a wrapped one.
  const int64_t H = m.layer.hidden, F = m.layer.ffn_hidden, E = m.layer.router.num_experts, L = m.num_layers;
  const int64_t ep = config.ep_size(), S = saturating_product({m.layer.num_shared_experts, F});
  const int64_t slots = config.balancing.eplb ? config.balancing.slots(static_cast<int>(E), static_cast<int>(ep)) : E;
  const int64_t per_layer = saturating_sum(saturating_sum(H, saturating_product({H, E})), saturating_product({3, H, S}));
  const int64_t dense = saturating_sum(saturating_product({int64_t{m.num_inputs()} + 1 + m.num_outputs(), H}),
                                       saturating_product({L, per_layer}));
  const int64_t num_dense = 3 + L * (2 + (S > 0 ? 3 : 0));
  constexpr int64_t kPerParam = 4 + 40 + 3 * 8;  // name length, a name of up to 40 bytes, three counts
  const int64_t dense_file = saturating_sum(saturating_sum(128 + num_dense * kPerParam, saturating_product({12, dense})),
                                            saturating_product({L, 8 + 4 * E}));
  const int64_t expert_files =
      saturating_sum(ep * 128, saturating_product({L, E, 3, saturating_sum(kPerParam, saturating_product({12, H, F}))}));
  const int64_t eplb_state = config.balancing.eplb ? saturating_product({L, slots * 12 + E * 21}) : 0;
  const int64_t meta = saturating_sum(saturating_sum(1024 + (ep + 1) * 120, saturating_product({L, E, 12})), eplb_state);
  return saturating_sum(saturating_sum(dense_file, expert_files), meta);
}

std::string bytes_text(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024 && u < 5) {
    bytes /= 1024;
    ++u;
  }
  return fmt::format("{:.{}f} {}", bytes, u == 0 ? 0 : 1, units[u]);
}

// "seed = 1 in the checkpoint, 2 in this run" for each setting that differs.
std::vector<std::string> data_differences(const std::map<std::string, std::string>& saved,
                                          const std::map<std::string, std::string>& mine) {
  std::set<std::string> keys;
  for (const auto& [key, value] : saved) keys.insert(key);
  for (const auto& [key, value] : mine) keys.insert(key);
  std::vector<std::string> out;
  for (const std::string& key : keys) {
    const auto a = saved.find(key), b = mine.find(key);
    const std::string old_value = a == saved.end() ? "(none)" : a->second;
    const std::string new_value = b == mine.end() ? "(none)" : b->second;
    if (old_value != new_value)
      out.push_back(fmt::format("{} = {} in the checkpoint, {} in this run", key, old_value, new_value));
  }
  return out;
}

std::string new_run_id() {
  std::random_device device;
  const uint64_t random = (uint64_t{device()} << 32) ^ device();
  const auto now = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  return fmt::format("{:016x}", random ^ (now * 0x9e3779b97f4a7c15ULL));
}

// A run id is a word meta.json can hold (parse_checkpoint_meta's rule).
Status check_run_id(const std::string& id) {
  if (id.size() > 64 || id.find_first_not_of("0123456789abcdefghijklmnopqrstuvwxyz-_") != std::string::npos)
    return invalid_argument("run_id '{}' must be at most 64 lowercase letters, digits, '-' or '_'", id);
  return Status::ok();
}

}  // namespace

std::map<std::string, std::string> data_settings(const TrainConfig& c) {
  std::map<std::string, std::string> s = {{"batch_tokens", fmt::format("{}", c.batch_tokens)}};
  if (c.model.task == TaskKind::kRegression) {
    const SyntheticTaskConfig& d = c.synthetic;
    s["data"] = "synthetic";
    s["seed"] = fmt::format("{}", d.seed);
    s["clusters"] = fmt::format("{}", d.num_clusters);
    s["zipf"] = fmt::format("{}", d.zipf_s);
    s["cluster_spread"] = fmt::format("{}", d.cluster_spread);
    s["input_dim"] = fmt::format("{}", d.input_dim);
    s["output_dim"] = fmt::format("{}", d.output_dim);
  } else {
    std::error_code ec;
    const std::filesystem::path absolute = std::filesystem::absolute(c.text.path, ec);
    const std::filesystem::path path = std::filesystem::weakly_canonical(absolute, ec);
    s["data"] = "text:" + (ec ? absolute.lexically_normal() : path).string();
    s["seed"] = fmt::format("{}", c.text.seed);
    s["window"] = fmt::format("{}", c.text.window);
  }
  return s;
}

namespace {

// The settings that need no model: TrainConfig::validate up to the model.
Status check_settings(const TrainConfig& c) {
  if (c.steps < 0) return invalid_argument("steps = {} is below 0", c.steps);
  if (c.num_nodes < 1 || c.num_ranks % c.num_nodes != 0)
    return invalid_argument("nodes = {} must divide ranks = {}", c.num_nodes, c.num_ranks);
  if (!(c.clip_norm >= 0) || !std::isfinite(c.clip_norm)) return invalid_argument("clip_norm = {} must be >= 0", c.clip_norm);
  if (c.save_every < 0) return invalid_argument("save_every = {} is below 0", c.save_every);
  if (c.save_every > 0 && c.save_dir.empty()) return invalid_argument("save_every = {} needs a save folder", c.save_every);
  if (c.preempt != nullptr && c.save_dir.empty()) return invalid_argument("preemption needs a save folder to save into");
  if (c.async_save && c.save_every == 0)
    return invalid_argument(
        "async_save writes the save_every checkpoints, but save_every = 0 (only the final one, written at once)");
  if (c.keep_checkpoints < 1) return invalid_argument("keep = {} must be at least 1", c.keep_checkpoints);
  EPX_RETURN_IF_ERROR(check_run_id(c.run_id));
  if (c.wait_matrix_every < 0)
    return invalid_argument("wait_matrix_every = {} is below 0 (0: never)", c.wait_matrix_every);
  if (c.grad_bucket_bytes < 4 || c.grad_bucket_bytes > (int64_t{1} << 40))
    return invalid_argument("grad_bucket_bytes = {} is outside [4, 2^40]", c.grad_bucket_bytes);
  EPX_RETURN_IF_ERROR(c.schedule.validate());
  EPX_RETURN_IF_ERROR(c.adamw.validate());
  return Status::ok();
}

// The experts against the EP groups (and EPLB's slots), then the synthetic data:
// TrainConfig::validate after the layout.
Status check_experts(const TrainConfig& c, const ModelConfig& m) {
  const int E = m.layer.router.num_experts, R = c.ep_size();
  // What an EP group is called in the messages: all ranks, or the ep ranks of one group.
  const std::string group = R == c.num_ranks ? fmt::format("ranks = {}", R) : fmt::format("ep = {}", R);
  if (c.balancing.eplb) {
    if (c.balancing.eplb_every < 1) return invalid_argument("eplb_every = {} must be at least 1", c.balancing.eplb_every);
    if (c.balancing.eplb_slots < 0) return invalid_argument("eplb_slots = {} is below 0", c.balancing.eplb_slots);
    const int S = c.balancing.slots(E, R);
    if (S < E) return invalid_argument("eplb_slots = {} is below experts = {}", S, E);
    // Each rank holds an expert at most once: slots beyond E x R stay empty.
    if (c.balancing.eplb_slots > 0 && int64_t{c.balancing.eplb_slots} > int64_t{E} * R)
      return invalid_argument("eplb_slots = {} is above experts = {} x {} = {}: a rank holds each expert at most "
                              "once, so further slots would stay empty",
                              c.balancing.eplb_slots, E, group, int64_t{E} * R);
    if (S % R != 0)
      return invalid_argument("eplb_slots = {} must be a multiple of {}{}", S, group,
                              R == c.num_ranks ? "" : " (each EP group holds its own slots)");
  } else if (E % R != 0) {
    return invalid_argument("experts = {} must be a multiple of {} ({})", E, group,
                            R == c.num_ranks ? "contiguous placement" : "each EP group holds every expert once");
  }
  if (c.model.task == TaskKind::kRegression) return c.synthetic.validate();
  return Status::ok();
}

// ep divides the ranks and splits the nodes evenly (ParallelLayout's rules).
Result<ParallelLayout> make_layout(const TrainConfig& c, std::optional<Topology>* topology) {
  if (c.ep < 0) return invalid_argument("ep = {} is below 0 (0: all ranks)", c.ep);
  if (c.ep > 0 && c.num_ranks % c.ep != 0)
    return invalid_argument("ep = {} must divide ranks = {} (EP groups of equal size)", c.ep, c.num_ranks);
  EPX_ASSIGN_OR_RETURN(Topology t, Topology::create(c.num_ranks, c.num_nodes));
  topology->emplace(t);
  return ParallelLayout::create(t, c.ep);
}

}  // namespace

Status TrainConfig::validate() const {
  EPX_RETURN_IF_ERROR(check_settings(*this));
  EPX_ASSIGN_OR_RETURN(ModelConfig m, resolved_model());
  std::optional<Topology> topology;
  EPX_RETURN_IF_ERROR(make_layout(*this, &topology).status());
  return check_experts(*this, m);
}

namespace {

// meta.json of the resumed checkpoint, checked against model `m` (any layout).
Result<detail::CheckpointMeta> read_resumed_meta(const TrainConfig& config, const ModelConfig& m) {
  detail::CheckpointMeta meta;
  meta.fingerprint = fingerprint(m);
  EPX_RETURN_IF_ERROR(detail::read_checkpoint_meta(config.resume_dir, &meta));
  return meta;
}

// The resumed checkpoint, every file verified against model `m`.
Result<detail::CheckpointMeta> verify_resumed(const TrainConfig& config, const ModelConfig& m) {
  detail::CheckpointMeta meta;
  meta.fingerprint = fingerprint(m);
  EPX_RETURN_IF_ERROR(detail::guard(fmt::format("verifying checkpoint {}", config.resume_dir),
                                    [&] { return detail::verify_checkpoint(config.resume_dir, &meta); }));
  return meta;
}

// check_resume after the files: the step and the data settings.
Status check_resumed(const TrainConfig& config, const detail::CheckpointMeta& meta) {
  if (meta.step > config.steps)
    return invalid_argument("checkpoint {} is at step {}, past steps = {}; ask for more steps", config.resume_dir,
                            meta.step, config.steps);
  if (meta.data.empty() || config.allow_data_change) return Status::ok();
  const std::vector<std::string> changed = data_differences(meta.data, data_settings(config));
  if (changed.empty()) return Status::ok();
  return invalid_argument("checkpoint {} (step {}) was trained on other data: {}; a resume continues the data of its "
                          "checkpoint (pass --allow-data-change to train on this data from it)",
                          config.resume_dir, meta.step, fmt::join(changed, "; "));
}

std::string data_note(const TrainConfig& config, const detail::CheckpointMeta& meta) {
  if (meta.data.empty())
    return fmt::format("checkpoint {} (step {}) records no data settings (written by an earlier epx): this run's "
                       "seed, data and batch are not checked against it",
                       config.resume_dir, meta.step);
  const std::vector<std::string> changed = data_differences(meta.data, data_settings(config));
  if (changed.empty()) return std::string();
  return fmt::format("training on other data than checkpoint {} (step {}) was trained on (--allow-data-change): {}",
                     config.resume_dir, meta.step, fmt::join(changed, "; "));
}

std::string reshard_note(const TrainConfig& config, const ModelConfig& m, const detail::CheckpointMeta& meta) {
  const detail::RunLayout saved = detail::saved_layout(meta), mine = detail::run_layout(config, m, config.ep_size());
  if (detail::same_layout(saved, mine)) return std::string();
  const char* placement = !config.balancing.eplb ? "experts placed contiguously"
                          : meta.eplb_window.empty() ? "expert placement computed anew for equal loads"
                                                     : "expert placement computed anew from the saved eplb window loads";
  return fmt::format("resharding checkpoint {} (step {}) written by {} onto {}: {}", config.resume_dir, meta.step,
                     saved.describe(), mine.describe(), placement);
}

// config.run_id, else the resumed checkpoint's (`resumed`: null without a resume).
std::string own_run_id(const TrainConfig& config, const detail::CheckpointMeta* resumed) {
  if (!config.run_id.empty() || resumed == nullptr) return config.run_id;
  return resumed->run_id;
}

}  // namespace

Result<ResumePoint> resume_point(const TrainConfig& config) {
  if (config.resume_dir.empty()) return failed_precondition("resume_point: the run does not resume");
  EPX_ASSIGN_OR_RETURN(std::string folder, detail::resolve_checkpoint(config.resume_dir));
  EPX_ASSIGN_OR_RETURN(ModelConfig m, config.resolved_model());
  EPX_ASSIGN_OR_RETURN(detail::CheckpointMeta meta, read_resumed_meta(config, m));
  return ResumePoint{.folder = std::move(folder), .step = meta.step, .run_id = std::move(meta.run_id)};
}

Result<std::string> resolve_run_id(const TrainConfig& config) {
  if (!config.run_id.empty()) return config.run_id;
  if (!config.resume_dir.empty()) {
    EPX_ASSIGN_OR_RETURN(ModelConfig m, config.resolved_model());
    EPX_ASSIGN_OR_RETURN(detail::CheckpointMeta meta, read_resumed_meta(config, m));
    if (!meta.run_id.empty()) return meta.run_id;
  }
  return new_run_id();
}

Status check_resume(const TrainConfig& config) {
  if (config.resume_dir.empty()) return Status::ok();
  EPX_ASSIGN_OR_RETURN(ModelConfig m, config.resolved_model());
  EPX_ASSIGN_OR_RETURN(detail::CheckpointMeta meta, verify_resumed(config, m));
  return check_resumed(config, meta);
}

Result<std::string> resume_data_note(const TrainConfig& config) {
  if (config.resume_dir.empty()) return std::string();
  EPX_ASSIGN_OR_RETURN(ModelConfig m, config.resolved_model());
  EPX_ASSIGN_OR_RETURN(detail::CheckpointMeta meta, read_resumed_meta(config, m));
  return data_note(config, meta);
}

Result<std::string> resume_note(const TrainConfig& config) {
  if (config.resume_dir.empty()) return std::string();
  EPX_ASSIGN_OR_RETURN(ModelConfig m, config.resolved_model());
  EPX_ASSIGN_OR_RETURN(detail::CheckpointMeta meta, read_resumed_meta(config, m));
  return reshard_note(config, m, meta);
}

std::string SavePlan::describe() const {
  std::string text = fmt::format("checkpoints to {}: about {} each, keeping {}; {} free in {}", folder,
                                 bytes_text(static_cast<double>(checkpoint_bytes)), keep,
                                 bytes_text(static_cast<double>(free_bytes)), probed);
  if (tight)
    text += fmt::format(" (warning: below the {} that {} kept checkpoints and one being written need; a later save "
                        "may fail)",
                        bytes_text(static_cast<double>(checkpoint_bytes) * (keep + 1)), keep);
  return text;
}

namespace {

// "step-000004, step-000006 (run 1a2b...)", the first few of a list.
std::string describe_steps(const std::vector<detail::StepOwner>& steps) {
  constexpr std::size_t kShown = 4;
  std::vector<std::string> names;
  std::set<std::string> runs;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (i < kShown) names.push_back(detail::step_folder_name(steps[i].step));
    runs.insert(!steps[i].readable       ? "a meta.json that does not read"
                : steps[i].run_id.empty() ? "written before run ids"
                                          : "run " + steps[i].run_id);
  }
  if (steps.size() > kShown) names.push_back(fmt::format("... ({} step folders)", steps.size()));
  return fmt::format("{} ({})", fmt::join(names, ", "), fmt::join(runs, "; "));
}

// save_dir's step folders are this run's: none for a run that does not
// resume (unless it was given its run id), its checkpoint's run (and the
// folders written before run ids) for a resumed one. `own` gives the run's
// id (own_run_id), asked only when there are step folders.
Status check_other_runs(const TrainConfig& config, const std::function<Result<std::string>()>& own) {
  const std::vector<detail::StepOwner> owners = detail::list_step_owners(config.save_dir);
  if (owners.empty()) return Status::ok();
  const bool resuming = !config.resume_dir.empty();
  EPX_ASSIGN_OR_RETURN(const std::string mine_id, own());
  std::vector<detail::StepOwner> others;
  for (const detail::StepOwner& o : owners) {
    const bool mine = o.readable && ((!mine_id.empty() && o.run_id == mine_id) || (resuming && o.run_id.empty()));
    if (!mine) others.push_back(o);
  }
  if (others.empty()) return Status::ok();
  return invalid_argument(
      "--save {} holds checkpoints of another run: {}; this {} would take over its 'latest' and mix the two runs' "
      "step folders. {}Choose another --save folder, or pass --overwrite-checkpoints to save into it anyway (a step "
      "folder of the same step is replaced; --keep prunes only this run's)",
      config.save_dir, describe_steps(others), resuming ? "resumed run" : "new run",
      resuming ? "" : "To continue that run, resume it (--resume). ");
}

// check_save for model `m`, the run's id from `own` (check_other_runs).
Result<SavePlan> plan_save(const TrainConfig& config, const ModelConfig& m,
                           const std::function<Result<std::string>()>& own) {
  SavePlan plan;
  if (config.save_dir.empty()) return plan;
  EPX_ASSIGN_OR_RETURN(detail::SaveSpace space, detail::probe_save_dir(config.save_dir));
  plan.folder = config.save_dir;
  plan.probed = space.probed;
  plan.keep = config.keep_checkpoints;
  plan.checkpoint_bytes = checkpoint_bytes(config, m);
  plan.free_bytes = space.free_bytes;
  if (plan.free_bytes < static_cast<uint64_t>(plan.checkpoint_bytes))
    return invalid_argument("--save {}: one checkpoint needs about {} ({} bytes) but {} has {} ({} bytes) free",
                            config.save_dir, bytes_text(static_cast<double>(plan.checkpoint_bytes)),
                            plan.checkpoint_bytes, space.probed, bytes_text(static_cast<double>(plan.free_bytes)),
                            plan.free_bytes);
  plan.tight = plan.free_bytes / static_cast<uint64_t>(plan.keep + 1) < static_cast<uint64_t>(plan.checkpoint_bytes);
  if (!config.overwrite_checkpoints) EPX_RETURN_IF_ERROR(check_other_runs(config, own));
  return plan;
}

}  // namespace

Result<SavePlan> check_save(const TrainConfig& config) {
  if (config.save_dir.empty()) return SavePlan{};
  EPX_ASSIGN_OR_RETURN(ModelConfig m, config.resolved_model());
  return plan_save(config, m, [&]() -> Result<std::string> {
    if (!config.run_id.empty() || config.resume_dir.empty()) return config.run_id;
    EPX_ASSIGN_OR_RETURN(detail::CheckpointMeta meta, read_resumed_meta(config, m));
    return meta.run_id;
  });
}

namespace {

// The resume: every file verified once, the step and data checked; the
// notes and where it starts kept.
Status plan_resume(const std::string& folder, detail::PlanState* s) {
  EPX_ASSIGN_OR_RETURN(detail::CheckpointMeta meta, verify_resumed(s->config, s->model));
  EPX_RETURN_IF_ERROR(check_resumed(s->config, meta));
  s->resume_note = reshard_note(s->config, s->model, meta);
  s->resume_data_note = data_note(s->config, meta);
  s->resume = ResumePoint{.folder = folder, .step = meta.step, .run_id = meta.run_id};
  s->resumed = std::move(meta);
  return Status::ok();
}

}  // namespace

Result<RunPlan> plan_run(const TrainConfig& config) {
  auto s = std::make_shared<detail::PlanState>();
  s->config = config;
  EPX_RETURN_IF_ERROR(check_settings(config));
  EPX_ASSIGN_OR_RETURN(s->model, config.resolved_model());
  EPX_ASSIGN_OR_RETURN(ParallelLayout layout, make_layout(config, &s->topology));
  s->layout.emplace(std::move(layout));
  EPX_RETURN_IF_ERROR(check_experts(config, s->model));
  EPX_RETURN_IF_ERROR(detail::check_data(config));
  if (!config.resume_dir.empty()) {
    EPX_ASSIGN_OR_RETURN(std::string folder, detail::resolve_checkpoint(config.resume_dir));
    EPX_RETURN_IF_ERROR(plan_resume(folder, s.get()));
  }
  const detail::CheckpointMeta* resumed = s->resumed ? &*s->resumed : nullptr;
  const std::string own = own_run_id(config, resumed);
  s->config.run_id = own.empty() ? new_run_id() : own;
  EPX_ASSIGN_OR_RETURN(s->save, plan_save(config, s->model, [&]() -> Result<std::string> { return own; }));
  return RunPlan(std::move(s));
}

const TrainConfig& RunPlan::config() const { return state_->config; }
const ModelConfig& RunPlan::model() const { return state_->model; }
const Topology& RunPlan::topology() const { return *state_->topology; }
const ParallelLayout& RunPlan::layout() const { return *state_->layout; }
const SavePlan& RunPlan::save() const { return state_->save; }
const std::optional<ResumePoint>& RunPlan::resume() const { return state_->resume; }
const std::string& RunPlan::resume_note() const { return state_->resume_note; }
const std::string& RunPlan::resume_data_note() const { return state_->resume_data_note; }

}  // namespace epx
