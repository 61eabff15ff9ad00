#include "exchange_bench.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/core/buffer.h"
#include "epx/exchange/buffer.h"
#include "cpu_time.h"
#include "epx/exchange/layout.h"
#include "naive_alltoall.h"
#include "synthetic_routing.h"

namespace epx::bench {

namespace {

enum Method : int {
  kDispatch,
  kCombine,
  kCombineCopyIn,
  kMemcpy,
  kNaiveDispatch,
  kNaiveCombine,
  kLayerCombine,
  kMemcpyLayer,
  kMemcpyExpanded,
  kLayerCombineOutside,
  kNumMethods
};
constexpr std::array<std::string_view, kNumMethods> kSpanName = {
    "bench.dispatch",       "bench.combine",       "bench.combine_copy_in", "bench.memcpy",
    "bench.naive_dispatch", "bench.naive_combine", "bench.layer_combine",   "bench.memcpy_layer",
    "bench.memcpy_expanded", "bench.layer_combine_outside"};

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Receiver weights: the experts write y in bf16 into the combine region, as
// the layer does.
constexpr DType kReceiverY = DType::kBF16;

bool receiver_weights(const ExchangeBenchConfig& c) { return c.layer_combine_weights == CombineWeights::kReceiver; }

// Holder weights with f32 partials (the layer's default): the experts write
// their f32 rows into the combine region (combine_expanded_input), as the
// layer does when the Buffer has room, and the combine reads them in place.
bool rows_in_place(const ExchangeBenchConfig& c) {
  return c.layer_combine && !receiver_weights(c) && c.layer_combine_dtype == DType::kF32;
}

// Bytes per received row that the layer's combine moves: y in kReceiverY
// with receiver weights, else one partial in layer_combine_dtype.
int64_t layer_row_bytes(const ExchangeBenchConfig& c) {
  return int64_t{c.hidden} *
         static_cast<int64_t>(dtype_size(receiver_weights(c) ? kReceiverY : c.layer_combine_dtype));
}
// Bytes of one expanded (token, expert) row of y under receiver weights.
int64_t receiver_y_row_bytes(const ExchangeBenchConfig& c) {
  return int64_t{c.hidden} * static_cast<int64_t>(dtype_size(kReceiverY));
}

// Everything about a shape that the main thread can know before the ranks
// start: routing, layouts, and the row counts each method will move.
struct ShapePlan {
  ExpertPlacement placement;
  std::vector<RankRouting> routing{};    // [R]
  std::vector<DispatchLayout> layout{};  // [R]
  std::vector<int64_t> recv_rows{};      // [R] dispatch rows rank r receives
  std::vector<int64_t> naive_send{};     // [R] (token, expert) rows rank r sends
  std::vector<int64_t> naive_recv{};     // [R] ... and receives
  int64_t max_recv_rows = 0;
  int64_t naive_max_rows = 0;
};

// State the rank threads share: timestamps of the current operation and
// the samples collected by rank 0.
struct Shared {
  explicit Shared(int num_ranks)
      : begin(num_ranks), end(num_ranks), cpu_ns(num_ranks), faults(num_ranks), x(num_ranks),
        inter_node_bytes(num_ranks) {}
  std::vector<int64_t> begin;
  std::vector<int64_t> end;
  std::vector<int64_t> cpu_ns;  // thread CPU time of the operation
  std::vector<int64_t> faults;  // page faults during the operation
  std::array<std::vector<double>, kNumMethods> samples;
  std::array<std::vector<double>, kNumMethods> cpu_samples;  // summed over ranks, ms
  std::array<int64_t, kNumMethods> timed_faults{};           // summed over ranks and repetitions
  std::vector<const std::byte*> x;                                // each rank's input rows
  std::vector<std::array<int64_t, kNumMethods>> inter_node_bytes;  // last timed call, per rank
  bool interleaved = true;
  Status failure;  // set by rank 0 when the naive phase cannot fit
  std::size_t epx_region_bytes = 0;
  std::size_t naive_bytes = 0;
  bool hierarchical = false;
};

// Payload value of (rank, token, column): exact in bf16, rarely zero, and
// different for neighbouring rows so a misrouted row shows.
float pattern(int rank, int token, int64_t column) {
  const int64_t v = (static_cast<int64_t>(rank) * 131 + static_cast<int64_t>(token) * 31 + column * 7) % 253;
  return static_cast<float>(v - 126) / 64.0f;
}

// The calling thread's minor and major page faults so far.
int64_t thread_page_faults() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_minflt + usage.ru_majflt;
}

std::string gib(std::size_t bytes) { return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / kGiB); }

Result<ShapePlan> plan_shape(const ExchangeBenchConfig& config, const Topology& topo) {
  EPX_ASSIGN_OR_RETURN(ExpertPlacement placement, ExpertPlacement::contiguous(config.num_experts, config.num_ranks));
  ShapePlan plan{.placement = std::move(placement)};
  const int num_ranks = config.num_ranks;
  plan.recv_rows.assign(num_ranks, 0);
  plan.naive_send.assign(num_ranks, 0);
  plan.naive_recv.assign(num_ranks, 0);
  const RoutingSpec spec{.num_tokens = config.num_tokens, .num_experts = config.num_experts, .topk = config.topk,
                         .skew = config.skew, .seed = config.seed};
  for (int r = 0; r < num_ranks; ++r) {
    EPX_ASSIGN_OR_RETURN(RankRouting routing, make_routing(spec, r));
    EPX_ASSIGN_OR_RETURN(DispatchLayout layout, compute_layout(routing.idx(), plan.placement, topo));
    for (int d = 0; d < num_ranks; ++d) plan.recv_rows[d] += layout.num_tokens_per_rank[d];
    for (int32_t e : routing.topk_idx) {
      if (e < 0) continue;
      const int d = plan.placement.rank_of(e);
      ++plan.naive_send[r];
      ++plan.naive_recv[d];
    }
    plan.routing.push_back(std::move(routing));
    plan.layout.push_back(std::move(layout));
  }
  for (int r = 0; r < num_ranks; ++r) {
    plan.max_recv_rows = std::max(plan.max_recv_rows, plan.recv_rows[r]);
    plan.naive_max_rows = std::max({plan.naive_max_rows, plan.naive_send[r], plan.naive_recv[r]});
  }
  return plan;
}

