// `epx train`: the MoE model on in-process or MPI ranks, with load balancing.
#include "train.h"

#include <signal.h>

#include <atomic>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <thread>
#include <type_traits>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "cli_checks.h"
#include "commands.h"
#include "launch.h"
#include "epx/comm/mpi.h"
#include "epx/comm/parallel_layout.h"
#include "epx/core/clock.h"
#include "epx/core/input_file.h"
#include "epx/core/memory.h"
#include "epx/experts/ffn.h"
#include "epx/observe/chrome_trace.h"
#include "epx/observe/metrics.h"
#include "epx/observe/output_path.h"
#include "epx/observe/progress.h"
#include "epx/observe/run_log.h"
#include "epx/observe/straggler.h"
#include "epx/observe/table.h"
#include "epx/train/checkpoint_lock.h"
#include "epx/train/memory_estimate.h"
#include "epx/train/run_plan.h"
#include "epx/train/trainer.h"
#include "train_limit.h"
#include "train_record.h"

namespace epx::app {
namespace {

constexpr uint64_t kMaxBatchTokens = uint64_t{1} << 24;  // --batch-tokens and run.batch_tokens

// One settable key of the config file: "section.key" -> a field.
using Setter = std::function<Status(const toml::node&, const std::string& key)>;

// The integer range of a key, [min, max], within its type's own limits.
struct IntRange {
  int64_t min = std::numeric_limits<int64_t>::min();
  uint64_t max = std::numeric_limits<uint64_t>::max();
};

template <typename T>
Status set_integer(T& field, const toml::node& node, const std::string& key, IntRange range) {
  const int64_t min = std::max(range.min, static_cast<int64_t>(std::numeric_limits<T>::min()));
  const uint64_t max = std::min(range.max, static_cast<uint64_t>(std::numeric_limits<T>::max()));
  auto v = node.value_exact<int64_t>();
  if (!v) return invalid_argument("{} must be an integer", key);
  if (*v < min) return invalid_argument("{} = {} must be at least {}", key, *v, min);
  if (*v > 0 && static_cast<uint64_t>(*v) > max) return invalid_argument("{} = {} is above the limit {}", key, *v, max);
  field = static_cast<T>(*v);
  return Status::ok();
}

template <typename T>
Setter bind(T& field, IntRange range = {}) {
  return [&field, range](const toml::node& node, const std::string& key) -> Status {
    (void)range;  // only integers have one
    if constexpr (std::is_same_v<T, bool>) {
      if (auto v = node.value_exact<bool>()) {
        field = *v;
        return Status::ok();
      }
      return invalid_argument("{} must be true or false", key);
    } else if constexpr (std::is_integral_v<T>) {
      return set_integer(field, node, key, range);
    } else if constexpr (std::is_floating_point_v<T>) {
      auto v = node.value<double>();  // integers are accepted
      if (!v || !node.is_number()) return invalid_argument("{} must be a number", key);
      field = *v;
      return Status::ok();
    } else {
      auto v = node.value_exact<std::string>();
      if (!v) return invalid_argument("{} must be a string", key);
      field = *v;
      return Status::ok();
    }
  };
}

// [1, the type's max] and [0, the type's max].
template <typename T>
Setter positive(T& field) {
  return bind(field, IntRange{.min = 1});
}
template <typename T>
Setter non_negative(T& field) {
  return bind(field, IntRange{.min = 0});
}

// ---- checks of one setting by itself ----------------------------------------

Status choice(const char* name, const std::string& value, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed)
    if (value == a) return Status::ok();
  std::string list;
  std::size_t i = 0;
  for (const char* a : allowed) list += fmt::format("{}{}", i++ == 0 ? "" : i == allowed.size() ? " or " : ", ", a);
  return invalid_argument("{} '{}' is not {}", name, value, list);
}

Status finite_above_zero(const char* name, double value) {
  if (!(value > 0) || !std::isfinite(value)) return invalid_argument("{} = {} must be finite and above 0", name, value);
  return Status::ok();
}

Status finite_at_least_zero(const char* name, double value) {
  if (!(value >= 0) || !std::isfinite(value)) return invalid_argument("{} = {} must be finite and >= 0", name, value);
  return Status::ok();
}

Status check_timeout(const TrainOptions& o) {
  // At most a week (so the milliseconds fit any clock); 1 ms at least.
  if (!(o.timeout_s >= 0.001 && o.timeout_s <= 604800))
    return invalid_argument("timeout = {} s is outside [0.001, 604800] seconds", o.timeout_s);
  return Status::ok();
}

Status check_data(const TrainOptions& o) {
  if (o.data == "synthetic" || (o.data.rfind("text:", 0) == 0 && o.data.size() > 5)) return Status::ok();
  return invalid_argument("--data '{}' is neither 'synthetic' nor 'text:FILE'", o.data);
}

Status check_lr(const TrainOptions& o) {
  if (!(o.lr > 0) || !std::isfinite(o.lr)) return invalid_argument("learning rate {} must be finite and above 0", o.lr);
  return Status::ok();
}

using Check = Status (*)(const TrainOptions&);

// The settings whose value is checked by itself, by config key: a config
// file runs a key's check as soon as it sets the key (the message then names
// the file and the key); make_config runs them all on the final options.
const std::map<std::string, Check>& single_checks() {
  static const std::map<std::string, Check> checks = {
      {"run.timeout", check_timeout},
      {"run.grad_overlap", [](const TrainOptions& o) { return choice("grad_overlap", o.grad_overlap, {"on", "off"}); }},
      {"data.source", check_data},
      {"model.dtype", [](const TrainOptions& o) { return choice("dtype", o.dtype, {"f32", "bf16"}); }},
      {"model.compute_dtype",
       [](const TrainOptions& o) { return choice("compute_dtype", o.compute_dtype, {"auto", "f32", "bf16"}); }},
      {"model.overlap", [](const TrainOptions& o) { return parse_overlap_mode(o.overlap).status(); }},
      {"model.dispatch_dtype",
       [](const TrainOptions& o) { return o.dispatch_dtype.empty() ? Status::ok() : parse_dtype(o.dispatch_dtype).status(); }},
      {"model.combine_dtype", [](const TrainOptions& o) { return choice("combine_dtype", o.combine_dtype, {"f32", "bf16"}); }},
      {"model.combine_weights",
       [](const TrainOptions& o) { return choice("combine_weights", o.combine_weights, {"holder", "receiver"}); }},
      {"model.score", [](const TrainOptions& o) { return choice("score", o.score, {"softmax", "sigmoid"}); }},
      {"balance.strategy", [](const TrainOptions& o) { return parse_balancing(o.balance, BalancingConfig{}).status(); }},
      {"balance.aux_coeff", [](const TrainOptions& o) { return finite_above_zero("aux_coeff", o.aux_coeff); }},
      {"balance.capacity_factor",
       [](const TrainOptions& o) { return finite_above_zero("capacity_factor", o.capacity_factor); }},
      {"balance.bias_rate", [](const TrainOptions& o) { return finite_at_least_zero("bias_rate", o.bias_rate); }},
      {"balance.z_coeff", [](const TrainOptions& o) { return finite_at_least_zero("z_coeff", o.z_coeff); }},
      {"optim.lr", check_lr},
      {"optim.weight_decay", [](const TrainOptions& o) { return finite_at_least_zero("weight_decay", o.weight_decay); }},
      {"optim.clip", [](const TrainOptions& o) { return finite_at_least_zero("clip", o.clip); }},
      {"output.record_waits", [](const TrainOptions& o) { return choice("record_waits", o.record_waits, {"on", "off"}); }},
  };
  return checks;
}

Status check_single_settings(const TrainOptions& o) {
  for (const auto& [key, check] : single_checks()) EPX_RETURN_IF_ERROR(check(o));
  return Status::ok();
}

std::map<std::string, Setter> config_keys(TrainOptions& o) {
  return {
      {"run.ranks", bind(o.num_ranks, {.min = 1, .max = 256})},
      {"run.nodes", bind(o.num_nodes, {.min = 1, .max = 256})},
      {"run.steps", bind(o.steps, {.min = 0, .max = uint64_t{1} << 40})},
      {"run.batch_tokens", bind(o.batch_tokens, {.min = 1, .max = kMaxBatchTokens})},
      {"run.seed", non_negative(o.seed)},
      {"run.timeout", bind(o.timeout_s)},
      {"run.grad_overlap", bind(o.grad_overlap)},
      {"parallelism.ep", bind(o.ep, {.min = 0, .max = 256})},
      {"data.source", bind(o.data)},
      {"data.input_dim", positive(o.input_dim)},
      {"data.output_dim", positive(o.output_dim)},
      {"data.clusters", positive(o.clusters)},
      {"data.zipf", bind(o.zipf)},
      {"data.cluster_spread", bind(o.cluster_spread)},
      {"data.window", positive(o.window)},
      {"model.layers", positive(o.layers)},
      {"model.hidden", positive(o.hidden)},
      {"model.ffn_hidden", positive(o.ffn_hidden)},
      {"model.experts", positive(o.experts)},
      {"model.topk", positive(o.topk)},
      {"model.shared_experts", non_negative(o.shared_experts)},
      {"model.dtype", bind(o.dtype)},
      {"model.compute_dtype", bind(o.compute_dtype)},
      {"model.overlap", bind(o.overlap)},
      {"model.overlap_chunks", bind(o.overlap_chunks, {.min = 1, .max = 64})},
      {"model.dispatch_dtype", bind(o.dispatch_dtype)},
      {"model.combine_dtype", bind(o.combine_dtype)},
      {"model.combine_weights", bind(o.combine_weights)},
      {"model.score", bind(o.score)},
      {"model.normalize", bind(o.normalize)},
      {"model.groups", positive(o.groups)},
      {"model.topk_groups", positive(o.topk_groups)},
      {"balance.strategy", bind(o.balance)},
      {"balance.aux_coeff", bind(o.aux_coeff)},
      {"balance.z_coeff", bind(o.z_coeff)},
      {"balance.bias_rate", bind(o.bias_rate)},
      {"balance.capacity_factor", bind(o.capacity_factor)},
      {"balance.eplb_every", bind(o.eplb_every, {.min = 1, .max = uint64_t{1} << 40})},
      {"balance.eplb_slots", non_negative(o.eplb_slots)},
      {"optim.lr", bind(o.lr)},
      {"optim.warmup", non_negative(o.warmup)},
      {"optim.min_lr_ratio", bind(o.min_lr_ratio)},
      {"optim.weight_decay", bind(o.weight_decay)},
      {"optim.clip", bind(o.clip)},
      {"output.metrics", bind(o.metrics_path)},
      {"output.trace", bind(o.trace_path)},
      {"output.trace_steps", non_negative(o.trace_steps)},
      {"output.wait_matrix_every", non_negative(o.wait_matrix_every)},
      {"output.record_waits", bind(o.record_waits)},
      {"output.save", bind(o.save_dir)},
      {"output.save_every", non_negative(o.save_every)},
      {"output.keep", bind(o.keep, {.min = 1, .max = 1000000})},
  };
}

Status apply_config(const toml::table& table, const std::string& path, TrainOptions& options);

Status load_config_file(const std::string& path, TrainOptions& options) {
  EPX_ASSIGN_OR_RETURN(std::string text, read_input_file(path, "the --config file", kMaxTomlBytes));
  return parse_train_config(text, path, options);
}

// A value as the file wrote it: strings quoted, numbers as TOML prints them.
std::string toml_text(const toml::node& node) {
  if (auto text = node.value_exact<std::string>()) return fmt::format("'{}'", *text);
  if (auto number = node.value_exact<double>()) return fmt::format("{}", *number);
  if (auto integer = node.value_exact<int64_t>()) return fmt::format("{}", *integer);
  if (auto flag = node.value_exact<bool>()) return *flag ? "true" : "false";
  return "(a table or array)";
}

// The keys of a parsed config file into options.
Status apply_config(const toml::table& table, const std::string& path, TrainOptions& options) {
  auto keys = config_keys(options);
  for (auto&& [section, node] : table) {
    const auto* inner = node.as_table();
    if (!inner)
      return invalid_argument("{}: '{}' is not a section; keys live in [run], [parallelism], [data], [model], [balance], [optim], [output]",
                              path, std::string(section.str()));
    for (auto&& [key, value] : *inner) {
      const std::string name = fmt::format("{}.{}", section.str(), key.str());
      auto it = keys.find(name);
      if (it == keys.end()) return invalid_argument("{}: unknown key '{}' (see configs/train-tiny.toml)", path, name);
      Status s = it->second(value, name);
      if (!s.is_ok()) return invalid_argument("{}: {}", path, s.message());
      if (auto check = single_checks().find(name); check != single_checks().end())
        if (s = check->second(options); !s.is_ok())
          return invalid_argument("{}: {} = {}: {}", path, name, toml_text(value), s.message());
    }
  }
  return Status::ok();
}

Result<TrainConfig> make_config(const TrainOptions& o) {
  TrainConfig c;
  c.num_ranks = o.num_ranks;
  c.num_nodes = o.num_nodes;
  c.ep = o.ep;
  c.steps = o.steps;
  c.batch_tokens = o.batch_tokens;
  ModelConfig& m = c.model;
  EPX_RETURN_IF_ERROR(check_single_settings(o));
  m.timeout = Milliseconds(std::llround(o.timeout_s * 1000));
  if (o.data == "synthetic") {
    m.task = TaskKind::kRegression;
  } else {
    m.task = TaskKind::kNextByte;
    c.text = {.path = o.data.substr(5), .window = o.window, .seed = o.seed};
  }
  m.input_dim = o.input_dim;
  m.output_dim = o.output_dim;
  m.window = o.window;
  m.num_layers = o.layers;
  c.synthetic = {.input_dim = o.input_dim, .output_dim = o.output_dim, .num_clusters = o.clusters, .zipf_s = o.zipf,
                 .cluster_spread = o.cluster_spread, .seed = o.seed};
  MoELayerConfig& l = m.layer;
  l.hidden = o.hidden;
  l.ffn_hidden = o.ffn_hidden;
  l.num_shared_experts = o.shared_experts;
  l.seed = o.seed;
  l.z_loss_coeff = o.z_coeff;
  EPX_ASSIGN_OR_RETURN(l.overlap, parse_overlap_mode(o.overlap));
  l.overlap_chunks = o.overlap_chunks;
  l.dtype = o.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  if (o.compute_dtype == "auto") {
    l.compute_dtype = faster_compute_dtype(l.dtype);
  } else {
    l.compute_dtype = o.compute_dtype == "f32" ? DType::kF32 : DType::kBF16;
  }
  if (!o.dispatch_dtype.empty()) {
    EPX_ASSIGN_OR_RETURN(l.dispatch_dtype, parse_dtype(o.dispatch_dtype));
  }
  l.combine_dtype = o.combine_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  l.combine_weights = o.combine_weights == "receiver" ? CombineWeights::kReceiver : CombineWeights::kHolder;
  l.router.num_experts = o.experts;
  l.router.topk = o.topk;
  l.router.score_function = o.score == "sigmoid" ? ScoreFunction::kSigmoid : ScoreFunction::kSoftmax;
  l.router.normalize_weights = o.normalize;
  l.router.num_groups = o.groups;
  l.router.topk_groups = o.topk_groups;
  BalancingConfig defaults;
  defaults.aux_loss_coeff = o.aux_coeff;
  defaults.capacity_factor = o.capacity_factor;
  defaults.bias_rate = static_cast<float>(o.bias_rate);
  if (o.eplb_every < 1) return invalid_argument("eplb_every = {} must be at least 1", o.eplb_every);
  if (o.eplb_slots < 0) return invalid_argument("eplb_slots = {} is below 0", o.eplb_slots);
  defaults.eplb_every = o.eplb_every;
  defaults.eplb_slots = o.eplb_slots;
  EPX_ASSIGN_OR_RETURN(c.balancing, parse_balancing(o.balance, defaults));
  c.schedule = {.peak = o.lr, .warmup_steps = o.warmup, .total_steps = o.steps, .min_ratio = o.min_lr_ratio};
  c.adamw.weight_decay = o.weight_decay;
  c.clip_norm = o.clip;
  c.grad_overlap = o.grad_overlap == "on";
  m.record_waits = o.record_waits == "on";
  c.wait_matrix_every = o.wait_matrix_every;
  c.save_dir = o.save_dir;
  c.save_every = o.save_every;
  c.async_save = o.async_save;
  c.keep_checkpoints = o.keep;
  c.resume_dir = o.resume_dir;
  c.overwrite_checkpoints = o.overwrite_checkpoints;
  c.allow_data_change = o.allow_data_change;
  if (o.trace_steps < 0) return invalid_argument("trace_steps = {} is below 0", o.trace_steps);
  return c;  // checked as a whole by plan_run
}

// The test hook EPX_TEST_FAULT (docs/errors.md, fault table): "stall:RANK:STEP:SECONDS"
// makes RANK sleep that long before STEP; "fail:RANK:STEP" makes it fail
// there, as a crashed rank would. For the fault tests only.
Status set_test_fault(TrainConfig* config) {
  const char* text = std::getenv("EPX_TEST_FAULT");
  if (text == nullptr || *text == '\0') return Status::ok();
  char kind[8] = {};
  int rank = -1;
  long long step = -1;
  double seconds = 0;
  const int fields = std::sscanf(text, "%7[a-z]:%d:%lld:%lf", kind, &rank, &step, &seconds);
  const bool stall = std::strcmp(kind, "stall") == 0 && fields == 4 && seconds >= 0;
  const bool fail = std::strcmp(kind, "fail") == 0 && fields == 3;
  if ((!stall && !fail) || rank < 0 || step < 0)
    return invalid_argument("EPX_TEST_FAULT = '{}' is not stall:RANK:STEP:SECONDS or fail:RANK:STEP", text);
  config->before_step = [=](int r, int64_t s) -> Status {
    if (r != rank || s != step) return Status::ok();
    if (fail) return internal_error("rank {} failed at step {} (EPX_TEST_FAULT)", r, s);
    fmt::print(stderr, "epx train: rank {} stalls for {} s before step {} (EPX_TEST_FAULT)\n", r, seconds, s);
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    return Status::ok();
  };
  return Status::ok();
}

std::string fixed(double v, int digits) { return fmt::format("{:.{}f}", v, digits); }

std::vector<std::vector<std::string>> summary_rows(const TrainSummary& s) {
  return {
      {"first loss", fmt::format("{:.5g}", s.first_loss)},
      {"final loss (last 10 steps)", fmt::format("{:.5g}", s.final_loss)},
      {"tokens/s", fmt::format("{:.0f}", s.tokens_per_second)},
      {"MaxVio (last step, mean over layers)", fixed(s.max_vio, 3)},
      {"MaxVio (last 10 steps)", fixed(s.mean_max_vio, 3)},
      {"dropped (token, expert) pairs", fmt::format("{}", s.dropped)},
      {"worst-rank idle fraction", fixed(s.idle_fraction, 3)},
      {"communication share of time", fixed(s.communication_share, 3)},
  };
}

int fail_usage(const Status& s) {
  fmt::print(stderr, "epx train: {}\n", s.message());
  return kExitUsage;
}

// Prints on rank 0 only (in-process: always).
int compare_balancing(const TrainOptions& o, const TrainConfig& base, bool root) {
  std::vector<std::string> names;
  std::string list = o.compare.empty() ? "none,aux,bias,capacity,bias+capacity,eplb,bias+eplb" : o.compare;
  for (std::size_t start = 0; start <= list.size();) {
    const std::size_t end = std::min(list.find(',', start), list.size());
    if (end > start) names.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  if (names.empty())
    return fail_usage(invalid_argument("--compare-balancing '{}' names no strategy; list some, e.g. none,aux,bias,eplb "
                                       "(or give no value for all of them)",
                                       o.compare));
  std::vector<BalancingConfig> strategies;
  for (const std::string& name : names) {
    auto b = parse_balancing(name, base.balancing.aux_loss_coeff > 0 || base.balancing.capacity_factor > 0
                                       ? base.balancing
                                       : BalancingConfig{.aux_loss_coeff = o.aux_coeff,
                                                         .bias_rate = static_cast<float>(o.bias_rate),
                                                         .capacity_factor = o.capacity_factor,
                                                         .eplb_every = o.eplb_every,
                                                         .eplb_slots = o.eplb_slots});
    if (!b.is_ok()) return fail_usage(b.status());
    strategies.push_back(*b);
  }
  std::vector<std::vector<std::string>> rows;
  for (const BalancingConfig& b : strategies) {
    TrainConfig c = base;
    c.balancing = b;
    c.save_dir.clear();
    c.save_every = 0;
    ProgressBar progress(c.steps, fmt::format("train [{}]", b.name()));
    auto summary = train(c, [&](const StepReport& r) {
      if (!o.quiet) progress.update(r.step + 1, fmt::format("loss {:.4g}", r.main_loss));
    });
    if (!o.quiet) progress.finish();
    if (!summary.is_ok()) {
      fmt::print(stderr, "epx train: {} failed: {}\n", b.name(), summary.status().message());
      return kExitFailed;
    }
    rows.push_back({b.name(), fmt::format("{:.5g}", summary->final_loss), fixed(summary->mean_max_vio, 3),
                    fmt::format("{}", summary->dropped), fixed(summary->idle_fraction, 3),
                    fmt::format("{:.0f}", summary->tokens_per_second)});
  }
  if (!root) return kExitOk;
  fmt::print("Balancing strategies, same data, model and seed ({} steps, {} ranks, {} experts, top-{}):\n", base.steps,
             base.num_ranks, base.model.layer.router.num_experts, base.model.layer.router.topk);
  fmt::print("{}", format_table({"balancing", "final loss", "expert MaxVio", "dropped", "rank idle fraction", "tokens/s"}, rows));
  return kExitOk;
}

// With --metrics -, stdout carries the JSON lines only; the rest goes to stderr.
constexpr std::size_t kStragglerWindowSteps = 50;  // the summary's straggler line looks at these last steps

std::FILE* text_stream(const TrainOptions& o) { return o.metrics_path == "-" ? stderr : stdout; }

void print_run_line(const TrainOptions& o, const TrainConfig& c, bool mpi) {
  const ModelConfig& m = c.model;
  fmt::print(stderr,
             "epx train: {} {} ranks ({} nodes{}), {} MoE layers of {} experts (top-{}, hidden {}, expert width {}, {}, "
             "expert GEMMs {}{}{}{}), "
             "{} tokens/step, balancing {}, data {}\n",
             c.num_ranks, mpi ? "MPI" : "in-process", c.num_nodes,
             c.ep_size() == c.num_ranks ? "" : fmt::format(", EP {} x EDP {}", c.ep_size(), c.num_ranks / c.ep_size()),
             m.num_layers, m.layer.router.num_experts,
             m.layer.router.topk, m.layer.hidden, m.layer.ffn_hidden, dtype_name(m.layer.dtype),
             dtype_name(m.layer.compute_dtype.value_or(m.layer.dtype)),
             m.layer.dispatch_dtype.value_or(m.layer.dtype) == m.layer.dtype
                 ? ""
                 : fmt::format(", dispatch {}", dtype_name(*m.layer.dispatch_dtype)),
             m.layer.combine_dtype == DType::kF32 ? "" : fmt::format(", combine partials {}", dtype_name(m.layer.combine_dtype)),
             m.layer.combine_weights == CombineWeights::kHolder ? "" : ", combine weighted by the receiver",
             c.batch_tokens,
             c.balancing.name(), o.data);
}

// The straggler diagnosis of the run's last steps (docs/operations.md,
// Finding a straggler): one line per straggler, or one saying there is none.
void print_stragglers(std::FILE* out, const StragglerWindow& recent) {
  if (recent.size() == 0) return;
  const std::vector<Straggler> found = recent.diagnose();
  for (const Straggler& s : found) fmt::print(out, "straggler: {}\n", describe(s));
  if (found.empty())
    fmt::print(out, "straggler: none (no rank caused a clear share of the waiting over the last {} steps)\n",
               recent.size());
}

void print_summary(const TrainOptions& o, const TrainSummary& summary, double wall_seconds,
                   const StragglerWindow& recent, const StepLimitWindow& limits) {
  std::FILE* out = text_stream(o);
  auto rows = summary_rows(summary);
  rows.push_back({"wall time (s)", fixed(wall_seconds, 2)});
  fmt::print(out, "{}", format_table({"summary", "value"}, rows));
  print_stragglers(out, recent);
  print_step_limit(out, limits);
  if (!o.metrics_path.empty() && o.metrics_path != "-") fmt::print(out, "metrics: {}\n", o.metrics_path);
  if (!o.trace_path.empty()) fmt::print(out, "trace: {} (open in https://ui.perfetto.dev)\n", o.trace_path);
  if (!o.save_dir.empty()) fmt::print(out, "checkpoint: {}\n", o.save_dir);
}

// --dry-run: the sizes the settings imply and the memory estimate per component.
void print_dry_run(const TrainOptions& o, const RunPlan& plan, const MemoryEstimate& e, const MemoryAvailable& a) {
  std::FILE* out = text_stream(o);
  const TrainConfig& c = plan.config();
  const ModelConfig& m = plan.model();
  const int E = m.layer.router.num_experts;
  const int slots = c.balancing.eplb ? c.balancing.slots(E, c.ep_size()) : E;
  fmt::print(out, "layout: {}\n", plan.layout().describe());
  fmt::print(out, "{}", format_table({"derived size", "value"},
                                     {{"tokens per rank (max_tokens_per_rank)", fmt::format("{}", m.max_tokens_per_rank)},
                                      {"expert slots per layer (per EP group)", fmt::format("{}", slots)},
                                      {"experts per rank per layer", fmt::format("{}", slots / c.ep_size())},
                                      {"expanded rows per rank (balanced routing)",
                                       fmt::format("{}", int64_t{m.max_tokens_per_rank} * m.layer.router.topk)},
                                      {"ranks in this process", fmt::format("{}", e.copies)},
                                      {"gradient all-reduce (--grad-overlap)",
                                       fmt::format("{}, buckets of {}", c.grad_overlap ? "beside the backward" : "after the backward",
                                                   format_bytes(c.grad_bucket_bytes))}}));
  std::vector<std::vector<std::string>> rows;
  for (const MemoryItem& item : e.items) rows.push_back({item.name, format_bytes(item.bytes), item.driver});
  rows.push_back({"per rank", format_bytes(e.per_rank()), ""});
  rows.push_back({fmt::format("this process ({} ranks)", e.copies), format_bytes(e.total()), ""});
  rows.push_back({"available", format_bytes(a.bytes), a.source});
  fmt::print(out, "{}", format_table({"memory", "bytes", "driven by"}, rows));
}

// Output paths: each --metrics / --trace location takes a new file (a probe
// file is created and removed there).
Status check_output_paths(const TrainOptions& o) {
  if (!o.metrics_path.empty()) EPX_RETURN_IF_ERROR(check_output_writable(o.metrics_path, "--metrics"));
  if (!o.trace_path.empty())
    EPX_RETURN_IF_ERROR(check_output_writable(o.trace_path, "--trace", /*renamed_into_place=*/true));
  return Status::ok();
}

// The checkpoint folder holding step folder `resume` (ck for ck/step-000006),
// or "" when `resume` is not a step folder.
std::string checkpoint_folder_of(const std::string& resume) {
  std::filesystem::path p = std::filesystem::path(resume).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  if (p.filename().string().rfind("step-", 0) != 0) return "";
  return p.has_parent_path() ? p.parent_path().string() : ".";
}

// Outputs apart from inputs: --metrics, --trace and --save against --config,
// --data text:FILE and the --resume checkpoint (its folder too), and each other.
Status check_train_paths(const TrainOptions& o) {
  std::vector<CommandPath> inputs = {{"--config", o.config_path, false},
                                     {"--data", o.data.rfind("text:", 0) == 0 ? o.data.substr(5) : "", false},
                                     {"--resume", o.resume_dir, true}};
  if (!o.resume_dir.empty())
    if (std::string folder = checkpoint_folder_of(o.resume_dir); !folder.empty())
      inputs.push_back({"--resume", std::move(folder), true});
  const CommandPath outputs[] = {
      {"--metrics", o.metrics_path, false}, {"--trace", o.trace_path, false}, {"--save", o.save_dir, true}};
  return check_outputs_apart(inputs, outputs);
}

// Before step 1: the memory estimate against what is available, then the
// output paths (rank 0's). kExitUsage with the numbers when either fails.
int preflight(const TrainOptions& o, const RunPlan& plan, bool root) {
  auto estimate = estimate_train_memory(plan);
  if (!estimate.is_ok()) return fail_usage(estimate.status());
  const MemoryAvailable available = available_memory();
  if (o.dry_run && root) print_dry_run(o, plan, *estimate, available);
  if (Status s = check_memory_fits(*estimate, available); !s.is_ok()) return fail_usage(s);
  if (root)
    if (Status s = check_output_paths(o); !s.is_ok()) return fail_usage(s);
  if (o.dry_run && root) fmt::print(text_stream(o), "dry run: every check passed; nothing was written\n");
  return kExitOk;
}

// Resuming from the checkpoint of step S: the metrics file is cut back to
// the records of steps 0 .. S-1 (one line on stderr, even with -q, when
// records are cut), so the resumed run's steps are in it once.
Status cut_metrics_for_resume(const TrainOptions& o, const RunPlan& plan) {
  if (!plan.resume() || o.metrics_path.empty() || o.metrics_path == "-") return Status::ok();
  const ResumePoint& from = *plan.resume();
  EPX_ASSIGN_OR_RETURN(MetricsCut cut, cut_metrics_before_step(o.metrics_path, from.step));
  if (cut.removed > 0)
    fmt::print(stderr,
               "epx train: {}: cut back to the steps before the checkpoint's step {} ({} records kept; the {} "
               "records of steps {} to {}, written after that checkpoint, removed: this run writes those steps anew)\n",
               o.metrics_path, from.step, cut.kept, cut.removed, cut.first_removed_step, cut.last_removed_step);
  else if (cut.bytes_removed > 0)
    fmt::print(stderr, "epx train: {}: removed a torn last line ({} bytes without a newline)\n", o.metrics_path,
               cut.bytes_removed);
  return Status::ok();
}

// Rank 0: the --save folder's lock (a second run is refused, exit 2; a stale
// lock is taken over with a line saying whose it was), then the metrics file
// (cut back for a resume, appended to then). The other ranks open nothing.
int open_outputs(const TrainOptions& o, const RunPlan& plan, bool root, std::optional<SaveLock>* lock,
                 std::optional<MetricsWriter>* metrics) {
  if (!root) return kExitOk;
  if (!o.save_dir.empty()) {
    auto taken = SaveLock::acquire(o.save_dir, plan.config().run_id);
    if (!taken.is_ok()) return fail_usage(taken.status());
    if (!taken->note().empty()) fmt::print(stderr, "epx train: {}\n", taken->note());
    lock->emplace(std::move(taken).value());
  }
  if (o.metrics_path.empty()) return kExitOk;
  if (Status s = cut_metrics_for_resume(o, plan); !s.is_ok()) return fail_usage(s);
  auto opened = MetricsWriter::open(o.metrics_path, /*append=*/!o.resume_dir.empty());
  if (!opened.is_ok()) return fail_usage(opened.status());
  metrics->emplace(std::move(opened).value());
  return kExitOk;
}

// The run: settings file, ranks and nodes, EP groups, backend, steps, batch, timeout, seed.
void add_train_run_options(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--config", o.config_path, "A TOML file of settings (see configs/train-*.toml); flags override it");
  cmd->add_option("--ranks", o.num_ranks, "Ranks: threads, or under MPI the processes started (they must be equal)")
      ->transform(in_range(1, 256))
      ->capture_default_str();
  cmd->add_option("--nodes", o.num_nodes,
                  "Nodes; must divide --ranks. In-process: emulated. Under MPI: 1 = the real hosts, more = each "
                  "host's ranks split into emulated nodes")
      ->transform(in_range(1, 256))
      ->capture_default_str();
  cmd->add_option("--ep", o.ep,
                  "Ranks per expert-parallel group (0 = all ranks); must divide --ranks. The --ranks / --ep EP groups "
                  "each hold every expert once and are data-parallel to each other: routed-expert gradients are "
                  "summed over the ranks holding the same experts, dense ones over all ranks. An EP group is "
                  "consecutive ranks, filling nodes before spanning them; --dry-run prints the groups")
      ->transform(in_range(0, 256))
      ->capture_default_str();
  cmd->add_option("--backend", o.backend,
                  "Where the ranks run: inproc (threads of this process), mpi (one rank per process, started by "
                  "mpirun or srun --mpi=pmix), auto (mpi when an MPI launcher started this process)")
      ->check(CLI::IsMember({"auto", "inproc", "mpi"}))
      ->capture_default_str();
  cmd->add_option("--steps", o.steps, "Optimizer steps")->transform(in_range(int64_t{0}, int64_t{1} << 40))->capture_default_str();
  cmd->add_option("--batch-tokens", o.batch_tokens, "Tokens per step over all ranks")
      ->transform(in_range(int64_t{1}, static_cast<int64_t>(kMaxBatchTokens)))
      ->capture_default_str();
  cmd->add_option("--timeout", o.timeout_s,
                  "Seconds any rank waits for the others in one operation (a dispatch, a combine, a barrier, an "
                  "all-reduce); past it every rank stops, naming the ranks that never arrived")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed of the data and the initialisation")
      ->transform(at_least(uint64_t{0}))
      ->capture_default_str();
}

// The training data.
void add_train_data_options(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--data", o.data,
                  "synthetic (clustered inputs, Zipf-skewed cluster sizes, one random function per cluster) or "
                  "text:FILE (byte-level next-byte prediction)")
      ->capture_default_str();
  cmd->add_option("--clusters", o.clusters, "Synthetic: clusters")->transform(at_least(1))->capture_default_str();
  cmd->add_option("--zipf", o.zipf, "Synthetic: Zipf exponent of the cluster sizes")->capture_default_str();
  cmd->add_option("--window", o.window, "Text: bytes of context per token")->transform(at_least(1))->capture_default_str();
}

// The model's shape.
void add_train_model_options(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--layers", o.layers, "MoE layers")->transform(at_least(1))->capture_default_str();
  cmd->add_option("--hidden", o.hidden, "Hidden size")->transform(at_least(1))->capture_default_str();
  cmd->add_option("--ffn-hidden", o.ffn_hidden, "Width of each expert")->transform(at_least(1))->capture_default_str();
  cmd->add_option("--experts", o.experts, "Routed experts per layer (a multiple of --ep, or of --ranks without it)")
      ->transform(at_least(1))
      ->capture_default_str();
  cmd->add_option("--topk", o.topk, "Experts per token")->transform(at_least(1))->capture_default_str();
  cmd->add_option("--shared-experts", o.shared_experts, "Shared experts (every token, every rank)")
      ->transform(at_least(0))
      ->capture_default_str();
}

// Payload and compute types, overlap, and how the combine works.
void add_train_exchange_options(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--dtype", o.dtype, "Dispatch payload (and the expert GEMMs' input): f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--compute-dtype", o.compute_dtype,
                  "Expert GEMMs: f32, bf16, or auto = the faster for --dtype on this CPU (f32 payload: f32; bf16 "
                  "payload: bf16 with AVX512-BF16 on AMD (measured about 2x f32 on Zen 5) or with AMX (assumed, not "
                  "measured); else f32 (AVX512-BF16 on Intel measured 0.5-0.85x f32); docs/design.md, Experts)")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--overlap", o.overlap,
                  "Exchange under compute in each MoE layer: none, shared (shared experts under the dispatch), "
                  "chunked (--overlap-chunks chunks pipelined), two-micro-batches; the same bits as none")
      ->check(CLI::IsMember({"none", "shared", "chunked", "two-micro-batches"}))
      ->capture_default_str();
  cmd->add_option("--overlap-chunks", o.overlap_chunks, "Chunks of --overlap chunked")
      ->transform(in_range(1, 64))
      ->capture_default_str();
  cmd->add_option("--dispatch-dtype", o.dispatch_dtype,
                  "What the dispatch sends (default: --dtype): fp8 = e4m3 with one f32 scale per 128 channels "
                  "(--hidden a multiple of 128), dequantised to --dtype for the experts; combine and backward "
                  "stay in --dtype")
      ->check(CLI::IsMember({"fp8", "bf16", "f32"}));
  cmd->add_option("--combine-dtype", o.combine_dtype,
                  "The combine's partial rows, one per (token, rank): f32 (exact) or bf16 (each partial rounded "
                  "once, half the combine's bytes; the sum across ranks stays fp32 in a fixed order and the "
                  "backward is the same; docs/design.md, Expanded layout and weighted combine)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--combine-weights", o.combine_weights,
                  "Where the combine applies the top-k weights: holder (each expert rank sends one weighted "
                  "partial per (token, rank), of --combine-dtype) or receiver (the experts write y in --dtype "
                  "straight into the combine region and each token's rank sums w * y in top-k order in fp32: "
                  "fewer bytes, other bits, the same on any number of ranks; needs --overlap none, "
                  "--combine-dtype f32 and a flat exchange; docs/design.md, Expanded layout and weighted combine)")
      ->check(CLI::IsMember({"holder", "receiver"}))
      ->capture_default_str();
}

