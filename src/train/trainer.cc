#include "epx/train/trainer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <mutex>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/balance/placement.h"
#include "epx/comm/inproc.h"
#include "epx/comm/parallel_layout.h"
#include "epx/core/clock.h"
#include "epx/core/memory.h"
#include "epx/train/checkpoint_lock.h"
#include "epx/train/run_plan.h"
#include "core/guard.h"
#include "train/checkpoint.h"
#include "train/eplb_train.h"
#include "train/grad_sync.h"
#include "train/run_plan_state.h"
#include "train/wait_report.h"

namespace epx {
namespace {

// The contiguous share [first, first + count) of `total` tokens for `rank`.
std::pair<int64_t, int64_t> share(int64_t total, int num_ranks, int rank) {
  const int64_t base = total / num_ranks, extra = total % num_ranks;
  const int64_t first = rank * base + std::min<int64_t>(rank, extra);
  return {first, base + (rank < extra ? 1 : 0)};
}

// Everything one rank needs to make its batches.
class DataSource {
 public:
  static Result<DataSource> create(const TrainConfig& config) {
    DataSource d;
    d.task_ = config.model.task;
    if (d.task_ == TaskKind::kRegression) {
      EPX_ASSIGN_OR_RETURN(SyntheticTask task, SyntheticTask::create(config.synthetic));
      d.synthetic_.emplace(std::move(task));
    } else {
      EPX_ASSIGN_OR_RETURN(TextTask task, TextTask::create(config.text));
      d.text_.emplace(std::move(task));
    }
    return d;
  }
  void fill(int64_t first, int64_t count, const ModelConfig& m, Batch* b) const {
    b->num_tokens = count;
    if (task_ == TaskKind::kRegression) {
      b->x.resize(static_cast<std::size_t>(count * m.input_dim));
      b->target.resize(static_cast<std::size_t>(count * m.output_dim));
      synthetic_->fill(first, count, b->x.data(), b->target.data(), nullptr);
    } else {
      b->context.resize(static_cast<std::size_t>(count * m.window));
      b->label.resize(static_cast<std::size_t>(count));
      text_->fill(first, count, b->context.data(), b->label.data());
    }
  }

 private:
  TaskKind task_ = TaskKind::kRegression;
  std::optional<SyntheticTask> synthetic_;
  std::optional<TextTask> text_;
};

constexpr int kTimeFields = 11;

// Where a rank is in the run, so a failure says it: "step 12, layer 1,
// dispatch: rank 2 did not arrive ..." (the layer adds its part).
struct StepContext {
  int64_t step = -1;  // -1: setting up (model, buffers, resume): no prefix
  const char* phase = "";
  [[nodiscard]] Status annotate(Status status) const {
    if (status.is_ok() || step < 0) return status;
    return Status(status.code(), fmt::format("step {}, {}: {}", step, phase, status.message()));
  }
};

}  // namespace

std::string BalancingConfig::name() const {
  std::vector<std::string> parts;
  if (aux_loss_coeff > 0) parts.emplace_back(aux_loss == AuxLossKind::kGlobalBatch ? "aux-global" : "aux");
  if (expert_bias) parts.emplace_back("bias");
  if (capacity_factor > 0) parts.emplace_back(drop_policy == DropPolicy::kScore ? "capacity-score" : "capacity");
  if (eplb) parts.emplace_back("eplb");
  return parts.empty() ? "none" : fmt::format("{}", fmt::join(parts, "+"));
}

Result<BalancingConfig> parse_balancing(std::string_view text, const BalancingConfig& defaults) {
  BalancingConfig out = defaults;
  out.aux_loss_coeff = 0;
  out.expert_bias = false;
  out.capacity_factor = 0;
  out.eplb = false;
  const double aux = defaults.aux_loss_coeff > 0 ? defaults.aux_loss_coeff : 1e-2;
  const double cf = defaults.capacity_factor > 0 ? defaults.capacity_factor : 1.25;
  std::size_t start = 0;
  bool none = false;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find('+', start), text.size());
    const std::string_view part = text.substr(start, end - start);
    if (part == "none") {
      none = true;
    } else if (part == "aux" || part == "aux-global") {
      out.aux_loss_coeff = aux;
      out.aux_loss = part == "aux" ? AuxLossKind::kMicroBatch : AuxLossKind::kGlobalBatch;
    } else if (part == "bias") {
      out.expert_bias = true;
    } else if (part == "capacity" || part == "capacity-score") {
      out.capacity_factor = cf;
      out.drop_policy = part == "capacity" ? DropPolicy::kPosition : DropPolicy::kScore;
    } else if (part == "eplb") {
      out.eplb = true;
    } else {
      return invalid_argument(
          "unknown balancing '{}' in '{}'; use none, aux, aux-global, bias, capacity, capacity-score, eplb, joined by "
          "'+'",
          part, text);
    }
    start = end + 1;
  }
  if (none && out.name() != "none") return invalid_argument("balancing '{}' combines 'none' with a strategy", text);
  return out;
}

