#!/usr/bin/env bash
# The pip route (docs/python.md): `pip install .` into a fresh venv made from
# Debian's python3 builds and installs epx and epx.torch for that venv's
# interpreter; the installed package (not the build tree) runs the two Python
# examples from another folder; `pip uninstall` removes every file it put there.
#
# Usage: pip_install_test.sh SOURCE_DIR PIP_BUILD_DIR [PYTHON]
set -euo pipefail
source_dir=$(cd "$1" && pwd)
pip_build=$2
python=${3:-/usr/bin/python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv=$work/venv

fail() { echo "pip_install_test: $*" >&2; exit 1; }

"$python" -m venv --system-site-packages "$venv"
# --no-index: nothing may come from a package index; --no-deps: numpy and
# torch are Debian's, seen through --system-site-packages.
if ! EPX_PIP_BUILD_DIR=$pip_build EPX_JOBS=${EPX_JOBS:-2} PYTHONPATH= \
     "$venv/bin/pip" install --no-build-isolation --no-deps --no-index "$source_dir" >"$work/pip.log" 2>&1; then
  tail -n 40 "$work/pip.log" >&2
  fail "pip install failed (log above)"
fi

cd "$work"
unset PYTHONPATH
where=$("$venv/bin/python" -c 'import epx, epx.torch, sys; print(epx.__file__); print(sys.prefix)')
module=$(sed -n 1p <<<"$where")
prefix=$(sed -n 2p <<<"$where")
[[ "$module" == "$prefix"/lib/python3*/site-packages/epx/__init__.py ]] ||
  fail "epx was imported from $module, not from the venv $prefix"

expect_start() {  # expect_start EXAMPLE TEXT: the example runs and its output starts with TEXT
  local out
  out=$("$venv/bin/python" "$source_dir/$1") || fail "$1 exited with $? under the venv's python"
  [[ "$out" == "$2"* ]] || fail "$1 printed: ${out:0:200}"
}
expect_start examples/python/quickstart.py "rows received per rank: ["
expect_start examples/python/readme_example.py "rank 0: loss "

"$venv/bin/pip" uninstall -y epx >"$work/uninstall.log" 2>&1 || fail "pip uninstall failed: $(cat "$work/uninstall.log")"
if "$venv/bin/python" -c 'import epx' 2>/dev/null; then
  fail "epx still imports after pip uninstall"
fi
leftover=$(find "$venv" -path '*site-packages/epx*' | head -n 3)
[[ -z "$leftover" ]] || fail "pip uninstall left files behind: $leftover"
echo "pip_install_test: installed into a fresh venv, ran both examples, uninstalled cleanly"
