// `epx demo`: one small dispatch/combine over in-process ranks, shown in full.
#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "cli_checks.h"
#include "commands.h"
#include "epx/comm/inproc.h"
#include "epx/core/buffer.h"
#include "epx/exchange/buffer.h"
#include "epx/exchange/layout.h"
#include "shape_options.h"
#include "stats.h"
#include "synthetic_routing.h"

namespace epx::app {

namespace {

// Payload of (rank, token, column): exact in bf16, distinct between rows.
float pattern(int rank, int token, int64_t column) {
  const int64_t v = (static_cast<int64_t>(rank) * 131 + static_cast<int64_t>(token) * 31 + column * 7) % 253;
  return static_cast<float>(v - 126) / 64.0f;
}

double imbalance(const std::vector<int64_t>& v) {
  if (v.empty()) return 0;
  const double mean = static_cast<double>(std::accumulate(v.begin(), v.end(), int64_t{0})) / static_cast<double>(v.size());
  return mean > 0 ? static_cast<double>(*std::max_element(v.begin(), v.end())) / mean : 0;
}

using epx::bench::median;

// What the ranks report back.
struct DemoShared {
  explicit DemoShared(int num_ranks)
      : begin(num_ranks), end(num_ranks), x(num_ranks), inter_node_bytes(num_ranks), intra_node_bytes(num_ranks) {}
  std::vector<int64_t> begin, end;
  std::vector<double> dispatch_ms, combine_ms;  // rank 0
  std::vector<const std::byte*> x;
  std::vector<int64_t> inter_node_bytes, intra_node_bytes;  // from dispatch's ExchangeStats
  bool hierarchical = false;
};

}  // namespace

CLI::App* add_demo_command(CLI::App& app, DemoOptions& o) {
  CLI::App* cmd = app.add_subcommand(
      "demo",
      "A short dispatch/combine over in-process ranks: what moved where, load imbalance, bandwidth, and a round-trip "
      "check (exit 1 if it fails)");
  add_shape_options(cmd, {.ranks = &o.num_ranks,
                          .nodes = &o.num_nodes,
                          .hidden = &o.hidden,
                          .experts = &o.num_experts,
                          .topk = &o.topk,
                          .skew = &o.skew,
                          .seed = &o.seed});
  cmd->add_option("--tokens", o.num_tokens, "Tokens per rank")->transform(in_range(0, 65536))->capture_default_str();
  cmd->add_option("--dtype", o.dtype, "Payload type")->check(CLI::IsMember({"bf16", "f32"}))->capture_default_str();
  cmd->add_option("--reps", o.reps, "Timed repetitions after the checked warm-up")
      ->transform(in_range(1, 1000))
      ->capture_default_str();
  cmd->add_flag("--json", o.json, "Print one JSON object instead of the text report");
  return cmd;
}

namespace {

// The option combinations the flags' own ranges cannot check; empty when they fit.
std::string check_demo_options(const DemoOptions& o, DType dtype) {
  if (o.num_ranks % o.num_nodes != 0)
    return fmt::format("--ranks {} is not a multiple of --nodes {}", o.num_ranks, o.num_nodes);
  if (o.num_experts % o.num_ranks != 0)
    return fmt::format("--experts {} is not a multiple of --ranks {} (experts are placed in equal blocks)",
                       o.num_experts, o.num_ranks);
  if (o.topk > o.num_experts)
    return fmt::format("--topk {} is larger than --experts {}: a token picks distinct experts", o.topk, o.num_experts);
  if ((static_cast<std::size_t>(o.hidden) * dtype_size(dtype)) % 8 != 0)
    return fmt::format("--hidden {} gives {} rows of {} bytes; rows must be a multiple of 8 bytes", o.hidden, o.dtype,
                       static_cast<std::size_t>(o.hidden) * dtype_size(dtype));
  return {};
}

// Routing and layouts, computed up front so the demo can show and check them.
struct DemoPlan {
  std::vector<bench::RankRouting> routing;
  std::vector<DispatchLayout> layout;
  std::vector<std::vector<int64_t>> sent;  // [source][destination] rows
  std::vector<int64_t> recv_rows;          // per destination rank
  std::vector<int64_t> tokens_per_expert;
  int64_t max_recv = 1;
};

Result<DemoPlan> plan_demo(const DemoOptions& o, const ExpertPlacement& placement, const Topology& topo) {
  const int R = o.num_ranks;
  DemoPlan plan;
  const bench::RoutingSpec spec{.num_tokens = o.num_tokens, .num_experts = o.num_experts, .topk = o.topk,
                                .skew = o.skew, .seed = o.seed};
  for (int r = 0; r < R; ++r) {
    EPX_ASSIGN_OR_RETURN(bench::RankRouting rr, bench::make_routing(spec, r));
    EPX_ASSIGN_OR_RETURN(DispatchLayout lr, compute_layout(rr.idx(), placement, topo));
    plan.routing.push_back(std::move(rr));
    plan.layout.push_back(std::move(lr));
  }
  plan.sent.assign(R, std::vector<int64_t>(R));
  plan.recv_rows.assign(R, 0);
  plan.tokens_per_expert.assign(o.num_experts, 0);
  for (int s = 0; s < R; ++s) {
    for (int d = 0; d < R; ++d) {
      plan.sent[s][d] = plan.layout[s].num_tokens_per_rank[d];
      plan.recv_rows[d] += plan.sent[s][d];
    }
    for (int e = 0; e < o.num_experts; ++e) plan.tokens_per_expert[e] += plan.layout[s].num_tokens_per_expert[e];
  }
  plan.max_recv = std::max<int64_t>(1, *std::max_element(plan.recv_rows.begin(), plan.recv_rows.end()));
  return plan;
}

// What one rank's exchange needs to run and check itself.
struct DemoRank {
  const DemoOptions& o;
  const ExpertPlacement& placement;
  const DemoPlan& plan;
  DemoShared& shared;
  DType dtype;
  std::size_t row_bytes;
};

// Every received row is its source's row, in (source rank, token) order; empty when so.
std::string check_dispatch(const DemoRank& d, int rank, const DispatchResult& recv) {
  const int R = d.o.num_ranks, T = d.o.num_tokens;
  if (recv.recv_x.size(0) != d.plan.recv_rows[rank])
    return fmt::format("rank {} received {} rows, the layout says {}", rank, recv.recv_x.size(0),
                       d.plan.recv_rows[rank]);
  int64_t prev = -1;
  for (int64_t i = 0; i < recv.recv_x.size(0); ++i) {
    const int s = recv.recv_src_rank.data_as<const int32_t>()[i];
    const int tok = recv.recv_src_idx.data_as<const int32_t>()[i];
    const int64_t key = static_cast<int64_t>(s) * std::max(T, 1) + tok;
    if (s < 0 || s >= R || tok < 0 || tok >= T || key <= prev || !d.plan.layout[s].in_rank(tok, rank) ||
        std::memcmp(recv.recv_x.row(i), d.shared.x[s] + tok * d.row_bytes, d.row_bytes) != 0)
      return fmt::format("rank {} row {} (from rank {}, token {}) is misrouted, out of order or corrupt", rank, i, s,
                         tok);
    prev = key;
  }
  return {};
}

// Combining y = recv_x must give x times the number of ranks each token reached; empty when so.
std::string check_combine(const DemoRank& d, int rank, const std::byte* x, const std::byte* out) {
  for (int tok = 0; tok < d.o.num_tokens; ++tok) {
    int reached = 0;
    for (int r = 0; r < d.o.num_ranks; ++r) reached += d.plan.layout[rank].in_rank(tok, r);
    for (int64_t c = 0; c < d.o.hidden; ++c) {
      const float want = load_as_f32(x + tok * d.row_bytes, d.dtype, c) * static_cast<float>(reached);
      const float want_stored = d.dtype == DType::kBF16 ? bf16_to_f32(f32_to_bf16(want)) : want;
      const float got = load_as_f32(out + tok * d.row_bytes, d.dtype, c);
      if (got != want_stored)
        return fmt::format("rank {}: combine gave out[{}][{}] = {}, expected {} (x times {} ranks)", rank, tok, c, got,
                           want_stored, reached);
    }
  }
  return {};
}

// Runs `op` from a common start; rank 0 records the time to the last rank's end in `samples`.
template <typename Op>
Status timed_on_all(Transport& t, DemoShared& shared, std::vector<double>* samples, Op&& op) {
  const int rank = t.rank();
  const auto deadline = [] { return Deadline::after(std::chrono::seconds(30)); };
  EPX_RETURN_IF_ERROR(t.barrier(deadline()));
  shared.begin[rank] = now_ns();
  Status status = op();
  shared.end[rank] = now_ns();
  EPX_RETURN_IF_ERROR(status);
  EPX_RETURN_IF_ERROR(t.barrier(deadline()));
  if (rank == 0 && samples)
    samples->push_back(static_cast<double>(*std::max_element(shared.end.begin(), shared.end.end()) -
                                           *std::min_element(shared.begin.begin(), shared.begin.end())) *
                       1e-6);
  return Status::ok();
}

// One rank: the checked warm-up round trip, then --reps timed ones; a check's failure goes to `failure`.
Status run_demo_rank(Transport& t, const DemoRank& d, std::string& failure) {
  const int rank = t.rank(), T = d.o.num_tokens;
  const int64_t H = d.o.hidden;
  AlignedBuffer x(std::max<std::size_t>(static_cast<std::size_t>(T) * d.row_bytes, 1));
  AlignedBuffer out(std::max<std::size_t>(static_cast<std::size_t>(T) * d.row_bytes, 1), kCacheLine, true);
  for (int tok = 0; tok < T; ++tok)
    for (int64_t c = 0; c < H; ++c) store_from_f32(x.data() + tok * d.row_bytes, d.dtype, c, pattern(rank, tok, c));
  d.shared.x[rank] = x.data();
  const TensorView outv = TensorView::contiguous(out.data(), d.dtype, {T, H});
  EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, BufferConfig{.num_experts = d.o.num_experts,
                                                                   .hidden = d.o.hidden,
                                                                   .dtype = d.dtype,
                                                                   .max_topk = d.o.topk,
                                                                   .max_tokens_per_rank = std::max(T, 1),
                                                                   .max_recv_tokens = d.plan.max_recv,
                                                                   .max_combine_dtype = d.dtype,
                                                                   .placement = d.placement}));
  if (rank == 0) d.shared.hierarchical = buffer->hierarchical();
  const DispatchInputs inputs{.x = TensorView::contiguous(x.data(), d.dtype, {T, H}),
                              .topk_idx = d.plan.routing[rank].idx(),
                              .topk_weights = d.plan.routing[rank].weights()};
  DispatchResult recv;
  for (int rep = 0; rep <= d.o.reps; ++rep) {  // rep 0 is the warm-up, and is checked
    const bool first = rep == 0;
    EPX_RETURN_IF_ERROR(timed_on_all(t, d.shared, first ? nullptr : &d.shared.dispatch_ms,
                                     [&] { return buffer->dispatch(inputs, &recv); }));
    if (first) {
      d.shared.inter_node_bytes[rank] = recv.stats.inter_node_payload_bytes;
      d.shared.intra_node_bytes[rank] = recv.stats.intra_node_payload_bytes;
      failure = check_dispatch(d, rank, recv);
      std::memset(out.data(), 0, out.size());
    }
    EPX_RETURN_IF_ERROR(timed_on_all(t, d.shared, first ? nullptr : &d.shared.combine_ms,
                                     [&] { return buffer->combine(recv.recv_x, recv.handle, outv); }));
    if (first && failure.empty()) failure = check_combine(d, rank, x.data(), out.data());
  }
  return t.barrier(Deadline::after(std::chrono::seconds(30)));
}

