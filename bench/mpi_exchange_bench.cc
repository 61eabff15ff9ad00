// The MPI backend's dispatch and combine against what an MPI user would
// otherwise run, in one run (`mpirun -n R epx_mpi_exchange_bench`):
//
//   epx        Buffer::dispatch / Buffer::combine on the MPI transport;
//   alltoallv  MPI_Alltoallv of exactly the bytes the dispatch delivers
//              (rows already packed by destination: the bare data movement);
//   naive      the pack / all-to-all-v / unpack dispatcher (Megatron-style):
//              one copy of a token per (token, expert) pair, packed by
//              destination rank and local expert, counts by MPI_Alltoall,
//              payload by MPI_Alltoallv, re-sorted expert-major; its combine
//              reverses the sort, sends the rows back and sums them weighted
//              in top-k order (fp32).
//
// Methods are interleaved in each repetition; each time is the slowest
// rank's, after a barrier; medians over repetitions. Logical bandwidth is
// DeepEP's per-rank figure: the dispatch's received row bytes per rank over
// the time (the same bytes for every method). Rank 0 then runs the
// in-process backend on the same shape with R threads (`epx bench
// exchange`'s code) while the other processes wait, for the in-process rate.
//
// --lowlat: instead, the low-latency benchmark (`epx bench lowlat`'s, on these
// processes): LowLatencyBuffer against the normal Buffer at --lowlat-tokens.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "epx/comm/mpi.h"
#include "epx/core/buffer.h"
#include "epx/core/dtype.h"
#include "epx/exchange/buffer.h"
#include "epx/exchange/layout.h"
#include "exchange_bench.h"
#include "lowlat_bench.h"
#include "mpi_launch.h"
#include "synthetic_routing.h"

