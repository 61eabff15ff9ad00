#!/bin/bash
# two_hosts.sh: run an MPI program on two emulated hosts on this machine.
#
#   tests/mpi/two_hosts.sh [options] -- PROGRAM [ARGS...]
#
# Two network namespaces joined by a veth pair (both ends named eth0, addresses
# SUBNET.1 and SUBNET.2/24), each "host" with its own hostname (UTS namespace)
# and an /etc/netns/NS/hosts that names both. OpenMPI's mpirun starts inside the
# first namespace; its ssh stand-in (tests/mpi/fake-ssh) starts orted inside the
# second. The program runs on 2 x NP ranks (ranks 0..NP-1 on host a, the rest
# on host b); the script exits with mpirun's status and then prints the bytes
# that crossed the veth during the run:
#   veth_bytes a_to_b=N b_to_a=M
#   veth_packets a_to_b=N b_to_a=M
# (with --hosts 3: host_bytes_sent a=N b=M c=K)
#   two_hosts_seconds=T
# (Ethernet frames as counted by the kernel: headers, TCP acks, launch and
# wire-up traffic included.)
#
# Options:
#   --np-per-host N, --ranks-per-host N   ranks per host (default 2)
#   --hosts N          2 (one veth pair; the default) or 3: hosts a, b, c (SUBNET.3),
#                      each joined by a veth pair to a bridge in a fourth, "switch"
#                      namespace; ranks 2*NP.. on host c
#   --rate RATE        tc tbf on both veth ends, e.g. 1gbit (default: none)
#   --rate-host H      apply --rate (and --delay) only to host H's link (a, b or c):
#                      with 2 hosts only H's egress (the link is the one pair, so
#                      capping both directions would cap the other host alike);
#                      with 3 hosts both directions, H's egress and the switch's
#                      port toward H, as a slow NIC is (default: every host's egress)
#   --burst B          tbf burst (default 256kb), --tbf-latency L (default 20ms)
#   --delay D          netem delay on both ends (with --rate: netem's rate, no tbf);
#                      needs sch_netem, which this machine's kernel lacks (exit 77)
#   --cpus LIST        give each host its own CPUs: LIST has one entry per host, in
#                      host order, separated by '/' (e.g. 0/1, or 0-1/2-3); host a's
#                      mpirun and ranks run under taskset -c on the first, host b's
#                      orted and ranks (fake-ssh) on the second, ...; with --bind-to
#                      none the ranks keep it. The kernel's network work (softirq:
#                      the veth, tbf, TCP) runs where it is raised, mostly on the
#                      sending host's CPU. Default: no pinning
#   --timeout S        kill the whole run after S seconds (default 300)
#   --subnet A.B.C     the /24 the two hosts use (default 10.231.77)
#   --mpirun-arg ARG   extra mpirun argument (repeatable), e.g. --mpirun-arg -x --mpirun-arg FOO
#   -x VAR             forward VAR to the ranks (mpirun -x; repeatable)
#   --verbose          print the mpirun command and log fake-ssh calls
#   --launch-in-host-a run PROGRAM itself in host a instead of mpirun: it starts the
#                      MPI runs (e.g. epx supervise --hosts), with
#                        EPX_TWO_HOSTS_NAMES="HOST_A HOST_B [HOST_C]" and
#                        EPX_TWO_HOSTS_MPIRUN_ARGS: the mpirun arguments after
#                        --host/-np/--map-by slot, one a line (fake-ssh, transports)
#   --bare             experiments: launch only (hosts, ranks, fake-ssh, --oversubscribe);
#                      none of the pml/osc/btl/oob/UCX settings below
#   --no-uts           experiments: both hosts keep this machine's hostname
#
# Needs root (namespaces, veth, tc); otherwise, or when namespaces cannot be
# made, it prints why and exits 77 (ctest SKIP_RETURN_CODE). It removes its
# namespaces, /etc/netns files and every process left in them, whatever happens.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
me=two_hosts.sh

launch_in_a=0 np=2 hosts=2 cpus='' rate='' rate_host='' burst=256kb tbf_latency=20ms delay='' timeout_s=300 subnet=10.231.77 verbose=0 bare=0 uts=1
extra=()
usage() { sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    --np-per-host|--ranks-per-host) np=$2; shift 2 ;;
    --hosts) hosts=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --cpus) cpus=$2; shift 2 ;;
    --rate-host) rate_host=$2; shift 2 ;;
    --burst) burst=$2; shift 2 ;;
    --tbf-latency) tbf_latency=$2; shift 2 ;;
    --delay) delay=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --subnet) subnet=$2; shift 2 ;;
    --mpirun-arg) extra+=("$2"); shift 2 ;;
    -x) extra+=(-x "$2"); shift 2 ;;
    --verbose|-v) verbose=1; shift ;;
    --launch-in-host-a) launch_in_a=1; shift ;;
    --bare) bare=1; shift ;;
    --no-uts) uts=0; shift ;;
    -h|--help) usage ;;
    --) shift; break ;;
    *) echo "$me: unknown option $1 (program goes after --)" >&2; usage ;;
  esac
