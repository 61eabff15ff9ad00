#include "epx/sim/scenario.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <variant>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "epx/core/input_file.h"

namespace epx::sim {
namespace {

using Field = std::variant<int*, int64_t*, uint64_t*, double*, bool*, std::string*>;

struct Key {
  const char* name;
  Field field;
};

// The hardware profile's keys, with "hardware." in front.
void add_hardware_keys(Scenario& s, std::vector<Key>& keys) {
  HardwareProfile& h = s.hardware;
  keys.insert(keys.end(), {
      {"hardware.name", &h.name},
      {"hardware.compute.bf16_flops", &h.bf16_flops},
      {"hardware.compute.fp8_flops", &h.fp8_flops},
      {"hardware.compute.sms", &h.sms},
      {"hardware.compute.gemm_efficiency", &h.gemm_efficiency},
      {"hardware.compute.gemm_half_rows", &h.gemm_half_rows},
      {"hardware.compute.gemm_tile", &h.gemm_tile},
      {"hardware.memory.hbm_bandwidth", &h.hbm_bandwidth},
      {"hardware.memory.optimizer_bandwidth", &h.optimizer_bandwidth},
      {"hardware.nvlink.bandwidth", &h.nvlink_bandwidth},
      {"hardware.nvlink.efficiency", &h.nvlink_efficiency},
      {"hardware.nvlink.latency", &h.nvlink_latency},
      {"hardware.nic.per_gpu", &h.nics_per_gpu},
      {"hardware.nic.bandwidth", &h.nic_bandwidth},
      {"hardware.nic.efficiency", &h.nic_efficiency},
      {"hardware.nic.latency", &h.nic_latency},
      {"hardware.comm.message_overhead", &h.message_overhead},
      {"hardware.comm.sms", &h.comm_sms},
      {"hardware.comm.forward_sm_bandwidth", &h.forward_sm_bandwidth},
      {"hardware.host.copy_bandwidth", &h.host_copy_bandwidth},
      {"hardware.host.nic_copies", &h.host_nic_copies},
      {"hardware.host.cores", &h.host_cores},
      {"hardware.nic.shared_per_node", &h.nic_shared_per_node},
  });
}

// The cluster and the model.
void add_cluster_and_model_keys(Scenario& s, std::vector<Key>& keys) {
  keys.insert(keys.end(), {
      {"cluster.nodes", &s.cluster.nodes},
      {"cluster.gpus_per_node", &s.cluster.gpus_per_node},
      {"cluster.rail_aligned", &s.cluster.rail_aligned},
      {"model.layers", &s.model.layers},
      {"model.dense_layers", &s.model.dense_layers},
      {"model.hidden", &s.model.hidden},
      {"model.expert_hidden", &s.model.expert_hidden},
      {"model.dense_hidden", &s.model.dense_hidden},
      {"model.experts", &s.model.experts},
      {"model.shared_experts", &s.model.shared_experts},
      {"model.topk", &s.model.topk},
      {"model.groups", &s.model.groups},
      {"model.topk_groups", &s.model.topk_groups},
      {"model.capacity_factor", &s.model.capacity_factor},
      {"model.score", &s.model.score},
      {"model.dispatch_dtype", &s.model.dispatch_dtype},
      {"model.combine_dtype", &s.model.combine_dtype},
      {"model.combine_remote_dtype", &s.model.combine_remote_dtype},
      {"model.compute_dtype", &s.model.compute_dtype},
      {"model.attention_flops_per_token", &s.model.attention_flops_per_token},
      {"model.attention", &s.model.attention},
      {"model.grad_dtype", &s.model.grad_dtype},
      {"model.embedding_params", &s.model.embedding_params},
      {"model.head_params", &s.model.head_params},
      {"model.activation_dtype", &s.model.activation_dtype},
  });
}

// How the model is split and trained.
void add_parallelism_and_optimizer_keys(Scenario& s, std::vector<Key>& keys) {
  keys.insert(keys.end(), {
      {"parallelism.ep", &s.parallelism.ep},
      {"parallelism.pp_stages", &s.parallelism.pp_stages},
      {"parallelism.micro_batches", &s.parallelism.micro_batches},
      {"parallelism.tokens_per_gpu", &s.parallelism.tokens_per_gpu},
      {"parallelism.dispatch", &s.parallelism.dispatch},
      {"parallelism.combine_per_rank", &s.parallelism.combine_per_rank},
      {"parallelism.mode", &s.parallelism.mode},
      {"parallelism.grad_overlap", &s.parallelism.grad_overlap},
      {"parallelism.grad_bucket_bytes", &s.parallelism.grad_bucket_bytes},
      {"parallelism.allreduce", &s.parallelism.allreduce},
      {"parallelism.pp_transfers", &s.parallelism.pp_transfers},
      {"optimizer.kind", &s.optimizer.kind},
      {"optimizer.master_dtype", &s.optimizer.master_dtype},
      {"optimizer.moment_dtype", &s.optimizer.moment_dtype},
      {"optimizer.weight_copy_dtype", &s.optimizer.weight_copy_dtype},
      {"optimizer.zero", &s.optimizer.zero},
  });
}

// Routing, balancing, schedule and run.
void add_routing_to_run_keys(Scenario& s, std::vector<Key>& keys) {
  keys.insert(keys.end(), {
      {"routing.distribution", &s.routing.distribution},
      {"routing.zipf_s", &s.routing.zipf_s},
      {"routing.lognormal_sigma", &s.routing.lognormal_sigma},
      {"routing.drift", &s.routing.drift},
      {"routing.trace", &s.routing.trace},
      {"routing.trace_format", &s.routing.trace_format},
      {"routing.seed", &s.routing.seed},
      {"routing.sample_tokens", &s.routing.sample_tokens},
      {"balancing.strategy", &s.balancing.strategy},
      {"balancing.aux_skew_reduction", &s.balancing.aux_skew_reduction},
      {"balancing.bias_rate", &s.balancing.bias_rate},
      {"balancing.eplb_redundant", &s.balancing.eplb_redundant},
      {"balancing.eplb_every", &s.balancing.eplb_every},
      {"schedule.overlap", &s.schedule.overlap},
      {"schedule.chunks", &s.schedule.chunks},
      {"run.steps", &s.run.steps},
      {"run.ep_groups", &s.run.ep_groups},
      {"run.trace_step", &s.run.trace_step},
      {"run.threads", &s.run.threads},
  });
}

// The one table of settable keys. Hardware keys are the profile file's keys
// with "hardware." in front.
std::vector<Key> keys_of(Scenario& s) {
  std::vector<Key> keys;
  add_hardware_keys(s, keys);
  add_cluster_and_model_keys(s, keys);
  add_parallelism_and_optimizer_keys(s, keys);
  add_routing_to_run_keys(s, keys);
  return keys;
}

Key* find_key(std::vector<Key>& keys, const std::string& name) {
  for (Key& k : keys)
    if (name == k.name) return &k;
  return nullptr;
}

template <typename T>
Status store_integer(T* field, const std::string& key, int64_t v) {
  if (v < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
      (v > 0 && static_cast<uint64_t>(v) > static_cast<uint64_t>(std::numeric_limits<T>::max())))
    return invalid_argument("{} = {} is outside [{}, {}]", key, v, std::numeric_limits<T>::min(),
                            std::numeric_limits<T>::max());
  *field = static_cast<T>(v);
  return Status::ok();
}

// One TOML value into its field.
Status set_from_node(const Key& key, const toml::node& node) {
  return std::visit(
      [&](auto* field) -> Status {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (auto v = node.value_exact<bool>()) {
            *field = *v;
            return Status::ok();
          }
          return invalid_argument("{} must be true or false", key.name);
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (auto v = node.value_exact<std::string>()) {
            *field = *v;
            return Status::ok();
          }
          return invalid_argument("{} must be a string", key.name);
        } else if constexpr (std::is_same_v<T, double>) {
          if (!node.is_number()) return invalid_argument("{} must be a number", key.name);
          *field = *node.value<double>();
          return Status::ok();
        } else {
          auto v = node.value_exact<int64_t>();
          if (!v) return invalid_argument("{} must be an integer", key.name);
          return store_integer(field, key.name, *v);
        }
      },
      key.field);
}

// One value given as text (--set, --sweep) into its field.
Status set_from_text(const Key& key, const std::string& text) {
  return std::visit(
      [&](auto* field) -> Status {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (text != "true" && text != "false") return invalid_argument("{} = '{}' must be true or false", key.name, text);
          *field = text == "true";
          return Status::ok();
        } else if constexpr (std::is_same_v<T, std::string>) {
          *field = text;
          return Status::ok();
        } else if constexpr (std::is_same_v<T, double>) {
          char* end = nullptr;
          const double v = std::strtod(text.c_str(), &end);
          if (text.empty() || *end != '\0' || !std::isfinite(v))
            return invalid_argument("{} = '{}' is not a finite number", key.name, text);
          *field = v;
          return Status::ok();
        } else {
          int64_t v = 0;
          auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
          if (ec != std::errc() || ptr != text.data() + text.size())
            return invalid_argument("{} = '{}' is not an integer", key.name, text);
          return store_integer(field, key.name, v);
        }
      },
      key.field);
}