// The router and load balancing.
void add_train_routing_options(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--score", o.score, "Gate: softmax or sigmoid")->check(CLI::IsMember({"softmax", "sigmoid"}))->capture_default_str();
  cmd->add_option("--groups", o.groups, "Expert groups for group-limited routing (1 = none)")
      ->transform(at_least(1))
      ->capture_default_str();
  cmd->add_option("--topk-groups", o.topk_groups, "Groups a token may use")->transform(at_least(1))->capture_default_str();
  cmd->add_option("--balance", o.balance,
                  "Load balancing: none, aux, aux-global, bias (aux-loss-free, DeepSeek-V3), capacity (drop by "
                  "position), capacity-score (drop the lowest scores), eplb (re-place experts with redundant "
                  "replicas every --eplb-every steps), or several joined by '+'")
      ->capture_default_str();
  cmd->add_option("--aux-coeff", o.aux_coeff, "Weight of the auxiliary load-balancing loss")->capture_default_str();
  cmd->add_option("--z-coeff", o.z_coeff, "Weight of the router z-loss (0 = off)")->capture_default_str();
  cmd->add_option("--bias-rate", o.bias_rate, "Step of the expert-bias update")->capture_default_str();
  cmd->add_option("--capacity-factor", o.capacity_factor, "Capacity factor of the capacity strategies")->capture_default_str();
  cmd->add_option("--eplb-every", o.eplb_every, "eplb: steps between re-placements of the experts")
      ->transform(in_range(int64_t{1}, int64_t{1} << 40))
      ->capture_default_str();
  cmd->add_option("--eplb-slots", o.eplb_slots,
                  "eplb: physical expert slots per layer of each EP group, >= --experts and a multiple of --ep (0 = "
                  "experts plus one redundant slot per EP rank)")
      ->transform(at_least(0))
      ->capture_default_str();
}

