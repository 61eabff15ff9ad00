#include "epx/train/trainer.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/balance/placement.h"
#include "epx/comm/inproc.h"
#include "epx/comm/parallel_layout.h"
#include "epx/core/clock.h"
#include "core/guard.h"
#include "train/checkpoint.h"
#include "train/eplb_train.h"

namespace epx {
namespace {

// The contiguous share [first, first + count) of `total` tokens for `rank`.
std::pair<int64_t, int64_t> share(int64_t total, int num_ranks, int rank) {
  const int64_t base = total / num_ranks, extra = total % num_ranks;
  const int64_t first = rank * base + std::min<int64_t>(rank, extra);
  return {first, base + (rank < extra ? 1 : 0)};
}

// The model's shape, without its layout (ranks, EP, nodes, slots): a
// checkpoint resumes on any layout of the same fingerprint.
std::string fingerprint(const ModelConfig& m) {
  const MoELayerConfig& l = m.layer;
  return fmt::format("task={} in={} out={} layers={} hidden={} ffn={} experts={} topk={} shared={} dtype={}",
                     m.task == TaskKind::kRegression ? "regression" : "next-byte", m.num_inputs(), m.num_outputs(),
                     m.num_layers, l.hidden, l.ffn_hidden, l.router.num_experts, l.router.topk, l.num_shared_experts,
                     dtype_name(l.dtype));
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

constexpr int kTimeFields = 8;

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

// Ranks per EP group. Until `epx train --ep` exists: one EP group of all ranks.
int ep_of(const TrainConfig& config) { return config.num_ranks; }

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
  const int64_t H = m.layer.hidden, F = m.layer.ffn_hidden, E = m.layer.router.num_experts, L = m.num_layers;
  const int64_t ep = ep_of(config), S = int64_t{m.layer.num_shared_experts} * F;
  const int64_t slots = config.balancing.eplb ? config.balancing.slots(static_cast<int>(E), static_cast<int>(ep)) : E;
  const int64_t dense = int64_t{m.num_inputs()} * H + H + H * m.num_outputs() + L * (H + H * E + 3 * H * S);
  const int64_t num_dense = 3 + L * (2 + (S > 0 ? 3 : 0));
  constexpr int64_t kPerParam = 4 + 40 + 3 * 8;  // name length, a name of up to 40 bytes, three counts
  const int64_t dense_file = 128 + num_dense * kPerParam + 12 * dense + L * (8 + 4 * E);
  const int64_t expert_files = ep * 128 + L * E * 3 * (kPerParam + 12 * H * F);
  const int64_t meta = 1024 + (ep + 1) * 120 + L * E * 12 + (config.balancing.eplb ? L * (slots * 12 + E * 21) : 0);
  return dense_file + expert_files + meta;
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

}  // namespace

Status check_resume(const TrainConfig& config) {
  if (config.resume_dir.empty()) return Status::ok();
  EPX_ASSIGN_OR_RETURN(ModelConfig m, config.resolved_model());
  detail::CheckpointMeta meta;
  meta.fingerprint = fingerprint(m);
  EPX_RETURN_IF_ERROR(detail::guard(fmt::format("verifying checkpoint {}", config.resume_dir),
                                    [&] { return detail::verify_checkpoint(config.resume_dir, &meta); }));
  if (meta.step > config.steps)
    return invalid_argument("checkpoint {} is at step {}, past steps = {}; ask for more steps", config.resume_dir,
                            meta.step, config.steps);
  return Status::ok();
}

Result<std::string> resume_note(const TrainConfig& config) {
  if (config.resume_dir.empty()) return std::string();
  EPX_ASSIGN_OR_RETURN(ModelConfig m, config.resolved_model());
  detail::CheckpointMeta meta;
  meta.fingerprint = fingerprint(m);
  EPX_RETURN_IF_ERROR(detail::read_checkpoint_meta(config.resume_dir, &meta));
  const detail::RunLayout saved = detail::saved_layout(meta), mine = detail::run_layout(config, m, ep_of(config));
  if (detail::same_layout(saved, mine)) return std::string();
  const char* placement = !config.balancing.eplb ? "experts placed contiguously"
                          : meta.eplb_window.empty() ? "expert placement computed anew for equal loads"
                                                     : "expert placement computed anew from the saved eplb window loads";
  return fmt::format("resharding checkpoint {} (step {}) written by {} onto {}: {}", config.resume_dir, meta.step,
                     saved.describe(), mine.describe(), placement);
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

Result<SavePlan> check_save(const TrainConfig& config) {
  SavePlan plan;
  if (config.save_dir.empty()) return plan;
  EPX_ASSIGN_OR_RETURN(ModelConfig m, config.resolved_model());
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
  return plan;
}

Status TrainConfig::validate() const {
  if (steps < 0) return invalid_argument("steps = {} is below 0", steps);
  if (num_nodes < 1 || num_ranks % num_nodes != 0)
    return invalid_argument("nodes = {} must divide ranks = {}", num_nodes, num_ranks);
  if (!(clip_norm >= 0) || !std::isfinite(clip_norm)) return invalid_argument("clip_norm = {} must be >= 0", clip_norm);
  if (save_every < 0) return invalid_argument("save_every = {} is below 0", save_every);
  if (save_every > 0 && save_dir.empty()) return invalid_argument("save_every = {} needs a save folder", save_every);
  if (keep_checkpoints < 1) return invalid_argument("keep = {} must be at least 1", keep_checkpoints);
  EPX_RETURN_IF_ERROR(schedule.validate());
  EPX_RETURN_IF_ERROR(adamw.validate());
  EPX_ASSIGN_OR_RETURN(ModelConfig m, resolved_model());
  const int E = m.layer.router.num_experts;
  if (balancing.eplb) {
    if (balancing.eplb_every < 1) return invalid_argument("eplb_every = {} must be at least 1", balancing.eplb_every);
    if (balancing.eplb_slots < 0) return invalid_argument("eplb_slots = {} is below 0", balancing.eplb_slots);
    const int S = balancing.slots(E, num_ranks);
    if (S < E) return invalid_argument("eplb_slots = {} is below experts = {}", S, E);
    if (S % num_ranks != 0) return invalid_argument("eplb_slots = {} must be a multiple of ranks = {}", S, num_ranks);
  } else if (E % num_ranks != 0) {
    return invalid_argument("experts = {} must be a multiple of ranks = {} (contiguous placement)", E, num_ranks);
  }
  if (model.task == TaskKind::kRegression) return synthetic.validate();
  return Status::ok();
}

// Every number in its shortest form that reads back to the same double, so
// equal text is equal bits (the same-loss tests compare these lines).
std::string StepReport::to_json() const {
  std::string layers_json;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const LoadStats& s = layers[l];
    layers_json += fmt::format("{}{{\"layer\":{},\"max_vio\":{},\"cv\":{},\"dropped\":{},\"worst_rank\":{},"
                               "\"worst_rank_share\":{},\"idle_fraction\":{},\"tokens_per_expert\":[{}],"
                               "\"tokens_per_rank\":[{}]}}",
                               l ? "," : "", l, s.max_vio, s.cv, s.num_dropped, s.worst_rank, s.worst_rank_share,
                               s.idle_fraction, fmt::join(s.tokens_per_expert, ","), fmt::join(s.tokens_per_rank, ","));
  }
  std::string ranks_json;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const RankTimes& t = ranks[r];
    ranks_json += fmt::format("{}{{\"rank\":{},\"router\":{},\"dispatch\":{},\"experts\":{},\"combine\":{},"
                              "\"dense\":{},\"wait\":{},\"sync\":{},\"total\":{}}}",
                              r ? "," : "", r, t.router, t.dispatch, t.experts, t.combine, t.dense, t.wait, t.sync,
                              t.total);
  }
  std::string eplb_json;
  if (eplb)
    eplb_json = fmt::format(",\"eplb\":{{\"balance_before\":[{}],\"balance_after\":[{}],\"moved_slots\":{},"
                            "\"moved_bytes\":{}}}",
                            fmt::join(eplb->balance_before, ","), fmt::join(eplb->balance_after, ","),
                            eplb->num_moved_slots, eplb->moved_bytes);
  return fmt::format("{{\"step\":{},\"loss\":{},\"main_loss\":{},\"lr\":{},\"grad_norm\":{},"
                     "\"seconds\":{},\"tokens_per_s\":{},\"layers\":[{}],\"ranks\":[{}]{}}}",
                     step, loss, main_loss, learning_rate, grad_norm, seconds, tokens_per_second, layers_json,
                     ranks_json, eplb_json);
}

namespace {
Result<TrainSummary> train_ranks(const TrainConfig& config, const StepCallback& on_step, bool keep_parameters);

// Collective, after every step: rank 0 tells the others whether its on_step
// failed. Rank 0 returns that Status, the others Aborted naming it, so every
// rank stops after the same step instead of one leaving the others waiting.
// The ranks learn whether rank 0's on_step failed (true: the run stops).
Result<bool> agree_on_stop(Transport& transport, const Status& stop, const Deadline& deadline) {
  double flag[1] = {transport.rank() == 0 && !stop.is_ok() ? 1.0 : 0.0};
  EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<double>(flag, 1), ReduceOp::kSum, deadline));
  return flag[0] != 0;
}