// The figures both reports print.
struct DemoSummary {
  std::string failure;  // empty: the round trip checked out
  int64_t total_rows = 0;
  double dispatch_ms = 0, combine_ms = 0, dispatch_gbps = 0, combine_gbps = 0;
  int64_t intra = 0, inter = 0;
};

DemoSummary summarize_demo(const DemoOptions& o, const DemoPlan& plan, const DemoShared& shared,
                           const std::vector<std::string>& failures, std::size_t row_bytes) {
  DemoSummary s;
  for (const std::string& f : failures)
    if (!f.empty() && s.failure.empty()) s.failure = f;
  s.total_rows = std::accumulate(plan.recv_rows.begin(), plan.recv_rows.end(), int64_t{0});
  const double bytes = static_cast<double>(s.total_rows) * static_cast<double>(row_bytes);
  auto gbps_per_rank = [&](double ms) { return ms > 0 ? bytes / o.num_ranks / (ms * 1e-3) / 1e9 : 0.0; };
  s.dispatch_ms = median(shared.dispatch_ms);
  s.combine_ms = median(shared.combine_ms);
  s.dispatch_gbps = gbps_per_rank(s.dispatch_ms);
  s.combine_gbps = gbps_per_rank(s.combine_ms);
  s.inter = std::accumulate(shared.inter_node_bytes.begin(), shared.inter_node_bytes.end(), int64_t{0});
  s.intra = std::accumulate(shared.intra_node_bytes.begin(), shared.intra_node_bytes.end(), int64_t{0});
  return s;
}

