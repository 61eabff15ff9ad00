#!/usr/bin/env python3
"""EP x EDP weak scaling of `epx train`, measured and predicted by `epx sim`, side by side.

One command, two phases, so that predictions are written down before anything is compared:

  # 1. predict: calibrate the machine (copy rates: `epx sim calibrate`; the compute rate from ONE
  #    in-process run at EP 2 x EDP 1), then predict every case with `epx sim run`; writes JSON.
  bench/ep_edp_scaling.py predict --epx build/bin/epx --out predictions.json
  # 2. measure: run every case with `epx train` (in-process and under mpirun on two emulated hosts
  #    with the link capped, tests/mpi/two_hosts.sh) and print measured, predicted and their ratio.
  #    The predictions are read from the file, never recomputed.
  bench/ep_edp_scaling.py measure --epx build/bin/epx --predictions predictions.json

Cases: EP 2 with EDP 1, 2, 4 (2, 4, 8 ranks) at a fixed batch per rank; gradient all-reduce
overlap on and off (`--grad-overlap`); in-process (one emulated node) and two hosts (EP groups
inside a host, EDP groups across the link; EDP 1 = 1 rank per host, so its EP group crosses).
Medians over the steps after the first `--skip` (warm-up). Needs root for the two hosts (exit
77 from two_hosts.sh: skipped, said so). Not part of `make test` (minutes). Without --out, the
JSON goes to docs/data/ep-edp/ (ep_edp_predictions_RATE.json, ep_edp_measured_RATE.json).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TWO_HOSTS = os.path.join(ROOT, "tests", "mpi", "two_hosts.sh")
# Where the predictions and measurements are kept (docs/simulator.md cites them).
DATA = os.path.join(ROOT, "docs", "data", "ep-edp")

# The model: small enough for 8 ranks on 2 cores, expert gradients large enough to be seen on the link.
MODEL = dict(layers=4, hidden=128, ffn_hidden=256, experts=8, topk=2, input_dim=32, output_dim=16)
EP = 2
EDPS = (1, 2, 4)
TOKENS_PER_RANK = 256


def train_flags(ranks, steps):
    m = MODEL
    return ["--ranks", str(ranks), "--steps", str(steps), "--batch-tokens", str(TOKENS_PER_RANK * ranks),
            "--layers", str(m["layers"]), "--hidden", str(m["hidden"]), "--ffn-hidden", str(m["ffn_hidden"]),
            "--experts", str(m["experts"]), "--topk", str(m["topk"]), "--balance", "bias", "-q"]


def rate_bytes(rate):
    """tc rate ('1gbit', '200mbit') in bytes/s."""
    m = re.fullmatch(r"([0-9.]+)([kmgt]?)bit", rate.lower())
    if not m:
        sys.exit(f"--rate {rate}: expected NUMBER[k|m|g]bit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale / 8


def run(cmd, **kw):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def read_metrics(path, skip):
    steps = [json.loads(line) for line in open(path) if line.strip()]
    timed = steps[skip:] if len(steps) > skip else steps
    seconds = [s["seconds"] for s in timed]
    def per_step(field):  # the slowest rank's value, median over steps
        return statistics.median(max(r.get(field, 0.0) for r in s["ranks"]) for s in timed)
    after = statistics.median(max(r.get("sync", 0.0) - r.get("grad_wait", 0.0) for r in s["ranks"]) for s in timed)
    return {"steps": len(timed), "step_s": statistics.median(seconds), "sync_s": per_step("sync"),
            "after_backward_s": after,  # gradient clipping, the optimizer, load statistics
            "grad_reduce_s": per_step("grad_reduce"), "grad_wait_s": per_step("grad_wait"),
            "step_s_min": min(seconds), "step_s_max": max(seconds)}


def git_commit():
    r = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], text=True, capture_output=True)
    return r.stdout.strip()


def train_has(epx, flag):
    out = run([epx, "train", "--help"]).stdout
    return re.search(r"(^|\s)" + re.escape(flag) + r"[\s,=]", out) is not None


# ---- the prediction side ---------------------------------------------------------------------------
def algorithm_of(case, allreduce):
    """`epx`: what epx's transports run for gradient buckets (in-process: every contribution gathered;
    MPI: an all-to-all of chunks, rank-order sums, an all-gather)."""
    if allreduce != "epx":
        return allreduce
    return "allgather" if case["where"] == "inproc" else "chunked"


def sim_sets(case, flops, rate, nic_latency, allreduce, nic_efficiency=0.94, optimizer_bandwidth=0.0):
    ranks, nodes = case["ranks"], case["nodes"]
    m = MODEL
    sets = {
        "cluster.nodes": nodes, "cluster.gpus_per_node": ranks // nodes,
        "model.layers": m["layers"], "model.hidden": m["hidden"], "model.expert_hidden": m["ffn_hidden"],
        "model.experts": m["experts"], "model.topk": m["topk"], "model.shared_experts": 0,
        "model.attention": "false", "model.score": "softmax", "model.compute_dtype": "bf16",
        "model.dispatch_dtype": "f32", "model.combine_dtype": "f32", "model.grad_dtype": "f32",
        "model.embedding_params": m["input_dim"] * m["hidden"], "model.head_params": m["hidden"] * m["output_dim"],
        "parallelism.ep": EP, "parallelism.tokens_per_gpu": TOKENS_PER_RANK, "parallelism.micro_batches": 1,
        "parallelism.dispatch": "two_hop" if nodes > 1 and EP > ranks // nodes else "flat",
        "parallelism.grad_overlap": "true" if case["overlap"] else "false",
        "parallelism.allreduce": algorithm_of(case, allreduce), "parallelism.grad_bucket_bytes": 4 << 20,  # epx train's default
        "routing.distribution": "uniform", "routing.sample_tokens": TOKENS_PER_RANK,
        "schedule.overlap": "none", "run.steps": 3, "run.threads": 1,
        "hardware.compute.bf16_flops": flops, "hardware.compute.gemm_efficiency": 1.0,
        "hardware.compute.gemm_half_rows": 0, "hardware.compute.gemm_tile": 1, "hardware.host.cores": 2,
        "hardware.nic.shared_per_node": "true", "hardware.nic.bandwidth": rate_bytes(rate),
        "hardware.nic.efficiency": nic_efficiency, "hardware.nic.latency": nic_latency,
        # The whole step: epx train's AdamW (f32 weights, gradients and moments, no ZeRO), no pipeline stages.
        "parallelism.pp_stages": 1, "model.activation_dtype": "f32", "optimizer.kind": "adamw",
        "optimizer.master_dtype": "f32", "optimizer.moment_dtype": "f32", "optimizer.weight_copy_dtype": "none",
        "optimizer.zero": "false", "hardware.memory.optimizer_bandwidth": optimizer_bandwidth,
    }
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def simulate(epx, scenario, case, flops, rate, args):
    r = run([epx, "sim", "run", scenario, "--json"] +
            sim_sets(case, flops, rate, args.nic_latency, args.allreduce, args.nic_efficiency,
                     getattr(args, "optimizer_bandwidth", 0.0)))
    if r.returncode != 0:
        sys.exit(f"epx sim failed ({r.returncode}): {r.stderr}")
    j = json.loads(r.stdout)
    compute = sum(v for k, v in j["phase_s"].items() if k in ("attention", "router", "shared", "experts", "dense"))
    whole = j.get("whole_step", {})
    opt = whole.get("optimizer", {})
    return {"step_s": j["step_s"]["p50"], "compute_s": compute, "grad": j["grad_sync"],
            "optimizer_s": opt.get("in_step_s", {}).get("p50", 0.0),
            "optimizer_traffic": opt.get("params", 0.0) * opt.get("bytes_per_param", 0.0),
            "pp_transfer_s": whole.get("pp_transfer", {}).get("in_step_s", {}).get("p50", 0.0)}


def cases(rate):
    out = []
    for where in ("inproc", "two_hosts"):
        for edp in EDPS:
            for overlap in (True, False):
                ranks = EP * edp
                out.append({"where": where, "edp": edp, "ranks": ranks, "nodes": 1 if where == "inproc" else 2,
                            "overlap": overlap, "rate": rate if where == "two_hosts" else ""})
    return out


def predict(args):
    work = tempfile.mkdtemp(prefix="epx-edp-")
    profile = os.path.join(work, "machine.toml")
    if args.reuse:
        return predict_again(args, work, profile)
    r = run([args.epx, "sim", "calibrate", "--mb", "64", "--out", profile])
    if r.returncode != 0:
        sys.exit(f"epx sim calibrate failed: {r.stderr}")
    if args.link_probe:
        args.nic_efficiency = link_efficiency(args.link_probe, args.rate)
    scenario = os.path.join(work, "scenario.toml")
    with open(scenario, "w") as f:
        f.write('[hardware]\nprofile = "machine.toml"\n')
    # The one calibration run: EP 2 x EDP 1 in-process (2 ranks: one per core, no all-reduce of experts).
    metrics = os.path.join(work, "base.jsonl")
    flags = train_flags(EP, args.steps) + ["--metrics", metrics]
    if train_has(args.epx, "--ep"):
        flags += ["--ep", str(EP)]
    trace = os.path.join(work, "base_trace.json")
    flags += ["--trace", trace, "--trace-steps", str(max(1, args.steps - 1))]
    r = run([args.epx, "train"] + flags)
    if r.returncode != 0:
        sys.exit(f"calibration run failed: {r.stderr}")
    base = read_metrics(metrics, args.skip)
    base["optimizer_span_s"] = optimizer_span(trace)
    base_case = {"where": "inproc", "edp": 1, "ranks": EP, "nodes": 1, "overlap": True}
    f0 = 1e10
    # The optimizer apart from compute: its rate (bytes of AdamW traffic per second on one core) from
    # the same run's "optimizer" spans; 2 ranks on 2 cores, so no oversubscription to take out.
    s0 = simulate(args.epx, scenario, base_case, f0, args.rate, args)
    args.optimizer_bandwidth = s0["optimizer_traffic"] / base["optimizer_span_s"]
    s0 = simulate(args.epx, scenario, base_case, f0, args.rate, args)
    # Everything the simulator charges as compute is scaled to the measured step; the exchange and
    # the all-reduce keep their modelled (copy-rate) cost.
    flops = f0 * s0["compute_s"] / max(base["step_s"] - (s0["step_s"] - s0["compute_s"]), 1e-9)
    write_predictions(args, scenario, profile, base, flops, work)


def optimizer_span(trace):
    """Median of the "optimizer" spans (AdamW over a rank's parameters) of a Chrome trace, seconds."""
    t = json.load(open(trace))
    events = t["traceEvents"] if isinstance(t, dict) else t
    spans = [e["dur"] for e in events if e.get("ph") == "X" and e.get("name") == "optimizer"]
    if not spans:
        sys.exit(f"{trace}: no optimizer spans")
    return statistics.median(spans) * 1e-6


def link_efficiency(probe, rate):
    """The capped link's efficiency, measured on its own before any prediction: 32 MiB each way
    between the two emulated hosts (tests/mpi/check_two_hosts.sh with the MPI probe)."""
    r = run([os.path.join(ROOT, "tests", "mpi", "check_two_hosts.sh"), probe, "--bytes", "33554432", "--rate", rate])
    m = re.search(r"\(([0-9.]+)% of the cap\)", r.stdout)
    if r.returncode != 0 or not m:
        sys.exit(f"link calibration failed ({r.returncode}): {r.stdout[-400:]}")
    print(f"link: {m.group(1)}% of the {rate} cap (MPI probe, 32 MiB each way)", flush=True)
    return float(m.group(1)) / 100


def predict_again(args, work, profile):
    """The calibration of an earlier prediction file, another --allreduce: marked post hoc."""
    old = json.load(open(args.reuse))
    with open(profile, "w") as f:
        f.write(old["calibration"]["profile"])
    scenario = os.path.join(work, "scenario.toml")
    with open(scenario, "w") as f:
        f.write('[hardware]\nprofile = "machine.toml"\n')
    args.rate = old["cases"][-1]["rate"]
    args.nic_efficiency = old.get("nic_efficiency", args.nic_efficiency)
    args.optimizer_bandwidth = old.get("optimizer_bandwidth", 0.0)
    args.post_hoc = f"recomputed from {args.reuse}'s calibration after the measurements"
    write_predictions(args, scenario, profile, old["calibration"]["measured"], old["calibration"]["flops"], work)


def write_predictions(args, scenario, profile, base, flops, work):
    preds = []
    for case in cases(args.rate):
        p = simulate(args.epx, scenario, case, flops, args.rate, args)
        # The other algorithm too, as a second reading (never the headline): MPI_Allreduce's choice
        # for a given size is not known in advance.
        other = "ring" if args.allreduce in ("hierarchical", "epx") else "hierarchical"
        saved, args.allreduce = args.allreduce, other
        p_other = simulate(args.epx, scenario, case, flops, args.rate, args)
        args.allreduce = saved
        preds.append({**case, "predicted": p, "predicted_" + other: p_other})
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "model": MODEL, "ep": EP,
              "tokens_per_rank": TOKENS_PER_RANK, "calibration": {"measured": base, "flops": flops,
              "profile": open(profile).read()}, "nic_latency": args.nic_latency, "nic_efficiency": args.nic_efficiency,
              "optimizer_bandwidth": getattr(args, "optimizer_bandwidth", 0.0), "allreduce": args.allreduce,
              "commit": git_commit(),
              "post_hoc": getattr(args, "post_hoc", ""), "cases": preds}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"calibration: EP 2 x EDP 1 in-process median step {1e3 * base['step_s']:.1f} ms -> "
          f"effective compute {flops / 1e9:.2f} GFLOP/s per rank; optimizer span "
          f"{1e3 * base.get('optimizer_span_s', 0):.2f} ms -> {getattr(args, 'optimizer_bandwidth', 0) / 1e9:.2f} GB/s of AdamW traffic")
    print(f"{'where':10} {'EDP':>3} {'ranks':>5} {'overlap':>7} {'pred step ms':>12} {'AR busy ms':>10} "
          f"{'AR exposed ms':>13} {'optimizer ms':>12} {'EDP bytes sent/rank':>19}")
    for c in preds:
        g = c["predicted"]["grad"]
        print(f"{c['where']:10} {c['edp']:>3} {c['ranks']:>5} {'on' if c['overlap'] else 'off':>7} "
              f"{1e3 * c['predicted']['step_s']:>12.1f} {1e3 * g['busy_s']['p50']:>10.1f} "
              f"{1e3 * g['exposed_s']['p50']:>13.1f} {1e3 * c['predicted'].get('optimizer_s', 0):>12.1f} "
              f"{g['edp']['bytes_sent']:>19.0f}")
    print(f"wrote {args.out}")
    shutil.rmtree(work, ignore_errors=True)


