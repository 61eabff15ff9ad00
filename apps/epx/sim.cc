// `epx sim`: the cluster simulator's command.
#include "sim.h"

#include <unistd.h>

#include <chrono>
#include <ctime>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_checks.h"
#include "commands.h"
#include "epx/observe/chrome_trace.h"
#include "epx/core/clock.h"
#include "epx/observe/output_path.h"
#include "epx/observe/progress.h"
#include "epx/observe/table.h"
#include "epx/sim/calibration.h"
#include "epx/sim/cost.h"
#include "epx/sim/goodput.h"
#include "epx/sim/memory.h"
#include "epx/sim/simulator.h"
#include "sim_report.h"

namespace epx::app {
namespace {

// "key=value" -> (key, value); the option's name for the error.
Result<std::pair<std::string, std::string>> split_setting(const std::string& text, const char* option) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size())
    return invalid_argument("{} '{}' must be KEY=VALUE (e.g. model.topk=4; epx sim keys lists the keys)", option, text);
  return std::make_pair(text.substr(0, eq), text.substr(eq + 1));
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&t));
  return buf;
}

std::string pct(double v) { return fmt::format("{:.1f}%", 100 * v); }
std::string ms(double s) { return fmt::format("{:.3f}", 1e3 * s); }

std::string describe(const sim::Scenario& s) {
  const auto& m = s.model;
  const auto& p = s.parallelism;
  const int dp = s.num_gpus() / (p.ep * p.pp_stages);
  std::string routing = s.routing.distribution;
  if (routing == "zipf") routing += fmt::format("(s={})", s.routing.zipf_s);
  if (routing == "lognormal") routing += fmt::format("(sigma={})", s.routing.lognormal_sigma);
  if (s.routing.drift > 0) routing += fmt::format(", drift {}/step", s.routing.drift);
  return fmt::format(
      "cluster: {} nodes x {} GPUs ({}), EP {} x PP {} x {} EP groups per stage (EDP {}, dense DP {})\n"
      "model: {} layers ({} dense), hidden {}, {} experts (+{} shared) of width {}, top-{}{}, dispatch {} / "
      "combine {}, compute {}\n"
      "run: {} tokens per GPU per micro-batch, {} micro-batches, mode {}, dispatch {}, overlap {}{}; routing {}, "
      "balancing {}\n",
      s.cluster.nodes, s.cluster.gpus_per_node, s.hardware.name, p.ep, p.pp_stages, s.ep_groups_per_stage(), dp,
      s.num_gpus() / p.pp_stages,
      m.layers, m.dense_layers, m.hidden, m.experts, m.shared_experts, m.expert_hidden, m.topk,
      m.groups > 1 ? fmt::format(" within {} of {} groups", m.topk_groups, m.groups) : "", m.dispatch_dtype,
      m.combine_dtype, m.compute_dtype, p.tokens_per_gpu, p.micro_batches, p.mode, p.dispatch, s.schedule.overlap,
      s.schedule.overlap == "chunked" ? fmt::format(" ({} chunks)", s.schedule.chunks) : "", routing,
      s.balancing.strategy);
}

std::string sampling_note(const sim::Scenario& s, const sim::SimResult& r) {
  if (r.sample_scale <= 1.0) return fmt::format("routing: all {} tokens per GPU routed token by token", r.sampled_tokens);
  return fmt::format(
      "routing: SAMPLED: {} of {} tokens per GPU routed token by token, every count scaled by {:.4g} "
      "(per-pair counts are noisier than at full size, so hot links read slightly hot; raise routing.sample_tokens "
      "to check)",
      r.sampled_tokens, s.parallelism.tokens_per_gpu, r.sample_scale);
}

std::vector<std::string> row_of(const sim::Percentiles& p, const std::string& name,
                                std::string (*fmt_one)(double)) {
  return {name, fmt_one(p.p50), fmt_one(p.p99), fmt_one(p.mean)};
}

std::string num(double v) { return fmt::format("{:.4g}", v); }
std::string tokens(double v) { return fmt::format("{:.0f}", v); }

nlohmann::json cost_json(const sim::AllReduceCost& c) {
  return {{"algorithm", c.algorithm}, {"seconds", c.seconds}, {"bytes_sent", c.bytes_sent},
          {"nic_bytes_sent", c.nic_bytes_sent}};
}

nlohmann::json grad_sync_json(const sim::SimResult& r) {
  auto p = [](const sim::Percentiles& x) { return nlohmann::json{{"p50", x.p50}, {"p99", x.p99}, {"mean", x.mean}}; };
  const sim::Summary& s = r.summary;
  return {{"edp_ranks", r.edp_ranks},
          {"dp_ranks", r.dp_ranks},
          {"expert_grad_bytes", r.expert_grad_bytes},
          {"dense_grad_bytes", r.dense_grad_bytes},
          {"edp", cost_json(r.grad_sync.edp)},
          {"dense", cost_json(r.grad_sync.dense)},
          {"buckets", r.grad_sync.buckets.size()},
          {"busy_s", p(s.grad_sync_s)},
          {"exposed_s", p(s.grad_exposed_s)},
          {"hidden_share", p(s.grad_hidden)}};
}