// The optimizer and the gradient all-reduce.
void add_train_optimizer_options(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--lr", o.lr, "Peak learning rate (AdamW)")->capture_default_str();
  cmd->add_option("--warmup", o.warmup, "Warm-up steps (then cosine decay)")->transform(at_least(int64_t{0}))->capture_default_str();
  cmd->add_option("--clip", o.clip, "Gradient-norm clip (0 = off)")->capture_default_str();
  cmd->add_option("--grad-overlap", o.grad_overlap,
                  "on: each bucket of gradients is all-reduced on a thread as soon as the backward has made it "
                  "final, beside the rest of the backward; off: after the backward (the same bits)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
}

// What the run writes to watch it: metrics, trace, wait records.
void add_train_observe_options(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--metrics", o.metrics_path,
                  "Write one JSON line per step to this file ('-' = stdout, and all other output goes to stderr). "
                  "Its folder is checked writable before step 1; a line that cannot be written stops the run at "
                  "that step (exit 1), the file still valid JSON Lines");
  cmd->add_option("--trace", o.trace_path,
                  "Write Chrome trace events of a few steps to this file (Perfetto); checked writable before step "
                  "1, written to a temporary file and renamed");
  cmd->add_option("--trace-steps", o.trace_steps, "Steps traced (from step 1)")
      ->transform(at_least(int64_t{0}))
      ->capture_default_str();
  cmd->add_option("--wait-matrix-every", o.wait_matrix_every,
                  "Every N steps a --metrics line also carries the full who-waited-for-whom matrices (\"wait_matrix\": "
                  "ranks x ranks seconds of arrival and data waits; docs/operations.md); every line carries each "
                  "rank's summary (exchange_wait, waited_for, late, slow_data). 0 = never")
      ->transform(in_range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  cmd->add_option("--record-waits", o.record_waits,
                  "on: every dispatch and combine records who waited for whom (the fields above); off: not (they "
                  "stay 0), only to measure what recording costs")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
}

// Checkpoints, resuming, and the dry run and balancing comparison.
void add_train_checkpoint_options(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--save", o.save_dir,
                  "Checkpoint folder that epx owns: new, empty, or written by epx before (anything else is refused, "
                  "nothing touched). Each save adds a verified step-NNNNNN folder and updates 'latest'; checked "
                  "writable and for free space before step 1. One run writes into it at a time: the run holds a lock "
                  "on DIR/.epx-lock (host, pid, start time, run id) from before step 1 to its end, and a second run "
                  "is refused naming the first; a lock left by a run that was killed is taken over, saying so");
  cmd->add_option("--save-every", o.save_every, "Also checkpoint every N steps (0 = only at the end)")
      ->transform(at_least(int64_t{0}))
      ->capture_default_str();
  cmd->add_flag("--async-save", o.async_save,
                "Write the --save-every checkpoints while training goes on: the step boundary copies the state, a "
                "thread writes the files, a later step boundary publishes them (one save in flight; the same files)");
  cmd->add_option("--keep", o.keep, "Step folders of this run kept in the --save folder (older ones are removed after a "
                  "new one is complete; another run's are never removed)")
      ->transform(in_range(1, 1000000))
      ->capture_default_str();
  cmd->add_flag("--dry-run", o.dry_run,
                "Check everything (settings, memory, output paths), print the derived sizes and the memory each "
                "rank needs per component, write nothing and exit (0: it would run; 2: it would not)");
  cmd->add_option("--resume", o.resume_dir,
                  "Continue from a checkpoint: a --save folder (its 'latest') or one of its step-NNNNNN folders; the "
                  "same model and data settings (seed, --data, --clusters, --zipf, --window, --batch-tokens) on any "
                  "layout (ranks, nodes, --ep, EPLB slots: resharded); every file is verified first. The --metrics file "
                  "is cut back to the checkpoint's step before the run appends to it, so no step is in it twice");
  cmd->add_flag("--allow-data-change", o.allow_data_change,
                "Let --resume train on other data settings than its checkpoint recorded (refused without it: exit 2 "
                "naming each setting, its old and new value)");
  cmd->add_flag("--overwrite-checkpoints", o.overwrite_checkpoints,
                "Let --save write into a folder holding another run's checkpoints (refused without it: a new run "
                "into a folder with step folders, or a resume into one with another run's): this run takes over "
                "'latest' and replaces a step folder of the same step; --keep still prunes only this run's");
  cmd->add_option("--compare-balancing", o.compare,
                  "Run the same training once per strategy (comma-separated; empty = none,aux,bias,capacity,"
                  "bias+capacity,eplb,bias+eplb) and print a table side by side")
      ->expected(0, 1);
}

}  // namespace