namespace epx::bench {
namespace {

struct Options {
  int tokens = 1024;
  int hidden = 7168;
  int experts = 256;
  int topk = 8;
  int nodes = 1;
  int reps = 7;
  std::string dtype = "bf16";
  uint64_t seed = 1;
  bool inproc = true;
  bool json = false;
  bool phases = false;
  bool epx_only = false;
  bool lowlat = false;
  std::vector<int> lowlat_tokens = {1, 8, 32, 128};
  int capacity = 0;
  bool lowlat_combine_per_rank = false;
  bool fp8 = false;
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// --lowlat: the low-latency benchmark on these processes; rank 0 prints.
int run_lowlat(Transport& t, const Options& o) {
  LowLatBenchConfig c;
  c.tokens = o.lowlat_tokens;
  c.hidden = o.hidden;
  c.num_experts = o.experts;
  c.topk = o.topk;
  c.dtype = o.dtype == "f32" ? DType::kF32 : DType::kBF16;
  c.reps = o.reps;
  c.capacity = o.capacity;
  c.combine_per_rank = o.lowlat_combine_per_rank;
  c.seed = o.seed;
  auto rows = run_lowlat_bench_on(t, c, [](const std::string& line) { fmt::print(stderr, "  {}\n", line); });
  if (!rows.is_ok()) {
    fmt::print(stderr, "rank {}: {}\n", t.rank(), rows.status().to_string());
    t.abort(rows.status());
    return 1;
  }
  if (t.rank() != 0) return 0;
  fmt::print("# low-latency vs normal: {} ranks / {} nodes, hidden {}, top-{} of {}, {}; {} reps (median; last end - "
             "first start)\n",
             t.num_ranks(), t.topology().num_nodes(), o.hidden, o.topk, o.experts, o.dtype, o.reps);
  fmt::print("{:>6} {:>4} {:>12} {:>12} {:>6} {:>12} {:>12} {:>6} {:>16} {:>16}\n", "tokens", "cap", "disp normal",
             "disp lowlat", "ratio", "comb normal", "comb lowlat", "ratio", "cpu disp n/ll", "cpu comb n/ll");
  for (const LowLatBenchRow& r : *rows) {
    fmt::print("{:>6} {:>4} {:>9.3f} ms {:>9.3f} ms {:>5.2f}x {:>9.3f} ms {:>9.3f} ms {:>5.2f}x {:>7.2f} / {:<6.2f} "
               "{:>7.2f} / {:<6.2f}\n",
               r.tokens, r.capacity, r.normal_dispatch.time_ms, r.lowlat_dispatch.time_ms, r.dispatch_speedup,
               r.normal_combine.time_ms, r.lowlat_combine.time_ms, r.combine_speedup, r.normal_dispatch.cpu_ms,
               r.lowlat_dispatch.cpu_ms, r.normal_combine.cpu_ms, r.lowlat_combine.cpu_ms);
    if (o.json)
      fmt::print("{{\"benchmark\":\"lowlat\",\"ranks\":{},\"nodes\":{},\"tokens\":{},\"capacity\":{},\"pairs\":{},\"rows\":{},"
                 "\"normal_dispatch_ms\":{:.4f},\"lowlat_dispatch_ms\":{:.4f},\"normal_combine_ms\":{:.4f},"
                 "\"lowlat_combine_ms\":{:.4f}}}\n",
                 t.num_ranks(), t.topology().num_nodes(), r.tokens, r.capacity, r.pairs, r.rows, r.normal_dispatch.time_ms,
                 r.lowlat_dispatch.time_ms, r.normal_combine.time_ms, r.lowlat_combine.time_ms);
  }
  return 0;
}

// The naive dispatcher's routes, kept from dispatch for combine.
struct Naive {
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;  // bytes, per rank
  std::vector<int> chunk_send, chunk_recv;  // rows per (rank, local expert) slot
  std::vector<int64_t> slot_row;            // [T, K] send row of (t, k), -1 none
  AlignedBuffer send, recv, sorted;
  int max_local = 0;
};

int run(int argc, char** argv) {
  Options o;
  CLI::App app{"MPI-backend dispatch/combine vs MPI_Alltoallv and a naive pack/all-to-all-v/unpack; run under mpirun"};
  app.add_option("--tokens", o.tokens, "Tokens per rank")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--hidden", o.hidden, "Elements per row")->check(CLI::Range(4, 1 << 20))->capture_default_str();
  app.add_option("--experts", o.experts, "Experts")->check(CLI::Range(1, 65536))->capture_default_str();
  app.add_option("--topk", o.topk, "Experts per token")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--nodes", o.nodes, "Nodes: 1 = the real hosts; more = emulated nodes")->capture_default_str();
  app.add_option("--reps", o.reps, "Timed repetitions")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--dtype", o.dtype, "Payload")->check(CLI::IsMember({"bf16", "f32"}))->capture_default_str();
  app.add_option("--seed", o.seed, "Routing seed")->capture_default_str();
  app.add_flag("!--no-inproc", o.inproc, "Skip the in-process run of the same shape");
  app.add_flag("--json", o.json, "Also print one JSON line");
  app.add_flag("--epx-only", o.epx_only,
               "Only epx's dispatch and combine (no baselines, no in-process run), and print the bytes that crossed "
               "nodes next to the (token, destination node) pairs times the row size");
  app.add_flag("--lowlat", o.lowlat, "Run the low-latency benchmark instead (LowLatencyBuffer vs Buffer)");
  app.add_option("--lowlat-tokens", o.lowlat_tokens, "--lowlat: tokens per rank")->delimiter(',')->capture_default_str();
  app.add_flag("--lowlat-combine-per-rank", o.lowlat_combine_per_rank,
               "--lowlat: low-latency combine with one row per (token, rank), summed by the expert's rank");
  app.add_option("--capacity", o.capacity, "--lowlat: rows per (local expert, source); 0 = the routing's largest")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--fp8", o.fp8,
               "Also time an fp8 dispatch of the same rows (e4m3, f32 scales, quantised on send), interleaved, and "
               "print its time and inter-node bytes against the dispatch of --dtype");
  app.add_flag("--phases", o.phases, "Print rank 0's time per exchange phase (tracer spans of the timed reps)");
  CLI11_PARSE(app, argc, argv);