# ---- the measured side -----------------------------------------------------------------------------
def measure_case(args, case, work):
    metrics = os.path.join(work, f"{case['where']}-{case['edp']}-{case['overlap']}.jsonl")
    flags = train_flags(case["ranks"], args.steps) + ["--ep", str(EP), "--metrics", metrics]
    if args.overlap_flag:
        flags += ["--grad-overlap", "on" if case["overlap"] else "off"]
    veth = None
    if case["where"] == "inproc":
        r = run([args.epx, "train"] + flags + ["--backend", "inproc"])
    else:
        r = run([TWO_HOSTS, "--np-per-host", str(case["ranks"] // 2), "--rate", case["rate"], "--timeout", "600",
                 "--subnet", args.subnet,
                 "--", args.epx, "train"] + flags + ["--backend", "mpi"])
        if r.returncode == 77:
            return {"skipped": "two_hosts.sh: " + r.stderr.strip().splitlines()[-1]}
        m = re.search(r"veth_bytes a_to_b=(\d+) b_to_a=(\d+)", r.stdout)
        veth = [int(m.group(1)), int(m.group(2))] if m else None
    if r.returncode != 0:
        return {"failed": f"exit {r.returncode}: {(r.stderr or r.stdout)[-400:]}"}
    out = read_metrics(metrics, args.skip)
    out["veth_bytes"] = veth
    return out


def measure(args):
    preds = json.load(open(args.predictions))
    if not train_has(args.epx, "--ep"):
        sys.exit("epx train has no --ep (branch eptrain not merged): nothing to measure")
    args.overlap_flag = train_has(args.epx, "--grad-overlap")
    args.load_before = os.getloadavg()
    work = tempfile.mkdtemp(prefix="epx-edp-m-")
    rows = []
    if not args.overlap_flag:
        print("epx train has no --grad-overlap (branch gradsync not merged): its gradients are reduced after the "
              "backward, so only the 'overlap off' cases are measured", flush=True)
    for c in preds["cases"]:
        if not args.overlap_flag and c["overlap"]:
            continue
        if args.where != "all" and c["where"] != args.where:
            continue
        got = measure_case(args, c, work)
        rows.append({**c, "measured": got})
        p = c["predicted"]["step_s"]
        if "step_s" in got:
            print(f"{c['where']:10} EDP {c['edp']} ranks {c['ranks']} overlap {'on ' if c['overlap'] else 'off'} "
                  f"measured {1e3 * got['step_s']:8.1f} ms  predicted {1e3 * p:8.1f} ms  "
                  f"predicted/measured {p / got['step_s']:.2f}  all-reduce busy {1e3 * got['grad_reduce_s']:.1f} "
                  f"exposed {1e3 * got['grad_wait_s']:.1f} (predicted {1e3 * c['predicted']['grad']['busy_s']['p50']:.1f} / "
                  f"{1e3 * c['predicted']['grad']['exposed_s']['p50']:.1f}) ms  after the backward "
                  f"{1e3 * got['after_backward_s']:.1f} ms (predicted optimizer {1e3 * c['predicted'].get('optimizer_s', 0):.1f})  "
                  f"veth {got.get('veth_bytes')}", flush=True)
        else:
            print(f"{c['where']:10} EDP {c['edp']} overlap {c['overlap']}: {got}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": git_commit(),
                   "load_before": args.load_before, "load_after": os.getloadavg(), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    shutil.rmtree(work, ignore_errors=True)


def main():
    global TOKENS_PER_RANK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["predict", "measure"])
    ap.add_argument("--epx", default=os.path.join(ROOT, "build", "bin", "epx"))
    ap.add_argument("--rate", default="1gbit", help="tc rate of the link between the two hosts")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--tokens-per-rank", type=int, default=TOKENS_PER_RANK,
                    help="the fixed batch per rank (more tokens: more backward to hide the all-reduce behind)")
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians")
    ap.add_argument("--nic-latency", type=float, default=1e-4, help="per ring step across the link (assumed)")
    ap.add_argument("--allreduce", default="epx",
                    help="epx (what epx's transports run: allgather in-process, chunked under MPI), ring, "
                         "hierarchical, auto, allgather or chunked")
    ap.add_argument("--nic-efficiency", type=float, default=0.94, help="of the link's cap (assumed, unless --link-probe)")
    ap.add_argument("--link-probe", default="", help="predict: measure the link's efficiency first with this MPI "
                    "probe (build/tests/mpi/epx_probe_mpi)")
    ap.add_argument("--reuse", default="", help="predict: take the calibration of this earlier prediction file")
    ap.add_argument("--subnet", default="10.231.77", help="measure: the /24 of the two emulated hosts")
    ap.add_argument("--where", default="all", choices=["all", "inproc", "two_hosts"], help="measure: which runs")
    ap.add_argument("--out", default="",
                    help=f"default {os.path.relpath(DATA, ROOT)}/ep_edp_{{predictions,measured}}_RATE.json")
    ap.add_argument("--predictions", default="",
                    help=f"measure: default {os.path.relpath(DATA, ROOT)}/ep_edp_predictions_RATE.json")
    args = ap.parse_args()
    TOKENS_PER_RANK = args.tokens_per_rank
    args.predictions = args.predictions or os.path.join(DATA, f"ep_edp_predictions_{args.rate}.json")
    kind = "predictions" if args.phase == "predict" else "measured"
    args.out = args.out or os.path.join(DATA, f"ep_edp_{kind}_{args.rate}.json")
    (predict if args.phase == "predict" else measure)(args)


if __name__ == "__main__":
    main()