// The shape of the Buffer a shape's ranks create (RankBench), without its
// placement and receive rows.
BufferConfig bench_buffer_config(const ExchangeBenchConfig& c) {
  BufferConfig b;
  b.num_experts = c.num_experts;
  b.hidden = c.hidden;
  b.dtype = c.dtype;
  b.max_topk = c.topk;
  b.max_tokens_per_rank = c.num_tokens;
  b.max_combine_dtype = c.layer_combine ? DType::kF32 : c.dtype;  // the layer's Buffer is f32
  return b;
}

// The layer combine's own buffers on one rank: y_expanded (one f32 row per
// received (token, local expert) pair: `expanded_rows`) and the f32 out, and
// with the rows in place a second out, the checked y-outside output.
std::size_t layer_combine_bytes(const ExchangeBenchConfig& c, int64_t expanded_rows) {
  if (!c.layer_combine) return 0;
  const std::size_t f32_row = static_cast<std::size_t>(c.hidden) * 4;
  const std::size_t outs = rows_in_place(c) ? 2 : 1;
  const auto rows = static_cast<std::size_t>(std::max<int64_t>(expanded_rows, 1));
  return (rows + outs * static_cast<std::size_t>(c.num_tokens)) * f32_row;
}

// Receiver weights: the f32 combine-region rows that hold the most bf16
// expanded rows (its (token, expert) rows, no padding) a rank of the plan gets.
// Rows in place (rows_in_place): the f32 rows of the most expanded rows.
int64_t expanded_region_rows(const ExchangeBenchConfig& c, const ShapePlan& plan) {
  if (!c.layer_combine || (!receiver_weights(c) && !rows_in_place(c))) return 0;
  const int64_t most = *std::max_element(plan.naive_recv.begin(), plan.naive_recv.end());
  return receiver_weights(c) ? most / 2 + 1 : most + 1;
}

// The naive baseline's configuration, sized by a shape's plan: the memory
// plan counts what RankBench::create_naive then allocates.
NaiveConfig naive_config(const ExchangeBenchConfig& c, const ShapePlan& plan) {
  return NaiveConfig{.num_experts = c.num_experts,
                     .hidden = c.hidden,
                     .dtype = c.dtype,
                     .max_topk = c.topk,
                     .max_rows = plan.naive_max_rows,
                     .placement = plan.placement,
                     .timeout = c.timeout};
}

MemoryPlan plan_memory(const ExchangeBenchConfig& config, const ShapePlan& plan) {
  const std::size_t row_bytes = static_cast<std::size_t>(config.hidden) * dtype_size(config.dtype);
  const std::size_t num_ranks = static_cast<std::size_t>(config.num_ranks);
  const std::size_t tokens = static_cast<std::size_t>(config.num_tokens);
  MemoryPlan m;
  m.common = num_ranks * 2 * tokens * row_bytes;  // x and out
  // Receive region + combine region (max_combine_dtype = payload dtype);
  // across nodes also the private staging the Buffer keeps between calls:
  // rows for and from the other nodes, fp32 partials on the two-hop combine.
  const std::size_t staged_row = config.num_nodes > 1 ? static_cast<std::size_t>(config.hidden) * 4 : 0;
  BufferConfig buffer = bench_buffer_config(config);
  buffer.max_recv_tokens = plan.max_recv_rows;
  buffer.max_expanded_rows = expanded_region_rows(config, plan);
  m.epx_after_create = num_ranks * 2 * tokens * staged_row;
  for (int r = 0; r < config.num_ranks; ++r) m.epx_after_create += layer_combine_bytes(config, plan.naive_recv[r]);
  m.epx = num_ranks * static_cast<std::size_t>(Buffer::estimate_region_bytes(buffer, config.num_ranks)) +
          m.epx_after_create;
  m.naive = num_ranks * NaiveAllToAll::bytes_needed(naive_config(config, plan));  // inproc messages are not copied
  m.available = available_memory_bytes();
  m.budget = m.available == 0 ? SIZE_MAX / 4 : static_cast<std::size_t>(m.available * config.memory_fraction);
  return m;
}

// Compares a row with float expectations: exactly for bf16 results of exact
// sums, within `rel` otherwise.
bool row_matches(const std::byte* got, const float* expected, DType dtype, int64_t hidden, double rel,
                 int64_t* bad_column, float* got_value) {
  for (int64_t c = 0; c < hidden; ++c) {
    const float g = load_as_f32(got, dtype, c);
    float want;
    if (dtype == DType::kBF16) {
      want = bf16_to_f32(f32_to_bf16(expected[c]));
    } else {
      want = expected[c];
    }
    if (!(std::fabs(g - want) <= rel * std::fabs(want))) {
      *bad_column = c;
      *got_value = g;
      return false;
    }
  }
  return true;
}

// One rank of one shape.
class RankBench {
 public:
  RankBench(Transport& transport, const ExchangeBenchConfig& config, const ShapePlan& plan, Shared& shared,
            const ProgressFn& progress, std::size_t epx_staging_bytes)
      : epx_staging_bytes_(epx_staging_bytes),
        t_(transport),
        config_(config),
        plan_(plan),
        shared_(shared),
        progress_(progress),
        rank_(transport.rank()),
        row_bytes_(static_cast<std::size_t>(config.hidden) * dtype_size(config.dtype)) {}

  Status run() {
    EPX_RETURN_IF_ERROR(create_inputs_and_buffer());
    EPX_RETURN_IF_ERROR(t_.barrier(deadline()));
    if (rank_ == 0) choose_schedule();
    EPX_RETURN_IF_ERROR(t_.barrier(deadline()));
    return shared_.interleaved ? run_interleaved() : run_phased();
  }