  std::unique_ptr<MpiSession> session;
  std::unique_ptr<Transport> connected;
  if (const int code = connect_mpi_rank(&argc, &argv, o.nodes, &session, &connected); code != 0) return code;
  if (o.lowlat) return run_lowlat(*connected, o);
  const int R = session->world_size();
  int exit_code = 0;
  {
    Transport& t = *connected;
    const int rank = t.rank();
    const DType dtype = o.dtype == "f32" ? DType::kF32 : DType::kBF16;
    const std::size_t row = static_cast<std::size_t>(o.hidden) * dtype_size(dtype);
    const int T = o.tokens, K = o.topk, E = o.experts;
    // A failure on one rank while others sit in a blocking MPI call of the
    // baselines: end the job.
    auto fail = [&](const Status& s) {
      fmt::print(stderr, "rank {}: {}\n", rank, s.to_string());
      t.abort(s);
      MPI_Abort(MPI_COMM_WORLD, 1);
      return 1;
    };
    auto placement = ExpertPlacement::contiguous(E, R);
    if (!placement.is_ok()) return fail(placement.status());
    const RoutingSpec spec{.num_tokens = T, .num_experts = E, .topk = K, .skew = 0.0, .seed = o.seed};
    // Every rank's layout (cheap), for the receive sizes.
    std::vector<int64_t> recv_rows(R, 0);
    RankRouting mine;
    DispatchLayout my_layout;
    for (int r = 0; r < R; ++r) {
      auto routing = make_routing(spec, r);
      if (!routing.is_ok()) return fail(routing.status());
      auto layout = compute_layout(routing->idx(), *placement, t.topology());
      if (!layout.is_ok()) return fail(layout.status());
      for (int d = 0; d < R; ++d) recv_rows[d] += layout->num_tokens_per_rank[d];
      if (r == rank) {
        mine = std::move(routing).value();
        my_layout = std::move(layout).value();
      }
    }
    const int64_t max_recv = *std::max_element(recv_rows.begin(), recv_rows.end());
    AlignedBuffer x(std::max<std::size_t>(T * row, 64));
    for (int i = 0; i < T; ++i)
      for (int c = 0; c < o.hidden; ++c) store_from_f32(x.data() + i * row, dtype, c, 0.001f * ((i * 7 + c + rank) % 997));
    const TensorView xv = TensorView::contiguous(x.data(), dtype, {T, o.hidden});
    AlignedBuffer out(std::max<std::size_t>(T * row, 64));
    Tracer tracer;  // --phases: rank 0's Buffer spans
    const TensorView outv = TensorView::contiguous(out.data(), dtype, {T, o.hidden});

    auto buffer = Buffer::create(t, BufferConfig{.num_experts = E, .hidden = o.hidden, .dtype = dtype, .max_topk = K,
                                                 .max_tokens_per_rank = T, .max_recv_tokens = max_recv,
                                                 .max_combine_dtype = dtype, .placement = *placement,
                                                 .timeout = Milliseconds(600000),
                                                 .tracer = o.phases && rank == 0 ? &tracer : nullptr});
    if (!buffer.is_ok()) return fail(buffer.status());
    // Across nodes, the flat algorithm too (one copy per (token, destination
    // rank) over the network), to compare with two-hop in the same run.
    const bool multi_node = t.topology().num_nodes() > 1;
    std::unique_ptr<Buffer> flat;
    if (multi_node) {
      auto made = Buffer::create(t, BufferConfig{.num_experts = E, .hidden = o.hidden, .dtype = dtype, .max_topk = K,
                                                 .max_tokens_per_rank = T, .max_recv_tokens = max_recv,
                                                 .max_combine_dtype = dtype, .placement = *placement,
                                                 .algorithm = DispatchAlgorithm::kFlat,
                                                 .timeout = Milliseconds(600000)});
      if (!made.is_ok()) return fail(made.status());
      flat = std::move(made).value();
    }
    std::unique_ptr<Buffer> fp8;
    if (o.fp8) {
      auto made = Buffer::create(t, BufferConfig{.num_experts = E, .hidden = o.hidden, .dtype = DType::kFP8E4M3,
                                                 .max_topk = K, .max_tokens_per_rank = T, .max_recv_tokens = max_recv,
                                                 .max_combine_dtype = dtype, .placement = *placement,
                                                 .timeout = Milliseconds(600000)});
      if (!made.is_ok()) return fail(made.status());
      fp8 = std::move(made).value();
    }

    // The baselines run on a communicator numbered like epx's ranks
    // (node-major), so their traffic matches the layouts whatever order the
    // launcher used.
    MPI_Comm bcomm = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, 0, rank, &bcomm);
    // alltoallv: the dispatch's bytes, packed by destination once.
    std::vector<int> a_sc(R), a_sd(R), a_rc(R), a_rd(R);
    {
      int at = 0;
      for (int d = 0; d < R; ++d) {
        a_sc[d] = static_cast<int>(my_layout.num_tokens_per_rank[d] * row);
        a_sd[d] = at;
        at += a_sc[d];
      }
    }
    MPI_Alltoall(a_sc.data(), 1, MPI_INT, a_rc.data(), 1, MPI_INT, bcomm);
    {
      int at = 0;
      for (int s = 0; s < R; ++s) {
        a_rd[s] = at;
        at += a_rc[s];
      }
    }
    AlignedBuffer a_send(std::max<std::size_t>(static_cast<std::size_t>(a_sd[R - 1]) + a_sc[R - 1], 64));
    AlignedBuffer a_recv(std::max<std::size_t>(static_cast<std::size_t>(max_recv) * row, 64));

