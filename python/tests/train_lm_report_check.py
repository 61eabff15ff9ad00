"""ctest python.train_lm_report: `epx report` on the metrics of examples/python/train_lm.py.

    train_lm_report_check.py EPX METRICS HTML EVAL_STEPS     (EVAL_STEPS: "3,7")

The metrics hold val_loss on the evaluated steps only; `epx report` exits 0, prints the last
validation loss, and its loss chart holds a validation series at exactly those steps with those
values. The same lines without val_loss give a page with no validation series and a summary
without it. `epx monitor` reads the file. Exit 0 when all hold, 1 naming the first that does not.
"""
import json
import math
import os
import re
import subprocess
import sys
import tempfile

VAL_SERIES = "validation loss (held out)"


def fail(what):
    print(f"train_lm_report_check: FAIL: {what}")
    sys.exit(1)


def loss_chart(html):
    """The page's first line chart (the loss chart): its embedded JSON."""
    found = re.search(r'data-kind="line">.*?<script type="application/json" class="chart-data">(.*?)</script>', html,
                      re.S)
    if not found:
        fail("the page has no line chart")
    return json.loads(found.group(1))


def report(epx, metrics, html):
    """Runs epx report; returns its stdout and the loss chart's series by name."""
    run = subprocess.run([epx, "report", metrics, "-o", html], capture_output=True, text=True, timeout=120)
    print(run.stdout + run.stderr, end="")
    if run.returncode != 0:
        fail(f"epx report {metrics} exited {run.returncode}, want 0")
    with open(html, encoding="utf-8") as f:
        return run.stdout, {s["name"]: s for s in loss_chart(f.read())["series"]}


def main(epx, metrics, html, eval_steps):
    with open(metrics, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    want_steps = [int(s) for s in eval_steps.split(",")]
    if sorted(val) != want_steps:
        fail(f"the metrics hold val_loss at steps {sorted(val)}, want {want_steps}")
    if not all(isinstance(v, float) and math.isfinite(v) for v in val.values()):
        fail(f"val_loss values {val} are not all finite numbers")

    stdout, series = report(epx, metrics, html)
    last = want_steps[-1]
    if f"last validation loss {val[last]:.4g} (step {last})" not in stdout:
        fail(f"the summary does not say the last validation loss {val[last]:.4g} (step {last})")
    if VAL_SERIES not in series:
        fail(f"the loss chart has series {list(series)}, none named {VAL_SERIES!r}")
    drawn = series[VAL_SERIES]
    if drawn.get("x") != [float(s) for s in want_steps]:
        fail(f"the validation series is at x {drawn.get('x')}, want {want_steps}")
    for step, y in zip(want_steps, drawn["y"]):
        if not math.isclose(y, val[step], rel_tol=1e-6):  # the page holds floats
            fail(f"the validation series holds {y} at step {step}, the metrics {val[step]}")

    with tempfile.TemporaryDirectory() as tmp:
        plain = os.path.join(tmp, "no_val.jsonl")
        with open(plain, "w", encoding="utf-8") as f:
            for r in records:
                r.pop("val_loss", None)
                f.write(json.dumps(r) + "\n")
        stdout, series = report(epx, plain, os.path.join(tmp, "no_val.html"))
        if VAL_SERIES in series or "validation" in stdout:
            fail(f"without val_loss the report still shows one: series {list(series)}")

    monitor = subprocess.run([epx, "monitor", metrics, "--plain"], capture_output=True, text=True, timeout=120)
    if monitor.returncode != 0 or f"step {records[-1]['step']}" not in monitor.stdout:
        fail(f"epx monitor --plain exited {monitor.returncode}: {monitor.stdout}{monitor.stderr}")
    print(f"train_lm_report_check: OK: validation loss at steps {want_steps} on the page and in the summary")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        print(__doc__)
        sys.exit(2)
    main(*sys.argv[1:])