CLI::App* add_train_command(CLI::App& app, TrainOptions& o) {
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train an MoE model on ranks that are threads of this process or, under mpirun or srun, one process each "
      "(experts spread over them), and report loss, load balance and "
      "where the time went. Settings: defaults < --config FILE.toml < flags");
  add_train_run_options(cmd, o);
  add_train_data_options(cmd, o);
  add_train_model_options(cmd, o);
  add_train_exchange_options(cmd, o);
  add_train_routing_options(cmd, o);
  add_train_optimizer_options(cmd, o);
  add_train_observe_options(cmd, o);
  add_train_checkpoint_options(cmd, o);
  return cmd;
}

Status parse_train_config(std::string_view text, const std::string& path, TrainOptions& options) {
  toml::table table;
  try {
    table = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    return invalid_argument("{}:{}:{}: {}", path, e.source().begin.line, e.source().begin.column, e.description());
  }
  return apply_config(table, path, options);
}

// The file is read before CLI11 parses, so that the flags parsed after it
// override it. CLI11's own config files cannot take its place: they map a
// key to the flag of the same name and a [section] to a subcommand, while
// this file has its own sections ([run], [model], ...), keys without a flag
// (data.input_dim) and range checks whose errors name the file's key.
int preload_train_config(int argc, char** argv, TrainOptions& options) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], path;
    if (arg == "--config" && i + 1 < argc) path = argv[i + 1];
    if (arg.rfind("--config=", 0) == 0) path = arg.substr(9);
    if (path.empty()) continue;
    Status s = load_config_file(path, options);
    if (!s.is_ok()) return fail_usage(s);
  }
  return kExitOk;
}