 private:
  // x (the pattern), out, epx's Buffer and its dispatch inputs.
  Status create_inputs_and_buffer() {
    const int T = config_.num_tokens;
    const int64_t H = config_.hidden;
    x_ = AlignedBuffer(static_cast<std::size_t>(T) * row_bytes_, 4096);
    out_ = AlignedBuffer(static_cast<std::size_t>(T) * row_bytes_, 4096, /*zero=*/true);
    for (int t = 0; t < T; ++t)
      for (int64_t c = 0; c < H; ++c) store_from_f32(x_.data() + t * row_bytes_, config_.dtype, c, pattern(rank_, t, c));
    x_view_ = TensorView::contiguous(x_.data(), config_.dtype, {T, H});
    out_view_ = TensorView::contiguous(out_.data(), config_.dtype, {T, H});
    shared_.x[rank_] = x_.data();
    const RankRouting& routing = plan_.routing[rank_];

    BufferConfig buffer_config = bench_buffer_config(config_);
    buffer_config.max_recv_tokens = plan_.max_recv_rows;
    buffer_config.max_expanded_rows = expanded_region_rows(config_, plan_);
    buffer_config.placement = plan_.placement;
    buffer_config.timeout = config_.timeout;
    buffer_config.tracer = config_.tracer;
    buffer_config.record_waits = config_.record_waits;
    EPX_ASSIGN_OR_RETURN(buffer_, Buffer::create(t_, buffer_config));
    inputs_ = DispatchInputs{.x = x_view_, .topk_idx = routing.idx(), .topk_weights = routing.weights()};
    return Status::ok();
  }

  // Rank 0, with epx's regions really allocated: whether the naive baseline
  // fits next to them (interleaved) or must wait until they are freed (phased).
  void choose_schedule() {
    shared_.epx_region_bytes = buffer_->region_bytes();
    shared_.hierarchical = buffer_->hierarchical();
    const std::size_t available = available_memory_bytes();
    const std::size_t need = naive_total_bytes() + epx_staging_bytes_;
    shared_.interleaved = shared_.interleaved &&
                          (available == 0 || need <= static_cast<std::size_t>(available * config_.memory_fraction));
    say(fmt::format("epx regions {} per rank ({}); naive baseline and epx staging need {} more, {} available: {}",
                    gib(shared_.epx_region_bytes), shared_.hierarchical ? "two-hop" : "flat", gib(need),
                    gib(available), shared_.interleaved ? "interleaved" : "phased (epx first, then the others)"));
  }

  // epx, memcpy, naive, epx, memcpy, naive, ...
  Status run_interleaved() {
    EPX_RETURN_IF_ERROR(create_naive());
    for (int w = 0; w < config_.warmup; ++w) {
      const bool check = config_.verify && w == 0;
      EPX_RETURN_IF_ERROR(epx_group(false, check));
      EPX_RETURN_IF_ERROR(memcpy_op(false));
      EPX_RETURN_IF_ERROR(naive_group(false, check));
    }
    EPX_RETURN_IF_ERROR(after_warmup());
    for (int rep = 0; rep < config_.reps; ++rep) {
      EPX_RETURN_IF_ERROR(epx_group(true, false));
      EPX_RETURN_IF_ERROR(memcpy_op(true));
      EPX_RETURN_IF_ERROR(naive_group(true, false));
      if (rank_ == 0) say(fmt::format("repetition {}/{} done", rep + 1, config_.reps));
    }
    return t_.barrier(deadline());
  }

  // epx alone, freed, then memcpy and naive.
  Status run_phased() {
    for (int w = 0; w < config_.warmup; ++w) EPX_RETURN_IF_ERROR(epx_group(false, config_.verify && w == 0));
    EPX_RETURN_IF_ERROR(after_warmup());
    for (int rep = 0; rep < config_.reps; ++rep) EPX_RETURN_IF_ERROR(epx_group(true, false));
    EPX_RETURN_IF_ERROR(t_.barrier(deadline()));
    recv_ = DispatchResult{};
    buffer_.reset();
    EPX_RETURN_IF_ERROR(t_.barrier(deadline()));
    if (rank_ == 0) shared_.failure = naive_fits();
    EPX_RETURN_IF_ERROR(t_.barrier(deadline()));
    if (!shared_.failure.is_ok()) return shared_.failure;
    EPX_RETURN_IF_ERROR(create_naive());
    for (int w = 0; w < config_.warmup; ++w) {
      EPX_RETURN_IF_ERROR(memcpy_op(false));
      EPX_RETURN_IF_ERROR(naive_group(false, config_.verify && w == 0));
    }
    EPX_RETURN_IF_ERROR(after_warmup());
    for (int rep = 0; rep < config_.reps; ++rep) {
      EPX_RETURN_IF_ERROR(memcpy_op(true));
      EPX_RETURN_IF_ERROR(naive_group(true, false));
    }
    return t_.barrier(deadline());
  }

  // ResourceExhausted when the naive baseline does not fit the memory budget.
  [[nodiscard]] Status naive_fits() const {
    const std::size_t available = available_memory_bytes();
    const std::size_t need = naive_total_bytes();
    if (available != 0 && need > static_cast<std::size_t>(available * config_.memory_fraction))
      return resource_exhausted(
          "the naive baseline needs {} for {} tokens/rank but only {} of {} available may be used "
          "(memory_fraction {}); run fewer tokens",
          gib(need), config_.num_tokens, gib(static_cast<std::size_t>(available * config_.memory_fraction)),
          gib(available), config_.memory_fraction);
    return Status::ok();
  }

  [[nodiscard]] Deadline deadline() const { return Deadline::after(config_.timeout); }
  void say(const std::string& line) const {
    if (progress_) progress_(line);
  }
  [[nodiscard]] std::size_t naive_total_bytes() const {
    return static_cast<std::size_t>(config_.num_ranks) * NaiveAllToAll::bytes_needed(naive_config(config_, plan_));
  }

  Status create_naive() {
    EPX_ASSIGN_OR_RETURN(naive_, NaiveAllToAll::create(t_, naive_config(config_, plan_)));
    if (rank_ == 0) shared_.naive_bytes = naive_->bytes();
    return Status::ok();
  }

  // Drops the warm-up's spans so the tracer holds the timed repetitions only.
  Status after_warmup() {
    EPX_RETURN_IF_ERROR(t_.barrier(deadline()));
    if (rank_ == 0) {
      if (config_.tracer) config_.tracer->clear();
      say(config_.verify ? "warm-up done, outputs checked" : "warm-up done");
    }
    return Status::ok();
  }