done
[ $# -ge 1 ] || usage
case $hosts in 2|3) ;; *) echo "$me: --hosts $hosts: expected 2 or 3" >&2; exit 2 ;; esac
case $np in ''|*[!0-9]*|0) echo "$me: --np-per-host needs a positive number" >&2; exit 2 ;; esac
case $hosts$rate_host in 2|3|2a|2b|3a|3b|3c) ;; *) echo "$me: --rate-host $rate_host: expected a or b (a, b or c with --hosts 3)" >&2; exit 2 ;; esac
if [ -n "$rate" ] && ! [[ $rate =~ ^[0-9]+(\.[0-9]+)?([kKmMgGtT]?(bit|bps))?$ ]]; then
  echo "$me: --rate $rate: expected a tc rate such as 1gbit or 200mbit" >&2; exit 2
fi

cpu_sets=()
if [ -n "$cpus" ]; then
  IFS=/ read -r -a cpu_sets <<<"$cpus"
  [ "${#cpu_sets[@]}" = "$hosts" ] || { echo "$me: --cpus $cpus: expected $hosts CPU lists separated by '/'" >&2; exit 2; }
  for c in "${cpu_sets[@]}"; do
    [[ $c =~ ^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$ ]] || { echo "$me: --cpus $cpus: '$c' is not a CPU list such as 0 or 0-1,4" >&2; exit 2; }
  done
  command -v taskset >/dev/null || { echo "$me: --cpus needs taskset (util-linux)" >&2; exit 2; }
fi

skip() { echo "$me: SKIP: $*" >&2; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces, veth, tc)"
for t in ip unshare hostname mpirun timeout; do
  command -v "$t" >/dev/null || skip "$t not found"
done
[ -z "$rate$delay" ] || command -v tc >/dev/null || skip "tc not found (--rate/--delay)"
mpirun --version 2>/dev/null | grep -q 'Open MPI' || skip "mpirun is not OpenMPI's (this harness drives OpenMPI's rsh launcher)"

id=$$
ns_a=epx2h-$id-a ns_b=epx2h-$id-b ns_c=epx2h-$id-c ns_s=epx2h-$id-s
host_a=epx-$id-a host_b=epx-$id-b host_c=epx-$id-c
addr_a=$subnet.1 addr_b=$subnet.2 addr_c=$subnet.3
veth_a=e2h${id}a veth_b=e2h${id}b veth_c=e2h${id}c   # temporary names (<= 15 chars), renamed eth0
names=(a b); [ "$hosts" = 3 ] && names=(a b c)
made_ns=()
child=
tmp=