// A key older hardware profiles set, refused with its reason.
constexpr std::string_view kRemovedStagesLocalNode = "hardware.nic.stages_local_node";

// Walks nested tables: [a.b] c = 1 becomes "prefix" + "a.b.c".
Status apply_table(const toml::table& table, const std::string& prefix, std::vector<Key>& keys,
                   const std::string& path, const std::vector<std::string>& skip) {
  for (auto&& [name, node] : table) {
    const std::string full = prefix + std::string(name.str());
    if (std::find(skip.begin(), skip.end(), full) != skip.end()) continue;
    if (const auto* inner = node.as_table()) {
      EPX_RETURN_IF_ERROR(apply_table(*inner, full + ".", keys, path, skip));
      continue;
    }
    Key* key = find_key(keys, full);
    if (key == nullptr && full == kRemovedStagesLocalNode)
      return invalid_argument(
          "{}: '{}' was removed: DeepEP's internode kernels send a sender's rows for its own node "
          "without the NIC, and the two-hop model now has a forwarding stage (hardware.comm.forward_sm_bandwidth; "
          "docs/simulator.md, Kernel models); delete the line",
          path, full);
    if (key == nullptr)
      return invalid_argument("{}: unknown key '{}' (see configs/sim/template.toml and configs/hardware/h100.toml)",
                              path, full);
    Status s = set_from_node(*key, node);
    if (!s.is_ok()) return invalid_argument("{}: {}", path, s.message());
  }
  return Status::ok();
}

