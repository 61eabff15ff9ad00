// moe_layer_bench: MoELayer forward and forward+backward throughput on
// in-process ranks, one shape per run, as one JSON object on stdout, next to
// the GEMM library's own rate on the same FLOPs measured in the same run.
//
//   moe_layer_bench --tokens 2048 --hidden 256 --ffn-hidden 512 --experts 16 --topk 2 --ranks 1 --reps 7
//
// The reference: every rank at once (one thread each, as the layer's experts
// run) multiplies its share of the routed rows, ceil(tokens x topk / ranks),
// by one [hidden, ffn_hidden] matrix in one oneDNN matmul of the compute
// dtype, the better of fixed sizes (bench/gemm_reference.h) and run-time
// sizes (the experts' path). GFLOP/s count the routed experts' GEMM FLOPs:
// forward 6 x tokens x topk x hidden x ffn_hidden, forward+backward 3x that.
// Each repetition times the reference, the forward, zero_grad of every
// parameter (zero_grad_s, reported apart: the reference has no gradients),
// then forward+backward (train_s: the layer's forward and backward only);
// the figures are medians over --reps, the phase times (rank 0's LayerTimes,
// forward+backward; forward_combine_s: the forward's combine alone) too.
//
// train_cpu_s is the process's CPU time (every rank thread's) over the same
// forward+backward, so train_cpu_s / train_s below the rank count means waits;
// train_blocked_s is rank 0's time blocked on other ranks in the exchanges of
// that forward+backward (MoELayer::waits, WaitRecord::blocked).
// --perf-ctl FIFO writes "enable" to perf's control FIFO after the warm-up and
// "disable" after the last repetition, so `perf record -D -1 --control
// fifo:FIFO` samples only the timed repetitions, not the Buffer's setup.
//
// bench/moe_layer_vs_torch.py runs it next to a PyTorch eager MoE layer of the
// same shape, interleaved, and reports the ratio.
#include <algorithm>
#include <fstream>
#include <mutex>
#include <optional>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/core/clock.h"
#include "epx/core/random.h"
#include "epx/layer/moe_layer.h"
#include "experts/gemm.h"
#include "cpu_time.h"
#include "gemm_reference.h"
#include "stats.h"

namespace {

using epx::bench::median;

struct Options {
  int tokens = 2048, hidden = 256, ffn_hidden = 512, experts = 16, topk = 2, ranks = 1, reps = 7;
  std::string dtype = "f32", compute_dtype = "", combine_dtype = "f32", combine_weights = "holder";
  std::string perf_ctl;  // perf's control FIFO, or empty
};

// What rank 0 records per repetition (seconds).
struct Samples {
  std::vector<double> gemm_fixed, gemm_runtime, forward, train, zero_grad, router, dispatch, experts, combine, forward_combine,
      train_cpu, train_blocked;
};

// One rank's share of the reference GEMM, in the compute dtype.
class ReferenceGemm {
 public:
  ReferenceGemm(const Options& o, epx::DType dtype)
      : m_((int64_t(o.tokens) * o.topk + o.ranks - 1) / o.ranks),
        n_(o.ffn_hidden),
        k_(o.hidden),
        a_(static_cast<std::size_t>(m_ * k_) * epx::dtype_size(dtype)),
        b_(static_cast<std::size_t>(k_ * n_) * epx::dtype_size(dtype)),
        c_(static_cast<std::size_t>(m_ * n_)),
        args_{.dtype = dtype, .m = m_, .n = n_, .k = k_, .a = a_.data(), .lda = k_, .b = b_.data(), .ldb = n_,
              .c = c_.data(), .ldc = n_} {
    fill(a_, dtype, 3), fill(b_, dtype, 4);
    epx::detail::ScopedOmpThreads one(1);
    fixed_.emplace(dtype, m_, n_, k_, a_.data(), b_.data(), c_.data());
  }
  int64_t rows() const { return m_; }
  void run_fixed() {
    epx::detail::ScopedOmpThreads one(1);
    fixed_->run();
  }
  epx::Status run_runtime() { return epx::detail::gemm(args_, 1); }