// The gradient all-reduce of the first stage: groups, bytes, algorithms, and
// how much the backward hides (training only).
std::string grad_sync_lines(const sim::Scenario& base, const sim::SimResult& r) {
  if (base.parallelism.mode != "train") return "";
  const sim::GradSyncResult& g = r.grad_sync;
  const sim::Summary& s = r.summary;
  auto mib = [](double b) { return b / (1 << 20); };
  return fmt::format(
      "gradient all-reduce per GPU of the first stage: routed experts {:.2f} MiB over EDP {} ranks ({}, sends {:.2f} MiB, {:.3f} ms "
      "alone); dense {:.2f} MiB over all {} ranks ({}, sends {:.2f} MiB, {:.3f} ms alone); {} buckets of at most "
      "{:.0f} MiB (whole layers), overlap {}\n"
      "gradient all-reduce in the step (p50): busy {} ms, exposed {} ms, hidden {}; gradients held {:.2f} MiB per "
      "GPU\n",
      mib(r.expert_grad_bytes), r.edp_ranks, g.edp.algorithm, mib(g.edp.bytes_sent), 1e3 * g.edp.seconds,
      mib(r.dense_grad_bytes), r.dp_ranks, g.dense.algorithm, mib(g.dense.bytes_sent), 1e3 * g.dense.seconds,
      g.buckets.size(), mib(static_cast<double>(base.parallelism.grad_bucket_bytes)),
      base.parallelism.grad_overlap ? "on" : "off", ms(s.grad_sync_s.p50), ms(s.grad_exposed_s.p50),
      pct(s.grad_hidden.p50), mib(r.expert_grad_bytes + r.dense_grad_bytes));
}

// The step's parts beside the MoE layers (docs/simulator.md "The whole step").
nlohmann::json whole_step_json(const sim::SimResult& r) {
  auto p = [](const sim::Percentiles& x) { return nlohmann::json{{"p50", x.p50}, {"p99", x.p99}, {"mean", x.mean}}; };
  const sim::Summary& s = r.summary;
  const sim::OptimizerCost& o = r.optimizer;
  return {{"pp_transfer", {{"bytes", r.pipeline.bytes}, {"link", r.pipeline.link}, {"seconds", r.pipeline.seconds},
                           {"per_unit_s", r.pipeline.per_unit_s}, {"in_step_s", p(s.pp_transfer_s)}}},
          {"optimizer", {{"params", o.params}, {"bytes_per_param", o.bytes_per_param}, {"update_s", o.update_s},
                         {"gather_expert", cost_json(o.gather_expert)}, {"gather_dense", cost_json(o.gather_dense)},
                         {"in_step_s", p(s.optimizer_s)}, {"gather_in_step_s", p(s.param_gather_s)}}}};
}

std::string whole_step_lines(const sim::Scenario& base, const sim::SimResult& r) {
  const sim::Summary& s = r.summary;
  std::string out;
  if (base.parallelism.pp_stages > 1)
    out += fmt::format("pipeline transfers: {:.2f} MiB per micro-batch per GPU over {} ({:.3f} ms each), {} ms per unit, "
                       "{} ms in the step (p50)\n",
                       r.pipeline.bytes / (1 << 20), r.pipeline.link, 1e3 * r.pipeline.seconds,
                       ms(r.pipeline.per_unit_s), ms(s.pp_transfer_s.p50));
  if (base.parallelism.mode == "train" && base.optimizer.kind != "none")
    out += fmt::format("optimizer ({}{}): {:.4g} parameters per GPU of the first stage, {:.0f} bytes of memory traffic "
                       "each, {:.3f} ms; in the step (p50): update {} ms, weight all-gather {} ms\n",
                       base.optimizer.kind, base.optimizer.zero ? ", ZeRO-1" : "", r.optimizer.params,
                       r.optimizer.bytes_per_param, 1e3 * r.optimizer.update_s, ms(s.optimizer_s.p50),
                       ms(s.param_gather_s.p50));
  return out;
}

nlohmann::json to_json(const sim::SimResult& r) {
  auto p = [](const sim::Percentiles& x) { return nlohmann::json{{"p50", x.p50}, {"p99", x.p99}, {"mean", x.mean}}; };
  const sim::Summary& s = r.summary;
  nlohmann::json phases = nlohmann::json::object();
  for (const auto& [name, seconds] : s.phase_s) phases[name] = seconds;
  return {{"step_s", p(s.step_s)},
          {"worst_idle", p(s.worst_idle)},
          {"exposed_comm", p(s.exposed_comm)},
          {"comm_share", p(s.comm_share)},
          {"tokens_per_s_per_gpu", p(s.tokens_per_s_per_gpu)},
          {"mfu", p(s.mfu)},
          {"max_vio", p(s.max_vio)},
          {"phase_s", phases},
          {"grad_sync", grad_sync_json(r)},
          {"whole_step", whole_step_json(r)},
          {"sampled_tokens", r.sampled_tokens},
          {"sample_scale", r.sample_scale},
          {"routed_gpu_layers", r.routed_gpu_layers},
          {"wall_s", r.wall_s}};
}