  // Runs `op` on every rank from a common start; rank 0 records last end - first start.
  template <typename Op>
  Status timed(Method method, bool record, Op&& op) {
    EPX_RETURN_IF_ERROR(t_.barrier(deadline()));
    const uint64_t inter_before = t_.counters().inter_node_bytes;
    Status status;
    {
      ScopedSpan span(config_.tracer, rank_, std::string(kSpanName[method]));
      const int64_t faults = thread_page_faults();
      const int64_t cpu = thread_cpu_ns();
      shared_.begin[rank_] = now_ns();
      status = op();
      shared_.end[rank_] = now_ns();
      shared_.cpu_ns[rank_] = thread_cpu_ns() - cpu;
      shared_.faults[rank_] = thread_page_faults() - faults;
    }
    EPX_RETURN_IF_ERROR(status);
    shared_.inter_node_bytes[rank_][method] = static_cast<int64_t>(t_.counters().inter_node_bytes - inter_before);
    EPX_RETURN_IF_ERROR(t_.barrier(deadline()));
    if (rank_ == 0 && record) {
      const int64_t first = *std::min_element(shared_.begin.begin(), shared_.begin.end());
      const int64_t last = *std::max_element(shared_.end.begin(), shared_.end.end());
      shared_.samples[method].push_back(static_cast<double>(last - first) * 1e-6);
      int64_t cpu = 0;
      for (int64_t ns : shared_.cpu_ns) cpu += ns;
      shared_.cpu_samples[method].push_back(static_cast<double>(cpu) * 1e-6);
      for (int64_t f : shared_.faults) shared_.timed_faults[method] += f;
    }
    return Status::ok();
  }

  Status epx_group(bool record, bool check) {
    EPX_RETURN_IF_ERROR(timed(kDispatch, record, [&] { return buffer_->dispatch(inputs_, &recv_); }));
    if (check) EPX_RETURN_IF_ERROR(check_dispatch());
    // The experts write their output straight into the combine region.
    EPX_ASSIGN_OR_RETURN(TensorView y, buffer_->combine_input(recv_.handle, config_.dtype));
    for (int64_t i = 0; i < recv_.recv_x.size(0); ++i) std::memcpy(y.row(i), recv_.recv_x.row(i), row_bytes_);
    if (check) std::memset(out_.data(), 0, out_.size());
    EPX_RETURN_IF_ERROR(timed(kCombine, record, [&] { return buffer_->combine(y, recv_.handle, out_view_); }));
    if (check) EPX_RETURN_IF_ERROR(check_combine("combine (zero-copy)"));
    if (check) std::memset(out_.data(), 0, out_.size());
    EPX_RETURN_IF_ERROR(
        timed(kCombineCopyIn, record, [&] { return buffer_->combine(recv_.recv_x, recv_.handle, out_view_); }));
    if (check) EPX_RETURN_IF_ERROR(check_combine("combine (copy-in)"));
    if (config_.layer_combine) EPX_RETURN_IF_ERROR(layer_combine(record, check));
    return Status::ok();
  }

  // MoELayer's combine: the experts' f32 outputs y_expanded (outside the
  // Buffer) -> combine_expanded weighted by the dispatched top-k weights -> f32
  // out. y_expanded holds the received rows as f32 (the same values every
  // repetition, so it is filled once, untimed).
  Status layer_combine(bool record, bool check) {
    if (layer_y_.size() == 0) prepare_layer_inputs();
    CombineOptions options;
    options.partial_dtype = config_.layer_combine_dtype;
    options.weights_at = config_.layer_combine_weights;
    // With the rows in place, the same combine with y outside the Buffer
    // runs first: the in-place combine keeps its rows for a backward (pinned
    // with the handle), and a later writer of the region would first copy
    // them out, time and memory that belong to neither path.
    std::vector<std::byte> outside;  // its output, when checked
    if (rows_in_place(config_)) EPX_RETURN_IF_ERROR(layer_combine_outside(options, record, check, &outside));
    if (check) std::memset(layer_out_.data(), 0, layer_out_.size());
    TensorView y = layer_y_view_;
    if (receiver() || rows_in_place(config_)) {
      EPX_ASSIGN_OR_RETURN(y, layer_rows_in_region());
    }
    EPX_RETURN_IF_ERROR(timed(kLayerCombine, record, [&] {
      return buffer_->combine_expanded(y, recv_.handle, layer_out_view_, {}, options);
    }));
    if (!check) return Status::ok();
    // bf16 partials: each (token, rank) partial is rounded once to bf16.
    // Receiver weights round f32 payload rows to bf16 in y.
    const bool rounded = config_.layer_combine_dtype == DType::kBF16 || (receiver() && config_.dtype != DType::kBF16);
    EPX_RETURN_IF_ERROR(check_weighted_combine("layer combine (combine_expanded)", layer_out_.data(), DType::kF32,
                                               rounded ? 1e-2 : 1e-5));
    if (rows_in_place(config_) && std::memcmp(outside.data(), layer_out_.data(), layer_out_.size()) != 0)
      return internal_error("rank {}: the layer combine with y in place and with y outside differ in bits", rank_);
    return Status::ok();
  }

  // The holder-weighted combine with y outside the Buffer: each holder
  // writes its partials into its region first. When checked, its output
  // goes to `bits` for the comparison with the in-place combine.
  Status layer_combine_outside(const CombineOptions& options, bool record, bool check, std::vector<std::byte>* bits) {
    if (check) std::memset(layer_out_.data(), 0, layer_out_.size());
    EPX_RETURN_IF_ERROR(timed(kLayerCombineOutside, record, [&] {
      return buffer_->combine_expanded(layer_y_view_, recv_.handle, layer_out_view_, {}, options);
    }));
    if (check) bits->assign(layer_out_.data(), layer_out_.data() + layer_out_.size());
    return Status::ok();
  }

  // The experts' rows, written into the combine region untimed (the other
  // combines overwrite it between repetitions): bf16 with receiver weights,
  // f32 in place.
  Result<TensorView> layer_rows_in_region() {
    EPX_ASSIGN_OR_RETURN(TensorView y,
                         buffer_->combine_expanded_input(recv_.handle, receiver() ? kReceiverY : DType::kF32));
    for (int64_t i = 0; i < y.size(0); ++i) {
      const float* row = layer_y_view_.row<float>(i);
      if (receiver()) {
        uint16_t* out = y.row<uint16_t>(i);
        for (int64_t c = 0; c < config_.hidden; ++c) out[c] = f32_to_bf16(row[c]);
      } else {
        std::memcpy(y.row<float>(i), row, sizeof(float) * config_.hidden);
      }
    }
    return y;
  }