 private:
  static void fill(std::vector<std::byte>& bytes, epx::DType dtype, uint64_t seed) {
    const std::size_t n = bytes.size() / epx::dtype_size(dtype);
    std::vector<float> f(n);
    for (std::size_t i = 0; i < n; ++i) f[i] = 0.1f * static_cast<float>(epx::standard_normal(seed, 0, i));
    if (dtype == epx::DType::kF32) std::memcpy(bytes.data(), f.data(), bytes.size());
    else
      for (std::size_t i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(bytes.data())[i] = epx::f32_to_bf16(f[i]);
  }
  int64_t m_, n_, k_;
  std::vector<std::byte> a_, b_;
  std::vector<float> c_;
  epx::detail::GemmArgs args_;
  std::optional<epx::bench::FixedGemm> fixed_;
};

epx::Status run_rank(const Options& o, const epx::MoELayerConfig& config, epx::Transport& t, Samples& out,
                     std::mutex& mu);

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"MoELayer forward and forward+backward throughput (tokens/s), medians of --reps"};
  app.add_option("--tokens", o.tokens, "Tokens over all ranks")->capture_default_str();
  app.add_option("--hidden", o.hidden)->capture_default_str();
  app.add_option("--ffn-hidden", o.ffn_hidden)->capture_default_str();
  app.add_option("--experts", o.experts)->capture_default_str();
  app.add_option("--topk", o.topk)->capture_default_str();
  app.add_option("--ranks", o.ranks, "In-process ranks (threads)")->capture_default_str();
  app.add_option("--reps", o.reps)->capture_default_str();
  app.add_option("--dtype", o.dtype, "Dispatch payload")->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  app.add_option("--compute-dtype", o.compute_dtype, "Expert GEMMs (default: --dtype)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--combine-dtype", o.combine_dtype, "MoELayerConfig::combine_dtype: the combine's partial rows")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  app.add_option("--combine-weights", o.combine_weights,
                 "MoELayerConfig::combine_weights: holder (weighted partials) or receiver (the experts write y in "
                 "--dtype into the combine region, the receiver weighs)")
      ->check(CLI::IsMember({"holder", "receiver"}))
      ->capture_default_str();
  app.add_option("--perf-ctl", o.perf_ctl,
                 "perf's control FIFO (perf record -D -1 --control fifo:PATH): enabled for the timed repetitions only");
  CLI11_PARSE(app, argc, argv);

  epx::MoELayerConfig config;
  config.hidden = o.hidden;
  config.ffn_hidden = o.ffn_hidden;
  config.router = {.num_experts = o.experts, .topk = o.topk, .normalize_weights = true};
  config.dtype = *epx::parse_dtype(o.dtype);
  config.combine_dtype = *epx::parse_dtype(o.combine_dtype);
  if (o.combine_weights == "receiver") config.combine_weights = epx::CombineWeights::kReceiver;
  if (!o.compute_dtype.empty()) config.compute_dtype = *epx::parse_dtype(o.compute_dtype);
  const epx::DType compute = config.compute_dtype.value_or(config.dtype);
  Samples s;
  std::mutex mu;
  auto topology = epx::Topology::create(o.ranks);
  if (!topology.is_ok()) {
    fmt::print(stderr, "{}\n", topology.status().to_string());
    return 2;
  }
  auto statuses = epx::run_ranks(*topology, [&](epx::Transport& t) { return run_rank(o, config, t, s, mu); });
  if (epx::Status st = epx::first_error(statuses); !st.is_ok()) {
    fmt::print(stderr, "moe_layer_bench: {}\n", st.to_string());
    return 1;
  }
  const double f = median(s.forward), b = median(s.train);
  const double gemm_s = std::min(median(s.gemm_fixed), median(s.gemm_runtime));
  const double flop = 6.0 * o.tokens * o.topk * double(o.hidden) * o.ffn_hidden;  // forward
  const double ref_rows = double((int64_t(o.tokens) * o.topk + o.ranks - 1) / o.ranks) * o.ranks;
  const double gemm_gflops = 2.0 * ref_rows * o.hidden * o.ffn_hidden / gemm_s / 1e9;
  fmt::print("{{\"impl\":\"epx\",\"tokens\":{},\"hidden\":{},\"ffn_hidden\":{},\"experts\":{},\"topk\":{},\"ranks\":{},"
             "\"dtype\":\"{}\",\"compute_dtype\":\"{}\",\"combine_dtype\":\"{}\",\"combine_weights\":\"{}\","
             "\"forward_s\":{:.6g},\"train_s\":{:.6g},"
             "\"forward_tokens_per_s\":{:.6g},\"train_tokens_per_s\":{:.6g},\"gemm_gflops\":{:.6g},"
             "\"gemm_fixed_s\":{:.6g},\"gemm_runtime_s\":{:.6g},\"forward_gflops\":{:.6g},\"train_gflops\":{:.6g},"
             "\"train_router_s\":{:.6g},\"train_dispatch_s\":{:.6g},\"train_experts_s\":{:.6g},"
             "\"train_combine_s\":{:.6g},\"forward_combine_s\":{:.6g},\"zero_grad_s\":{:.6g},\"train_cpu_s\":{:.6g},\"train_blocked_s\":{:.6g}}}\n",
             o.tokens, o.hidden, o.ffn_hidden, o.experts, o.topk, o.ranks, o.dtype, epx::dtype_name(compute), o.combine_dtype,
             o.combine_weights, f, b,
             o.tokens / f, o.tokens / b, gemm_gflops, median(s.gemm_fixed), median(s.gemm_runtime), flop / f / 1e9,
             3 * flop / b / 1e9, median(s.router), median(s.dispatch), median(s.experts), median(s.combine),
             median(s.forward_combine), median(s.zero_grad), median(s.train_cpu),
             median(s.train_blocked));
  return 0;
}