void print_demo_json(const DemoOptions& o, DType dtype, const DemoPlan& plan, bool hierarchical,
                     const DemoSummary& s) {
  nlohmann::json j;
  j["config"] = {{"ranks", o.num_ranks}, {"nodes", o.num_nodes}, {"tokens", o.num_tokens}, {"hidden", o.hidden},
                 {"experts", o.num_experts}, {"topk", o.topk}, {"skew", o.skew}, {"seed", o.seed},
                 {"dtype", std::string(dtype_name(dtype))}, {"reps", o.reps}};
  j["hierarchical"] = hierarchical;
  j["rows_sent"] = plan.sent;
  j["recv_rows"] = plan.recv_rows;
  j["tokens_per_expert"] = plan.tokens_per_expert;
  j["imbalance"] = {{"recv_rows", imbalance(plan.recv_rows)},
                    {"tokens_per_expert", imbalance(plan.tokens_per_expert)}};
  j["dispatch"] = {{"time_ms", s.dispatch_ms}, {"gbps", s.dispatch_gbps}};
  j["combine"] = {{"time_ms", s.combine_ms}, {"gbps", s.combine_gbps}};
  j["payload_bytes"] = {{"intra_node", s.intra}, {"inter_node", s.inter}};
  j["round_trip"] = s.failure.empty() ? "OK" : "FAILED";
  if (!s.failure.empty()) j["error"] = s.failure;
  fmt::print("{}\n", j.dump(2));
}