// Every number in its shortest form that reads back to the same double, so
// equal text is equal bits (the same-loss tests compare these lines).
std::string StepReport::to_json() const {
  using detail::json_number;
  std::string layers_json;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const LoadStats& s = layers[l];
    layers_json += fmt::format("{}{{\"layer\":{},\"max_vio\":{},\"cv\":{},\"dropped\":{},\"worst_rank\":{},"
                               "\"worst_rank_share\":{},\"idle_fraction\":{},\"tokens_per_expert\":[{}],"
                               "\"tokens_per_rank\":[{}]}}",
                               l ? "," : "", l, json_number(s.max_vio), json_number(s.cv), s.num_dropped,
                               s.worst_rank, json_number(s.worst_rank_share), json_number(s.idle_fraction),
                               fmt::join(s.tokens_per_expert, ","), fmt::join(s.tokens_per_rank, ","));
  }
  std::string ranks_json;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const RankTimes& t = ranks[r];
    ranks_json += fmt::format("{}{{\"rank\":{},\"router\":{},\"dispatch\":{},\"experts\":{},\"combine\":{},"
                              "\"dense\":{},\"wait\":{},\"sync\":{},\"total\":{},\"grad_reduce\":{},"
                              "\"grad_wait\":{},\"grad_bytes\":{},\"exchange_wait\":{},\"waited_for\":{},\"late\":{},"
                              "\"slow_data\":{}}}",
                              r ? "," : "", r, t.router, t.dispatch, t.experts, t.combine, t.dense, t.wait, t.sync,
                              t.total, t.grad_reduce, t.grad_wait, t.grad_bytes, t.exchange_wait, t.waited_for, t.late,
                              t.slow_data);
  }
  std::string eplb_json;
  if (eplb)
    eplb_json = fmt::format(",\"eplb\":{{\"balance_before\":[{}],\"balance_after\":[{}],\"moved_slots\":{},"
                            "\"moved_bytes\":{}}}",
                            fmt::join(eplb->balance_before, ","), fmt::join(eplb->balance_after, ","),
                            eplb->num_moved_slots, eplb->moved_bytes);
  const std::string resumed = resumed_from >= 0 ? fmt::format(",\"resumed_from\":{}", resumed_from) : "";
  return fmt::format("{{\"step\":{},\"loss\":{},\"main_loss\":{},\"lr\":{},\"grad_norm\":{},"
                     "\"seconds\":{},\"tokens_per_s\":{},\"num_nodes\":{}{},\"layers\":[{}],\"ranks\":[{}]{}{}}}",
                     step, json_number(loss), json_number(main_loss), json_number(learning_rate),
                     json_number(grad_norm), json_number(seconds), json_number(tokens_per_second), num_nodes, resumed,
                     layers_json, ranks_json, eplb_json, detail::wait_matrix_json(wait_matrix));
}

namespace {
Result<TrainSummary> train_ranks(const RunPlan& plan, const StepCallback& on_step, bool keep_parameters,
                                 bool* stopped_together);

// Collective, after every step: rank 0 tells the others whether its on_step
// failed, every rank whether it was asked to stop for preemption and whether
// its asynchronous save is still writing. Rank 0 returns a failed on_step's
// Status, the others Aborted naming it, so every rank stops after the same
// step instead of one leaving the others waiting.
struct StepAgreement {
  bool stop = false;     // rank 0's on_step failed: the run stops
  bool preempt = false;  // some rank was asked to stop: every rank saves, then stops
  bool writing = false;  // some rank's asynchronous save has not written its files yet
};

Result<StepAgreement> agree_on_stop(Transport& transport, const Status& stop, const std::atomic<bool>* preempt,
                                    bool writing, const Deadline& deadline) {
  double flags[3] = {transport.rank() == 0 && !stop.is_ok() ? 1.0 : 0.0,
                     preempt != nullptr && preempt->load() ? 1.0 : 0.0, writing ? 1.0 : 0.0};
  EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<double>(flags, 3), ReduceOp::kSum, deadline));
  return StepAgreement{flags[0] != 0, flags[1] != 0, flags[2] != 0};
}