  void prepare_layer_inputs() {
    const ExpandedLayout& expanded = buffer_->expanded_layout(recv_.handle);
    const int64_t rows = expanded.num_rows();
    const int64_t H = config_.hidden;
    layer_y_ = AlignedBuffer(static_cast<std::size_t>(std::max<int64_t>(rows, 1) * H) * 4, 4096, /*zero=*/true);
    float* y = reinterpret_cast<float*>(layer_y_.data());
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = expanded.recv_row[static_cast<std::size_t>(i)];
      if (r < 0) continue;
      for (int64_t c = 0; c < H; ++c) y[i * H + c] = load_as_f32(recv_.recv_x.row(r), config_.dtype, c);
    }
    layer_y_view_ = TensorView::contiguous(y, DType::kF32, {rows, H});
    layer_out_ = AlignedBuffer(static_cast<std::size_t>(config_.num_tokens) * H * 4, 4096, /*zero=*/true);
    layer_out_view_ = TensorView::contiguous(layer_out_.data(), DType::kF32, {config_.num_tokens, H});
  }

  // The physical limit: the bytes this rank receives, one memcpy, between two
  // of the naive baseline's buffers (already faulted in).
  Status memcpy_op(bool record) {
    const std::size_t bytes = static_cast<std::size_t>(plan_.recv_rows[rank_]) * row_bytes_;
    std::span<std::byte> dst = naive_->scratch(0);
    std::span<std::byte> src = naive_->scratch(1);
    EPX_CHECK_LE(bytes, dst.size());
    EPX_RETURN_IF_ERROR(timed(kMemcpy, record, [&] {
      std::memcpy(dst.data(), src.data(), bytes);
      return Status::ok();
    }));
    return config_.layer_combine ? memcpy_layer_op(record) : Status::ok();
  }

  // The limit of the layer's combine: the partial bytes it sends (received
  // rows x hidden x 4 for f32 partials, x 2 for bf16), copied in chunks of the memcpy buffers'
  // size (larger than the last-level cache: every chunk goes to memory).
  Status memcpy_layer_op(bool record) {
    const auto bytes = static_cast<std::size_t>(plan_.recv_rows[rank_] * layer_row_bytes(config_));
    EPX_RETURN_IF_ERROR(chunked_memcpy(kMemcpyLayer, bytes, record));
    if (!receiver()) return Status::ok();
    return chunked_memcpy(kMemcpyExpanded,
                          static_cast<std::size_t>(plan_.naive_recv[rank_] * receiver_y_row_bytes(config_)), record);
  }
  bool receiver() const { return receiver_weights(config_); }
  // `bytes` copied in chunks of the memcpy buffers' size, timed as `method`.
  Status chunked_memcpy(Method method, std::size_t bytes, bool record) {
    std::span<std::byte> dst = naive_->scratch(0);
    std::span<std::byte> src = naive_->scratch(1);
    const std::size_t chunk = std::min(dst.size(), src.size());
    return timed(method, record, [&] {
      for (std::size_t done = 0; done < bytes; done += chunk)
        std::memcpy(dst.data(), src.data(), std::min(chunk, bytes - done));
      return Status::ok();
    });
  }

  Status naive_group(bool record, bool check) {
    const RankRouting& routing = plan_.routing[rank_];
    EPX_RETURN_IF_ERROR(
        timed(kNaiveDispatch, record, [&] { return naive_->dispatch(x_view_, routing.idx(), &naive_recv_); }));
    if (check) EPX_RETURN_IF_ERROR(check_naive_dispatch());
    if (check) std::memset(out_.data(), 0, out_.size());
    EPX_RETURN_IF_ERROR(timed(kNaiveCombine, record,
                              [&] { return naive_->combine(naive_recv_.recv_x, routing.weights(), out_view_); }));
    if (check) EPX_RETURN_IF_ERROR(check_weighted_combine("naive combine", out_.data(), config_.dtype, 1e-2));
    return Status::ok();
  }

  // recv_x row i must be row recv_src_idx[i] of rank recv_src_rank[i], in
  // (source rank, source token) order, with the right local expert ids.
  Status check_dispatch() const {
    const int64_t n = recv_.recv_x.size(0);
    if (n != plan_.recv_rows[rank_])
      return internal_error("verify: rank {} received {} rows from dispatch, expected {}", rank_, n,
                            plan_.recv_rows[rank_]);
    const int topk = config_.topk;
    std::vector<int32_t> per_expert(plan_.placement.num_local_experts(rank_), 0);
    int64_t prev = -1;
    for (int64_t i = 0; i < n; ++i) {
      const int s = recv_.recv_src_rank.data_as<const int32_t>()[i];
      const int t = recv_.recv_src_idx.data_as<const int32_t>()[i];
      if (s < 0 || s >= config_.num_ranks || t < 0 || t >= config_.num_tokens || !plan_.layout[s].in_rank(t, rank_))
        return internal_error("verify: rank {} row {} claims source (rank {}, token {}), which is not routed here",
                              rank_, i, s, t);
      const int64_t key = static_cast<int64_t>(s) * config_.num_tokens + t;
      if (key <= prev)
        return internal_error("verify: rank {} row {} (rank {}, token {}) is out of (source rank, token) order",
                              rank_, i, s, t);
      prev = key;
      if (std::memcmp(recv_.recv_x.row(i), shared_.x[s] + t * row_bytes_, row_bytes_) != 0)
        return internal_error("verify: rank {} row {} differs from token {} of rank {}", rank_, i, t, s);
      const int32_t* idx = plan_.routing[s].topk_idx.data() + static_cast<std::size_t>(t) * topk;
      const int32_t* got = recv_.recv_topk_idx.row<const int32_t>(i);
      for (int k = 0; k < topk; ++k) {
        const int e = idx[k];
        const int want = e >= 0 && plan_.placement.rank_of(e) == rank_ ? plan_.placement.local_id(e) : -1;
        if (got[k] != want)
          return internal_error("verify: rank {} row {} recv_topk_idx[{}] = {}, expected {} (global expert {})", rank_,
                                i, k, got[k], want, e);
        if (want >= 0) ++per_expert[want];
      }
    }
    if (per_expert != recv_.num_recv_tokens_per_expert)
      return internal_error("verify: rank {} num_recv_tokens_per_expert differs from the count of its rows", rank_);
    return Status::ok();
  }

  // out[t] must be x[t] times the number of ranks token t reached.
  Status check_combine(std::string_view what) const {
    const int64_t H = config_.hidden;
    std::vector<float> expected(H);
    for (int t = 0; t < config_.num_tokens; ++t) {
      int reached = 0;
      for (int r = 0; r < config_.num_ranks; ++r) reached += plan_.layout[rank_].in_rank(t, r);
      for (int64_t c = 0; c < H; ++c) expected[c] = pattern(rank_, t, c) * static_cast<float>(reached);
      int64_t column = 0;
      float got = 0;
      if (!row_matches(out_.data() + t * row_bytes_, expected.data(), config_.dtype, H, 0.0, &column, &got))
        return internal_error("verify: {} on rank {}: out[{}][{}] = {}, expected {} (x times {} ranks)", what, rank_, t,
                              column, got, expected[column], reached);
    }
    return Status::ok();
  }

  // Expert-major: for each local expert, for each source rank, its tokens in order.
  Status check_naive_dispatch() const {
    const int topk = config_.topk;
    int64_t row = 0;
    for (int j = 0; j < plan_.placement.num_local_experts(rank_); ++j) {
      const int e = plan_.placement.global_id(rank_, j);
      for (int s = 0; s < config_.num_ranks; ++s) {
        const std::vector<int32_t>& idx = plan_.routing[s].topk_idx;
        for (int t = 0; t < config_.num_tokens; ++t) {
          if (std::find(idx.begin() + static_cast<std::ptrdiff_t>(t) * topk,
                        idx.begin() + static_cast<std::ptrdiff_t>(t + 1) * topk, e) ==
              idx.begin() + static_cast<std::ptrdiff_t>(t + 1) * topk)
            continue;
          if (row >= naive_recv_.recv_x.size(0))
            return internal_error("verify: naive dispatch on rank {} returned only {} rows", rank_, row);
          if (std::memcmp(naive_recv_.recv_x.row(row), shared_.x[s] + t * row_bytes_, row_bytes_) != 0)
            return internal_error("verify: naive dispatch on rank {} row {} is not token {} of rank {}", rank_, row, t,
                                  s);
          ++row;
        }
      }
    }
    if (row != naive_recv_.recv_x.size(0))
      return internal_error("verify: naive dispatch on rank {} returned {} rows, expected {}", rank_,
                            naive_recv_.recv_x.size(0), row);
    return Status::ok();
  }

  // out[t] = sum over k of w[t, k] * x[t] (fp32 in slot order), within `rel`.
  Status check_weighted_combine(std::string_view what, const std::byte* out, DType out_dtype, double rel) const {
    const int64_t H = config_.hidden;
    const int topk = config_.topk;
    const RankRouting& routing = plan_.routing[rank_];
    std::vector<float> expected(H);
    for (int t = 0; t < config_.num_tokens; ++t) {
      std::fill(expected.begin(), expected.end(), 0.0f);
      for (int k = 0; k < topk; ++k) {
        if (routing.topk_idx[static_cast<std::size_t>(t) * topk + k] < 0) continue;
        const float w = routing.topk_weights[static_cast<std::size_t>(t) * topk + k];
        for (int64_t c = 0; c < H; ++c)
          expected[c] += w * load_as_f32(x_.data() + t * row_bytes_, config_.dtype, c);
      }
      int64_t column = 0;
      float got = 0;
      const std::size_t out_row = static_cast<std::size_t>(H) * dtype_size(out_dtype);
      if (!row_matches(out + t * out_row, expected.data(), out_dtype, H, rel, &column, &got))
        return internal_error("verify: {} on rank {}: out[{}][{}] = {}, expected {}", what, rank_, t, column, got,
                              expected[column]);
    }
    return Status::ok();
  }

  const std::size_t epx_staging_bytes_;  // all ranks; allocated by the first operations, not by create
  Transport& t_;
  const ExchangeBenchConfig& config_;
  const ShapePlan& plan_;
  Shared& shared_;
  const ProgressFn& progress_;
  const int rank_;
  const std::size_t row_bytes_;
  AlignedBuffer x_;
  AlignedBuffer out_;
  TensorView x_view_;
  TensorView out_view_;
  DispatchInputs inputs_;
  std::unique_ptr<Buffer> buffer_;
  DispatchResult recv_;
  std::unique_ptr<NaiveAllToAll> naive_;
  NaiveDispatchResult naive_recv_;
  AlignedBuffer layer_y_;    // the layer combine's y_expanded (f32)
  AlignedBuffer layer_out_;  // and its f32 out
  TensorView layer_y_view_;
  TensorView layer_out_view_;
};

