#!/usr/bin/env bash
# The run report in a real browser: `epx report` on the metrics of a short
# real run, and `epx sim run --report` on the template scenario, each page
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

# 1. The metrics of a real run; with who-waited-for-whom matrices when the
# trainer writes them, else the checked-in file of such a run.
metrics=$out/metrics.jsonl
if "$epx" train --help 2>/dev/null | grep -q -- --wait-matrix-every; then
  "$epx" -q train --ranks 4 --steps 8 --layers 2 --experts 8 --topk 2 --hidden 32 --ffn-hidden 32 \
    --batch-tokens 256 --balance eplb --eplb-every 4 --wait-matrix-every 1 --metrics "$metrics" >"$out/train.log" 2>&1 ||
    fail "epx train exited $? (log: $out/train.log)"
else
  metrics=$src/tests/observe/data/report_metrics.jsonl
  echo "epx train writes no wait matrix yet: using $metrics"
fi

# 2. Its report, in the browser.
msg=$("$epx" report "$metrics" -o "$out/report.html" 2>&1)
rc=$?
echo "$msg"
[[ $rc -eq 0 ]] || fail "epx report exited $rc"
grep -q "^wrote $out/report.html" <<<"$msg" || fail "epx report did not say it wrote the page"
"${check[@]}" "$out/report.html" --screenshot "$out/report.png" --expect-kinds line,heatmap,bars
rc=$?
[[ $rc -eq 0 ]] || { [[ $rc -eq 77 ]] && exit 77; fail "the run report did not render cleanly (exit $rc)"; }
grep -q "Wait matrix of step" "$out/report.html" || fail "the run report shows no wait matrix"

# 3. The checker must catch a chart that fails: cut one heatmap's data short.
python3 - "$out/report.html" "$out/broken.html" <<'PY' || fail "could not make the broken page"
import sys
html = open(sys.argv[1]).read()
at = html.index('"q":"') + len('"q":"')
open(sys.argv[2], "w").write(html[:at] + "AAAA" + html[at:])
PY
"${check[@]}" "$out/broken.html" --screenshot "$out/broken.png" --expect-kinds heatmap >"$out/broken.log" 2>&1
rc=$?
cat "$out/broken.log"
[[ $rc -eq 1 ]] || fail "the checker passed a page with a broken chart (exit $rc)"
grep -q "console error" "$out/broken.log" || fail "the checker did not report the broken chart's console error"

# 4. A simulated run's page.
msg=$("$epx" sim run "$src/configs/sim/template.toml" --steps 3 --report "$out/sim_report.html" 2>&1)
rc=$?
[[ $rc -eq 0 ]] || { echo "$msg"; fail "epx sim run --report exited $rc"; }
grep -q "^report: $out/sim_report.html" <<<"$msg" || fail "epx sim run did not name its report"
"${check[@]}" "$out/sim_report.html" --screenshot "$out/sim_report.png" --expect-kinds line,timeline,bars ||
  fail "the simulated run's report did not render cleanly"
echo "report browser test passed: screenshots $out/report.png, $out/sim_report.png"