// What a stopped run returns on this rank: rank 0 its callback's error, the
// others Aborted. Not a failure of the step's work, so no step context.
Status stop_status(int rank, const Status& stop, int64_t step) {
  if (rank == 0) return Status(stop.code(), fmt::format("after step {}: {}", step + 1, stop.message()));
  return aborted("rank 0 stopped the run after step {}", step + 1);
}
}  // namespace

namespace {

// On an external transport (MPI) an error on this process alone (a file, a
// config) must end the other ranks' waits too: they hear of it at once. A
// stop every rank agreed on needs no notice, and one would race the
// agreement: it may overtake the all-reduce a slower rank is still
// finishing, which would then fail with the notice instead of the stop.
void tell_the_others(const TrainConfig& config, const Status& failed) {
  if (config.transport != nullptr)
    config.transport->abort(aborted("rank {} stopped training: {}", config.transport->rank(), failed.to_string()));
}

}  // namespace

Result<TrainSummary> train(const TrainConfig& config, const StepCallback& on_step, bool keep_parameters) {
  Result<RunPlan> plan = detail::guard("train", [&] { return plan_run(config); });
  if (!plan.is_ok()) {
    tell_the_others(config, plan.status());
    return plan.status();
  }
  return train(*plan, on_step, keep_parameters);
}

Result<TrainSummary> train(const RunPlan& plan, const StepCallback& on_step, bool keep_parameters) {
  bool stopped_together = false;
  Result<TrainSummary> result =
      detail::guard("train", [&] { return train_ranks(plan, on_step, keep_parameters, &stopped_together); });
  if (!result.is_ok() && !stopped_together) tell_the_others(plan.config(), result.status());
  return result;
}

Status detail::check_data(const TrainConfig& config) { return DataSource::create(config).status(); }