MethodTiming summarize(const Shared& shared, Method method, int64_t bytes, int num_ranks) {
  const std::vector<double>& samples = shared.samples[method];
  MethodTiming m;
  m.samples_ms = samples;
  m.time_ms = median(samples);
  m.min_ms = samples.empty() ? 0 : *std::min_element(samples.begin(), samples.end());
  m.cpu_ms = median(shared.cpu_samples[method]);
  m.page_faults = samples.empty() ? 0 : shared.timed_faults[method] / static_cast<int64_t>(samples.size());
  if (m.time_ms > 0) {
    m.gbps_total = static_cast<double>(bytes) / (m.time_ms * 1e-3) / 1e9;
    m.gbps = m.gbps_total / num_ranks;
  }
  return m;
}

// The shape's rows and bytes from the plan, and each method's summary.
ExchangeBenchResult collect_result(const ExchangeBenchConfig& config, const ShapePlan& plan, const Shared& shared) {
  ExchangeBenchResult r;
  r.config = config;
  r.config.tracer = nullptr;
  r.schedule = shared.interleaved ? "interleaved" : "phased";
  r.hierarchical = shared.hierarchical;
  r.row_bytes = static_cast<int64_t>(config.hidden) * static_cast<int64_t>(dtype_size(config.dtype));
  for (int rank = 0; rank < config.num_ranks; ++rank) {
    r.recv_rows += plan.recv_rows[rank];
    r.naive_rows += plan.naive_send[rank];
    r.dispatch_inter_node_bytes += shared.inter_node_bytes[rank][kDispatch];
    r.combine_inter_node_bytes += shared.inter_node_bytes[rank][kCombine];
    r.naive_dispatch_inter_node_bytes += shared.inter_node_bytes[rank][kNaiveDispatch];
    r.naive_combine_inter_node_bytes += shared.inter_node_bytes[rank][kNaiveCombine];
  }
  r.max_recv_rows = plan.max_recv_rows;
  r.recv_bytes = r.recv_rows * r.row_bytes;
  r.epx_region_bytes = shared.epx_region_bytes;
  r.naive_bytes = shared.naive_bytes;
  r.dispatch = summarize(shared, kDispatch, r.recv_bytes, config.num_ranks);
  r.combine = summarize(shared, kCombine, r.recv_bytes, config.num_ranks);
  r.combine_copy_in = summarize(shared, kCombineCopyIn, r.recv_bytes, config.num_ranks);
  r.memcpy = summarize(shared, kMemcpy, r.recv_bytes, config.num_ranks);
  r.naive_dispatch = summarize(shared, kNaiveDispatch, r.recv_bytes, config.num_ranks);
  r.naive_combine = summarize(shared, kNaiveCombine, r.recv_bytes, config.num_ranks);
  r.layer_bytes = config.layer_combine ? r.recv_rows * layer_row_bytes(config) : 0;
  r.expanded_bytes = config.layer_combine && receiver_weights(config) ? r.naive_rows * receiver_y_row_bytes(config) : 0;
  r.layer_combine = summarize(shared, kLayerCombine, r.layer_bytes, config.num_ranks);
  r.memcpy_layer = summarize(shared, kMemcpyLayer, r.layer_bytes, config.num_ranks);
  r.layer_combine_outside = summarize(shared, kLayerCombineOutside, r.layer_bytes, config.num_ranks);
  r.memcpy_expanded = summarize(shared, kMemcpyExpanded, r.expanded_bytes, config.num_ranks);
  return r;
}