kill_ns_procs() {  # kill every process whose network namespace is $1
  local sig=$1 ns=$2 pids
  pids=$(ip netns pids "$ns" 2>/dev/null) || return 0
  [ -n "$pids" ] && kill "-$sig" $pids 2>/dev/null
  return 0
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  [ -n "$child" ] && kill -TERM "$child" 2>/dev/null
  local ns
  for ns in "${made_ns[@]}"; do kill_ns_procs TERM "$ns"; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    local left=
    for ns in "${made_ns[@]}"; do [ -n "$(ip netns pids "$ns" 2>/dev/null)" ] && left=1; done
    [ -z "$left" ] && break
    sleep 0.2
  done
  for ns in "${made_ns[@]}"; do kill_ns_procs KILL "$ns"; done
  for ns in "${made_ns[@]}"; do
    ip netns del "$ns" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  done
  ip link del "$veth_a" 2>/dev/null   # only if it never moved into a namespace
  rmdir /etc/netns 2>/dev/null         # only when empty (another run may use it)
  [ -n "$tmp" ] && rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# A run killed with SIGKILL (a ctest timeout, say) cannot clean up after itself:
# remove the namespaces of runs whose script is gone.
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^epx2h-[0-9]+-[abcs]$'); do
  pid=${ns#epx2h-}; pid=${pid%-*}
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "$me: removing $ns, left by run $pid" >&2
    kill_ns_procs KILL "$ns"
    ip netns del "$ns" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  fi
done
for d in /tmp/epx2h-[0-9]*.*; do
  [ -d "$d" ] || continue
  pid=${d#/tmp/epx2h-}; pid=${pid%%.*}
  kill -0 "$pid" 2>/dev/null || rm -rf "$d"
done

# ---- the two hosts ----------------------------------------------------------
ns_of() { local v=ns_$1; echo "${!v}"; }
all_ns=("$ns_a" "$ns_b"); [ "$hosts" = 3 ] && all_ns=("$ns_a" "$ns_b" "$ns_c" "$ns_s")
for ns in "${all_ns[@]}"; do
  ip netns add "$ns" 2>/dev/null || skip "cannot create network namespace $ns (ip netns add failed)"
  made_ns+=("$ns")
done
if [ "$hosts" = 2 ]; then
  ip link add "$veth_a" netns "$ns_a" type veth peer name "$veth_b" netns "$ns_b" ||
    skip "cannot create a veth pair"
else  # each host's eth0 to port pH of bridge br0 in the switch namespace
  ip -n "$ns_s" link add br0 type bridge && ip -n "$ns_s" link set br0 up || skip "cannot create a bridge"
  for h in "${names[@]}"; do
    v=veth_$h
    ip link add "${!v}" netns "$(ns_of "$h")" type veth peer name "p$h" netns "$ns_s" || skip "cannot create a veth pair"
    ip -n "$ns_s" link set "p$h" master br0 && ip -n "$ns_s" link set "p$h" up || skip "cannot attach p$h to the bridge"
  done
fi
setup() {  # ns tmpname addr
  local ns=$1 tmp=$2 addr=$3
  ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 >/dev/null 2>&1
  ip -n "$ns" link set "$tmp" name eth0 &&
    ip -n "$ns" addr add "$addr/24" dev eth0 &&
    ip -n "$ns" link set lo up &&
    ip -n "$ns" link set eth0 up
}
for h in "${names[@]}"; do
  v=veth_$h a=addr_$h
  setup "$(ns_of "$h")" "${!v}" "${!a}" || { echo "$me: setting up $(ns_of "$h") failed" >&2; exit 1; }
done
if [ -n "$rate$delay" ]; then
  if [ -n "$delay" ]; then
    qdisc=(netem delay "$delay" ${rate:+rate "$rate"})
  else
    qdisc=(tbf rate "$rate" burst "$burst" latency "$tbf_latency")
  fi
  capped=()  # "namespace device" pairs
  for h in "${names[@]}"; do capped+=("$(ns_of "$h") eth0"); done
  [ -n "$rate_host" ] && capped=("$(ns_of "$rate_host") eth0")
  [ -n "$rate_host" ] && [ "$hosts" = 3 ] && capped+=("$ns_s p$rate_host")
  for nd in "${capped[@]}"; do
    tc -n "${nd% *}" qdisc add dev "${nd#* }" root "${qdisc[@]}" ||
      skip "tc qdisc add dev ${nd#* } root ${qdisc[*]} failed (kernel without sch_${qdisc[0]}, or a bad value)"
  done
fi
# /etc/netns/NS/hosts is bind-mounted over /etc/hosts by "ip netns exec NS".
for h in "${names[@]}"; do
  ns=$(ns_of "$h")
  mkdir -p "/etc/netns/$ns" || mkdir -p "/etc/netns/$ns"   # a parallel run may rmdir /etc/netns between the two levels
  { printf '127.0.0.1\tlocalhost\n'
    for g in "${names[@]}"; do a=addr_$g n=host_$g; printf '%s\t%s\n' "${!a}" "${!n}"; done; } >"/etc/netns/$ns/hosts"
done
# Wait for the links (veth carrier is immediate, but be sure).
for _ in $(seq 50); do
  up=1
  for h in "${names[@]}"; do ip -n "$(ns_of "$h")" -o link show eth0 | grep -q LOWER_UP || up=; done
  [ -n "$up" ] && break
  sleep 0.1
done

counter() { ip netns exec "$1" cat "/sys/class/net/eth0/statistics/$2"; }
tx_a0=$(counter "$ns_a" tx_bytes) tx_b0=$(counter "$ns_b" tx_bytes)
[ "$hosts" = 3 ] && tx_c0=$(counter "$ns_c" tx_bytes)
txp_a0=$(counter "$ns_a" tx_packets) txp_b0=$(counter "$ns_b" tx_packets)

# ---- the run ----------------------------------------------------------------
EPX_FAKE_SSH_HOSTS= host_list=
for h in "${names[@]}"; do
  n=host_$h a=addr_$h
  EPX_FAKE_SSH_HOSTS+="${!n}=$(ns_of "$h") ${!a}=$(ns_of "$h") "
  host_list+="${host_list:+,}${!n}:$np"
done
export EPX_FAKE_SSH_HOSTS
# --cpus: fake-ssh starts each remote host's orted under taskset -c (host a's
# mpirun gets its own below).
EPX_FAKE_SSH_CPUS=
if [ -n "$cpus" ]; then
  i=0
  for h in "${names[@]}"; do EPX_FAKE_SSH_CPUS+="$(ns_of "$h")=${cpu_sets[$i]} "; i=$((i + 1)); done
fi
export EPX_FAKE_SSH_CPUS
if [ "$verbose" = 1 ]; then export EPX_FAKE_SSH_LOG=/dev/stderr; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ "$uts" = 1 ] || export EPX_FAKE_SSH_NO_UTS=1
# OpenMPI's session directories go under TMPDIR (fake-ssh passes it on to
# orted): one per run, removed by cleanup even when orted was killed.
tmp=$(mktemp -d "/tmp/epx2h-$id.XXXXXX") && export TMPDIR=$tmp

mpirun_cmd=(
  mpirun
  --host "$host_list" -np $((hosts * np)) --map-by slot
  --oversubscribe
  --mca plm_rsh_agent "$here/fake-ssh"
)
if [ "$bare" = 0 ]; then
  export UCX_TLS=tcp,sm,self UCX_NET_DEVICES=eth0
  mpirun_cmd+=(
    --bind-to none
    --mca oob_tcp_if_include eth0
    --mca btl self,vader,tcp --mca btl_tcp_if_include eth0
    --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any
    --mca osc sm,ucx
    -x UCX_TLS -x UCX_NET_DEVICES
  )
fi
# The sanitizers' settings too, when set (fake-ssh gives the remote side a clean environment).
mpirun_cmd+=(-x TMPDIR -x PATH ${LD_LIBRARY_PATH:+-x LD_LIBRARY_PATH} ${ASAN_OPTIONS:+-x ASAN_OPTIONS}
             ${UBSAN_OPTIONS:+-x UBSAN_OPTIONS} "${extra[@]}" "$@")
if [ "$uts" = 1 ]; then
  in_host_a=(ip netns exec "$ns_a" unshare --uts -- /bin/sh -c 'hostname "$1" || exit 1; shift; exec "$@"' sh "$host_a")
else
  in_host_a=(ip netns exec "$ns_a")
fi
[ -n "$cpus" ] && in_host_a+=(taskset -c "${cpu_sets[0]}")
if [ "$launch_in_a" = 1 ]; then  # the program runs mpirun itself: it gets the arguments after --map-by slot
  EPX_TWO_HOSTS_MPIRUN_ARGS=$(printf '%s\n' "${mpirun_cmd[@]:7:${#mpirun_cmd[@]}-7-$#}")
  EPX_TWO_HOSTS_NAMES=
  for h in "${names[@]}"; do n=host_$h; EPX_TWO_HOSTS_NAMES+="${EPX_TWO_HOSTS_NAMES:+ }${!n}"; done
  export EPX_TWO_HOSTS_MPIRUN_ARGS EPX_TWO_HOSTS_NAMES
  mpirun_cmd=("$@")
fi
[ "$verbose" = 1 ] && echo "$me: ip netns exec $ns_a unshare --uts (hostname $host_a): ${mpirun_cmd[*]}" >&2
t0=$(date +%s.%N)
"${in_host_a[@]}" timeout --kill-after=10 "$timeout_s" "${mpirun_cmd[@]}" &
child=$!
wait "$child"
rc=$?
child=
t1=$(date +%s.%N)
[ "$rc" = 124 ] && echo "$me: the run took longer than ${timeout_s}s; killed" >&2

tx_a1=$(counter "$ns_a" tx_bytes) tx_b1=$(counter "$ns_b" tx_bytes)
txp_a1=$(counter "$ns_a" tx_packets) txp_b1=$(counter "$ns_b" tx_packets)
if [ "$hosts" = 2 ]; then
  echo "veth_bytes a_to_b=$((tx_a1 - tx_a0)) b_to_a=$((tx_b1 - tx_b0))"
  echo "veth_packets a_to_b=$((txp_a1 - txp_a0)) b_to_a=$((txp_b1 - txp_b0))"
else  # what each host sent into the switch
  echo "host_bytes_sent a=$((tx_a1 - tx_a0)) b=$((tx_b1 - tx_b0)) c=$(($(counter "$ns_c" tx_bytes) - tx_c0))"
fi
echo "two_hosts_seconds=$(echo "$t1 $t0" | awk '{printf "%.2f", $1 - $2}')"
exit "$rc"