// What a stopped run returns on this rank: rank 0 its callback's error, the
// others Aborted. Not a failure of the step's work, so no step context.
Status stop_status(int rank, const Status& stop, int64_t step) {
  if (rank == 0) return Status(stop.code(), fmt::format("after step {}: {}", step + 1, stop.message()));
  return aborted("rank 0 stopped the run after step {}", step + 1);
}
}  // namespace

Result<TrainSummary> train(const TrainConfig& config, const StepCallback& on_step, bool keep_parameters) {
  Result<TrainSummary> result =
      detail::guard("train", [&] { return train_ranks(config, on_step, keep_parameters); });
  // On an external transport (MPI) an error on this process alone (a file,
  // a config) must end the other ranks' waits too: they hear of it at once.
  if (!result.is_ok() && config.transport != nullptr)
    config.transport->abort(aborted("rank {} stopped training: {}", config.transport->rank(), result.status().to_string()));
  return result;
}

namespace {

// EPLB's start: each layer's slot map into `model` (the Buffers follow it) and
// the window, fresh or from the checkpoint (detail::eplb_start).
Status start_eplb(const TrainConfig& config, const ParallelLayout& layout, ModelConfig* model,
                  detail::EplbState* eplb) {
  const int E = model->layer.router.num_experts;
  eplb->placement = detail::eplb_placement_config(config, *model, layout.ep());
  eplb->expert_bytes = int64_t{9} * model->layer.hidden * model->layer.ffn_hidden * 4;
  detail::CheckpointMeta saved;
  if (!config.resume_dir.empty()) {
    saved.fingerprint = fingerprint(*model);
    EPX_RETURN_IF_ERROR(detail::read_checkpoint_meta(config.resume_dir, &saved));
  }
  EPX_ASSIGN_OR_RETURN(detail::EplbStart start,
                       detail::eplb_start(*eplb, model->num_layers, E, config.resume_dir.empty() ? nullptr : &saved,
                                          detail::run_layout(config, *model, layout.ep())));
  model->layer_slots = std::move(start.layer_slots);
  eplb->window = std::move(start.window);
  return Status::ok();
}

Result<TrainSummary> train_ranks(const TrainConfig& config, const StepCallback& on_step, bool keep_parameters) {
  EPX_RETURN_IF_ERROR(config.validate());
  EPX_ASSIGN_OR_RETURN(ModelConfig model_config, config.resolved_model());
  EPX_ASSIGN_OR_RETURN(Topology topology, Topology::create(config.num_ranks, config.num_nodes));
  EPX_ASSIGN_OR_RETURN(ParallelLayout layout, ParallelLayout::create(topology, ep_of(config)));
  detail::EplbState eplb_init;
  if (config.balancing.eplb) EPX_RETURN_IF_ERROR(start_eplb(config, layout, &model_config, &eplb_init));
  // Open the data and the checkpoint's meta once here, so that a bad file
  // fails before any rank starts.
  EPX_RETURN_IF_ERROR(DataSource::create(config).status());
  EPX_RETURN_IF_ERROR(check_resume(config));
  EPX_RETURN_IF_ERROR(check_save(config).status());

  TrainSummary summary;
  std::mutex mu;
  std::vector<StepReport> recent;  // the last 10 reports (rank 0)
  double run_seconds = 0, comm_seconds = 0, total_seconds = 0;
  int64_t timed_tokens = 0;

  auto rank_steps = [&](Transport& transport, StepContext& where) -> Status {
    const int rank = transport.rank(), R = transport.num_ranks();
    auto deadline = [&] { return Deadline::after(model_config.timeout); };
    EPX_ASSIGN_OR_RETURN(DataSource data, DataSource::create(config));
    EPX_ASSIGN_OR_RETURN(auto model, MoEModel::create(model_config, transport));
    std::vector<Parameter*> params, dense;
    std::vector<MoELayer*> layers;
    std::size_t dense_size = 0;
    // Re-placement rebuilds layers, so the lists are refreshed after one.
    auto collect = [&] {
      params = model->parameters();
      layers = model->layers();
      dense.clear();
      dense_size = 0;
      for (Parameter* p : params)
        if (p->kind == ParamKind::kDense) {
          dense.push_back(p);
          dense_size += p->grad.size();
        }
    };
    collect();
    detail::EplbState eplb = eplb_init;
    AdamW adam(config.adamw);
    auto save = [&](int64_t step) -> Status {
      // This run's layout, whatever the checkpoint it resumed from had.
      detail::CheckpointMeta meta;
      meta.step = step;
      meta.fingerprint = fingerprint(model_config);
      meta.num_ranks = R;
      meta.num_nodes = config.num_nodes;
      meta.ep = layout.ep();
      meta.num_slots = detail::run_layout(config, model_config, layout.ep()).num_slots;
      if (config.balancing.eplb) {
        for (MoELayer* layer : layers) meta.layer_slots.push_back(layer->slot_expert());
        meta.eplb_window = eplb.window;
      }
      return detail::save_checkpoint(config.save_dir, config.keep_checkpoints, meta, transport, layout, params, adam,
                                     layers, deadline());
    };
    detail::CheckpointMeta resumed;  // step 0 without a resume
    resumed.fingerprint = fingerprint(model_config);
    if (!config.resume_dir.empty())
      EPX_RETURN_IF_ERROR(
          detail::load_checkpoint(config.resume_dir, &resumed, transport, params, adam, layers, deadline()));
    const int64_t first_step = resumed.step;

    Batch batch;
    std::vector<float> packed(std::max<std::size_t>(dense_size, 1));
    Status stop;  // rank 0: what on_step returned
    for (int64_t step = first_step; step < config.steps; ++step) {
      const bool tracing = config.tracer && step >= config.trace_first && step < config.trace_first + config.trace_steps;
      for (MoELayer* layer : layers) layer->set_tracer(tracing ? config.tracer : nullptr);
      Tracer* tracer = tracing ? config.tracer : nullptr;
      where = {step, "before the step"};
      if (config.before_step) EPX_RETURN_IF_ERROR(config.before_step(rank, step));
      Stopwatch step_watch;
      const auto [first, count] = share(config.batch_tokens, R, rank);
      data.fill(step * config.batch_tokens + first, count, model_config, &batch);

      double loss = 0;
      {
        ScopedSpan span(tracer, rank, "forward_backward");
        where.phase = "forward/backward";
        EPX_ASSIGN_OR_RETURN(loss, model->forward_backward(batch, config.batch_tokens));
      }
      Stopwatch wait_watch;
      {
        ScopedSpan span(tracer, rank, "wait");
        where.phase = "barrier after forward/backward";
        EPX_RETURN_IF_ERROR(transport.barrier(deadline()));
      }
      const double wait = wait_watch.seconds();

      Stopwatch sync_watch;
      double grad_norm = 0;
      {
        ScopedSpan span(tracer, rank, "sync");
        where.phase = "gradient all_reduce";
        std::size_t at = 0;
        for (Parameter* p : dense) {
          std::copy(p->grad.begin(), p->grad.end(), packed.begin() + static_cast<std::ptrdiff_t>(at));
          at += p->grad.size();
        }
        EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<float>(packed.data(), dense_size), ReduceOp::kSum, deadline()));
        at = 0;
        for (Parameter* p : dense) {
          std::copy(packed.begin() + static_cast<std::ptrdiff_t>(at),
                    packed.begin() + static_cast<std::ptrdiff_t>(at + p->grad.size()), p->grad.begin());
          at += p->grad.size();
        }
        double duplicate_sq = 0;
        for (MoELayer* layer : layers) {
          EPX_RETURN_IF_ERROR(layer->sum_replica_gradients());
          duplicate_sq += layer->duplicate_grad_sq();
        }
        where.phase = "gradient norm";
        EPX_ASSIGN_OR_RETURN(grad_norm, clip_grad_norm(params, config.clip_norm, transport, deadline(), duplicate_sq));
      }
      const double lr = learning_rate(config.schedule, step);
      {
        ScopedSpan span(tracer, rank, "optimizer");
        adam.step(params, lr);
        for (MoELayer* layer : layers) EPX_RETURN_IF_ERROR(layer->update_bias());
      }
      std::vector<LoadStats> step_stats;
      for (MoELayer* layer : layers) step_stats.push_back(layer->load_stats());
      std::optional<EplbReport> eplb_report;
      if (config.balancing.eplb) {
        for (std::size_t l = 0; l < layers.size(); ++l)
          for (std::size_t e = 0; e < eplb.window[l].size(); ++e)
            eplb.window[l][e] += step_stats[l].tokens_per_expert[e];
        if ((step + 1) % config.balancing.eplb_every == 0 && step + 1 < config.steps) {
          ScopedSpan span(tracer, rank, "eplb");
          where.phase = "eplb re-placement";
          eplb_report.emplace();
          EPX_RETURN_IF_ERROR(
              detail::replace_experts(*model, adam, transport, layout, eplb, &*eplb_report, deadline()));
          collect();
          for (MoELayer* layer : layers) layer->set_tracer(tracer);
        }
      }
      const double sync = sync_watch.seconds();

      // Report: losses summed over ranks, every rank's times.
      double aux = 0;
      for (MoELayer* layer : layers) aux += layer->aux_loss();
      double losses[2] = {loss, loss - aux};
      where.phase = "step report (all_reduce, all_gather)";
      EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<double>(losses, 2), ReduceOp::kSum, deadline()));
      const StepTimes& st = model->times();
      const double mine[kTimeFields] = {st.layers.router, st.layers.dispatch, st.layers.experts, st.layers.combine,
                                        st.dense, wait, sync + st.layers.stats, step_watch.seconds()};
      std::vector<double> all(static_cast<std::size_t>(kTimeFields) * R);
      EPX_RETURN_IF_ERROR(transport.all_gather(std::span<const double>(mine, kTimeFields), std::span<double>(all), deadline()));
      if (rank == 0) {
        StepReport report;
        report.step = step;
        report.steps = config.steps;
        report.loss = losses[0];
        report.main_loss = losses[1];
        report.learning_rate = lr;
        report.grad_norm = grad_norm;
        report.seconds = step_watch.seconds();
        report.tokens_per_second = static_cast<double>(config.batch_tokens) / std::max(report.seconds, 1e-9);
        report.layers = std::move(step_stats);
        report.eplb = eplb_report;
        for (int r = 0; r < R; ++r) {
          const double* f = all.data() + static_cast<std::ptrdiff_t>(r) * kTimeFields;
          report.ranks.push_back({f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]});
        }
        std::lock_guard lock(mu);
        if (step == first_step) summary.first_loss = report.main_loss;
        if (report.eplb) summary.eplb_moved_bytes += report.eplb->moved_bytes;
        for (const LoadStats& s : report.layers) summary.dropped += s.num_dropped;
        if (step > first_step || config.steps - first_step == 1) {
          run_seconds += report.seconds;
          timed_tokens += config.batch_tokens;
        }
        for (const RankTimes& t : report.ranks) {
          comm_seconds += t.communication();
          total_seconds += t.total;
        }
        recent.push_back(report);
        if (recent.size() > 10) recent.erase(recent.begin());
        if (on_step) stop = on_step(report);
      }
      where.phase = "agreeing to go on after the step";
      EPX_ASSIGN_OR_RETURN(const bool stopped, agree_on_stop(transport, stop, deadline()));
      if (stopped) {
        where.step = -1;
        return stop_status(rank, stop, step);
      }
      where.phase = "checkpoint";
      if (config.save_every > 0 && (step + 1) % config.save_every == 0 && step + 1 < config.steps)
        EPX_RETURN_IF_ERROR(save(step + 1));
    }
    for (MoELayer* layer : layers) layer->set_tracer(nullptr);
    where = {config.steps, "final checkpoint"};
    if (!config.save_dir.empty()) EPX_RETURN_IF_ERROR(save(config.steps));
    if (keep_parameters) {
      std::lock_guard lock(mu);
      for (Parameter* p : params)
        if (p->kind == ParamKind::kDense && rank == 0) summary.parameters[p->name] = p->value;
      for (MoELayer* layer : layers) {
        const Buffer& buffer = layer->buffer();
        const int local = buffer.num_local_experts();
        for (Parameter* p : layer->parameters()) {
          if (p->kind != ParamKind::kExpert) continue;
          const int64_t per_expert = p->numel() / std::max(local, 1);
          for (int l = 0; l < local; ++l) {
            const int g = buffer.placement().global_id(rank, l);
            summary.parameters[fmt::format("{}#{}", p->name, g)].assign(
                p->value.begin() + l * per_expert, p->value.begin() + (l + 1) * per_expert);
          }
        }
      }
    }
    if (rank == 0 && config.balancing.eplb) {
      std::lock_guard lock(mu);
      for (MoELayer* layer : layers) summary.layer_slots.push_back(layer->slot_expert());
    }
    return Status::ok();
  };

  auto rank_main = [&](Transport& transport) -> Status {
    StepContext where;
    return where.annotate(rank_steps(transport, where));
  };

  if (config.transport != nullptr) {
    Transport& transport = *config.transport;
    if (transport.num_ranks() != topology.num_ranks() || transport.topology().num_nodes() != topology.num_nodes())
      return invalid_argument("the {} transport has {} but the run asks for {}", transport.backend_name(),
                              transport.topology().describe(), topology.describe());
    Status status;
    try {
      status = rank_main(transport);
    } catch (const std::exception& e) {
      status = internal_error("rank {} threw an exception: {}", transport.rank(), e.what());
    }
    if (!status.is_ok()) return Status(status.code(), fmt::format("rank {}: {}", transport.rank(), status.message()));
  } else {
    InprocWorld world(topology);
    EPX_RETURN_IF_ERROR(first_error(world.run(rank_main)));
  }

  summary.steps = config.steps;
  if (!recent.empty()) {
    double loss = 0, vio = 0, idle = 0;
    for (const StepReport& r : recent) {
      loss += r.main_loss;
      double worst_idle = 0, layer_vio = 0;
      for (const LoadStats& s : r.layers) {
        worst_idle = std::max(worst_idle, s.idle_fraction);
        layer_vio += s.max_vio;
      }
      vio += layer_vio / static_cast<double>(std::max<std::size_t>(r.layers.size(), 1));
      idle += worst_idle;
    }
    const auto n = static_cast<double>(recent.size());
    summary.final_loss = loss / n;
    summary.mean_max_vio = vio / n;
    summary.idle_fraction = idle / n;
    double last_vio = 0;
    for (const LoadStats& s : recent.back().layers) last_vio += s.max_vio;
    summary.max_vio = last_vio / static_cast<double>(std::max<std::size_t>(recent.back().layers.size(), 1));
  }
  summary.tokens_per_second = run_seconds > 0 ? static_cast<double>(timed_tokens) / run_seconds : 0.0;
  summary.communication_share = total_seconds > 0 ? comm_seconds / total_seconds : 0.0;
  return summary;
}

}  // namespace

}  // namespace epx