namespace {

// Tells perf (through its control FIFO, when given) to start or stop sampling.
void perf_control(const std::string& fifo, const char* command) {
  if (fifo.empty()) return;
  std::ofstream(fifo) << command << '\n' << std::flush;
}

epx::Status zero_grads(epx::MoELayer& layer) {
  for (epx::Parameter* p : layer.parameters()) p->zero_grad();
  return epx::Status::ok();
}

epx::Status run_rank(const Options& o, const epx::MoELayerConfig& config, epx::Transport& t, Samples& out,
                     std::mutex& mu) {
  const int T = o.tokens / o.ranks + (t.rank() < o.tokens % o.ranks ? 1 : 0), H = o.hidden;
  epx::BufferConfig bc{.num_experts = o.experts, .hidden = H, .dtype = config.dtype, .max_topk = o.topk,
                       .max_tokens_per_rank = o.tokens, .placement = {}};
  if (config.combine_weights == epx::CombineWeights::kReceiver)
    bc.max_expanded_rows = int64_t{o.tokens} * o.topk;  // every (token, expert) pair of the batch
  EPX_ASSIGN_OR_RETURN(auto buffer, epx::Buffer::create(t, bc));
  EPX_ASSIGN_OR_RETURN(auto layer, epx::MoELayer::create(config, t, *buffer, 0));
  ReferenceGemm reference(o, config.compute_dtype.value_or(config.dtype));
  std::vector<float> x(static_cast<std::size_t>(T) * H), y(x.size()), grad(x.size()), grad_x(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(epx::standard_normal(1, t.rank(), i));
    grad[i] = static_cast<float>(epx::standard_normal(2, t.rank(), i));
  }
  auto view = [&](std::vector<float>& v) { return epx::TensorView::contiguous(v.data(), epx::DType::kF32, {T, H}); };
  const auto deadline = [] { return epx::Deadline::after(epx::Milliseconds(600000)); };
  // Times `step` from a barrier to the barrier after it (the slowest rank).
  auto timed = [&](auto&& step) -> epx::Result<double> {
    EPX_RETURN_IF_ERROR(t.barrier(deadline()));
    epx::Stopwatch watch;
    EPX_RETURN_IF_ERROR(step());
    EPX_RETURN_IF_ERROR(t.barrier(deadline()));
    return watch.seconds();
  };
  for (int rep = -1; rep < o.reps; ++rep) {  // rep -1 warms up
    if (rep == 0 && t.rank() == 0) perf_control(o.perf_ctl, "enable");
    EPX_ASSIGN_OR_RETURN(const double fixed, timed([&] { reference.run_fixed(); return epx::Status::ok(); }));
    EPX_ASSIGN_OR_RETURN(const double runtime, timed([&] { return reference.run_runtime(); }));
    EPX_ASSIGN_OR_RETURN(const double fwd, timed([&] { return layer->forward(view(x), view(y)); }));
    const double fwd_combine = layer->times().combine;
    // zero_grad is outside the timed step: the reference has no gradients to clear.
    EPX_ASSIGN_OR_RETURN(const double zero, timed([&] { return zero_grads(*layer); }));
    const double cpu_before = epx::bench::process_cpu_seconds();
    EPX_ASSIGN_OR_RETURN(const double both, timed([&]() -> epx::Status {
                           EPX_RETURN_IF_ERROR(layer->forward(view(x), view(y)));
                           return layer->backward(view(grad), view(grad_x));
                         }));
    const double train_cpu = epx::bench::process_cpu_seconds() - cpu_before;
    const double blocked = layer->waits().blocked;  // this forward's and backward's
    if (t.rank() != 0 || rep < 0) continue;
    std::lock_guard lock(mu);
    const epx::LayerTimes& lt = layer->times();
    out.gemm_fixed.push_back(fixed), out.gemm_runtime.push_back(runtime);
    out.forward.push_back(fwd), out.train.push_back(both), out.zero_grad.push_back(zero);
    out.router.push_back(lt.router), out.dispatch.push_back(lt.dispatch);
    out.experts.push_back(lt.experts), out.combine.push_back(lt.combine);
    out.forward_combine.push_back(fwd_combine), out.train_cpu.push_back(train_cpu), out.train_blocked.push_back(blocked);
  }
  if (t.rank() == 0) perf_control(o.perf_ctl, "disable");
  return epx::Status::ok();
}

}  // namespace