double ratio(double num, double den) { return den > 0 ? num / den : 0.0; }

// The methods against memcpy and the naive baseline, from wall and CPU time.
void set_ratios(ExchangeBenchResult& r) {
  r.dispatch_vs_memcpy = ratio(r.memcpy.time_ms, r.dispatch.time_ms);
  r.combine_vs_memcpy = ratio(r.memcpy.time_ms, r.combine.time_ms);
  r.dispatch_vs_naive = ratio(r.naive_dispatch.time_ms, r.dispatch.time_ms);
  r.combine_vs_naive = ratio(r.naive_combine.time_ms, r.combine.time_ms);
  r.dispatch_vs_memcpy_cpu = ratio(r.memcpy.cpu_ms, r.dispatch.cpu_ms);
  r.combine_vs_memcpy_cpu = ratio(r.memcpy.cpu_ms, r.combine.cpu_ms);
  r.dispatch_vs_naive_cpu = ratio(r.naive_dispatch.cpu_ms, r.dispatch.cpu_ms);
  r.combine_vs_naive_cpu = ratio(r.naive_combine.cpu_ms, r.combine.cpu_ms);
  r.layer_combine_vs_memcpy = ratio(r.memcpy_layer.time_ms, r.layer_combine.time_ms);
  r.layer_combine_vs_naive = ratio(r.naive_combine.time_ms, r.layer_combine.time_ms);
  r.layer_outside_vs_memcpy = ratio(r.memcpy_layer.time_ms, r.layer_combine_outside.time_ms);
  r.layer_outside_vs_naive = ratio(r.naive_combine.time_ms, r.layer_combine_outside.time_ms);
  r.layer_combine_vs_memcpy_cpu = ratio(r.memcpy_layer.cpu_ms, r.layer_combine.cpu_ms);
}

// Before a shape: the heap's free memory back to the system (malloc_trim),
// and the peak resident memory reset to the current one (clear_refs 5), so
// that peak_rss_bytes() after it is this shape's. Where the kernel refuses
// the reset, the peak stays the process's so far.
void reset_peak_rss() {
  malloc_trim(0);
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
}

// The peak resident memory since reset_peak_rss() (VmHWM), else since the
// process started (getrusage's ru_maxrss, KiB on Linux).
std::size_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return static_cast<std::size_t>(std::stoull(line.substr(6))) * 1024;
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::size_t>(usage.ru_maxrss) * 1024;
}

}  // namespace

CpuSnapshot cpu_snapshot() {
  CpuSnapshot snap;
  std::ifstream in("/proc/stat");
  std::string cpu;
  uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  if (in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal && cpu == "cpu")
    snap.machine_busy_s =
        static_cast<double>(user + nice + system + irq + softirq + steal) / static_cast<double>(sysconf(_SC_CLK_TCK));
  snap.self_s = process_cpu_seconds();
  snap.wall_s = static_cast<double>(now_ns()) * 1e-9;
  return snap;
}

double other_cpu_share(const CpuSnapshot& before, const CpuSnapshot& after) {
  const double wall = after.wall_s - before.wall_s;
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (wall <= 0 || cores < 1 || after.machine_busy_s <= 0) return 0;
  const double others = (after.machine_busy_s - before.machine_busy_s) - (after.self_s - before.self_s);
  return std::clamp(others / (wall * static_cast<double>(cores)), 0.0, 1.0);
}

std::size_t available_memory_bytes() {
  const MemoryAvailable available = available_memory();
  return available.bytes == kMemoryUnbounded ? 0 : static_cast<std::size_t>(available.bytes);
}

MemoryEstimate estimate_exchange_bench_memory(const ExchangeBenchConfig& c) {
  const int64_t T = c.num_tokens, K = c.topk, R = c.num_ranks;
  const int64_t row_bytes = saturating_product({c.hidden, static_cast<int64_t>(dtype_size(c.dtype))});
  MemoryEstimate e;
  e.copies = R;  // every rank is a thread of this process
  const std::string tokens = fmt::format("tokens = {}", T);
  e.add("routing (top-k ids and weights)", saturating_product({T, K, 8}), tokens);
  e.add("input and output rows", saturating_product({T, row_bytes, 2}), tokens);
  // The fewest rows a rank can receive: its share when every token's top-k
  // spreads evenly over min(topk, ranks) ranks. A skewed routing needs more.
  BufferConfig buffer = bench_buffer_config(c);
  buffer.max_recv_tokens = std::max<int64_t>(saturating_product({T, std::min(K, R)}), 1);
  e.add("epx exchange regions (balanced routing)", Buffer::estimate_region_bytes(buffer, c.num_ranks), tokens);
  // Balanced, a rank receives T x K (token, expert) pairs: the layer combine's expert rows.
  if (c.layer_combine)
    e.add("layer combine: f32 expert rows and out (balanced routing)",
          static_cast<int64_t>(layer_combine_bytes(c, saturating_product({T, K}))), tokens);
  return e;
}