// The rows-sent matrix: source ranks down, destination ranks across, with totals.
void print_rows_sent(const DemoPlan& plan, int64_t total_rows) {
  const int R = static_cast<int>(plan.sent.size());
  fmt::print("rows sent (a token counts once per destination rank):\n");
  fmt::print("{:>10}", "from \\ to");
  for (int d = 0; d < R; ++d) fmt::print("{:>7}", fmt::format("r{}", d));
  fmt::print("{:>8}\n", "total");
  for (int s = 0; s < R; ++s) {
    fmt::print("{:>10}", fmt::format("r{}", s));
    for (int d = 0; d < R; ++d) fmt::print("{:>7}", plan.sent[s][d]);
    fmt::print("{:>8}\n", std::accumulate(plan.sent[s].begin(), plan.sent[s].end(), int64_t{0}));
  }
  fmt::print("{:>10}", "received");
  for (int d = 0; d < R; ++d) fmt::print("{:>7}", plan.recv_rows[d]);
  fmt::print("{:>8}\n\n", total_rows);
}

void print_demo_text(const DemoOptions& o, DType dtype, const Topology& topo, const DemoPlan& plan,
                     bool hierarchical, const DemoSummary& s, std::size_t row_bytes) {
  fmt::print("epx demo: {} ranks ({}), {} tokens/rank, hidden {} {}, {} experts ({} per rank), top-{}, skew {}, seed {}\n",
             o.num_ranks, topo.describe(), o.num_tokens, o.hidden, dtype_name(dtype), o.num_experts,
             o.num_experts / o.num_ranks, o.topk, o.skew, o.seed);
  fmt::print("path: {}\n\n", hierarchical ? "two-hop (across nodes once per destination node, then inside)"
                                          : "flat (every (token, rank) pair copied directly)");
  print_rows_sent(plan, s.total_rows);
  fmt::print("received rows per rank: imbalance max/mean {:.2f}\n", imbalance(plan.recv_rows));
  fmt::print("tokens per expert:");
  for (int e = 0; e < o.num_experts; ++e)
    fmt::print("{}e{} {}", e % 8 == 0 ? "\n  " : "  ", e, plan.tokens_per_expert[e]);
  fmt::print("\n  imbalance max/mean {:.2f}\n\n", imbalance(plan.tokens_per_expert));
  if (o.num_nodes > 1)
    fmt::print("dispatch payload: {} bytes copied inside nodes, {} bytes sent between nodes\n", s.intra, s.inter);
  fmt::print("dispatch: {:.3f} ms, {:.2f} GB/s per rank (logical: received rows x {} B / time, median of {})\n",
             s.dispatch_ms, s.dispatch_gbps, row_bytes, o.reps);
  fmt::print("combine:  {:.3f} ms, {:.2f} GB/s per rank\n", s.combine_ms, s.combine_gbps);
  if (s.failure.empty())
    fmt::print("round trip: OK (every received row matches its source; combine(recv_x) == x * ranks reached)\n");
  else
    fmt::print("round trip: FAILED: {}\n", s.failure);
}

}  // namespace

