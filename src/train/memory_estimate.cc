#include "epx/train/memory_estimate.h"

#include <algorithm>
#include <initializer_list>

#include <fmt/format.h>

#include "epx/exchange/buffer.h"
#include "train/model_buffer.h"

namespace epx {
namespace {

// A setting, its value and a typical value: the driver of an item is the
// setting furthest above its typical value.
struct Setting {
  const char* name;
  int64_t value;
  int64_t typical;
};

std::string driver(std::initializer_list<Setting> settings) {
  const Setting* best = nullptr;
  double best_ratio = 0;
  for (const Setting& s : settings) {
    const double ratio = static_cast<double>(s.value) / static_cast<double>(std::max<int64_t>(s.typical, 1));
    if (best == nullptr || ratio > best_ratio) {
      best = &s;
      best_ratio = ratio;
    }
  }
  return fmt::format("{} = {}", best->name, best->value);
}

// The shape every item is computed from. R: the ranks of one EP group (its
// Buffers span them); local: experts (slots) per rank, E / R or slots / R.
struct Shape {
  int64_t R, nodes, L, H, F, E, K, S, T, local, inputs, outputs, batch_tokens, dtype_bytes, bucket_bytes, edp;
  bool fp8_dispatch;  // the layer dequantises the received rows into a buffer of their own
  int64_t eplb_slots;  // as the user set it (0: the default, experts plus one per rank)
};

Shape shape_of(const TrainConfig& config, const ModelConfig& m) {
  const MoELayerConfig& l = m.layer;
  const int64_t E = l.router.num_experts;
  const int64_t R = std::max(config.ep_size(), 1);
  const int64_t slots = config.balancing.eplb ? config.balancing.slots(l.router.num_experts, static_cast<int>(R)) : E;
  // An EP group spans nodes only when it is larger than one node.
  const int64_t per_node = std::max(config.num_ranks / std::max(config.num_nodes, 1), 1);
  return {R, R > per_node ? R / per_node : 1, m.num_layers, l.hidden, l.ffn_hidden, E, l.router.topk,
          l.num_shared_experts, m.max_tokens_per_rank, slots / R, m.num_inputs(),
          m.num_outputs(), config.batch_tokens, static_cast<int64_t>(dtype_size(l.dtype)),
          config.grad_bucket_bytes, config.num_ranks / R, l.dispatch_dtype == DType::kFP8E4M3,
          config.balancing.eplb ? config.balancing.eplb_slots : 0};
}

void add_parameters(const Shape& s, MemoryEstimate* e) {
  // The experts a rank holds are slots / R under eplb: set slots name them.
  const std::string expert_driver =
      s.eplb_slots > 0 ? driver({{"eplb_slots", s.eplb_slots, 64}, {"experts", s.E, 64}, {"hidden", s.H, 1024},
                                 {"ffn_hidden", s.F, 2048}, {"layers", s.L, 8}})
                       : driver({{"experts", s.E, 64}, {"hidden", s.H, 1024}, {"ffn_hidden", s.F, 2048}, {"layers", s.L, 8}});
  const int64_t expert = saturating_product({s.L, s.local, 3, s.H, s.F, 4});
  e->add("expert weights", expert, expert_driver);
  e->add("expert gradients", expert, expert_driver);
  e->add("expert AdamW moments", saturating_product({expert, 2}), expert_driver);
  if (s.dtype_bytes != 4) e->add("bf16 copies of the expert weights", saturating_product({expert, s.dtype_bytes}) / 4, expert_driver);
  // Replicated on every rank: input projection, head, norms, routers, shared experts.
  int64_t dense = saturating_sum(saturating_product({s.inputs, s.H}), saturating_product({s.H, s.outputs + 1}));
  dense = saturating_sum(dense, saturating_product({s.L, saturating_sum(saturating_product({s.H, s.E + 1}), saturating_product({3, s.S, s.H, s.F}))}));
  const int64_t dense_bytes = saturating_product({dense, 4});
  const std::string dense_driver = driver({{"experts", s.E, 64}, {"hidden", s.H, 1024}, {"shared_experts", s.S, 1},
                                           {"input_dim", s.inputs, 1024}, {"layers", s.L, 8}});
  e->add("dense weights", dense_bytes, dense_driver);
  e->add("dense gradients", dense_bytes, dense_driver);
  e->add("dense AdamW moments", saturating_product({dense_bytes, 2}), dense_driver);
  // GradientSync packs one bucket at a time (at most grad_bucket_bytes, or
  // all the gradients it reduces when they are fewer: the experts' only with
  // EDP > 1); the transport stages a copy of it and, under MPI, receives up
  // to twice it.
  const int64_t grads = s.edp > 1 ? saturating_sum(dense_bytes, expert) : dense_bytes;
  e->add("gradient all-reduce buckets", saturating_product({std::min(grads, s.bucket_bytes), 3}),
         driver({{"grad_bucket_bytes", s.bucket_bytes, 4 << 20}}));
}

void add_activations(const Shape& s, MemoryEstimate* e) {
  // Per layer, for backward: x, n, outputs and their gradients [T, H]; the
  // router's logits, scores and their gradients [T, E]; the expanded rows
  // (T * topk of them when routing is balanced) in and out, the expert FFN's
  // h1, h3 and activation and their gradients [rows, F]. An fp8 dispatch
  // adds the received rows dequantised (at most the expanded rows). Shared
  // experts keep the same [T, F] state over all T tokens: an item of their own.
  const int64_t rows = s.T * s.K;
  int64_t per_layer = saturating_product({s.T, s.H, 4, 8});
  if (s.fp8_dispatch) per_layer = saturating_sum(per_layer, saturating_product({rows, s.H, s.dtype_bytes}));
  per_layer = saturating_sum(per_layer, saturating_product({s.T, s.E, 4, 3}));
  per_layer = saturating_sum(per_layer, saturating_product({rows, s.H, s.dtype_bytes + 12}));
  per_layer = saturating_sum(per_layer, saturating_product({rows, s.F, 4, 6}));
  e->add("activations and backward state", saturating_product({per_layer, s.L}),
         driver({{"batch_tokens", s.batch_tokens, 4096}, {"experts", s.E, 256}, {"hidden", s.H, 1024},
                 {"ffn_hidden", s.F, 2048}, {"topk", s.K, 8}, {"layers", s.L, 8}}));
  if (s.S > 0)
    e->add("shared-expert activations and backward state", saturating_product({s.S, s.T, s.F, 4, 6, s.L}),
           driver({{"shared_experts", s.S, 1}, {"batch_tokens", s.batch_tokens, 4096}, {"ffn_hidden", s.F, 2048},
                   {"layers", s.L, 8}}));
  const int64_t batch = saturating_product({s.T, s.inputs + s.outputs, 4});
  e->add("batch", batch, driver({{"batch_tokens", s.batch_tokens, 4096}, {"input_dim", s.inputs, 1024}}));
}

Status add_exchange(const Shape& s, const TrainConfig& c, const ModelConfig& m, MemoryEstimate* e) {
  // eplb places its slots contiguously (rank-major), which is also what a
  // BufferConfig without a placement sizes; no placement map is built here, so
  // sizing costs nothing however many slots there are.
  ModelConfig sized = m;
  if (c.balancing.eplb) sized.placement.reset();
  EPX_ASSIGN_OR_RETURN(const BufferConfig bc, detail::model_buffer_config(sized, static_cast<int>(s.local * s.R),
                                                                          static_cast<int>(s.R), /*rank_major=*/false));
  const int64_t buffers = c.balancing.eplb ? s.L : 1;  // eplb: one Buffer per layer
  const std::string exchange_driver = driver({{"batch_tokens", s.batch_tokens, 4096}, {"hidden", s.H, 1024},
                                              {"topk", s.K, 8}, {c.ep_size() == c.num_ranks ? "ranks" : "ep", s.R, 8}});
  e->add("exchange regions (receive and combine)",
         saturating_product({Buffer::estimate_region_bytes(bc, static_cast<int>(s.R)), buffers}), exchange_driver);
  // Rows that cross nodes are staged to send and to receive.
  if (s.nodes > 1)
    e->add("staging of rows across nodes", saturating_product({s.T, std::min(s.K, s.nodes), s.H, s.dtype_bytes, 2}),
           exchange_driver);
  return Status::ok();
}

}  // namespace

Result<MemoryEstimate> estimate_train_memory(const TrainConfig& config) {
  EPX_ASSIGN_OR_RETURN(ModelConfig m, config.resolved_model());
  return estimate_train_memory(config, m);
}

Result<MemoryEstimate> estimate_train_memory(const RunPlan& plan) { return estimate_train_memory(plan.config(), plan.model()); }

Result<MemoryEstimate> estimate_train_memory(const TrainConfig& config, const ModelConfig& m) {
  const Shape s = shape_of(config, m);
  MemoryEstimate e;
  e.copies = config.transport != nullptr ? 1 : config.num_ranks;
  add_parameters(s, &e);
  add_activations(s, &e);
  EPX_RETURN_IF_ERROR(add_exchange(s, config, m, &e));
  // Measured against peak RSS (docs/design.md): the allocator's arenas, the
  // threads and the GEMM library add about 10% and a few MiB per rank.
  const int64_t counted = e.per_rank();
  e.add("allocator, thread and library slack", saturating_sum(counted / 10, int64_t{4} << 20), e.largest()->driver);
  return e;
}

}  // namespace epx
