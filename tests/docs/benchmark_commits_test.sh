#!/bin/bash
# benchmark_commits_test.sh SOURCE_ROOT: docs/performance.md names a commit above
# every table (tests/docs/benchmark_commits.py), and the check itself fails on
# a table that names none.
set -u
root=$1
check=$root/tests/docs/benchmark_commits.py
python3 "$check" "$root" || { echo "FAIL: docs/performance.md has a table without a commit"; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/docs"
printf '# B\n\n## Run\n\nMeasured on a loaded machine.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n' > "$tmp/docs/performance.md"
python3 "$check" "$tmp" > "$tmp/out"
rc=$?
[ "$rc" = 1 ] || { echo "FAIL: a table without a commit gave exit $rc, not 1"; exit 1; }
grep -q 'performance.md:7: the table names no commit' "$tmp/out" || { echo "FAIL: no file:line in"; cat "$tmp/out"; exit 1; }
printf '# B\n\n## Run\n\nCommit `4a7d074`, a loaded machine.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n' > "$tmp/docs/performance.md"
python3 "$check" "$tmp" > "$tmp/out" || { echo "FAIL: a table with a commit was refused"; cat "$tmp/out"; exit 1; }
echo "PASS"