    // naive: sizes of the (token, expert) copies.
    Naive n;
    n.max_local = 0;
    for (int r = 0; r < R; ++r) n.max_local = std::max(n.max_local, placement->num_local_experts(r));
    const int slots = R * n.max_local;
    n.chunk_send.assign(slots, 0);
    n.slot_row.assign(static_cast<std::size_t>(T) * K, -1);
    for (int i = 0; i < T * K; ++i) {
      const int e = mine.topk_idx[i];
      if (e >= 0) ++n.chunk_send[placement->rank_of(e) * n.max_local + placement->local_id(e)];
    }
    n.chunk_recv.assign(slots, 0);
    MPI_Alltoall(n.chunk_send.data(), n.max_local, MPI_INT, n.chunk_recv.data(), n.max_local, MPI_INT, bcomm);
    int64_t naive_send_rows = 0, naive_recv_rows = 0;
    for (int v : n.chunk_send) naive_send_rows += v;
    for (int v : n.chunk_recv) naive_recv_rows += v;
    int64_t naive_rows_total_all = naive_send_rows;
    MPI_Allreduce(MPI_IN_PLACE, &naive_rows_total_all, 1, MPI_INT64_T, MPI_SUM, bcomm);
    int64_t naive_max = std::max(naive_send_rows, naive_recv_rows);
    MPI_Allreduce(MPI_IN_PLACE, &naive_max, 1, MPI_INT64_T, MPI_MAX, bcomm);
    n.send = AlignedBuffer(std::max<std::size_t>(naive_max * row, 64));
    n.recv = AlignedBuffer(std::max<std::size_t>(naive_max * row, 64));
    n.sorted = AlignedBuffer(std::max<std::size_t>(naive_max * row, 64));
    n.send_counts.assign(R, 0), n.send_displs.assign(R, 0), n.recv_counts.assign(R, 0), n.recv_displs.assign(R, 0);

