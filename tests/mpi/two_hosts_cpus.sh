#!/bin/bash
# two_hosts_cpus.sh [two_hosts.sh options]: two_hosts.sh --cpus FIRST/LAST runs
# host a's rank on CPU 0 and host b's on the machine's last CPU (taskset in the
# harness and in fake-ssh); each rank prints the CPUs it may use.
# Prints "each host on its own CPUs" and exits 0, or says what it saw and exits 1
# (77: two_hosts.sh skipped).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
last=$(($(nproc --all) - 1))
out=$("$here/two_hosts.sh" "$@" --cpus "0/$last" --np-per-host 1 --timeout 120 -- \
  /bin/sh -c 'echo "host $(hostname) cpus $(grep Cpus_allowed_list /proc/self/status | cut -f2)"')
rc=$?
[ "$rc" = 77 ] && exit 77
echo "$out"
a=$(grep -c -- "-a cpus 0$" <<<"$out")
b=$(grep -c -- "-b cpus $last$" <<<"$out")
if [ "$rc" = 0 ] && [ "$a" = 1 ] && [ "$b" = 1 ]; then
  echo "each host on its own CPUs"
  exit 0
fi
echo "two_hosts_cpus.sh: expected host a's rank on CPU 0 and host b's on CPU $last (two_hosts.sh exit $rc)" >&2
exit 1
