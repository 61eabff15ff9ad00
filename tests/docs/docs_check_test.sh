#!/bin/bash
# docs_check_test.sh SOURCE_ROOT EPX_BINARY: the docs pass tests/docs/docs_check.py,
# and the check finds each kind of false statement put into a copy of them.
set -u
root=$1
epx=$2
check=$root/tests/docs/docs_check.py
python3 "$check" "$root" "$epx" || { echo "FAIL: the docs disagree with the tree or the command (above)"; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A copy of the tree whose README.md and docs/ can be edited: the rest linked.
fresh() {
  rm -rf "$tmp/t" && mkdir "$tmp/t"
  for entry in "$root"/*; do
    name=$(basename "$entry")
    case $name in README.md | docs | build*) ;; *) ln -s "$entry" "$tmp/t/$name" ;; esac
  done
  cp "$root/README.md" "$tmp/t/README.md"
  cp -r "$root/docs" "$tmp/t/docs"
}
# expect_finding DESCRIPTION PATTERN CHECK: the check exits 1 naming PATTERN.
expect_finding() {
  python3 "$check" "$tmp/t" "$epx" "$3" > "$tmp/out" 2>&1
  local rc=$?
  [ "$rc" = 1 ] || { echo "FAIL: $1: exit $rc, not 1"; cat "$tmp/out"; exit 1; }
  grep -qF -- "$2" "$tmp/out" || { echo "FAIL: $1: no '$2' in"; cat "$tmp/out"; exit 1; }
}

fresh; sed -i '/^| `src\/sim` |/d' "$tmp/t/README.md"
expect_finding "a src folder missing from the layout" 'no row for `src/sim`' layout
fresh; sed -i 's/`hardware\/`, `sim\/`/`hardware\/`/' "$tmp/t/README.md"
expect_finding "a configs subfolder left out" 'but not `sim/`' layout
fresh; sed -i 's/^| `epx_balance` | `src\/balance` | `epx_exchange`, `epx_routing` |/| `epx_balance` | `src\/balance` | `epx_train` |/' "$tmp/t/README.md"
expect_finding "a dependency the build does not declare" 'depend on `epx_train`' libraries
fresh; sed -i '/^| `EPX_BUILD_PYTHON` |/d' "$tmp/t/README.md"
expect_finding "a CMake option missing" 'misses `EPX_BUILD_PYTHON`' options
fresh; sed -i 's/^| `EPX_SANITIZE` | `OFF` |/| `EPX_SANITIZE` | `ON` |/' "$tmp/t/README.md"
expect_finding "a wrong default" '`EPX_SANITIZE` defaults to OFF' options
fresh; sed -i '/^| `epx sim keys` |/d' "$tmp/t/README.md"
expect_finding "a command missing" 'misses `epx sim keys`' commands
fresh; printf '\nRun `epx train --no-such-flag` first.\n' >> "$tmp/t/docs/cluster.md"
expect_finding "a flag epx train does not have" '--no-such-flag is not an option of `epx train`' flags
fresh; printf '\n```sh\nepx report m.jsonl --follow\n```\n' >> "$tmp/t/docs/operations.md"
expect_finding "a flag of another command" '--follow is not an option of `epx report`' flags
fresh; printf '\n```sh\nmpirun --made-up -n 2 build/bin/epx demo\n```\n' >> "$tmp/t/README.md"
expect_finding "a launcher flag not in the allow-list" '--made-up of `mpirun`' flags
fresh; printf '\n```sh\nbench/overlap_bench.sh --no-such-option\n```\n' >> "$tmp/t/README.md"
expect_finding "a script flag not in the script" '--no-such-option is not in the source of' flags
fresh; printf '\nSee [the numbers](docs/benchmarks.md).\n' >> "$tmp/t/README.md"
expect_finding "a link to a removed document" 'the link docs/benchmarks.md' links
fresh; printf '\nThe combine lives in `src/exchange/combine_old.{h,cc}`.\n' >> "$tmp/t/docs/design.md"
expect_finding "a source file that is not there" 'src/exchange/combine_old.h is not in the tree' links
echo "PASS"