    auto naive_dispatch = [&]() {
      // Pack by (destination rank, local expert, token); counts by all-to-all.
      std::vector<int> chunk_offset(slots, 0);
      std::fill(n.chunk_send.begin(), n.chunk_send.end(), 0);
      for (int i = 0; i < T * K; ++i) {
        const int e = mine.topk_idx[i];
        if (e >= 0) ++n.chunk_send[placement->rank_of(e) * n.max_local + placement->local_id(e)];
      }
      for (int s = 0, at = 0; s < slots; ++s) {
        chunk_offset[s] = at;
        at += n.chunk_send[s];
      }
      for (int i = 0; i < T; ++i)
        for (int k = 0; k < K; ++k) {
          const int e = mine.topk_idx[i * K + k];
          if (e < 0) continue;
          const int slot = placement->rank_of(e) * n.max_local + placement->local_id(e);
          const int64_t r = chunk_offset[slot]++;
          n.slot_row[i * K + k] = r;
          std::memcpy(n.send.data() + r * row, x.data() + i * row, row);
        }
      MPI_Alltoall(n.chunk_send.data(), n.max_local, MPI_INT, n.chunk_recv.data(), n.max_local, MPI_INT,
                   bcomm);
      for (int d = 0, s_at = 0, r_at = 0; d < R; ++d) {
        int sr = 0, rr = 0;
        for (int j = 0; j < n.max_local; ++j) {
          sr += n.chunk_send[d * n.max_local + j];
          rr += n.chunk_recv[d * n.max_local + j];
        }
        n.send_counts[d] = static_cast<int>(sr * row);
        n.send_displs[d] = static_cast<int>(s_at * row);
        n.recv_counts[d] = static_cast<int>(rr * row);
        n.recv_displs[d] = static_cast<int>(r_at * row);
        s_at += sr;
        r_at += rr;
      }
      MPI_Alltoallv(n.send.data(), n.send_counts.data(), n.send_displs.data(), MPI_BYTE, n.recv.data(),
                    n.recv_counts.data(), n.recv_displs.data(), MPI_BYTE, bcomm);
      // Source-major chunks -> expert-major.
      std::byte* to = n.sorted.data();
      for (int j = 0; j < n.max_local; ++j)
        for (int s = 0; s < R; ++s) {
          std::size_t before = 0;
          for (int jj = 0; jj < j; ++jj) before += n.chunk_recv[s * n.max_local + jj];
          const std::size_t bytes = n.chunk_recv[s * n.max_local + j] * row;
          std::memcpy(to, n.recv.data() + n.recv_displs[s] + before * row, bytes);
          to += bytes;
        }
    };
    auto naive_combine = [&]() {
      // Expert-major -> source-major, send back, weighted sum in top-k order.
      const std::byte* from = n.sorted.data();
      for (int j = 0; j < n.max_local; ++j)
        for (int s = 0; s < R; ++s) {
          std::size_t before = 0;
          for (int jj = 0; jj < j; ++jj) before += n.chunk_recv[s * n.max_local + jj];
          const std::size_t bytes = n.chunk_recv[s * n.max_local + j] * row;
          std::memcpy(n.recv.data() + n.recv_displs[s] + before * row, from, bytes);
          from += bytes;
        }
      MPI_Alltoallv(n.recv.data(), n.recv_counts.data(), n.recv_displs.data(), MPI_BYTE, n.send.data(),
                    n.send_counts.data(), n.send_displs.data(), MPI_BYTE, bcomm);
      std::vector<float> acc(o.hidden);
      for (int i = 0; i < T; ++i) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int k = 0; k < K; ++k) {
          const int64_t r = n.slot_row[i * K + k];
          if (r < 0) continue;
          const float w = mine.topk_weights[i * K + k];
          const std::byte* src = n.send.data() + r * row;
          // Typed inner loops, so the compiler vectorizes them as a user's code would be.
          if (dtype == DType::kBF16) {
            const auto* v = reinterpret_cast<const uint16_t*>(src);
            for (int c = 0; c < o.hidden; ++c) acc[c] += w * bf16_to_f32(v[c]);
          } else {
            const auto* v = reinterpret_cast<const float*>(src);
            for (int c = 0; c < o.hidden; ++c) acc[c] += w * v[c];
          }
        }
        if (dtype == DType::kBF16) {
          auto* v = reinterpret_cast<uint16_t*>(out.data() + i * row);
          for (int c = 0; c < o.hidden; ++c) v[c] = f32_to_bf16(acc[c]);
        } else {
          std::memcpy(out.data() + i * row, acc.data(), row);
        }
      }
    };