// What the simulator's in-memory routing and layout state needs, against
// the memory available: refused before anything is allocated.
Status check_sim_memory(const sim::Scenario& s) {
  return check_memory_fits(sim::estimate_memory(s), available_memory());
}

Result<sim::Scenario> scenario_from(const SimOptions& o) {
  EPX_ASSIGN_OR_RETURN(sim::Scenario s, sim::load_scenario(o.scenario_path));
  for (const std::string& text : o.sets) {
    EPX_ASSIGN_OR_RETURN(auto kv, split_setting(text, "--set"));
    Status st = sim::set_value(s, kv.first, kv.second);
    if (!st.is_ok()) return invalid_argument("--set {}: {}", text, st.message());
  }
  if (o.steps > 0) s.run.steps = o.steps;
  if (s.run.trace_step >= s.run.steps) s.run.trace_step = 0;
  Status st = s.validate();
  if (!st.is_ok()) return invalid_argument("{} (after --set/--steps): {}", o.scenario_path, st.message());
  EPX_RETURN_IF_ERROR(check_sim_memory(s));
  return s;
}

// --trace and --report apart from the scenario, its routing trace and each
// other; --report is for one run (not --sweep), to a place that can be written.
Status check_outputs(const SimOptions& o, const sim::Scenario& s) {
  const CommandPath inputs[] = {{"scenario", o.scenario_path, false}, {"routing.trace", s.routing.trace, false}};
  const CommandPath outputs[] = {{"--trace", o.trace_path, false}, {"--report", o.report_path, false}};
  EPX_RETURN_IF_ERROR(check_outputs_apart(inputs, outputs));
  if (o.report_path.empty()) return Status::ok();
  if (!o.sweep.empty()) return invalid_argument("--report '{}' shows one run; it cannot be used with --sweep", o.report_path);
  return check_output_writable(o.report_path, "--report", /*renamed_into_place=*/true);
}

// The progress line of a simulation, on stderr: on a terminal once the run
// has taken a second (redrawn in place), with --progress from the start (in
// place on a terminal, plain lines every 10% elsewhere), never with -q.
// Never on stdout, so --json and the tables stay clean.
class StepProgress {
 public:
  StepProgress(const SimOptions& o, int steps, std::string label)
      : on_(!o.quiet && (o.progress || ::isatty(::fileno(stderr)) == 1)),
        forced_(o.progress),
        bar_(steps, std::move(label), stderr, o.progress ? ProgressStyle::kAuto : ProgressStyle::kTerminal) {}

  // Steps done of steps; the line shows them, the rate and the ETA.
  void update(int done, int steps) {
    if (!on_) return;
    const double elapsed = static_cast<double>(now_ns() - start_ns_) * 1e-9;
    if (!forced_ && elapsed < 1.0) return;
    shown_ = true;
    // The terminal line has its own rate and ETA; a plain line gets them here.
    const double eta = done > 0 ? elapsed / done * (steps - done) : 0.0;
    bar_.update(done, bar_.terminal() ? fmt::format("elapsed {:.1f} s", elapsed)
                                      : fmt::format("elapsed {:.1f} s, ETA {:.1f} s", elapsed, eta));
  }
  void finish() {
    if (shown_) bar_.finish();
  }

 private:
  bool on_, forced_, shown_ = false;
  int64_t start_ns_ = now_ns();
  ProgressBar bar_;
};

// A simulation with its progress line.
Result<sim::SimResult> simulate_with_progress(const sim::Scenario& s, sim::SimOptions so, const SimOptions& o,
                                              std::string label) {
  StepProgress progress(o, s.run.steps, std::move(label));
  so.on_step = [&progress](int done, int steps) { progress.update(done, steps); };
  auto result = sim::simulate(s, so);
  if (result.is_ok()) progress.finish();  // a failed run's line is ended, not completed
  return result;
}

// A simulation that fails on its input (a malformed trace, a missing file) is a
// usage error: exit 2, nothing written; anything else is a failed run.
int exit_code_of(const Status& status) {
  const StatusCode code = status.code();
  return code == StatusCode::kInvalidArgument || code == StatusCode::kNotFound ? kExitUsage : kExitFailed;
}

// --sweep KEY=V1,V2,...: the key, its values in order, and the base scenario
// with the key set to each value.
struct Sweep {
  std::string key;
  std::vector<std::string> values;
  std::vector<sim::Scenario> scenarios;
};

