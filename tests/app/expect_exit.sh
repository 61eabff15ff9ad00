#!/usr/bin/env bash
# Runs a command and checks both its exit code and its output (stdout and
# stderr together), so a CLI test cannot pass on its own failure text.
# Usage: expect_exit.sh EXIT_CODE REGEX COMMAND [ARGS...]
# REGEX is an extended regular expression matched against the whole output
# (grep -E, across lines: the output is searched as one string). Exit 77
# (skipped) is passed through unless it is the expected code, so a test's
# SKIP_RETURN_CODE 77 still works.
set -uo pipefail
if (( $# < 3 )); then
  echo "usage: expect_exit.sh EXIT_CODE REGEX COMMAND [ARGS...]" >&2
  exit 2
fi
want=$1 regex=$2
shift 2
out=$("$@" 2>&1)
code=$?
printf '%s\n' "$out"
if [[ $code -eq 77 && $want -ne 77 ]]; then
  echo "expect_exit: skipped (exit 77): $*"
  exit 77
fi
if [[ $code -ne $want ]]; then
  echo "expect_exit: FAIL: exit code $code, want $want: $*"
  exit 1
fi
if ! printf '%s' "$out" | grep -Ezq -- "$regex"; then
  echo "expect_exit: FAIL: the output does not match '$regex': $*"
  exit 1
fi
echo "expect_exit: ok: exit $code and the output matches"