Status syntax_error(const std::string& path, const toml::parse_error& e) {
  return invalid_argument("{}:{}:{}: {}", path, e.source().begin.line, e.source().begin.column, e.description());
}

Result<toml::table> parse_toml_text(std::string_view text, const std::string& path) {
  try {
    return toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    return syntax_error(path, e);
  }
}

// A file that is not a regular one (a directory, /dev/zero, a FIFO) or is too
// large is refused before it is read (read_input_file).
Result<toml::table> parse_toml(const std::string& path, std::string_view what) {
  EPX_ASSIGN_OR_RETURN(std::string text, read_input_file(path, what, kMaxTomlBytes));
  return parse_toml_text(text, path);
}

Status one_of(const std::string& key, const std::string& value, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed)
    if (value == a) return Status::ok();
  std::string list;
  for (const char* a : allowed) list += fmt::format("{}{}", list.empty() ? "" : ", ", a);
  return invalid_argument("{} = '{}' is not one of {}", key, value, list);
}

Status at_least(const char* key, double value, double limit) {
  if (!(value >= limit)) return invalid_argument("{} = {} is below {}", key, value, limit);
  return Status::ok();
}

Status positive(const char* key, double value) {
  if (!(value > 0) || !std::isfinite(value)) return invalid_argument("{} = {} must be above 0", key, value);
  return Status::ok();
}

}  // namespace