// Each swept scenario is validated and checked against the memory as a whole.
Result<Sweep> sweep_of(const SimOptions& o, const sim::Scenario& base) {
  EPX_ASSIGN_OR_RETURN(auto kv, split_setting(o.sweep, "--sweep"));
  Sweep sweep;
  sweep.key = kv.first;
  const std::string& list = kv.second;
  for (std::size_t start = 0;;) {
    const auto comma = list.find(',', start);
    sweep.values.push_back(list.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  for (const std::string& v : sweep.values) {
    sim::Scenario s = base;
    Status st = sim::set_value(s, sweep.key, v);
    if (st.is_ok()) st = s.validate();
    if (st.is_ok()) st = check_sim_memory(s);
    if (!st.is_ok()) return invalid_argument("--sweep {}={}: {}", sweep.key, v, st.message());
    sweep.scenarios.push_back(std::move(s));
  }
  return sweep;
}

// One simulation per swept value: a table row each, or one JSON object.
int run_sweep(const SimOptions& o, const sim::Scenario& base) {
  auto swept = sweep_of(o, base);
  if (!swept.is_ok()) {
    fmt::print(stderr, "epx sim: {}\n", swept.status().message());
    return kExitUsage;
  }
  const std::string& key = swept->key;
  const std::vector<std::string>& values = swept->values;
  const std::vector<sim::Scenario>& scenarios = swept->scenarios;
  if (!o.json) fmt::print("{}\n", describe(base));
  std::vector<std::vector<std::string>> rows;
  nlohmann::json all = nlohmann::json::array();
  for (std::size_t i = 0; i < scenarios.size(); ++i) {
    auto r = simulate_with_progress(scenarios[i], {}, o, fmt::format("sim {}={}", key, values[i]));
    if (!r.is_ok()) {
      fmt::print(stderr, "epx sim: {}={}: {}\n", key, values[i], r.status().message());
      return exit_code_of(r.status());
    }
    const sim::Summary& s = r->summary;
    rows.push_back({values[i], ms(s.step_s.p50), ms(s.step_s.p99), pct(s.worst_idle.p50), pct(s.exposed_comm.p50),
                    tokens(s.tokens_per_s_per_gpu.p50), pct(s.mfu.p50), num(s.max_vio.p50),
                    ms(s.grad_exposed_s.p50), pct(s.grad_hidden.p50)});
    nlohmann::json j = to_json(*r);
    j["value"] = values[i];
    all.push_back(j);
    if (i == 0 && !o.json) fmt::print("{}\n\n", sampling_note(scenarios[i], *r));
  }
  if (o.json) {
    fmt::print("{}\n", nlohmann::json{{"sweep", key}, {"rows", all}}.dump());
  } else {
    fmt::print("{}", format_table({key, "step ms p50", "step ms p99", "worst idle", "comm not hidden",
                                   "tokens/s/GPU", "MFU", "max_vio", "grad AR exposed ms", "grad AR hidden"},
                                  rows));
  }
  return kExitOk;
}

// The tables of one run for people: the summary per step, the gradient sync,
// the whole step, the phases, and where the trace and report went.
void print_run_tables(const SimOptions& o, const sim::Scenario& base, const sim::SimResult& r) {
  const sim::Summary& s = r.summary;
  fmt::print("{}{}\n", describe(base), sampling_note(base, r));
  fmt::print("simulated {} steps x {} of {} EP groups per stage: {} route + layout calls in {:.3f} s\n\n",
             base.run.steps, r.simulated_groups, base.ep_groups_per_stage(), r.routed_gpu_layers, r.wall_s);
  fmt::print("{}\n", format_table({"per step", "p50", "p99", "mean"},
                                  {row_of(s.step_s, "step time ms", ms), row_of(s.worst_idle, "worst GPU idle", pct),
                                   row_of(s.exposed_comm, "comm not hidden (share of stage)", pct),
                                   row_of(s.comm_share, "comm busy (share of stage)", pct),
                                   row_of(s.tokens_per_s_per_gpu, "tokens/s/GPU", tokens),
                                   row_of(s.mfu, "MFU", pct), row_of(s.max_vio, "max_vio (expert load)", num),
                                   row_of(s.grad_sync_s, "grad all-reduce busy ms", ms),
                                   row_of(s.grad_exposed_s, "grad all-reduce exposed ms", ms),
                                   row_of(s.grad_hidden, "grad all-reduce hidden", pct)}));
  fmt::print("{}{}\n", grad_sync_lines(base, r), whole_step_lines(base, r));
  std::vector<std::vector<std::string>> phases;
  for (const auto& [name, seconds] : s.phase_s) phases.push_back({name, ms(seconds)});
  fmt::print("{}", format_table({"time per GPU per stage unit (fwd+bwd)", "ms"}, phases));
  if (!o.trace_path.empty())
    fmt::print("\ntrace of step {} (the first stage with an MoE layer, EP group 0; track 2g = GPU g compute, 2g+1 = its communication): {}\n",
               base.run.trace_step, o.trace_path);
  if (!o.report_path.empty()) fmt::print("\nreport: {}\n", o.report_path);
}

// One simulation: its trace and report written first, then JSON or the tables.
int run_once(const SimOptions& o, const sim::Scenario& base) {
  sim::SimOptions so;
  so.keep_trace = !o.trace_path.empty() || !o.report_path.empty();
  auto result = simulate_with_progress(base, so, o, "sim");
  if (!result.is_ok()) {
    fmt::print(stderr, "epx sim: {}\n", result.status().message());
    return exit_code_of(result.status());
  }
  const sim::SimResult& r = *result;
  if (!o.trace_path.empty()) {
    Status st = write_chrome_trace(r.trace, o.trace_path);
    if (!st.is_ok()) {
      fmt::print(stderr, "epx sim: --trace: {}\n", st.message());
      return kExitFailed;
    }
  }
  if (!o.report_path.empty()) {
    Status st = write_sim_report(base, r, describe(base) + sampling_note(base, r), o.report_path);
    if (!st.is_ok()) {
      fmt::print(stderr, "epx sim: --report: {}\n", st.message());
      return kExitFailed;
    }
  }
  if (o.json)
    fmt::print("{}\n", to_json(r).dump());
  else
    print_run_tables(o, base, r);
  return kExitOk;
}

int run_scenario(const SimOptions& o) {
  auto loaded = scenario_from(o);
  if (!loaded.is_ok()) {
    fmt::print(stderr, "epx sim: {}\n", loaded.status().message());
    return kExitUsage;
  }
  const sim::Scenario& base = *loaded;
  if (Status st = check_outputs(o, base); !st.is_ok()) {
    fmt::print(stderr, "epx sim: {}\n", st.message());
    return kExitUsage;
  }
  return o.sweep.empty() ? run_once(o, base) : run_sweep(o, base);
}

int run_keys() {
  for (const std::string& k : sim::scenario_keys()) fmt::print("{}\n", k);
  return kExitOk;
}

// --profile: a shipped profile's name ("h800") or a path.
Status load_profile(const std::string& name_or_path, sim::Scenario* s) {
  EPX_ASSIGN_OR_RETURN(std::string path, sim::find_hardware_profile(name_or_path, ""));
  return sim::load_hardware(path, s);
}

int run_calibrate(const SimOptions& o) {
  const int threads =
      o.calibrate_threads > 0 ? o.calibrate_threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const sim::CopyBandwidth bw = sim::measure_copy_bandwidth(o.calibrate_mb << 20, threads);
  const std::string when = utc_now();
  const std::string toml = sim::machine_profile_toml(bw, when);
  fmt::print(stderr, "memcpy {} MiB per thread, best of 5: one thread {:.2f} GB/s, {} threads {:.2f} GB/s ({})\n",
             o.calibrate_mb, bw.one_thread / 1e9, threads, bw.all_threads / 1e9, when);
  if (o.calibrate_out.empty()) {
    fmt::print("{}", toml);
    return kExitOk;
  }
  std::ofstream out(o.calibrate_out);
  out << toml;
  if (!out) {
    fmt::print(stderr, "epx sim calibrate: cannot write '{}'\n", o.calibrate_out);
    return kExitFailed;
  }
  fmt::print("wrote {}\n", o.calibrate_out);
  return kExitOk;
}

// One row of the predictions table: DeepEP's shape through `kernel` on
// `nodes` x 8 GPUs, with the bandwidth DeepEP's own test would print.
Result<std::vector<std::string>> prediction_row(const sim::HardwareProfile& h, const std::string& kernel, int nodes,
                                                int tokens) {
  EPX_ASSIGN_OR_RETURN(sim::ExchangeEstimate e, sim::estimate_exchange(sim::deepep_scenario(h, nodes, tokens, kernel)));
  double disp = e.dispatch_node_bw, comb = e.combine_node_bw;
  std::string per = "(token, node) x row / t (RDMA)";
  if (kernel == "low_latency") {
    disp = e.dispatch_selection_bw, comb = e.combine_selection_bw;
    per = "(token, expert) x msg / t";
  } else if (nodes == 1) {
    disp = e.dispatch_rank_bw, comb = e.combine_rank_bw;
    per = "(token, rank) x row / t (NVL)";
  }
  const std::string name = kernel == "low_latency" ? "low-latency" : nodes == 1 ? "normal (intranode)" : "normal (two-hop)";
  return std::vector<std::string>{name, fmt::format("EP{}", nodes * 8), fmt::format("{}", tokens),
                                  fmt::format("{:.1f}", 1e6 * e.dispatch_s), fmt::format("{:.1f}", 1e6 * e.combine_s),
                                  fmt::format("{:.1f}", disp / 1e9), fmt::format("{:.1f}", comb / 1e9), per};
}

int run_fit(const SimOptions& o) {
  sim::Scenario s;
  Status st = load_profile(o.fit_profile, &s);
  if (!st.is_ok()) {
    fmt::print(stderr, "epx sim fit: {}\n", st.message());
    return kExitUsage;
  }
  auto fit = sim::fit_deepep(s.hardware);
  if (!fit.is_ok()) {
    fmt::print(stderr, "epx sim fit: {}\n", fit.status().message());
    return kExitFailed;
  }
  // The profile with the fitted parameters: the figures below and the predictions use it.
  s.hardware.nvlink_efficiency = fit->nvlink_efficiency;
  s.hardware.forward_sm_bandwidth = fit->forward_sm_bandwidth;
  const double fwd = sim::forward_bandwidth(s.hardware);
  fmt::print("fitted on DeepEP's published points ({}):\n  nvlink.efficiency = {:.4f}   (EP8)\n"
             "  comm.forward_sm_bandwidth = {:.4g}   (EP16; x {} forwarding SMs = {:.1f} GB/s per GPU)\n"
             "  not fitted: nic.efficiency = {:.4f} ({:.1f} GB/s), latencies, message_overhead\n",
             s.hardware.name, fit->nvlink_efficiency, fit->forward_sm_bandwidth, sim::forwarding_sms(s.hardware),
             fwd / 1e9, s.hardware.nic_efficiency, s.hardware.nic_bandwidth * s.hardware.nic_efficiency / 1e9);
  const double nvl = s.hardware.nvlink_bandwidth * fit->nvlink_efficiency;
  fmt::print("  check (not fitted): the forwarding SMs' fitted rate is {:.3f} x the NVLink rate fitted on EP8 ({:.1f} "
             "GB/s)\n\n",
             fwd / nvl, nvl / 1e9);
  std::vector<std::vector<std::string>> rows;
  for (const auto& p : fit->points)
    rows.push_back({p.name, fmt::format("{:.1f}", p.published_gbs), fmt::format("{:.1f}", p.fitted_gbs),
                    fmt::format("{:+.2f}%", 100 * (p.fitted_gbs / p.published_gbs - 1))});
  fmt::print("{}\n", format_table({"calibration point", "published GB/s", "model GB/s", "residual"}, rows));
  // Predictions, nothing fitted: other EP sizes and the decode shape.
  rows.clear();
  const std::vector<std::pair<std::string, int>> cases = {{"two_hop", 4096}, {"two_hop", 128}, {"low_latency", 128}};
  for (const auto& [kernel, tokens] : cases)
    for (int nodes : {1, 2, 4, 8, 16, 32}) {
      auto row = prediction_row(s.hardware, kernel, nodes, tokens);
      if (!row.is_ok()) {
        fmt::print(stderr, "epx sim fit: {}\n", row.status().message());
        return kExitFailed;
      }
      rows.push_back(*row);
    }
  fmt::print("predictions with the fitted parameters (DeepEP's test shapes: hidden 7168, top-8 of 256, fp8 dispatch, "
             "bf16 combine; normal: <= 4 nodes per token):\n{}",
             format_table({"kernel", "EP", "tokens/rank", "dispatch us", "combine us", "dispatch GB/s", "combine GB/s",
                           "GB/s counts"},
                          rows));
  return kExitOk;
}

int run_predict(const SimOptions& o) {
  int nodes = 0, per_node = 0;
  if (std::sscanf(o.node_shape.c_str(), "%dx%d", &nodes, &per_node) != 2 || nodes < 1 || per_node < 1 ||
      nodes * per_node != o.ranks) {
    fmt::print(stderr, "epx sim predict-exchange: --nodes-shape '{}' must be NODESxRANKS_PER_NODE with {} ranks\n",
               o.node_shape, o.ranks);
    return kExitUsage;
  }
  sim::Scenario s;
  Status st = load_profile(o.profile_path, &s);
  if (!st.is_ok()) {
    fmt::print(stderr, "epx sim predict-exchange: {}\n", st.message());
    return kExitUsage;
  }
  s.cluster.nodes = nodes;
  s.cluster.gpus_per_node = per_node;
  s.model.layers = 1;
  s.model.hidden = o.hidden;
  s.model.experts = o.experts;
  s.model.topk = o.topk;
  s.model.dispatch_dtype = o.dtype;
  s.model.combine_dtype = o.dtype;
  // The in-process two-hop combine sends its partial sums between nodes in f32.
  s.model.combine_remote_dtype = nodes > 1 ? "f32" : "";
  s.parallelism.ep = o.ranks;
  s.parallelism.tokens_per_gpu = o.tokens;
  s.parallelism.dispatch = nodes > 1 ? "two_hop" : "flat";
  s.parallelism.mode = "forward";
  s.routing.sample_tokens = o.tokens;
  if (Status fits = check_sim_memory(s); !fits.is_ok()) {
    fmt::print(stderr, "epx sim predict-exchange: {}\n", fits.message());
    return kExitUsage;
  }
  auto e = sim::estimate_exchange(s);
  if (!e.is_ok()) {
    fmt::print(stderr, "epx sim predict-exchange: {}\n", e.status().message());
    return e.status().code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailed;
  }
  fmt::print("{}: {} ranks as {}, {} tokens per rank, hidden {} {}, top-{} of {} (uniform)\n", s.hardware.name,
             o.ranks, o.node_shape, o.tokens, o.hidden, o.dtype, o.topk, o.experts);
  fmt::print("{}", format_table({"predicted", "ms", "MB moved (rows x bytes)"},
                                {{"dispatch", fmt::format("{:.1f}", 1e3 * e->dispatch_s),
                                  fmt::format("{:.1f}", e->bytes_dispatched / 1e6)},
                                 {"combine", fmt::format("{:.1f}", 1e3 * e->combine_s),
                                  fmt::format("{:.1f}", e->bytes_dispatched / 1e6)}}));
  return kExitOk;
}

std::string minutes(double s) { return fmt::format("{:.1f}", s / 60); }

std::vector<std::string> goodput_row(const sim::FailureModel& m, const sim::GoodputPoint& p, std::string label) {
  const double lost_gpu_hours_per_day = static_cast<double>(m.gpus) * 24 * (1 - p.goodput);
  return {std::move(label), minutes(p.interval_s), pct(p.goodput), fmt::format("{:.0f}", lost_gpu_hours_per_day)};
}

int run_goodput(const SimOptions& o) {
  const sim::FailureModel m{o.gpus, o.failures_per_gpu_hour, o.save_seconds, o.restart_seconds};
  auto best = sim::best_checkpoint_interval(m);
  if (!best.is_ok()) {
    fmt::print(stderr, "epx sim goodput: {}\n", best.status().message());
    return kExitUsage;
  }
  std::vector<double> ladder = o.intervals_min;
  if (ladder.empty()) ladder = {5, 10, 15, 30, 60, 120, 240};
  std::vector<std::vector<std::string>> rows;
  nlohmann::json points = nlohmann::json::array();
  for (double minutes_each : ladder) {
    auto p = sim::expected_goodput(m, 60 * minutes_each);
    if (!p.is_ok()) {
      fmt::print(stderr, "epx sim goodput: --interval {}: {}\n", minutes_each, p.status().message());
      return kExitUsage;
    }
    rows.push_back(goodput_row(m, *p, ""));
    points.push_back({{"interval_s", p->interval_s}, {"goodput", p->goodput}});
  }
  rows.push_back(goodput_row(m, *best, "best"));
  const double mtbf = sim::job_mtbf_s(m);
  if (o.json) {
    fmt::print("{}\n", nlohmann::json{{"gpus", m.gpus}, {"failures_per_gpu_hour", m.failures_per_gpu_hour},
                                      {"save_blocking_s", m.save_blocking_s}, {"restart_s", m.restart_s},
                                      {"job_mtbf_s", mtbf}, {"points", points},
                                      {"best", {{"interval_s", best->interval_s}, {"goodput", best->goodput}}},
                                      {"young_interval_s", sim::young_interval_s(m)}}.dump());
    return kExitOk;
  }
  fmt::print("{} GPUs at {:.3g} failures per GPU-hour: the job fails every {:.1f} h on average ({:.2f} a day)\n"
             "a save stops training {:.0f} s, a restart costs {:.0f} s (detect, stop, start, load)\n",
             m.gpus, m.failures_per_gpu_hour, mtbf / 3600, 86400 / mtbf, m.save_blocking_s, m.restart_s);
  fmt::print("{}", format_table({"", "interval (min)", "goodput", "GPU-hours lost per day"}, rows));
  fmt::print("best interval {} min, goodput {}; Young's sqrt(2 x save x MTBF) = {} min\n", minutes(best->interval_s),
             pct(best->goodput), minutes(sim::young_interval_s(m)));
  return kExitOk;
}

}  // namespace

namespace {

// `epx sim run`: a scenario file, its overrides, a sweep, the outputs.
CLI::App* add_sim_run(CLI::App& sim, SimOptions& o) {
  CLI::App* cmd = sim.add_subcommand("run", "Simulate a scenario file (configs/sim/*.toml) and print the summary table");
  cmd->add_option("scenario", o.scenario_path, "Scenario TOML file (see configs/sim/template.toml)")->required();
  cmd->add_option("--set", o.sets, "Override one value, KEY=VALUE (e.g. model.topk=4); repeatable")
      ->allow_extra_args(false)
      ->take_all();
  cmd->add_option("--sweep", o.sweep,
                  "KEY=V1,V2,...: run once per value and print one row per setting (any key; epx sim keys)");
  cmd->add_option("--steps", o.steps, "Simulated steps (overrides run.steps)")->transform(in_range(1, 1000000));
  cmd->add_option("--trace", o.trace_path, "Write a Chrome trace of one step (run.trace_step) to this file");
  cmd->add_option("--report", o.report_path,
                  "Also write the run as one self-contained HTML page: per-GPU timelines of the traced step, idle "
                  "and exposed communication per GPU, step time over the steps, a summary (not with --sweep)");
  cmd->add_flag("--json", o.json, "Print one JSON object instead of the tables");
  cmd->add_flag("--progress", o.progress,
                "Progress lines on stderr (steps done, elapsed, ETA) from the start, also when stderr is not a "
                "terminal (plain lines every 10%); without it a terminal gets one line, redrawn in place, on runs "
                "longer than a second; -q silences it");
  return cmd;
}

// `epx sim calibrate`: this machine's copy rate as a hardware profile.
CLI::App* add_sim_calibrate(CLI::App& sim, SimOptions& o) {
  CLI::App* cmd = sim.add_subcommand(
      "calibrate",
      "Measure this machine's memory copy rate and print (or write) a hardware profile of the in-process backend "
      "for `epx sim predict-exchange`");
  cmd->add_option("--mb", o.calibrate_mb, "MiB copied per thread per pass")
      ->transform(in_range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  cmd->add_option("--threads", o.calibrate_threads, "Copy threads for the host rate; 0 = all cores")
      ->transform(in_range(0, 1024))
      ->capture_default_str();
  cmd->add_option("--out", o.calibrate_out, "Write the profile here instead of stdout");
  return cmd;
}

// `epx sim fit`: the link model fitted on DeepEP's published points.
CLI::App* add_sim_fit(CLI::App& sim, SimOptions& o) {
  CLI::App* cmd = sim.add_subcommand(
      "fit",
      "Fit the link model's efficiencies (nvlink, nic) of a profile on DeepEP's published EP8/EP16 points, then "
      "predict other EP sizes and the decode shape (128 tokens per rank) without fitting");
  cmd->add_option("--profile", o.fit_profile, "Hardware profile: a shipped one's name or a .toml path (H800: the GPU DeepEP measured on)")
      ->capture_default_str();
  return cmd;
}

// `epx sim predict-exchange`: the in-process exchange at a shape, from a profile.
CLI::App* add_sim_predict(CLI::App& sim, SimOptions& o) {
  CLI::App* cmd = sim.add_subcommand(
      "predict-exchange",
      "Predict one dispatch and one combine of the in-process backend at `epx bench exchange`'s shape from a "
      "profile (from `epx sim calibrate`)");
  cmd->add_option("--profile", o.profile_path, "Hardware profile: a .toml path (from epx sim calibrate) or a shipped one's name")->required();
  cmd->add_option("--tokens", o.tokens, "Tokens per rank")->transform(in_range(1, 1 << 20))->capture_default_str();
  cmd->add_option("--ranks", o.ranks, "Ranks")->transform(in_range(1, 4096))->capture_default_str();
  cmd->add_option("--nodes-shape", o.node_shape, "NODESxRANKS_PER_NODE")->capture_default_str();
  cmd->add_option("--hidden", o.hidden, "Elements per row")->transform(in_range(1, 1 << 20))->capture_default_str();
  cmd->add_option("--experts", o.experts, "Experts")->transform(in_range(1, 65536))->capture_default_str();
  cmd->add_option("--topk", o.topk, "Experts per token")->transform(in_range(1, 64))->capture_default_str();
  cmd->add_option("--dtype", o.dtype, "Payload type")->check(CLI::IsMember({"bf16", "f32"}))->capture_default_str();
  return cmd;
}

// `epx sim goodput`: goodput under failures for a range of checkpoint intervals.
CLI::App* add_sim_goodput(CLI::App& sim, SimOptions& o) {
  CLI::App* cmd = sim.add_subcommand(
      "goodput",
      "Expected goodput of a long run under random failures (Daly's model: each failure loses the work since the "
      "last save plus a restart) for a range of checkpoint intervals, and the interval that maximises it");
  cmd->add_option("--gpus", o.gpus, "GPUs in the job")->transform(in_range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  cmd->add_option("--failures-per-gpu-hour", o.failures_per_gpu_hour,
                  "Failure rate of one GPU with its share of the host and network (default: 419 unexpected "
                  "interruptions in 54 days on 16,384 GPUs, the Llama 3 report)")
      ->transform(in_range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--save-seconds", o.save_seconds,
                  "Time one save stops training (an asynchronous save: its snapshot only)")
      ->transform(in_range(0.0, 1e6))
      ->capture_default_str();
  cmd->add_option("--restart-seconds", o.restart_seconds,
                  "Time from a failure to training again: detect, stop the ranks, start, load the checkpoint")
      ->transform(in_range(0.0, 1e6))
      ->capture_default_str();
  cmd->add_option("--interval", o.intervals_min,
                  "Checkpoint intervals to show, minutes of training between saves (repeatable; default 5, 10, "
                  "15, 30, 60, 120, 240)");
  cmd->add_flag("--json", o.json, "Print one JSON object instead of the table");
  return cmd;
}

}  // namespace

SimCommands add_sim_command(CLI::App& app, SimOptions& o) {
  SimCommands c;
  CLI::App* sim = app.add_subcommand(
      "sim",
      "Cluster simulator: predicts per-GPU timelines, idle time, hidden/exposed communication, tokens/s/GPU and MFU "
      "of an MoE configuration on up to thousands of GPUs, with traffic from epx's own router and dispatch layout "
      "(see docs/simulator.md)");
  sim->require_subcommand(1);
  c.sim = sim;
  c.run = add_sim_run(*sim, o);
  c.keys = sim->add_subcommand("keys", "List every scenario key (--set/--sweep take them)");
  c.calibrate = add_sim_calibrate(*sim, o);
  c.fit = add_sim_fit(*sim, o);
  c.predict = add_sim_predict(*sim, o);
  c.goodput = add_sim_goodput(*sim, o);
  return c;
}

int run_sim(const SimCommands& c, const SimOptions& o) {
  if (*c.run) return run_scenario(o);
  if (*c.keys) return run_keys();
  if (*c.calibrate) return run_calibrate(o);
  if (*c.fit) return run_fit(o);
  if (*c.predict) return run_predict(o);
  if (*c.goodput) return run_goodput(o);
  fmt::print(stderr, "epx sim: no subcommand given; see epx sim --help\n");
  return kExitUsage;
}

}  // namespace epx::app
