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

int run_demo(const DemoOptions& o) {
  auto usage = [](const std::string& message) {
    fmt::print(stderr, "epx demo: {}\n", message);
    return kExitUsage;
  };
  if (o.num_ranks % o.num_nodes != 0)
    return usage(fmt::format("--ranks {} is not a multiple of --nodes {}", o.num_ranks, o.num_nodes));
  if (o.num_experts % o.num_ranks != 0)
    return usage(fmt::format("--experts {} is not a multiple of --ranks {} (experts are placed in equal blocks)",
                             o.num_experts, o.num_ranks));
  if (o.topk > o.num_experts)
    return usage(fmt::format("--topk {} is larger than --experts {}: a token picks distinct experts", o.topk,
                             o.num_experts));
  const DType dtype = o.dtype == "f32" ? DType::kF32 : DType::kBF16;
  if ((static_cast<std::size_t>(o.hidden) * dtype_size(dtype)) % 8 != 0)
    return usage(fmt::format("--hidden {} gives {} rows of {} bytes; rows must be a multiple of 8 bytes", o.hidden,
                             o.dtype, static_cast<std::size_t>(o.hidden) * dtype_size(dtype)));
  const int R = o.num_ranks;
  const int T = o.num_tokens;
  const int64_t H = o.hidden;
  const std::size_t row_bytes = static_cast<std::size_t>(H) * dtype_size(dtype);

  Result<Topology> topo = Topology::create(R, o.num_nodes);
  if (!topo.is_ok()) return usage(topo.status().message());
  Result<ExpertPlacement> placement = ExpertPlacement::contiguous(o.num_experts, R);
  if (!placement.is_ok()) return usage(placement.status().message());

  // Routing and layouts, computed up front so the demo can show and check them.
  std::vector<bench::RankRouting> routing;
  std::vector<DispatchLayout> layout;
  const bench::RoutingSpec spec{.num_tokens = T, .num_experts = o.num_experts, .topk = o.topk, .skew = o.skew,
                                .seed = o.seed};
  for (int r = 0; r < R; ++r) {
    Result<bench::RankRouting> rr = bench::make_routing(spec, r);
    if (!rr.is_ok()) return usage(rr.status().message());
    Result<DispatchLayout> lr = compute_layout(rr->idx(), *placement, *topo);
    if (!lr.is_ok()) return usage(lr.status().message());
    routing.push_back(std::move(rr).value());
    layout.push_back(std::move(lr).value());
  }
  std::vector<std::vector<int64_t>> sent(R, std::vector<int64_t>(R));
  std::vector<int64_t> recv_rows(R, 0);
  std::vector<int64_t> tokens_per_expert(o.num_experts, 0);
  for (int s = 0; s < R; ++s) {
    for (int d = 0; d < R; ++d) {
      sent[s][d] = layout[s].num_tokens_per_rank[d];
      recv_rows[d] += sent[s][d];
    }
    for (int e = 0; e < o.num_experts; ++e) tokens_per_expert[e] += layout[s].num_tokens_per_expert[e];
  }
  const int64_t max_recv = std::max<int64_t>(1, *std::max_element(recv_rows.begin(), recv_rows.end()));

  DemoShared shared(R);
  std::vector<std::string> failures(R);
  InprocWorld world(*topo);
  const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
    const int rank = t.rank();
    const auto deadline = [] { return Deadline::after(std::chrono::seconds(30)); };
    AlignedBuffer x(std::max<std::size_t>(static_cast<std::size_t>(T) * row_bytes, 1));
    AlignedBuffer out(std::max<std::size_t>(static_cast<std::size_t>(T) * row_bytes, 1), kCacheLine, true);
    for (int tok = 0; tok < T; ++tok)
      for (int64_t c = 0; c < H; ++c) store_from_f32(x.data() + tok * row_bytes, dtype, c, pattern(rank, tok, c));
    shared.x[rank] = x.data();
    const TensorView xv = TensorView::contiguous(x.data(), dtype, {T, H});
    const TensorView outv = TensorView::contiguous(out.data(), dtype, {T, H});
    EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, BufferConfig{.num_experts = o.num_experts,
                                                                     .hidden = o.hidden,
                                                                     .dtype = dtype,
                                                                     .max_topk = o.topk,
                                                                     .max_tokens_per_rank = std::max(T, 1),
                                                                     .max_recv_tokens = max_recv,
                                                                     .max_combine_dtype = dtype,
                                                                     .placement = *placement}));
    if (rank == 0) shared.hierarchical = buffer->hierarchical();
    const DispatchInputs inputs{.x = xv, .topk_idx = routing[rank].idx(), .topk_weights = routing[rank].weights()};
    DispatchResult recv;
    // Times `op` from a common start to the last rank's end.
    auto timed = [&](std::vector<double>* samples, auto&& op) -> Status {
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
    };
    for (int rep = 0; rep <= o.reps; ++rep) {  // rep 0 is the warm-up, and is checked
      const bool first = rep == 0;
      EPX_RETURN_IF_ERROR(timed(first ? nullptr : &shared.dispatch_ms, [&] { return buffer->dispatch(inputs, &recv); }));
      if (first) {
        shared.inter_node_bytes[rank] = recv.stats.inter_node_payload_bytes;
        shared.intra_node_bytes[rank] = recv.stats.intra_node_payload_bytes;
        // Every received row is its source's row, in (source rank, token) order.
        if (recv.recv_x.size(0) != recv_rows[rank] && failures[rank].empty())
          failures[rank] = fmt::format("rank {} received {} rows, the layout says {}", rank, recv.recv_x.size(0),
                                       recv_rows[rank]);
        int64_t prev = -1;
        for (int64_t i = 0; i < recv.recv_x.size(0) && failures[rank].empty(); ++i) {
          const int s = recv.recv_src_rank.data_as<const int32_t>()[i];
          const int tok = recv.recv_src_idx.data_as<const int32_t>()[i];
          const int64_t key = static_cast<int64_t>(s) * std::max(T, 1) + tok;
          if (s < 0 || s >= R || tok < 0 || tok >= T || key <= prev || !layout[s].in_rank(tok, rank) ||
              std::memcmp(recv.recv_x.row(i), shared.x[s] + tok * row_bytes, row_bytes) != 0)
            failures[rank] = fmt::format("rank {} row {} (from rank {}, token {}) is misrouted, out of order or corrupt",
                                         rank, i, s, tok);
          prev = key;
        }
      }
      // y = recv_x: combine must give x times the number of ranks each token reached.
      if (first) std::memset(out.data(), 0, out.size());
      EPX_RETURN_IF_ERROR(timed(first ? nullptr : &shared.combine_ms,
                                [&] { return buffer->combine(recv.recv_x, recv.handle, outv); }));
      if (first) {
        for (int tok = 0; tok < T && failures[rank].empty(); ++tok) {
          int reached = 0;
          for (int r = 0; r < R; ++r) reached += layout[rank].in_rank(tok, r);
          for (int64_t c = 0; c < H; ++c) {
            const float want = load_as_f32(x.data() + tok * row_bytes, dtype, c) * static_cast<float>(reached);
            const float want_stored = dtype == DType::kBF16 ? bf16_to_f32(f32_to_bf16(want)) : want;
            const float got = load_as_f32(out.data() + tok * row_bytes, dtype, c);
            if (got != want_stored) {
              failures[rank] = fmt::format("rank {}: combine gave out[{}][{}] = {}, expected {} (x times {} ranks)",
                                           rank, tok, c, got, want_stored, reached);
              break;
            }
          }
        }
      }
    }
    return t.barrier(deadline());
  });
  const Status status = first_error(statuses);
  if (!status.is_ok()) {
    fmt::print(stderr, "epx demo: the exchange failed: {}\n", status.to_string());
    return kExitFailed;
  }

  std::string failure;
  for (const std::string& f : failures)
    if (!f.empty()) {
      failure = f;
      break;
    }
  const int64_t total_rows = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  const double bytes = static_cast<double>(total_rows) * static_cast<double>(row_bytes);
  const double dispatch_ms = median(shared.dispatch_ms);
  const double combine_ms = median(shared.combine_ms);
  auto gbps_per_rank = [&](double ms) { return ms > 0 ? bytes / R / (ms * 1e-3) / 1e9 : 0.0; };
  const int64_t inter = std::accumulate(shared.inter_node_bytes.begin(), shared.inter_node_bytes.end(), int64_t{0});
  const int64_t intra = std::accumulate(shared.intra_node_bytes.begin(), shared.intra_node_bytes.end(), int64_t{0});

  if (o.json) {
    nlohmann::json j;
    j["config"] = {{"ranks", R},          {"nodes", o.num_nodes}, {"tokens", T},      {"hidden", H},
                   {"experts", o.num_experts}, {"topk", o.topk}, {"skew", o.skew}, {"seed", o.seed},
                   {"dtype", std::string(dtype_name(dtype))}, {"reps", o.reps}};
    j["hierarchical"] = shared.hierarchical;
    j["rows_sent"] = sent;
    j["recv_rows"] = recv_rows;
    j["tokens_per_expert"] = tokens_per_expert;
    j["imbalance"] = {{"recv_rows", imbalance(recv_rows)}, {"tokens_per_expert", imbalance(tokens_per_expert)}};
    j["dispatch"] = {{"time_ms", dispatch_ms}, {"gbps", gbps_per_rank(dispatch_ms)}};
    j["combine"] = {{"time_ms", combine_ms}, {"gbps", gbps_per_rank(combine_ms)}};
    j["payload_bytes"] = {{"intra_node", intra}, {"inter_node", inter}};
    j["round_trip"] = failure.empty() ? "OK" : "FAILED";
    if (!failure.empty()) j["error"] = failure;
    fmt::print("{}\n", j.dump(2));
    return failure.empty() ? kExitOk : kExitFailed;
  }

  fmt::print("epx demo: {} ranks ({}), {} tokens/rank, hidden {} {}, {} experts ({} per rank), top-{}, skew {}, seed {}\n",
             R, topo->describe(), T, H, dtype_name(dtype), o.num_experts, o.num_experts / R, o.topk, o.skew, o.seed);
  fmt::print("path: {}\n\n", shared.hierarchical ? "two-hop (across nodes once per destination node, then inside)"
                                                 : "flat (every (token, rank) pair copied directly)");
  fmt::print("rows sent (a token counts once per destination rank):\n");
  fmt::print("{:>10}", "from \\ to");
  for (int d = 0; d < R; ++d) fmt::print("{:>7}", fmt::format("r{}", d));
  fmt::print("{:>8}\n", "total");
  for (int s = 0; s < R; ++s) {
    fmt::print("{:>10}", fmt::format("r{}", s));
    for (int d = 0; d < R; ++d) fmt::print("{:>7}", sent[s][d]);
    fmt::print("{:>8}\n", std::accumulate(sent[s].begin(), sent[s].end(), int64_t{0}));
  }
  fmt::print("{:>10}", "received");
  for (int d = 0; d < R; ++d) fmt::print("{:>7}", recv_rows[d]);
  fmt::print("{:>8}\n\n", total_rows);
  fmt::print("received rows per rank: imbalance max/mean {:.2f}\n", imbalance(recv_rows));
  fmt::print("tokens per expert:");
  for (int e = 0; e < o.num_experts; ++e) fmt::print("{}e{} {}", e % 8 == 0 ? "\n  " : "  ", e, tokens_per_expert[e]);
  fmt::print("\n  imbalance max/mean {:.2f}\n\n", imbalance(tokens_per_expert));
  if (o.num_nodes > 1)
    fmt::print("dispatch payload: {} bytes copied inside nodes, {} bytes sent between nodes\n", intra, inter);
  fmt::print("dispatch: {:.3f} ms, {:.2f} GB/s per rank (logical: received rows x {} B / time, median of {})\n",
             dispatch_ms, gbps_per_rank(dispatch_ms), row_bytes, o.reps);
  fmt::print("combine:  {:.3f} ms, {:.2f} GB/s per rank\n", combine_ms, gbps_per_rank(combine_ms));
  if (failure.empty()) {
    fmt::print("round trip: OK (every received row matches its source; combine(recv_x) == x * ranks reached)\n");
    return kExitOk;
  }
  fmt::print("round trip: FAILED: {}\n", failure);
  return kExitFailed;
}

}  // namespace epx::app
