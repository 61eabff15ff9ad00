#!/usr/bin/env bash
# The run report in a real browser: `epx report` on the metrics of a short
# real run (and the same run with a validation loss every 4 steps), and
# `epx sim run --report` on the template scenario, each page
# opened in headless Chromium (report_browser_check.py): no console error,
# every chart drawn, a screenshot kept in OUT_DIR. Also checks that the
# checker fails a page whose chart cannot be drawn, so this test can fail.
# Usage: report_browser_test.sh EPX SOURCE_DIR OUT_DIR
# Exit 0 pass, 1 fail, 77 skipped (no Chromium: Debian package chromium).
set -uo pipefail
epx=$1 src=$2 out=$3
chromium=${EPX_CHROMIUM:-chromium}
if ! command -v "$chromium" >/dev/null 2>&1; then
  echo "SKIP: '$chromium' not found (Debian package chromium; scripts/setup.sh installs it)"
  exit 77
fi
mkdir -p "$out"
check=(python3 "$src/tests/observe/report_browser_check.py" --chromium "$chromium")
fail() {
  echo "FAIL: $*"
  exit 1
}

# 1. The metrics of a real run, with a who-waited-for-whom matrix every step.
metrics=$out/metrics.jsonl
"$epx" -q train --ranks 4 --steps 12 --layers 2 --experts 8 --topk 2 --hidden 32 --ffn-hidden 32 \
  --batch-tokens 256 --balance eplb --eplb-every 4 --wait-matrix-every 1 --metrics "$metrics" >"$out/train.log" 2>&1 ||
  fail "epx train exited $? (log: $out/train.log)"

# 2. Its report, and a simulated run's.
msg=$("$epx" report "$metrics" -o "$out/report.html" 2>&1)
rc=$?
echo "$msg"
[[ $rc -eq 0 ]] || fail "epx report exited $rc"
grep -q "^wrote $out/report.html" <<<"$msg" || fail "epx report did not say it wrote the page"
grep -q "Wait matrix of step" "$out/report.html" || fail "the run report shows no wait matrix"
python3 - "$metrics" "$out/val_metrics.jsonl" <<'PY' || fail "could not add val_loss to the metrics"
import json, sys
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as out:
    for line in f:
        r = json.loads(line)
        if r["step"] % 4 == 3:
            r["val_loss"] = r["main_loss"] + 0.05
        out.write(json.dumps(r) + "\n")
PY
msg=$("$epx" report "$out/val_metrics.jsonl" -o "$out/report_val.html" 2>&1)
rc=$?
[[ $rc -eq 0 ]] || { echo "$msg"; fail "epx report (with val_loss) exited $rc"; }
grep -q "validation loss (held out)" "$out/report_val.html" || fail "the run report shows no validation loss"
msg=$("$epx" sim run "$src/configs/sim/template.toml" --steps 3 --report "$out/sim_report.html" 2>&1)
rc=$?
[[ $rc -eq 0 ]] || { echo "$msg"; fail "epx sim run --report exited $rc"; }
grep -q "^report: $out/sim_report.html" <<<"$msg" || fail "epx sim run did not name its report"

# 3. A page whose chart cannot be drawn (one heatmap's data cut short), which
# the checker must fail.
python3 - "$out/report.html" "$out/broken.html" <<'PY' || fail "could not make the broken page"
import sys
html = open(sys.argv[1]).read()
at = html.index('"q":"') + len('"q":"')
open(sys.argv[2], "w").write(html[:at] + "AAAA" + html[at:])
PY

# 4. All three in one browser.
"${check[@]}" --page "$out/report.html" "$out/report.png" line,heatmap,bars \
  --page "$out/report_val.html" "$out/report_val.png" line,heatmap,bars \
  --page "$out/sim_report.html" "$out/sim_report.png" line,timeline,bars \
  --must-fail "$out/broken.html" >"$out/check.log" 2>&1
rc=$?
cat "$out/check.log"
[[ $rc -eq 77 ]] && exit 77
[[ $rc -eq 0 ]] || fail "the pages did not render cleanly, or the broken one passed (exit $rc)"
grep -q "broken.html: console error" "$out/check.log" || fail "the checker did not report the broken chart's console error"
echo "report browser test passed: screenshots $out/report.png, $out/report_val.png, $out/sim_report.png"