namespace {

// Preemption (SIGTERM, SIGUSR1: what Slurm sends before it ends or requeues
// a job): the handler only raises the flag; every rank reads it after each
// step and they agree to save and stop (TrainConfig::preempt).
std::atomic<bool> g_preempt{false};
extern "C" void on_preempt_signal(int) { g_preempt.store(true); }

void catch_preemption(TrainConfig* config) {
  struct sigaction sa {};
  sa.sa_handler = on_preempt_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
  config->preempt = &g_preempt;
}

// The run's configuration from the options, each checked by itself, before
// anything is read or written; plan_run checks it as a whole once this
// process knows its ranks (under MPI, the real hosts are the nodes).
Status make_run_config(const TrainOptions& o, TrainConfig* config) {
  EPX_RETURN_IF_ERROR(check_train_paths(o));  // before anything is read or written
  EPX_ASSIGN_OR_RETURN(*config, make_config(o));
  // From here: a preemption signal during start-up (MPI, preflight, loading)
  // is kept and honoured at the first step boundary.
  if (!o.save_dir.empty() && !o.dry_run && !o.compare_given) catch_preemption(config);
  return set_test_fault(config);
}

// Under MPI this process runs one rank; rank 0 prints and writes the files.
int join_mpi(TrainOptions& o, TrainConfig* config, std::unique_ptr<MpiSession>* session,
             std::unique_ptr<Transport>* transport) {
  if (o.backend != "mpi" && !(o.backend == "auto" && launched_by_mpi())) return kExitOk;
  // The MPI ranks are split into --nodes nodes: plan_run's rule first.
  if (config->num_ranks % config->num_nodes != 0)
    return fail_usage(invalid_argument("nodes = {} must divide ranks = {}", config->num_nodes, config->num_ranks));
  auto opened = open_mpi_rank(config->num_ranks, config->num_nodes, "epx train", session, transport);
  if (opened != kExitOk) return opened;
  config->num_nodes = (*transport)->topology().num_nodes();
  config->transport = transport->get();
  if ((*transport)->rank() != 0) {
    o.quiet = true;
    o.metrics_path.clear();
    o.trace_path.clear();
  }
  return kExitOk;
}

// Rank 0's lines before the first step: the save plan, and what a resume
// changes (another layout, unchecked or other data: one line each, even with -q).
void print_start_notes(const TrainOptions& o, const RunPlan& plan, bool root) {
  if (!root) return;
  if (!o.save_dir.empty() && (!o.quiet || plan.save().tight)) fmt::print(stderr, "epx train: {}\n", plan.save().describe());
  for (const std::string* note : {&plan.resume_note(), &plan.resume_data_note()})
    if (!note->empty()) fmt::print(stderr, "epx train: {}\n", *note);
}

// After each step on rank 0: the metrics line (a line that cannot be written
// stops the run at that step), the straggler and efficiency windows, the
// progress line.
Status record_step(const StepReport& r, const TrainOptions& o, std::optional<MetricsWriter>& metrics,
                   StragglerWindow& recent, StepLimitWindow& limits, ProgressBar& progress) {
  if (metrics) {  // the one place a report becomes text
    Status s = metrics->write(r.to_json());
    if (!s.is_ok()) return Status(s.code(), fmt::format("writing metrics: {}", s.message()));
  }
  if (r.step > 0) recent.add(step_record(r));
  limits.add(r);
  double vio = 0;
  for (const LoadStats& s : r.layers) vio += s.max_vio;
  vio /= static_cast<double>(std::max<std::size_t>(r.layers.size(), 1));
  if (!o.quiet) progress.update(r.step + 1, fmt::format("loss {:.4g} MaxVio {:.2f}", r.main_loss, vio));
  return Status::ok();
}

// After the last step: the trace, rank 0's summary, and the exit code
// (preempted: how to go on).
int finish_run(const TrainOptions& o, const TrainSummary& summary, const Tracer& tracer, double wall_s,
               const StragglerWindow& recent, const StepLimitWindow& limits, bool root) {
  if (!o.trace_path.empty()) {
    Status s = write_chrome_trace(tracer.spans(), o.trace_path);
    if (!s.is_ok()) {
      fmt::print(stderr, "epx train: {}\n", s.message());
      return kExitFailed;
    }
  }
  const int done = summary.preempted_at >= 0 ? kExitPreempted : kExitOk;
  if (!root) return done;
  print_summary(o, summary, wall_s, recent, limits);
  if (done == kExitPreempted)
    fmt::print(stderr,
               "epx train: preempted (SIGTERM or SIGUSR1): saved the checkpoint of step {} in {}; exit {}: run the "
               "same command with --resume {} to go on\n",
               summary.preempted_at, o.save_dir, kExitPreempted, o.save_dir);
  return done;
}

// The steps, with their progress line; the exit code.
int run_steps(const TrainOptions& o, const RunPlan& plan, const Tracer& tracer, bool root,
              std::optional<MetricsWriter>& metrics, bool mpi) {
  if (!o.quiet) print_run_line(o, plan.config(), mpi);
  print_start_notes(o, plan, root);
  ProgressBar progress(plan.config().steps, "train");
  Stopwatch wall;
  // The last steps as the metrics reader sees them, for the straggler line
  // (the first step left out: every rank's first GEMMs are slow).
  StragglerWindow recent(kStragglerWindowSteps);
  StepLimitWindow limits(plan, kStragglerWindowSteps);  // the efficiency line: the same steps
  auto summary =
      train(plan, [&](const StepReport& r) { return record_step(r, o, metrics, recent, limits, progress); });
  if (!o.quiet) progress.finish();
  if (!summary.is_ok()) {
    fmt::print(stderr, "epx train: {}\n", summary.status().to_string());
    return kExitFailed;
  }
  return finish_run(o, *summary, tracer, wall.seconds(), recent, limits, root);
}

}  // namespace