int run_demo(const DemoOptions& o) {
  auto usage = [](const std::string& message) {
    fmt::print(stderr, "epx demo: {}\n", message);
    return kExitUsage;
  };
  const DType dtype = o.dtype == "f32" ? DType::kF32 : DType::kBF16;
  if (std::string bad = check_demo_options(o, dtype); !bad.empty()) return usage(bad);
  const std::size_t row_bytes = static_cast<std::size_t>(o.hidden) * dtype_size(dtype);
  Result<Topology> topo = Topology::create(o.num_ranks, o.num_nodes);
  if (!topo.is_ok()) return usage(topo.status().message());
  Result<ExpertPlacement> placement = ExpertPlacement::contiguous(o.num_experts, o.num_ranks);
  if (!placement.is_ok()) return usage(placement.status().message());
  Result<DemoPlan> plan = plan_demo(o, *placement, *topo);
  if (!plan.is_ok()) return usage(plan.status().message());

  DemoShared shared(o.num_ranks);
  std::vector<std::string> failures(o.num_ranks);
  const DemoRank demo{.o = o, .placement = *placement, .plan = *plan, .shared = shared, .dtype = dtype, .row_bytes = row_bytes};
  InprocWorld world(*topo);
  const Status status =
      first_error(world.run([&](Transport& t) { return run_demo_rank(t, demo, failures[t.rank()]); }));
  if (!status.is_ok()) {
    fmt::print(stderr, "epx demo: the exchange failed: {}\n", status.to_string());
    return kExitFailed;
  }
  const DemoSummary summary = summarize_demo(o, *plan, shared, failures, row_bytes);
  if (o.json)
    print_demo_json(o, dtype, *plan, shared.hierarchical, summary);
  else
    print_demo_text(o, dtype, *topo, *plan, shared.hierarchical, summary, row_bytes);
  return summary.failure.empty() ? kExitOk : kExitFailed;
}

}  // namespace epx::app