Result<int64_t> row_bytes(const std::string& dtype, int hidden) {
  if (dtype == "fp8") return int64_t{hidden} + int64_t{(hidden + 127) / 128} * 4;
  if (dtype == "bf16") return int64_t{hidden} * 2;
  if (dtype == "f32") return int64_t{hidden} * 4;
  return invalid_argument("dtype '{}' is not one of fp8, bf16, f32", dtype);
}

double dtype_bytes(const std::string& dtype) {
  if (dtype == "f32") return 4;
  if (dtype == "bf16") return 2;
  if (dtype == "fp8") return 1;
  return 0;
}

double attention_flops(const ModelConfig& m) {
  if (!m.attention) return 0.0;
  return m.attention_flops_per_token > 0 ? m.attention_flops_per_token : 8.0 * m.hidden * m.hidden;
}

namespace {

// The hardware profile: rates above 0, efficiencies in (0, 1].
Status check_hardware(const Scenario& s) {
  const HardwareProfile& h = s.hardware;
  EPX_RETURN_IF_ERROR(positive("hardware.compute.bf16_flops", h.bf16_flops));
  if (s.model.compute_dtype == "fp8") EPX_RETURN_IF_ERROR(positive("hardware.compute.fp8_flops", h.fp8_flops));
  EPX_RETURN_IF_ERROR(at_least("hardware.compute.sms", h.sms, 1));
  if (h.comm_sms < 0 || h.comm_sms >= h.sms)
    return invalid_argument("hardware.comm.sms = {} is outside [0, hardware.compute.sms = {})", h.comm_sms, h.sms);
  if (!(h.gemm_efficiency > 0 && h.gemm_efficiency <= 1))
    return invalid_argument("hardware.compute.gemm_efficiency = {} is outside (0, 1]", h.gemm_efficiency);
  EPX_RETURN_IF_ERROR(at_least("hardware.compute.gemm_half_rows", h.gemm_half_rows, 0));
  EPX_RETURN_IF_ERROR(at_least("hardware.compute.gemm_tile", h.gemm_tile, 1));
  EPX_RETURN_IF_ERROR(positive("hardware.memory.hbm_bandwidth", h.hbm_bandwidth));
  EPX_RETURN_IF_ERROR(at_least("hardware.memory.optimizer_bandwidth", h.optimizer_bandwidth, 0));
  EPX_RETURN_IF_ERROR(positive("hardware.nvlink.bandwidth", h.nvlink_bandwidth));
  if (!(h.nvlink_efficiency > 0 && h.nvlink_efficiency <= 1))
    return invalid_argument("hardware.nvlink.efficiency = {} is outside (0, 1]", h.nvlink_efficiency);
  EPX_RETURN_IF_ERROR(at_least("hardware.nvlink.latency", h.nvlink_latency, 0));
  EPX_RETURN_IF_ERROR(at_least("hardware.nic.per_gpu", h.nics_per_gpu, 1));
  if (s.cluster.nodes > 1) EPX_RETURN_IF_ERROR(positive("hardware.nic.bandwidth", h.nic_bandwidth));
  if (!(h.nic_efficiency > 0 && h.nic_efficiency <= 1))
    return invalid_argument("hardware.nic.efficiency = {} is outside (0, 1]", h.nic_efficiency);
  EPX_RETURN_IF_ERROR(at_least("hardware.nic.latency", h.nic_latency, 0));
  EPX_RETURN_IF_ERROR(at_least("hardware.comm.message_overhead", h.message_overhead, 0));
  EPX_RETURN_IF_ERROR(at_least("hardware.comm.forward_sm_bandwidth", h.forward_sm_bandwidth, 0));
  EPX_RETURN_IF_ERROR(at_least("hardware.host.copy_bandwidth", h.host_copy_bandwidth, 0));
  EPX_RETURN_IF_ERROR(at_least("hardware.host.nic_copies", h.host_nic_copies, 1));
  EPX_RETURN_IF_ERROR(at_least("hardware.host.cores", h.host_cores, 0));
  return Status::ok();
}

// The cluster's shape and the model's sizes, routing and dtypes.
Status check_cluster_and_model(const Scenario& s) {
  EPX_RETURN_IF_ERROR(at_least("cluster.nodes", s.cluster.nodes, 1));
  EPX_RETURN_IF_ERROR(at_least("cluster.gpus_per_node", s.cluster.gpus_per_node, 1));
  if (static_cast<int64_t>(s.cluster.nodes) * s.cluster.gpus_per_node > (1 << 20))
    return invalid_argument("cluster.nodes x cluster.gpus_per_node = {} is above the limit {}",
                            static_cast<int64_t>(s.cluster.nodes) * s.cluster.gpus_per_node, 1 << 20);

  const ModelConfig& m = s.model;
  EPX_RETURN_IF_ERROR(at_least("model.layers", m.layers, 1));
  if (m.dense_layers < 0 || m.dense_layers >= m.layers)
    return invalid_argument("model.dense_layers = {} is outside [0, model.layers = {})", m.dense_layers, m.layers);
  EPX_RETURN_IF_ERROR(at_least("model.hidden", m.hidden, 1));
  EPX_RETURN_IF_ERROR(at_least("model.expert_hidden", m.expert_hidden, 1));
  EPX_RETURN_IF_ERROR(at_least("model.dense_hidden", m.dense_hidden, 0));
  EPX_RETURN_IF_ERROR(at_least("model.experts", m.experts, 1));
  EPX_RETURN_IF_ERROR(at_least("model.shared_experts", m.shared_experts, 0));
  if (m.topk < 1 || m.topk > m.experts)
    return invalid_argument("model.topk = {} is outside [1, model.experts = {}]", m.topk, m.experts);
  if (m.groups < 1 || m.experts % m.groups != 0)
    return invalid_argument("model.groups = {} must be at least 1 and divide model.experts = {}", m.groups, m.experts);
  if (m.groups > 1 && (m.topk_groups < 1 || m.topk_groups > m.groups))
    return invalid_argument("model.topk_groups = {} is outside [1, model.groups = {}]", m.topk_groups, m.groups);
  if (m.groups > 1 && m.topk_groups * (m.experts / m.groups) < m.topk)
    return invalid_argument("model.topk_groups = {} groups of {} experts hold fewer than model.topk = {} experts",
                            m.topk_groups, m.experts / m.groups, m.topk);
  EPX_RETURN_IF_ERROR(at_least("model.capacity_factor", m.capacity_factor, 0));
  EPX_RETURN_IF_ERROR(one_of("model.score", m.score, {"sigmoid", "softmax"}));
  EPX_RETURN_IF_ERROR(one_of("model.dispatch_dtype", m.dispatch_dtype, {"fp8", "bf16", "f32"}));
  EPX_RETURN_IF_ERROR(one_of("model.combine_dtype", m.combine_dtype, {"bf16", "f32"}));
  if (!m.combine_remote_dtype.empty())
    EPX_RETURN_IF_ERROR(one_of("model.combine_remote_dtype", m.combine_remote_dtype, {"bf16", "f32"}));
  EPX_RETURN_IF_ERROR(one_of("model.compute_dtype", m.compute_dtype, {"bf16", "fp8"}));
  EPX_RETURN_IF_ERROR(at_least("model.attention_flops_per_token", m.attention_flops_per_token, 0));
  EPX_RETURN_IF_ERROR(one_of("model.grad_dtype", m.grad_dtype, {"f32", "bf16"}));
  EPX_RETURN_IF_ERROR(at_least("model.embedding_params", static_cast<double>(m.embedding_params), 0));
  EPX_RETURN_IF_ERROR(at_least("model.head_params", static_cast<double>(m.head_params), 0));
  EPX_RETURN_IF_ERROR(one_of("model.activation_dtype", m.activation_dtype, {"fp8", "bf16", "f32"}));
  return Status::ok();
}

// How the model is split over the cluster.
Status check_parallelism(const Scenario& s) {
  const ModelConfig& m = s.model;
  const ParallelismConfig& p = s.parallelism;
  EPX_RETURN_IF_ERROR(at_least("parallelism.pp_stages", p.pp_stages, 1));
  if (p.pp_stages > m.layers)
    return invalid_argument("parallelism.pp_stages = {} is above model.layers = {}", p.pp_stages, m.layers);
  EPX_RETURN_IF_ERROR(at_least("parallelism.ep", p.ep, 1));
  if (p.ep > 4096) return invalid_argument("parallelism.ep = {} is above the limit 4096", p.ep);
  if (s.num_gpus() % (p.ep * p.pp_stages) != 0)
    return invalid_argument("parallelism.ep x parallelism.pp_stages = {} x {} must divide the {} GPUs ({} nodes x {})",
                            p.ep, p.pp_stages, s.num_gpus(), s.cluster.nodes, s.cluster.gpus_per_node);
  if (p.ep > s.cluster.gpus_per_node && p.ep % s.cluster.gpus_per_node != 0)
    return invalid_argument("parallelism.ep = {} must be a multiple of cluster.gpus_per_node = {} (or at most it)", p.ep,
                            s.cluster.gpus_per_node);
  EPX_RETURN_IF_ERROR(at_least("parallelism.micro_batches", p.micro_batches, 1));
  if (p.tokens_per_gpu < 1 || p.tokens_per_gpu > (int64_t{1} << 24))
    return invalid_argument("parallelism.tokens_per_gpu = {} is outside [1, {}]", p.tokens_per_gpu, int64_t{1} << 24);
  EPX_RETURN_IF_ERROR(one_of("parallelism.dispatch", p.dispatch, {"two_hop", "flat", "low_latency", "low_latency_epx"}));
  if (p.combine_per_rank && p.dispatch != "low_latency_epx")
    return invalid_argument("parallelism.combine_per_rank = true needs parallelism.dispatch = 'low_latency_epx', got '{}'",
                            p.dispatch);
  if (p.dispatch == "two_hop" && !s.cluster.rail_aligned && p.ep > s.cluster.gpus_per_node)
    return invalid_argument("parallelism.dispatch = 'two_hop' needs cluster.rail_aligned = true");
  EPX_RETURN_IF_ERROR(one_of("parallelism.mode", p.mode, {"train", "forward"}));
  EPX_RETURN_IF_ERROR(at_least("parallelism.grad_bucket_bytes", static_cast<double>(p.grad_bucket_bytes), 0));
  EPX_RETURN_IF_ERROR(one_of("parallelism.allreduce", p.allreduce, {"ring", "hierarchical", "auto", "allgather", "chunked"}));
  return Status::ok();
}

// The optimizer's dtypes and the routing distribution.
Status check_optimizer_and_routing(const Scenario& s) {
  const OptimizerConfig& o = s.optimizer;
  EPX_RETURN_IF_ERROR(one_of("optimizer.kind", o.kind, {"adamw", "none"}));
  EPX_RETURN_IF_ERROR(one_of("optimizer.master_dtype", o.master_dtype, {"f32", "bf16"}));
  EPX_RETURN_IF_ERROR(one_of("optimizer.moment_dtype", o.moment_dtype, {"f32", "bf16"}));
  EPX_RETURN_IF_ERROR(one_of("optimizer.weight_copy_dtype", o.weight_copy_dtype, {"none", "bf16", "fp8"}));

  const RoutingConfig& r = s.routing;
  EPX_RETURN_IF_ERROR(one_of("routing.distribution", r.distribution, {"uniform", "zipf", "lognormal", "trace"}));
  EPX_RETURN_IF_ERROR(at_least("routing.zipf_s", r.zipf_s, 0));
  EPX_RETURN_IF_ERROR(at_least("routing.lognormal_sigma", r.lognormal_sigma, 0));
  EPX_RETURN_IF_ERROR(at_least("routing.drift", r.drift, 0));
  if (r.distribution == "trace" && r.trace.empty())
    return invalid_argument("routing.distribution = 'trace' needs routing.trace (a file of per-expert token counts)");
  EPX_RETURN_IF_ERROR(one_of("routing.trace_format", r.trace_format, {"auto", "jsonl", "counts"}));
  if (r.sample_tokens < 1 || r.sample_tokens > 65536)
    return invalid_argument("routing.sample_tokens = {} is outside [1, 65536]", r.sample_tokens);
  return Status::ok();
}

// Balancing against the placement, the overlap schedule, the run.
Status check_balancing_schedule_and_run(const Scenario& s) {
  const ModelConfig& m = s.model;
  const ParallelismConfig& p = s.parallelism;
  const BalancingConfig& b = s.balancing;
  EPX_RETURN_IF_ERROR(one_of("balancing.strategy", b.strategy, {"none", "aux", "bias", "capacity", "eplb"}));
  if (!(b.aux_skew_reduction >= 0 && b.aux_skew_reduction <= 1))
    return invalid_argument("balancing.aux_skew_reduction = {} is outside [0, 1]", b.aux_skew_reduction);
  EPX_RETURN_IF_ERROR(at_least("balancing.bias_rate", b.bias_rate, 0));
  EPX_RETURN_IF_ERROR(at_least("balancing.eplb_redundant", b.eplb_redundant, 0));
  EPX_RETURN_IF_ERROR(at_least("balancing.eplb_every", b.eplb_every, 1));
  if (b.strategy == "capacity" && !(m.capacity_factor > 0))
    return invalid_argument("balancing.strategy = 'capacity' needs model.capacity_factor > 0 (it is {})",
                            m.capacity_factor);
  if (b.strategy != "eplb" && m.experts % std::min(p.ep, m.experts) != 0)
    return invalid_argument("model.experts = {} must be a multiple of parallelism.ep = {} (contiguous placement)",
                            m.experts, p.ep);
  if (b.strategy != "eplb" && m.experts < p.ep)
    return invalid_argument("model.experts = {} is below parallelism.ep = {}; use balancing.strategy = 'eplb' with "
                            "redundant slots",
                            m.experts, p.ep);

  EPX_RETURN_IF_ERROR(one_of("schedule.overlap", s.schedule.overlap, {"none", "shared", "chunked", "two_micro_batch"}));
  if (s.schedule.chunks < 1 || s.schedule.chunks > 64)
    return invalid_argument("schedule.chunks = {} is outside [1, 64]", s.schedule.chunks);
  if (s.schedule.overlap == "two_micro_batch" && p.micro_batches % 2 != 0)
    return invalid_argument("schedule.overlap = 'two_micro_batch' needs an even parallelism.micro_batches (it is {})",
                            p.micro_batches);

  if (s.run.steps < 1 || s.run.steps > 1000000)
    return invalid_argument("run.steps = {} is outside [1, 1000000]", s.run.steps);
  EPX_RETURN_IF_ERROR(at_least("run.ep_groups", s.run.ep_groups, 0));
  if (s.run.trace_step < 0 || s.run.trace_step >= s.run.steps)
    return invalid_argument("run.trace_step = {} is outside [0, run.steps = {})", s.run.trace_step, s.run.steps);
  EPX_RETURN_IF_ERROR(at_least("run.threads", s.run.threads, 0));
  return Status::ok();
}

}  // namespace