namespace {

// What every rank of the run shares: the plan, and what rank 0 gathers for
// the summary (under `mu`).
struct RunState {
  RunState(const RunPlan& p, const StepCallback& s, bool keep)
      : config(p.config()), layout(p.layout()), run_id(p.config().run_id), model_config(p.model()), on_step(s),
        keep_parameters(keep) {}
  const TrainConfig& config;
  const ParallelLayout& layout;
  const std::string& run_id;  // recorded in every checkpoint
  ModelConfig model_config;   // the plan's, with EPLB's starting slot maps
  detail::EplbState eplb;     // EPLB's start: the placement, the window (a resume's from its checkpoint)
  const StepCallback& on_step;
  bool keep_parameters;
  std::mutex mu;
  TrainSummary summary;
  std::vector<StepReport> recent;  // the last 10 reports
  double run_seconds = 0, comm_seconds = 0, total_seconds = 0;
  int64_t timed_tokens = 0;
  std::atomic<bool> stopped_together{false};  // every rank agreed to stop after rank 0's on_step failed
  std::optional<SaveLock> save_lock;   // save_dir's, held by rank 0 (the process, in-process) for the run
  std::atomic<int64_t> preempted_at{-1};      // every rank agreed to save and stop here (TrainConfig::preempt)
};

// EPLB's start: each layer's slot map into `m` (it decides the Buffers, so
// it is read before any rank starts) and the window, fresh or from the
// resumed checkpoint (`resumed`, or null; detail::eplb_start: its placement
// on the same layout, placed anew from its window loads on another).
Status prepare_eplb(const TrainConfig& config, const detail::CheckpointMeta* resumed, ModelConfig* m,
                    detail::EplbState* eplb) {
  eplb->placement = detail::eplb_placement_config(config, *m, config.ep_size());
  eplb->expert_bytes = int64_t{9} * m->layer.hidden * m->layer.ffn_hidden * 4;
  EPX_ASSIGN_OR_RETURN(detail::EplbStart start,
                       detail::eplb_start(*eplb, m->num_layers, m->layer.router.num_experts, resumed,
                                          detail::run_layout(config, *m, config.ep_size())));
  m->layer_slots = std::move(start.layer_slots);
  eplb->window = std::move(start.window);
  return Status::ok();
}

// The run's shared state from its plan (everything is checked there):
// EPLB's start from the plan's resumed checkpoint, and save_dir's lock (one
// writer per save folder: rank 0 publishes and prunes, so rank 0 locks it).
Result<std::unique_ptr<RunState>> prepare_run(const RunPlan& plan, const StepCallback& on_step, bool keep_parameters) {
  auto run = std::make_unique<RunState>(plan, on_step, keep_parameters);
  const TrainConfig& config = plan.config();
  const std::optional<detail::CheckpointMeta>& resumed = plan.state().resumed;
  if (config.balancing.eplb)
    EPX_RETURN_IF_ERROR(prepare_eplb(config, resumed ? &*resumed : nullptr, &run->model_config, &run->eplb));
  if (!config.save_dir.empty() && (config.transport == nullptr || config.transport->rank() == 0)) {
    EPX_ASSIGN_OR_RETURN(SaveLock lock, SaveLock::acquire(config.save_dir, run->run_id));
    run->save_lock.emplace(std::move(lock));
  }
  return run;
}

// This rank's transports: the world, its EP group (the world itself when
// there is one EP group) and its EDP group (null when it is this rank alone:
// nothing to sum).
struct RankGroups {
  Transport* world = nullptr;
  Transport* ep = nullptr;
  Transport* edp = nullptr;
  ParallelGroups split{};  // the groups split from the world, when there are several EP groups
};

// Splits the world into EP and EDP groups (collective). One EP group of all
// ranks splits nothing, so such a run keeps the bits it always had.
Result<RankGroups> make_groups(Transport& world, const ParallelLayout& layout, const Deadline& deadline) {
  RankGroups g{.world = &world, .ep = &world};
  if (layout.ep() == layout.num_ranks()) return g;
  EPX_ASSIGN_OR_RETURN(g.split, split_parallel(world, layout, deadline));
  g.ep = g.split.ep.get();
  g.edp = g.split.edp.get();
  return g;
}

// The model's parameters by how their gradients are summed.
struct ModelParts {
  std::vector<Parameter*> params{}, dense{};
  std::vector<MoELayer*> layers{};
};

ModelParts model_parts(MoEModel& model) {
  ModelParts parts{.params = model.parameters(), .layers = model.layers()};
  for (Parameter* p : parts.params)
    if (p->kind == ParamKind::kDense) parts.dense.push_back(p);
  return parts;
}

// The rank's gradient reductions (train/grad_sync.h): dense over the world,
// replicas over the EP group, routed experts over the EDP group; bucketed,
// on a thread beside the backward with grad_overlap. Collective.
Result<std::unique_ptr<detail::GradientSync>> make_grad_sync(const TrainConfig& config, const RankGroups& groups,
                                                             MoEModel& model, const Deadline& deadline) {
  EPX_ASSIGN_OR_RETURN(auto sync, detail::GradientSync::create(
                                      {.world = groups.world, .ep = groups.ep, .edp = groups.edp},
                                      {.bucket_bytes = static_cast<std::size_t>(config.grad_bucket_bytes),
                                       .overlap = config.grad_overlap,
                                       .timeout = model.config().timeout},
                                      deadline));
  EPX_RETURN_IF_ERROR(sync->plan(model));
  return sync;
}

// One rank's part of the run.
struct Rank {
  Rank(RunState& r, StepContext& w) : run(r), where(w) {}
  RunState& run;
  StepContext& where;
  RankGroups groups;
  DataSource data;
  std::unique_ptr<MoEModel> model;
  ModelParts parts;  // refreshed after a re-placement (it rebuilds layers)
  detail::EplbState eplb;
  AdamW adam{AdamWConfig{}};
  int64_t first_step = 0;
  Batch batch;
  std::unique_ptr<detail::GradientSync> grad_sync;  // after the model: destroyed before it
  std::unique_ptr<detail::CheckpointWrite> saving;  // an asynchronous save begun, not yet published
  Status stop;                 // rank 0: what on_step returned
  [[nodiscard]] int rank() const { return groups.world->rank(); }
  [[nodiscard]] const TrainConfig& config() const { return run.config; }
  [[nodiscard]] Deadline deadline() const { return Deadline::after(run.model_config.timeout); }
};

// Checkpoint `step`'s meta.json before its files are listed.
detail::CheckpointMeta checkpoint_meta(Rank& r, int64_t step) {
  const TrainConfig& config = r.config();
  detail::CheckpointMeta meta;
  meta.step = step;
  meta.fingerprint = detail::fingerprint(r.run.model_config);
  meta.num_ranks = config.num_ranks;
  meta.num_nodes = config.num_nodes;
  meta.ep = r.run.layout.ep();
  meta.num_slots = detail::run_layout(config, r.run.model_config, meta.ep).num_slots;
  meta.run_id = r.run.run_id;
  meta.data = data_settings(config);
  if (config.balancing.eplb) {
    for (MoELayer* layer : r.parts.layers) meta.layer_slots.push_back(layer->slot_expert());
    meta.eplb_window = r.eplb.window;
  }
  return meta;
}

// Collective: publishes the asynchronous save in flight, if any (waiting for
// this rank's files when they are not written yet).
Status finish_saving(Rank& r) {
  if (!r.saving) return Status::ok();
  r.saving->wait();  // this rank's files first: the deadline is for the other ranks
  Status s = r.saving->finish(*r.groups.world, r.deadline());
  r.saving.reset();
  return s;
}

// Collective: writes checkpoint `step` in logical order (rank 0 the dense
// file, EP group 0 the expert files) with this run's layout. With
// async_save only the snapshot is taken here; the files are written on a
// thread and published at a later step boundary (finish_saving). At most one
// save is in flight: the one before is published first.
Status save_rank(Rank& r, int64_t step, bool async) {
  const TrainConfig& config = r.config();
  EPX_RETURN_IF_ERROR(finish_saving(r));
  EPX_ASSIGN_OR_RETURN(r.saving, detail::CheckpointWrite::begin(config.save_dir, config.keep_checkpoints,
                                                                checkpoint_meta(r, step), *r.groups.world,
                                                                r.run.layout, r.parts.params, r.adam, r.parts.layers,
                                                                r.deadline()));
  if (async) {
    r.saving->write_in_background();
    return Status::ok();
  }
  r.saving->write();
  return finish_saving(r);
}

// Collective: the groups, the data, the model and, on a resume, its state.
Status open_rank(Rank& r, Transport& world) {
  const TrainConfig& config = r.config();
  EPX_ASSIGN_OR_RETURN(r.groups, make_groups(world, r.run.layout, r.deadline()));
  EPX_ASSIGN_OR_RETURN(r.data, DataSource::create(config));
  EPX_ASSIGN_OR_RETURN(r.model, MoEModel::create(r.run.model_config, *r.groups.world, *r.groups.ep));
  r.parts = model_parts(*r.model);
  EPX_ASSIGN_OR_RETURN(r.grad_sync, make_grad_sync(config, r.groups, *r.model, r.deadline()));
  r.eplb = r.run.eplb;
  r.adam = AdamW(config.adamw);
  if (config.resume_dir.empty()) return Status::ok();
  detail::CheckpointMeta resumed;
  resumed.fingerprint = detail::fingerprint(r.run.model_config);
  EPX_RETURN_IF_ERROR(detail::load_checkpoint(config.resume_dir, &resumed, *r.groups.world, r.parts.params, r.adam,
                                              r.parts.layers, r.deadline()));
  r.first_step = resumed.step;
  return Status::ok();
}

// What one step measured, for its report.
struct StepNumbers {
  Stopwatch watch;  // the whole step
  double loss = 0, aux = 0, grad_norm = 0, lr = 0;  // aux: this rank's share of the layers' aux losses
  double wait = 0, sync = 0;  // seconds
  std::vector<LoadStats> stats;
  std::optional<EplbReport> eplb;
  std::vector<double> wait_row;  // who this rank waited for (train/wait_report.h)
};

// This rank's share of the global batch, forward and backward, then the
// barrier that shows how long it waited for the slowest rank. Collective.
Status forward_backward(Rank& r, int64_t step, Tracer* tracer, StepNumbers* n) {
  const TrainConfig& config = r.config();
  const auto [first, count] = share(config.batch_tokens, r.groups.world->num_ranks(), r.rank());
  r.data.fill(step * config.batch_tokens + first, count, r.run.model_config, &r.batch);
  {
    ScopedSpan span(tracer, r.rank(), "forward_backward");
    r.where.phase = "forward/backward";
    r.grad_sync->start_step();
    EPX_ASSIGN_OR_RETURN(n->loss, r.model->forward_backward(r.batch, config.batch_tokens));
  }
  // Now: a re-placement later in the step rebuilds the layers, and their losses.
  for (MoELayer* layer : r.parts.layers) n->aux += layer->aux_loss();
  Stopwatch wait_watch;
  {
    ScopedSpan span(tracer, r.rank(), "wait");
    r.where.phase = "barrier after forward/backward";
    EPX_RETURN_IF_ERROR(r.groups.world->barrier(r.deadline()));
  }
  n->wait = wait_watch.seconds();
  return Status::ok();
}

// Gradients summed and clipped, then AdamW and the expert bias (from the
// global loads: the same on every rank). Collective.
Status update_parameters(Rank& r, int64_t step, Tracer* tracer, StepNumbers* n) {
  {
    ScopedSpan span(tracer, r.rank(), "sync");
    r.where.phase = "gradient all_reduce";
    EPX_RETURN_IF_ERROR(r.grad_sync->finish(r.deadline()));
    double duplicate_sq = 0;
    for (MoELayer* layer : r.parts.layers) duplicate_sq += layer->duplicate_grad_sq();
    r.where.phase = "gradient norm";
    // Every EP group now holds the same expert gradients: the norm over one
    // EP group counts each logical expert once.
    EPX_ASSIGN_OR_RETURN(n->grad_norm, clip_grad_norm(r.parts.params, r.config().clip_norm, *r.groups.ep,
                                                      r.deadline(), duplicate_sq));
  }
  n->lr = learning_rate(r.config().schedule, step);
  ScopedSpan span(tracer, r.rank(), "optimizer");
  r.adam.step(r.parts.params, n->lr);
  for (MoELayer* layer : r.parts.layers) EPX_RETURN_IF_ERROR(layer->update_bias());
  return Status::ok();
}

// The step's global loads into the EPLB window and, every eplb_every steps,
// a re-placement: every EP group makes the same plan from the global loads
// and moves its experts inside itself. Collective.
Status eplb_step(Rank& r, int64_t step, Tracer* tracer, StepNumbers* n) {
  const TrainConfig& config = r.config();
  for (std::size_t l = 0; l < r.parts.layers.size(); ++l)
    for (std::size_t e = 0; e < r.eplb.window[l].size(); ++e) r.eplb.window[l][e] += n->stats[l].tokens_per_expert[e];
  if ((step + 1) % config.balancing.eplb_every != 0 || step + 1 >= config.steps) return Status::ok();
  ScopedSpan span(tracer, r.rank(), "eplb");
  r.where.phase = "eplb re-placement";
  n->eplb.emplace();
  EPX_RETURN_IF_ERROR(detail::replace_experts(*r.model, r.adam, *r.groups.ep, r.eplb, &*n->eplb, r.deadline()));
  // Every EP group moves the same slots.
  n->eplb->num_moved_slots *= r.run.layout.edp();
  n->eplb->moved_bytes *= r.run.layout.edp();
  r.parts = model_parts(*r.model);
  EPX_RETURN_IF_ERROR(r.grad_sync->plan(*r.model));
  for (MoELayer* layer : r.parts.layers) layer->set_tracer(tracer);
  return Status::ok();
}

// Rank 0: the report into the summary, then to on_step.
void record_report(Rank& r, StepReport report) {
  RunState& run = r.run;
  const TrainConfig& config = r.config();
  std::lock_guard lock(run.mu);
  if (report.step == r.first_step) run.summary.first_loss = report.main_loss;
  if (report.eplb) run.summary.eplb_moved_bytes += report.eplb->moved_bytes;
  for (const LoadStats& s : report.layers) run.summary.dropped += s.num_dropped;
  if (report.step > r.first_step || config.steps - r.first_step == 1) {
    run.run_seconds += report.seconds;
    run.timed_tokens += config.batch_tokens;
  }
  for (const RankTimes& t : report.ranks) {
    run.comm_seconds += t.communication();
    run.total_seconds += t.total;
  }
  run.recent.push_back(report);
  if (run.recent.size() > 10) run.recent.erase(run.recent.begin());
  if (run.on_step) r.stop = run.on_step(report);
}

// The step's report: losses summed over every rank, every rank's times; rank
// 0 builds the StepReport. Collective.
Status report_step(Rank& r, int64_t step, StepNumbers& n) {
  const int R = r.groups.world->num_ranks();
  double losses[2] = {n.loss, n.loss - n.aux};
  r.where.phase = "step report (all_reduce, all_gather)";
  EPX_RETURN_IF_ERROR(r.groups.world->all_reduce(std::span<double>(losses, 2), ReduceOp::kSum, r.deadline()));
  const StepTimes& st = r.model->times();
  std::vector<double> mine = {st.layers.router, st.layers.dispatch, st.layers.experts, st.layers.combine,
                              st.dense, n.wait, n.sync + st.layers.stats, n.watch.seconds(),
                              r.grad_sync->times().reduce, r.grad_sync->times().wait,
                              static_cast<double>(r.grad_sync->reduced_bytes())};
  mine.insert(mine.end(), n.wait_row.begin(), n.wait_row.end());
  const std::size_t stride = mine.size();
  std::vector<double> all(stride * R);
  EPX_RETURN_IF_ERROR(
      r.groups.world->all_gather(std::span<const double>(mine), std::span<double>(all), r.deadline()));
  if (r.rank() != 0) return Status::ok();
  StepReport report;
  report.step = step;
  report.steps = r.config().steps;
  report.num_nodes = r.config().num_nodes;
  report.loss = losses[0];
  report.main_loss = losses[1];
  report.learning_rate = n.lr;
  report.grad_norm = n.grad_norm;
  report.seconds = n.watch.seconds();
  report.tokens_per_second = static_cast<double>(r.config().batch_tokens) / std::max(report.seconds, 1e-9);
  report.layers = std::move(n.stats);
  report.eplb = std::move(n.eplb);
  if (step == r.first_step && !r.config().resume_dir.empty()) report.resumed_from = r.first_step;
  for (int q = 0; q < R; ++q) {
    const double* f = all.data() + static_cast<std::ptrdiff_t>(q) * stride;
    RankTimes& t = report.ranks.emplace_back();
    t.router = f[0], t.dispatch = f[1], t.experts = f[2], t.combine = f[3], t.dense = f[4], t.wait = f[5];
    t.sync = f[6], t.total = f[7], t.grad_reduce = f[8], t.grad_wait = f[9], t.grad_bytes = f[10];
  }
  detail::fill_wait_fields(all, stride, kTimeFields, detail::wait_matrix_due(step, r.config().wait_matrix_every),
                           &report.ranks, &report.wait_matrix);
  record_report(r, std::move(report));
  return Status::ok();
}

// One optimizer step on this rank. Collective.
Status run_step(Rank& r, int64_t step) {
  const TrainConfig& config = r.config();
  const bool tracing = config.tracer && step >= config.trace_first && step < config.trace_first + config.trace_steps;
  Tracer* tracer = tracing ? config.tracer : nullptr;
  for (MoELayer* layer : r.parts.layers) layer->set_tracer(tracer);
  r.where = {step, "before the step"};
  if (config.before_step) EPX_RETURN_IF_ERROR(config.before_step(r.rank(), step));
  StepNumbers n;
  EPX_RETURN_IF_ERROR(forward_backward(r, step, tracer, &n));
  // Now: a re-placement later in the step rebuilds the layers.
  detail::append_wait_row(r.parts.layers, *r.groups.ep, r.groups.world->num_ranks(), &n.wait_row);
  Stopwatch sync_watch;
  EPX_RETURN_IF_ERROR(update_parameters(r, step, tracer, &n));
  for (MoELayer* layer : r.parts.layers) n.stats.push_back(layer->load_stats());
  if (config.balancing.eplb) EPX_RETURN_IF_ERROR(eplb_step(r, step, tracer, &n));
  n.sync = sync_watch.seconds();
  return report_step(r, step, n);
}

// keep_parameters: dense parameters from rank 0, experts from EP group 0
// (every EP group holds the same), by "name#slot"; eplb's final maps.
void keep_rank_parameters(Rank& r) {
  RunState& run = r.run;
  std::lock_guard lock(run.mu);
  if (r.rank() == 0 && r.config().balancing.eplb)
    for (MoELayer* layer : r.parts.layers) run.summary.layer_slots.push_back(layer->slot_expert());
  if (!run.keep_parameters) return;
  if (r.rank() == 0)
    for (Parameter* p : r.parts.dense) run.summary.parameters[p->name] = p->value;
  if (run.layout.ep_group(r.rank()) != 0) return;
  const int ep_rank = r.groups.ep->rank();
  for (MoELayer* layer : r.parts.layers) {
    const Buffer& buffer = layer->buffer();
    const int local = buffer.num_local_experts();
    for (Parameter* p : layer->expert_parameters()) {
      const int64_t per_expert = p->numel() / std::max(local, 1);
      for (int l = 0; l < local; ++l)
        run.summary.parameters[fmt::format("{}#{}", p->name, buffer.placement().global_id(ep_rank, l))].assign(
            p->value.begin() + l * per_expert, p->value.begin() + (l + 1) * per_expert);
    }
  }
}

// Preemption: the checkpoint of `step` (steps done), then the run ends on
// every rank alike. Collective.
Status save_preempted(Rank& r, int64_t step) {
  EPX_RETURN_IF_ERROR(save_rank(r, step, /*async=*/false));
  r.run.preempted_at.store(step);
  for (MoELayer* layer : r.parts.layers) layer->set_tracer(nullptr);
  return Status::ok();
}

// One rank from its setup to its last checkpoint. Collective.
Status run_rank(RunState& run, Transport& world, StepContext& where) {
  Rank r(run, where);
  EPX_RETURN_IF_ERROR(open_rank(r, world));
  const TrainConfig& config = run.config;
  for (int64_t step = r.first_step; step < config.steps; ++step) {
    EPX_RETURN_IF_ERROR(run_step(r, step));
    where.phase = "agreeing to go on after the step";
    const bool writing = r.saving && !r.saving->written();
    EPX_ASSIGN_OR_RETURN(const StepAgreement agreed,
                         agree_on_stop(world, r.stop, config.preempt, writing, r.deadline()));
    if (agreed.stop) {
      where.step = -1;
      run.stopped_together.store(true);
      return stop_status(r.rank(), r.stop, step);
    }
    where.phase = "checkpoint";
    if (r.saving && !agreed.writing) EPX_RETURN_IF_ERROR(finish_saving(r));  // every rank has written it
    if (agreed.preempt && step + 1 < config.steps) return save_preempted(r, step + 1);
    if (config.save_every > 0 && (step + 1) % config.save_every == 0 && step + 1 < config.steps)
      EPX_RETURN_IF_ERROR(save_rank(r, step + 1, config.async_save));
  }
  for (MoELayer* layer : r.parts.layers) layer->set_tracer(nullptr);
  where = {config.steps, "final checkpoint"};
  if (!config.save_dir.empty()) EPX_RETURN_IF_ERROR(save_rank(r, config.steps, /*async=*/false));
  keep_rank_parameters(r);
  return Status::ok();
}

// The summary's means over the last reports and the run's rates.
TrainSummary finish_summary(RunState& run) {
  TrainSummary summary = std::move(run.summary);
  summary.preempted_at = run.preempted_at.load();
  summary.steps = summary.preempted_at >= 0 ? summary.preempted_at : run.config.steps;
  if (!run.recent.empty()) {
    double loss = 0, vio = 0, idle = 0;
    for (const StepReport& r : run.recent) {
      loss += r.main_loss;
      double worst_idle = 0, layer_vio = 0;
      for (const LoadStats& s : r.layers) {
        worst_idle = std::max(worst_idle, s.idle_fraction);
        layer_vio += s.max_vio;
      }
      vio += layer_vio / static_cast<double>(std::max<std::size_t>(r.layers.size(), 1));
      idle += worst_idle;
    }
    const auto n = static_cast<double>(run.recent.size());
    summary.final_loss = loss / n;
    summary.mean_max_vio = vio / n;
    summary.idle_fraction = idle / n;
    double last_vio = 0;
    for (const LoadStats& s : run.recent.back().layers) last_vio += s.max_vio;
    summary.max_vio = last_vio / static_cast<double>(std::max<std::size_t>(run.recent.back().layers.size(), 1));
  }
  summary.tokens_per_second = run.run_seconds > 0 ? static_cast<double>(run.timed_tokens) / run.run_seconds : 0.0;
  summary.communication_share = run.total_seconds > 0 ? run.comm_seconds / run.total_seconds : 0.0;
  return summary;
}

// This process's rank on the caller's transport (MPI).
Status run_on_transport(RunState& run, const Topology& topology, Transport& transport) {
  if (transport.num_ranks() != topology.num_ranks() || transport.topology().num_nodes() != topology.num_nodes())
    return invalid_argument("the {} transport has {} but the run asks for {}", transport.backend_name(),
                            transport.topology().describe(), topology.describe());
  Status status;
  try {
    StepContext where;
    status = where.annotate(run_rank(run, transport, where));
  } catch (const std::exception& e) {
    status = internal_error("rank {} threw an exception: {}", transport.rank(), e.what());
  }
  if (!status.is_ok()) return Status(status.code(), fmt::format("rank {}: {}", transport.rank(), status.message()));
  return Status::ok();
}

Result<TrainSummary> train_ranks(const RunPlan& plan, const StepCallback& on_step, bool keep_parameters,
                                 bool* stopped_together) {
  EPX_ASSIGN_OR_RETURN(std::unique_ptr<RunState> run, prepare_run(plan, on_step, keep_parameters));
  if (Transport* transport = plan.config().transport; transport != nullptr) {
    Status status = run_on_transport(*run, plan.topology(), *transport);
    *stopped_together = run->stopped_together.load();
    EPX_RETURN_IF_ERROR(status);
  } else {
    InprocWorld world(plan.topology());
    EPX_RETURN_IF_ERROR(first_error(world.run([&](Transport& transport) {
      StepContext where;
      return where.annotate(run_rank(*run, transport, where));
    })));
  }
  return finish_summary(*run);
}

}  // namespace

}  // namespace epx