Status validate_exchange_bench_config(const ExchangeBenchConfig& c) {
  if (c.num_ranks < 1) return invalid_argument("ranks = {} must be at least 1", c.num_ranks);
  if (c.num_nodes < 1) return invalid_argument("nodes = {} must be at least 1", c.num_nodes);
  if (c.num_ranks % c.num_nodes != 0)
    return invalid_argument("ranks = {} is not a multiple of nodes = {}", c.num_ranks, c.num_nodes);
  if (c.num_tokens < 1) return invalid_argument("tokens = {} must be at least 1", c.num_tokens);
  if (c.layer_combine && c.layer_combine_weights == CombineWeights::kReceiver && c.num_nodes > 1)
    return invalid_argument("the layer combine with receiver weights takes the flat path only, but the shape has "
                            "nodes = {} (two-hop); run it on 1x{} shapes",
                            c.num_nodes, c.num_ranks);
  if (c.hidden < 1) return invalid_argument("hidden = {} must be at least 1", c.hidden);
  if (c.num_experts < 1) return invalid_argument("experts = {} must be at least 1", c.num_experts);
  if (c.num_experts % c.num_ranks != 0)
    return invalid_argument("experts = {} is not a multiple of ranks = {} (experts are placed in equal blocks)",
                            c.num_experts, c.num_ranks);
  if (c.topk < 1) return invalid_argument("topk = {} must be at least 1", c.topk);
  if (c.topk > c.num_experts)
    return invalid_argument("topk = {} is larger than experts = {}: a token picks distinct experts", c.topk,
                            c.num_experts);
  if (c.dtype != DType::kBF16 && c.dtype != DType::kF32)
    return invalid_argument("dtype {} is not supported here: use bf16 or f32", dtype_name(c.dtype));
  if ((static_cast<std::size_t>(c.hidden) * dtype_size(c.dtype)) % 8 != 0)
    return invalid_argument("hidden = {} gives {}-byte rows; rows must be a multiple of 8 bytes", c.hidden,
                            static_cast<std::size_t>(c.hidden) * dtype_size(c.dtype));
  if (c.reps < 1) return invalid_argument("reps = {} must be at least 1", c.reps);
  if (c.warmup < 1) return invalid_argument("warmup = {} must be at least 1 (it also checks the results)", c.warmup);
  if (!(c.skew >= 0) || !std::isfinite(c.skew)) return invalid_argument("skew = {} must be a finite number >= 0", c.skew);
  if (!(c.memory_fraction > 0 && c.memory_fraction <= 1))
    return invalid_argument("memory_fraction = {} must be in (0, 1]", c.memory_fraction);
  return Status::ok();
}

Result<ExchangeBenchResult> run_exchange_bench(const ExchangeBenchConfig& config, const ProgressFn& progress) {
  EPX_RETURN_IF_ERROR(validate_exchange_bench_config(config));
  EPX_ASSIGN_OR_RETURN(Topology topo, Topology::create(config.num_ranks, config.num_nodes));
  EPX_ASSIGN_OR_RETURN(ShapePlan plan, plan_shape(config, topo));
  const MemoryPlan memory = plan_memory(config, plan);
  if (progress)
    progress(fmt::format("memory: inputs/outputs {}, epx about {}, naive baseline {}; {} available, budget {}",
                         gib(memory.common), gib(memory.epx), gib(memory.naive), gib(memory.available),
                         gib(memory.budget)));
  if (!memory.fits_phased())
    return resource_exhausted(
        "{} tokens/rank x {} ranks at hidden {} {} needs about {} (inputs/outputs {}, epx {}, naive baseline {}) "
        "even running the methods one after the other, but the budget is {} ({:.0f}% of {} available); "
        "use fewer tokens{}",
        config.num_tokens, config.num_ranks, config.hidden, dtype_name(config.dtype),
        gib(memory.common + std::max(memory.epx, memory.naive)), gib(memory.common), gib(memory.epx),
        gib(memory.naive), gib(memory.budget), config.memory_fraction * 100, gib(memory.available),
        config.layer_combine ? " or --layer-combine off (the layer's f32 rows are most of epx's share)" : "");

  reset_peak_rss();
  Shared shared(config.num_ranks);
  shared.interleaved = memory.fits_interleaved();
  const CpuSnapshot cpu_before = cpu_snapshot();
  const std::size_t epx_staging = memory.epx_after_create;
  InprocWorld world(topo);
  const std::vector<Status> statuses = world.run([&](Transport& transport) -> Status {
    RankBench bench(transport, config, plan, shared, progress, epx_staging);
    return bench.run();
  });
  EPX_RETURN_IF_ERROR(first_error(statuses));

  const CpuSnapshot cpu_after = cpu_snapshot();
  ExchangeBenchResult r = collect_result(config, plan, shared);
  r.other_cpu_share = other_cpu_share(cpu_before, cpu_after);
  r.planned_bytes = memory.at_once();
  r.peak_rss_bytes = peak_rss_bytes();
  if (progress)
    progress(fmt::format("memory: peak {} resident, planned {}", gib(r.peak_rss_bytes), gib(r.planned_bytes)));
  set_ratios(r);
  return r;
}

std::vector<PhaseSummary> summarize_phases(const Tracer& tracer) {
  std::map<std::string, PhaseSummary> by_name;
  for (const TraceSpan& span : tracer.spans()) {
    PhaseSummary& p = by_name[span.name];
    p.name = span.name;
    const double ms = static_cast<double>(span.end_ns - span.begin_ns) * 1e-6;
    ++p.count;
    p.total_ms += ms;
    p.max_ms = std::max(p.max_ms, ms);
  }
  std::vector<PhaseSummary> out;
  for (auto& [name, p] : by_name) {
    p.mean_ms = p.count ? p.total_ms / static_cast<double>(p.count) : 0;
    out.push_back(p);
  }
  return out;
}

}  // namespace epx::bench
