// moe_layer_bench: MoELayer forward and forward+backward throughput on
// in-process ranks, one shape per run, as one JSON object on stdout.
//
//   moe_layer_bench --tokens 2048 --hidden 256 --ffn-hidden 512 --experts 16 --topk 2 --ranks 1 --reps 7
//
// bench/moe_layer_vs_torch.py runs it next to a PyTorch eager MoE layer of the
// same shape, interleaved, and reports the ratio.
#include <algorithm>
#include <mutex>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/core/clock.h"
#include "epx/core/random.h"
#include "epx/layer/moe_layer.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int tokens = 2048, hidden = 256, ffn_hidden = 512, experts = 16, topk = 2, ranks = 1, reps = 7;
  std::string dtype = "f32", combine_dtype = "f32";
  CLI::App app{"MoELayer forward and forward+backward throughput (tokens/s), medians of --reps"};
  app.add_option("--tokens", tokens, "Tokens over all ranks")->capture_default_str();
  app.add_option("--hidden", hidden)->capture_default_str();
  app.add_option("--ffn-hidden", ffn_hidden)->capture_default_str();
  app.add_option("--experts", experts)->capture_default_str();
  app.add_option("--topk", topk)->capture_default_str();
  app.add_option("--ranks", ranks, "In-process ranks (threads)")->capture_default_str();
  app.add_option("--reps", reps)->capture_default_str();
  app.add_option("--dtype", dtype)->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  app.add_option("--combine-dtype", combine_dtype, "MoELayerConfig::combine_dtype: the combine's partial rows")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  epx::MoELayerConfig config;
  config.hidden = hidden;
  config.ffn_hidden = ffn_hidden;
  config.router = {.num_experts = experts, .topk = topk, .normalize_weights = true};
  config.dtype = dtype == "bf16" ? epx::DType::kBF16 : epx::DType::kF32;
  config.combine_dtype = combine_dtype == "bf16" ? epx::DType::kBF16 : epx::DType::kF32;
  std::vector<double> forward_s, train_s, combine_s, train_combine_s;  // LayerTimes::combine of rank 0
  std::mutex mu;
  auto topology = epx::Topology::create(ranks);
  if (!topology.is_ok()) {
    fmt::print(stderr, "{}\n", topology.status().to_string());
    return 2;
  }
  auto statuses = epx::run_ranks(*topology, [&](epx::Transport& t) -> epx::Status {
    const int T = tokens / ranks + (t.rank() < tokens % ranks ? 1 : 0);
    EPX_ASSIGN_OR_RETURN(auto buffer,
                         epx::Buffer::create(t, {.num_experts = experts, .hidden = hidden, .dtype = config.dtype,
                                                 .max_topk = topk, .max_tokens_per_rank = tokens, .placement = {}}));
    EPX_ASSIGN_OR_RETURN(auto layer, epx::MoELayer::create(config, t, *buffer, 0));
    std::vector<float> x(static_cast<std::size_t>(T) * hidden), out(x.size()), grad(x.size()), grad_x(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<float>(epx::standard_normal(1, t.rank(), i));
      grad[i] = static_cast<float>(epx::standard_normal(2, t.rank(), i));
    }
    auto view = [&](std::vector<float>& v) { return epx::TensorView::contiguous(v.data(), epx::DType::kF32, {T, hidden}); };
    const auto deadline = [] { return epx::Deadline::after(epx::Milliseconds(600000)); };
    for (int rep = -1; rep < reps; ++rep) {  // rep -1 warms up
      EPX_RETURN_IF_ERROR(t.barrier(deadline()));
      epx::Stopwatch watch;
      EPX_RETURN_IF_ERROR(layer->forward(view(x), view(out)));
      EPX_RETURN_IF_ERROR(t.barrier(deadline()));
      const double fwd = watch.seconds(), fwd_combine = layer->times().combine;
      EPX_RETURN_IF_ERROR(t.barrier(deadline()));
      watch.reset();
      for (epx::Parameter* p : layer->parameters()) p->zero_grad();
      EPX_RETURN_IF_ERROR(layer->forward(view(x), view(out)));
      EPX_RETURN_IF_ERROR(layer->backward(view(grad), view(grad_x)));
      EPX_RETURN_IF_ERROR(t.barrier(deadline()));
      const double both = watch.seconds();
      if (t.rank() == 0 && rep >= 0) {
        std::lock_guard lock(mu);
        forward_s.push_back(fwd);
        train_s.push_back(both);
        combine_s.push_back(fwd_combine);
        train_combine_s.push_back(layer->times().combine);
      }
    }
    return epx::Status::ok();
  });
  if (epx::Status s = epx::first_error(statuses); !s.is_ok()) {
    fmt::print(stderr, "moe_layer_bench: {}\n", s.to_string());
    return 1;
  }
  const double f = median(forward_s), b = median(train_s);
  fmt::print("{{\"impl\":\"epx\",\"tokens\":{},\"hidden\":{},\"ffn_hidden\":{},\"experts\":{},\"topk\":{},\"ranks\":{},"
             "\"dtype\":\"{}\",\"combine_dtype\":\"{}\",\"forward_s\":{:.6g},\"train_s\":{:.6g},"
             "\"forward_tokens_per_s\":{:.6g},\"train_tokens_per_s\":{:.6g},\"combine_s\":{:.6g},"
             "\"train_combine_s\":{:.6g}}}\n",
             tokens, hidden, ffn_hidden, experts, topk, ranks, dtype, combine_dtype, f, b, tokens / f, tokens / b,
             median(combine_s), median(train_combine_s));
  return 0;
}
