#!/usr/bin/env bash
# Installs the Debian 12 packages epx builds with, and only those missing.
#
# Idempotent and quiet when everything is present. As root it runs
# `apt-get update` (only when something is missing) and installs the rest;
# as another user it names the missing packages and fails. Set
# EPX_SKIP_SETUP=1 to skip it (e.g. on a machine that is not Debian).
set -euo pipefail

packages=(
  build-essential cmake g++ make pkg-config
  clang libclang-rt-14-dev libomp-dev  # make fuzz: libFuzzer and OpenMP for clang
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev libcli11-dev nlohmann-json3-dev libspdlog-dev libtomlplusplus-dev libsimdjson-dev
  libopenblas-dev libdnnl-dev libxxhash-dev
  openmpi-bin libopenmpi-dev
  slurmctld slurmd slurm-client munge libpmix-dev iproute2
  ccache
  chromium  # the report's browser test (tests/observe/report_browser_test.sh)
  python3-dev pybind11-dev libdlpack-dev python3-numpy python3-torch python3-pytest  # import epx, epx.torch
  python3-venv  # `pip install .` into a venv (make venv, the pip test)
  fortunes  # English text for examples/python/train_lm.py: /usr/share/games/fortunes (2.4 MB of quotations, poems, jokes)
)

if [[ "${EPX_SKIP_SETUP:-0}" == 1 ]]; then
  exit 0
fi

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "scripts/setup.sh: dpkg-query not found: this script only knows Debian packages." >&2
  echo "Install the equivalents of: ${packages[*]}" >&2
  echo "then rerun with EPX_SKIP_SETUP=1." >&2
  exit 1
fi

missing=()
for package in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)
  if [[ "$status" != "install ok installed" ]]; then
    missing+=("$package")
  fi
done

if (( ${#missing[@]} == 0 )); then
  exit 0
fi

if (( EUID != 0 )); then
  echo "scripts/setup.sh: missing Debian packages: ${missing[*]}" >&2
  echo "Install them as root, e.g.:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
  exit 1
fi

echo "scripts/setup.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends "${missing[@]}"