int run_train(const TrainOptions& options) {
  TrainOptions o = options;
  TrainConfig config;
  if (Status s = make_run_config(o, &config); !s.is_ok()) return fail_usage(s);
  std::unique_ptr<MpiSession> session;
  std::unique_ptr<Transport> transport;
  if (const int rc = join_mpi(o, &config, &session, &transport); rc != kExitOk) return rc;
  const bool root = transport == nullptr || transport->rank() == 0;
  Tracer tracer;
  if (!o.trace_path.empty() && !o.compare_given) {
    config.tracer = &tracer;
    config.trace_steps = o.trace_steps;
  }
  // Every check of the run, once (--save: owned, writable, room for a
  // checkpoint, no other run's); every stage below takes the plan.
  Result<RunPlan> plan = plan_run(config);
  if (!plan.is_ok()) {
    if (transport) transport->abort(aborted("rank {} refused the settings", transport->rank()));
    return fail_usage(plan.status());
  }
  // Preflight: memory and output paths, before any step (and, with
  // --dry-run, instead of the run).
  if (o.dry_run && root && !o.save_dir.empty()) fmt::print(text_stream(o), "{}\n", plan->save().describe());
  if (const int rc = preflight(o, *plan, root); rc != kExitOk || o.dry_run) {
    if (rc != kExitOk && transport) transport->abort(aborted("rank {} failed the preflight checks", transport->rank()));
    return rc;
  }
  if (o.compare_given) return compare_balancing(o, plan->config(), root);

  // Everything is checked; only now are files opened: the save folder's
  // lock first (rank 0), then the metrics.
  std::optional<SaveLock> lock;
  std::optional<MetricsWriter> metrics;
  if (const int rc = open_outputs(o, *plan, root, &lock, &metrics); rc != kExitOk) {
    if (transport) transport->abort(aborted("rank 0 could not open its outputs (the --save lock, --metrics)"));
    return rc;
  }
  return run_steps(o, *plan, tracer, root, metrics, transport != nullptr);
}

}  // namespace epx::app