Status Scenario::validate() const {
  EPX_RETURN_IF_ERROR(check_hardware(*this));
  EPX_RETURN_IF_ERROR(check_cluster_and_model(*this));
  EPX_RETURN_IF_ERROR(check_parallelism(*this));
  EPX_RETURN_IF_ERROR(check_optimizer_and_routing(*this));
  return check_balancing_schedule_and_run(*this);
}

Status load_hardware(const std::string& path, Scenario* scenario) {
  EPX_ASSIGN_OR_RETURN(toml::table table, parse_toml(path, "the hardware profile"));
  auto keys = keys_of(*scenario);
  return apply_table(table, "hardware.", keys, path, {});
}

namespace {

// The scenario of a parsed file: the profile it names, its own keys, validated.
Result<Scenario> scenario_from_table(const toml::table& table, const std::string& path) {
  Scenario s;
  s.path = path;
  // What a scenario cannot do without, said as such rather than as the first
  // zero that the defaults leave (the model and cluster keys have defaults).
  if (table.empty())
    return invalid_argument("{}: the scenario is empty; it needs at least its hardware (hardware.profile = \"h100\"); "
                            "configs/sim/template.toml lists every key",
                            path);
  if (!table.at_path("hardware.profile") && !table.at_path("hardware.compute.bf16_flops"))
    return invalid_argument("{}: hardware.profile is not set: name a profile (hardware.profile = \"h100\") or set "
                            "every hardware.* key (see configs/hardware/h100.toml)",
                            path);
  // The profile first, so that hardware.* keys in the scenario override it.
  if (const auto* node = table.at_path("hardware.profile").node()) {
    auto name = node->value_exact<std::string>();
    if (!name) return invalid_argument("{}: hardware.profile must be a string (a name or a path)", path);
    auto profile = find_hardware_profile(*name, std::filesystem::path(path).parent_path().string());
    if (!profile.is_ok())
      return Status(profile.status().code(), fmt::format("{}: hardware.profile = '{}': {}", path, *name,
                                                         profile.status().message()));
    Status st = load_hardware(*profile, &s);
    if (!st.is_ok()) return Status(st.code(), fmt::format("{} (hardware.profile in {})", st.message(), path));
  }
  auto keys = keys_of(s);
  EPX_RETURN_IF_ERROR(apply_table(table, "", keys, path, {"hardware.profile"}));
  // A trace path is relative to the scenario file too.
  if (!s.routing.trace.empty() && std::filesystem::path(s.routing.trace).is_relative())
    s.routing.trace = (std::filesystem::path(path).parent_path() / s.routing.trace).string();
  Status st = s.validate();
  if (!st.is_ok()) return invalid_argument("{}: {}", path, st.message());
  return s;
}

}  // namespace

Result<Scenario> load_scenario(const std::string& path) {
  EPX_ASSIGN_OR_RETURN(toml::table table, parse_toml(path, "the scenario file"));
  return scenario_from_table(table, path);
}

Result<Scenario> parse_scenario(std::string_view text, const std::string& path) {
  EPX_ASSIGN_OR_RETURN(toml::table table, parse_toml_text(text, path));
  return scenario_from_table(table, path);
}

Status set_value(Scenario& scenario, const std::string& key, const std::string& value) {
  auto keys = keys_of(scenario);
  Key* k = find_key(keys, key);
  if (k == nullptr) return invalid_argument("unknown key '{}' (epx sim keys lists them)", key);
  return set_from_text(*k, value);
}

std::vector<std::string> scenario_keys() {
  Scenario s;
  std::vector<std::string> names;
  for (const Key& k : keys_of(s)) names.emplace_back(k.name);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace epx::sim