    enum {
      kDispatch, kCombine, kFlatDispatch, kFlatCombine, kAlltoallv, kNaiveDispatch, kNaiveCombine, kFp8Dispatch,
      kMethods
    };
    const char* names[kMethods] = {"epx dispatch", "epx combine", "epx flat dispatch", "epx flat combine",
                                   "MPI_Alltoallv (same bytes)", "naive dispatch", "naive combine",
                                   "epx fp8 dispatch"};
    const char* keys[kMethods] = {"dispatch", "combine", "flat_dispatch", "flat_combine", "alltoallv",
                                  "naive_dispatch", "naive_combine", "fp8_dispatch"};
    std::vector<std::vector<double>> samples(kMethods);
    std::vector<int64_t> inter_node(kMethods, 0);  // bytes this rank sent to other nodes, timed reps
    int64_t dispatch_payload = 0, dispatch_meta = 0;  // from ExchangeStats, timed reps
    DispatchResult recv;
    const DispatchInputs inputs{.x = xv, .topk_idx = mine.idx(), .topk_weights = mine.weights()};
    TensorView y;
    auto timed = [&](int method, auto&& op) -> Status {
      MPI_Barrier(bcomm);
      const uint64_t before = t.counters().inter_node_bytes;
      const double start = now_ms();
      EPX_RETURN_IF_ERROR(op());
      double ms = now_ms() - start;
      MPI_Allreduce(MPI_IN_PLACE, &ms, 1, MPI_DOUBLE, MPI_MAX, bcomm);
      if (method >= 0) {
        samples[method].push_back(ms);
        inter_node[method] += static_cast<int64_t>(t.counters().inter_node_bytes - before);
      }
      return Status::ok();
    };
    // Naive and MPI_Alltoallv bytes to other nodes: what this rank sends there.
    int64_t naive_remote_rows = 0, alltoallv_remote_bytes = 0;
    for (int d = 0; d < R; ++d) {
      if (t.topology().same_node(d, rank)) continue;
      alltoallv_remote_bytes += a_sc[d];
      for (int j = 0; j < n.max_local; ++j) naive_remote_rows += n.chunk_send[d * n.max_local + j];
    }
    DispatchResult flat_recv, fp8_recv;
    for (int rep = -1; rep < o.reps; ++rep) {  // rep -1: warm-up
      const bool warm = rep >= 0;
      if (rep == 0) tracer.clear();
      Status s = timed(warm ? kDispatch : -1, [&] { return (*buffer)->dispatch(inputs, &recv); });
      if (s.is_ok() && warm) {
        dispatch_payload += recv.stats.inter_node_payload_bytes;
        dispatch_meta += recv.stats.inter_node_meta_bytes;
      }
      if (s.is_ok()) {
        auto input = (*buffer)->combine_input(recv.handle, dtype);
        if (!input.is_ok()) return fail(input.status());
        y = *input;
        if (!warm) std::memcpy(y.data(), recv.recv_x.data(), recv.recv_x.size(0) * row);
        s = timed(warm ? kCombine : -1, [&] { return (*buffer)->combine(y, recv.handle, outv); });
      }
      if (s.is_ok() && fp8) s = timed(warm ? kFp8Dispatch : -1, [&] { return fp8->dispatch(inputs, &fp8_recv); });
      if (s.is_ok() && flat) {
        s = timed(warm ? kFlatDispatch : -1, [&] { return flat->dispatch(inputs, &flat_recv); });
        if (s.is_ok()) {
          auto input = flat->combine_input(flat_recv.handle, dtype);
          if (!input.is_ok()) return fail(input.status());
          if (!warm) std::memcpy(input->data(), flat_recv.recv_x.data(), flat_recv.recv_x.size(0) * row);
          s = timed(warm ? kFlatCombine : -1, [&] { return flat->combine(*input, flat_recv.handle, outv); });
        }
      }
      if (o.epx_only) {
        if (!s.is_ok()) return fail(s);
        continue;
      }
      if (s.is_ok())
        s = timed(warm ? kAlltoallv : -1, [&] {
          MPI_Alltoallv(a_send.data(), a_sc.data(), a_sd.data(), MPI_BYTE, a_recv.data(), a_rc.data(), a_rd.data(),
                        MPI_BYTE, bcomm);
          return Status::ok();
        });
      if (s.is_ok()) s = timed(warm ? kNaiveDispatch : -1, [&] { naive_dispatch(); return Status::ok(); });
      if (s.is_ok()) s = timed(warm ? kNaiveCombine : -1, [&] { naive_combine(); return Status::ok(); });
      if (!s.is_ok()) return fail(s);
      if (warm) {
        inter_node[kAlltoallv] += alltoallv_remote_bytes;
        inter_node[kNaiveDispatch] += naive_remote_rows * static_cast<int64_t>(row);
        inter_node[kNaiveCombine] += naive_remote_rows * static_cast<int64_t>(row);
      }
    }
    // Totals over ranks.
    MPI_Allreduce(MPI_IN_PLACE, inter_node.data(), kMethods, MPI_INT64_T, MPI_SUM, bcomm);
    int64_t dispatch_bytes[2] = {dispatch_payload, dispatch_meta};
    MPI_Allreduce(MPI_IN_PLACE, dispatch_bytes, 2, MPI_INT64_T, MPI_SUM, bcomm);
    // (token, destination node) pairs that leave their node, over all ranks.
    int64_t remote_pairs = 0;
    for (int node = 0; node < t.topology().num_nodes(); ++node)
      if (node != t.node()) remote_pairs += my_layout.num_tokens_per_node[node];
    MPI_Allreduce(MPI_IN_PLACE, &remote_pairs, 1, MPI_INT64_T, MPI_SUM, bcomm);
    // Every message byte epx sent to another node in this run, warm-up included.
    int64_t run_inter_node = static_cast<int64_t>(t.counters().inter_node_bytes);
    MPI_Allreduce(MPI_IN_PLACE, &run_inter_node, 1, MPI_INT64_T, MPI_SUM, bcomm);
    if (o.phases && rank == 0)
      for (const PhaseSummary& p : summarize_phases(tracer))
        fmt::print("phase {:<18} mean {:8.3f} ms  max {:8.3f} ms  ({} calls)\n", p.name, p.mean_ms, p.max_ms, p.count);
    int64_t total_recv = 0;
    for (int64_t v : recv_rows) total_recv += v;
    const double logical = static_cast<double>(total_recv) / R * static_cast<double>(row);  // bytes per rank
    double inproc_ms[2] = {0, 0};
    if (o.inproc && !o.epx_only) {
      // Rank 0 runs the in-process backend on the same shape; the others wait.
      if (rank == 0) {
        ExchangeBenchConfig c;
        c.num_ranks = R;
        c.num_nodes = t.topology().num_nodes();
        c.num_tokens = T;
        c.hidden = o.hidden;
        c.num_experts = E;
        c.topk = K;
        c.dtype = dtype;
        c.reps = o.reps;
        c.seed = o.seed;
        auto result = run_exchange_bench(c);
        if (result.is_ok()) {
          inproc_ms[0] = result->dispatch.time_ms;
          inproc_ms[1] = result->combine.time_ms;
        } else {
          fmt::print(stderr, "in-process run: {}\n", result.status().to_string());
        }
      }
      const Status waited = t.barrier(Deadline::after(std::chrono::minutes(30)));
      if (!waited.is_ok()) return fail(waited);
    }
    if (rank == 0) {
      fmt::print("MPI backend, {} processes ({}), {} tokens/rank, hidden {}, top-{} of {} experts, {}; {} ({} reps, "
                 "medians; logical bytes/rank {:.1f} MB)\n",
                 R, t.topology().describe(), T, o.hidden, K, E, o.dtype, session->library_version(), o.reps,
                 logical / 1e6);
      fmt::print("{:<28} {:>10} {:>10} {:>16}\n", "method", "ms", "GB/s", "inter-node MB");
      std::string json = fmt::format("{{\"ranks\":{},\"nodes\":{},\"tokens\":{},\"hidden\":{},\"topk\":{},\"experts\":{}",
                                     R, t.topology().num_nodes(), T, o.hidden, K, E);
      for (int m = 0; m < kMethods; ++m) {
        if (samples[m].empty()) continue;
        const double ms = median(samples[m]);
        const double mb = static_cast<double>(inter_node[m]) / static_cast<double>(samples[m].size()) / 1e6;
        fmt::print("{:<28} {:>10.3f} {:>10.2f} {:>16.2f}\n", names[m], ms, logical / (ms * 1e6), mb);
        json += fmt::format(",\"{}_ms\":{:.4f},\"{}_inter_node_bytes\":{}", keys[m], ms, keys[m],
                            inter_node[m] / static_cast<int64_t>(samples[m].size()));
      }
      fmt::print("rows moved per rank: epx dispatch {:.0f} (one per (token, rank)), naive {:.0f} (one per (token, "
                 "expert))\n",
                 static_cast<double>(total_recv) / R, static_cast<double>(naive_rows_total_all) / R);
      if (multi_node)
        fmt::print("inter_node_dispatch pairs={} row_bytes={} dispatches={} payload_bytes={} meta_bytes={} "
                   "expected_payload_bytes={} run_inter_node_message_bytes={}\n",
                   remote_pairs, row, samples[kDispatch].size(), dispatch_bytes[0], dispatch_bytes[1],
                   remote_pairs * static_cast<int64_t>(row) * static_cast<int64_t>(samples[kDispatch].size()),
                   run_inter_node);
      if (o.inproc && !o.epx_only) {
        fmt::print("{:<28} {:>10.3f} {:>10.2f}\n", "in-process dispatch", inproc_ms[0], logical / (inproc_ms[0] * 1e6));
        fmt::print("{:<28} {:>10.3f} {:>10.2f}\n", "in-process combine", inproc_ms[1], logical / (inproc_ms[1] * 1e6));
        json += fmt::format(",\"inproc_dispatch_ms\":{:.4f},\"inproc_combine_ms\":{:.4f}", inproc_ms[0], inproc_ms[1]);
      }
      const double d = median(samples[kDispatch]), c = median(samples[kCombine]);
      if (multi_node)
        fmt::print("two-hop vs flat: dispatch {:.2f}x faster, {:.2f}x fewer inter-node bytes; combine {:.2f}x faster\n",
                   median(samples[kFlatDispatch]) / d,
                   static_cast<double>(inter_node[kFlatDispatch]) / std::max<double>(1.0, inter_node[kDispatch]),
                   median(samples[kFlatCombine]) / c);
      if (fp8)
        fmt::print("fp8 vs {} dispatch: time {:.3f}x, inter-node bytes {:.3f}x\n", o.dtype,
                   median(samples[kFp8Dispatch]) / d,
                   static_cast<double>(inter_node[kFp8Dispatch]) / std::max<double>(1.0, inter_node[kDispatch]));
      if (o.epx_only) {
        if (o.json) fmt::print("{}}}\n", json);
        return exit_code;
      }
      fmt::print("epx vs naive: dispatch {:.2f}x, combine {:.2f}x; vs MPI_Alltoallv: dispatch {:.2f}x\n",
                 median(samples[kNaiveDispatch]) / d, median(samples[kNaiveCombine]) / c,
                 median(samples[kAlltoallv]) / d);
      if (o.inproc && inproc_ms[0] > 0)
        fmt::print("MPI rate / in-process rate: dispatch {:.2f}, combine {:.2f}\n", inproc_ms[0] / d, inproc_ms[1] / c);
      const TransportCounters counters = t.counters();
      json += fmt::format(",\"inter_node_bytes_rank0\":{}}}", counters.inter_node_bytes);
      if (o.json) fmt::print("{}\n", json);
    }
  }
  return exit_code;
}

}  // namespace
}  // namespace epx::bench

int main(int argc, char** argv) { return epx::bench::run(argc, argv); }
