#!/usr/bin/env bash
# single_node.sh: start a real single-node Slurm on this machine, run one
# command under `srun`, print its output, stop everything, exit with the
# command's status.
#
#   tests/slurm/single_node.sh [-n N] [--mpi TYPE] [--timeout SECS] [--keep]
#                              [--srun-arg ARG]... -- PROGRAM [ARGS...]
#   tests/slurm/single_node.sh --sbatch [-n N] [--srun-arg ARG]... [--during CMD] [--after CMD]
#                              -- SCRIPT [ARGS...]
#
#   -n N            tasks (MPI ranks) for srun, default 4 (with --sbatch: only
#                   when given, else the script's #SBATCH lines decide)
#   --mpi TYPE      srun --mpi=TYPE, default pmix (OpenMPI 4.1 here needs it;
#                   pmi2 aborts in MPI_Init, see docs/cluster.md)
#   --timeout SECS  bound on the whole run, default 120 (EPX_SLURM_TIMEOUT)
#   --keep          keep the temporary directory (configs, daemon logs)
#   --srun-arg ARG  one more argument for srun, or for sbatch (repeatable)
#   --sbatch        submit SCRIPT with `sbatch --wait` instead (e.g. the
#                   templates in configs/slurm/); it runs in a scratch
#                   directory (its output files go with it unless --keep),
#                   its output is printed at the end
#   --during CMD    (--sbatch) run `bash -c CMD` in the job's directory as soon
#                   as the job is submitted, beside it (e.g. to signal it with
#                   scancel); the run fails if CMD fails. Its environment has
#                   EPX_SLURM_JOB_ID (the job id) and SLURM_CONF (scancel,
#                   scontrol and squeue reach this cluster)
#   --after CMD     (--sbatch) run `bash -c CMD` the same way once the job has
#                   ended for good; the run fails if CMD fails
#                   With --during or --after the job is submitted without
#                   --wait and followed with `scontrol show job` through its
#                   requeues until it ends in a final state (COMPLETED,
#                   FAILED, ...); each change of state and restart count is
#                   logged ("job J: RUNNING, restarts 1, ..."), the last one
#                   as "job J ended: STATE, restarts R, exit code X:S". A job
#                   held (REQUEUE_HOLD, Reason JobHeld* or
#                   job_requeued_in_held_state) fails the run at once
#
# e.g.  tests/slurm/single_node.sh -n 4 -- build/bin/epx demo
#       EPX=$PWD/build/bin/epx CONFIG=$PWD/configs/train-tiny.toml \
#         tests/slurm/single_node.sh --sbatch -- configs/slurm/one-node.sbatch
#
# What it does, all inside one fresh directory /tmp/epx-slurm.XXXXXX and
# without systemd or /etc/slurm: makes a munge key and starts `munged -F` on its
# own socket; writes slurm.conf (SLURM_CONF points at it, for the daemons and
# for srun/sinfo) with free ports, this host's `hostname -s` as the one node,
# proctrack/linuxproc + task/none (no cgroups), CPUs=max(8,N) accepted on a
# smaller machine through SlurmdParameters=config_overrides, quick requeues
# (cred_expire=15, sched_interval=2: a requeued job starts again ~16 s after
# its run ended instead of ~3 min), and a random
# FirstJobId (Open MPI names shared memory after the job id: two of these
# clusters at once must not both run job 1); starts `slurmctld -D` and
# `slurmd -D` in the background in their own session, records their PIDs,
# waits until the node is idle; runs `srun -n N --mpi=pmix
# --kill-on-bad-exit=1 --wait=30 --immediate=20 PROGRAM ARGS`; then stops the
# processes it started, by PID (a trap on EXIT/INT/TERM and its own timeout,
# whatever went wrong), and removes the directory. Leftovers of an earlier run that was
# killed (its harness PID gone) are stopped and removed first, found by their
# own directory, never by process name.
#
# Exit status: the program's (srun's: the largest task exit code; with
# --during/--after: 0 for a job that ended COMPLETED with exit code 0, else
# its exit code, or 1, and then 1 if CMD failed);
# 77 (ctest SKIP_RETURN_CODE) when this environment cannot run Slurm: not
# root, a Slurm/munge command or the srun MPI plugin missing, or the daemons
# do not come up; set EPX_SLURM_REQUIRE=1 to make those failures (exit 1)
# instead of skips; 124 when the whole run passed --timeout; 2 on bad usage.
#
# Root only: SlurmUser=root, and munged/slurmd need it. Packages (Debian 12):
# slurmctld slurmd slurm-client munge libpmix-dev (and openmpi-bin
# libopenmpi-dev for MPI programs); slurm-wlm-basic-plugins, pulled in by
# slurmd, holds mpi_pmix.so, which dlopen()s libpmix.so from libpmix-dev.
# See docs/cluster.md.
set -uo pipefail

prog_name=${0##*/}
ntasks=4
mpi_type=pmix
timeout_s=${EPX_SLURM_TIMEOUT:-120}
keep=0
srun_extra=()
mode=srun
ntasks_given=0
during_cmd=
after_cmd=

usage() {
  sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0" >&2
  exit 2
}

while (($#)); do
  case "$1" in
    -n|--ntasks) [[ $# -ge 2 ]] || usage; ntasks=$2; ntasks_given=1; shift 2 ;;
    -n*) ntasks=${1#-n}; ntasks_given=1; shift ;;
    --sbatch) mode=sbatch; shift ;;
    --mpi) [[ $# -ge 2 ]] || usage; mpi_type=$2; shift 2 ;;
    --mpi=*) mpi_type=${1#--mpi=}; shift ;;
    --timeout) [[ $# -ge 2 ]] || usage; timeout_s=$2; shift 2 ;;
    --timeout=*) timeout_s=${1#--timeout=}; shift ;;
    --keep) keep=1; shift ;;
    --srun-arg) [[ $# -ge 2 ]] || usage; srun_extra+=("$2"); shift 2 ;;
    --srun-arg=*) srun_extra+=("${1#--srun-arg=}"); shift ;;
    --during) [[ $# -ge 2 ]] || usage; during_cmd=$2; shift 2 ;;
    --after) [[ $# -ge 2 ]] || usage; after_cmd=$2; shift 2 ;;
    -h|--help) usage ;;
    --) shift; break ;;
    *) echo "$prog_name: unknown option '$1' (the program goes after --)" >&2; usage ;;
  esac
done
(($# >= 1)) || { echo "$prog_name: no program given after --" >&2; usage; }
[[ "$ntasks" =~ ^[1-9][0-9]*$ ]] || { echo "$prog_name: -n wants a positive integer, got '$ntasks'" >&2; exit 2; }
[[ "$timeout_s" =~ ^[1-9][0-9]*$ ]] || { echo "$prog_name: --timeout wants seconds, got '$timeout_s'" >&2; exit 2; }
follow=0
[[ -n "$during_cmd" || -n "$after_cmd" ]] && follow=1
((follow)) && [[ "$mode" != sbatch ]] && { echo "$prog_name: --during and --after go with --sbatch" >&2; exit 2; }

t_start=${EPOCHREALTIME/[.,]/}
# The caller's stdout and stderr, for the traps: a signal that arrives while
# a function runs with its output redirected (wait_until's polls) runs the
# trap with those redirections, and the trap exits without undoing them.
exec {out_fd}>&1 {err_fd}>&2
# No subshell in log(): it runs in signal traps too.
log() {
  local us=$((${EPOCHREALTIME/[.,]/} - t_start))
  printf '[%s %d.%ds] %s\n' "$prog_name" $((us / 1000000)) $((us / 100000 % 10)) "$*" >&2
}

skip() {
  if [[ "${EPX_SLURM_REQUIRE:-0}" == 1 ]]; then
    log "FAILED (EPX_SLURM_REQUIRE=1): $*"
    exit 1
  fi
  log "SKIPPED: $*"
  exit 77
}

# ---------------------------------------------------------------- environment
((EUID == 0)) || skip "needs root (SlurmUser=root, munged and slurmd run as root); uid is $EUID"
for cmd in munged mungekey munge unmunge slurmctld slurmd srun sbatch sinfo scontrol scancel; do
  command -v "$cmd" >/dev/null 2>&1 || skip "'$cmd' not found (Debian: apt-get install slurmctld slurmd slurm-client munge)"
done
command -v setsid >/dev/null 2>&1 || skip "'setsid' not found (Debian: util-linux)"
# ss (iproute2) finds free ports and tells when slurmctld listens; without it
# a bash /dev/tcp probe and plain polling do, a little slower.
have_ss=0
command -v ss >/dev/null 2>&1 && have_ss=1
slurm_version=$(slurmctld -V 2>/dev/null)
[[ "$slurm_version" == slurm* ]] || skip "slurmctld -V does not answer like Slurm: '$(slurmctld -V 2>&1 | head -1)'"
if [[ "$mpi_type" != none ]]; then
  plugin_dir=
  for d in /usr/lib/x86_64-linux-gnu/slurm-wlm /usr/lib/"$(uname -m)"-linux-gnu/slurm-wlm /usr/lib64/slurm /usr/lib/slurm; do
    [[ -e "$d/mpi_none.so" ]] && { plugin_dir=$d; break; }
  done
  # Only the plugins the tests rely on are an environment matter; a misspelt
  # type is left to srun, which names it.
  if [[ "$mpi_type" =~ ^(pmix|pmix_v[0-9]+|pmi2)$ && -n "$plugin_dir" && ! -e "$plugin_dir/mpi_${mpi_type}.so" ]]; then
    skip "Slurm's MPI plugin mpi_${mpi_type}.so is not in $plugin_dir (Debian: slurm-wlm-basic-plugins)"
  fi
  # Slurm's pmix plugin dlopen()s the unversioned libpmix.so from the PMIx
  # directory it was built against: on Debian that file is in libpmix-dev.
  if [[ "$mpi_type" == pmix* && -n "$plugin_dir" && -e "$plugin_dir/mpi_${mpi_type}.so" ]]; then
    pmix_lib=$(grep -aoE '/[[:alnum:]_./+-]*pmix[[:alnum:]_./+-]*/lib' "$(readlink -f "$plugin_dir/mpi_${mpi_type}.so")" | head -1)
    if [[ -n "$pmix_lib" && ! -e "$pmix_lib/libpmix.so" ]]; then
      skip "Slurm's pmix plugin needs $pmix_lib/libpmix.so (Debian: libpmix-dev)"
    fi
  fi
fi

# The mini cluster must not see an outer Slurm job's settings (SLURM_JOB_ID
# would make srun launch a step of a job our slurmctld never heard of).
while IFS= read -r var; do unset "$var"; done < <(compgen -e | grep -E '^(SLURM|SBATCH|SALLOC|SRUN)_' || true)

host=$(hostname -s)
[[ -n "$host" ]] || skip "hostname -s is empty"
base_dir=${EPX_SLURM_TMP:-/tmp}

# Processes that name directory $1 in their command line, working directory,
# open files or environment (SLURM_CONF=$1/slurm.conf: every job task and
# slurmstepd of that run): our daemons and what they started. Not this shell.
# One pass of grep/find over /proc; the greps' own PIDs are gone by the end.
procs_using() {
  local dir=$1 pid
  # "${dir%?}[x]" matches $dir but does not occur in grep's own command line.
  local pat="${dir%?}[${dir: -1}]/"
  {
    grep -lsz -e "$pat" /proc/[0-9]*/cmdline
    grep -lsz -e "^SLURM_CONF=$pat" /proc/[0-9]*/environ
    find /proc/[0-9]*/cwd /proc/[0-9]*/fd -maxdepth 1 -lname "$dir/*" 2>/dev/null
  } 2>/dev/null | sed -n 's|^/proc/\([0-9]*\)/.*|\1|p' | sort -un | while read -r pid; do
    [[ "$pid" == "$$" ]] && continue
    [[ -e "/proc/$pid" ]] && echo "$pid"
  done
}

# Stop PIDs: TERM, up to $2 seconds, then KILL.
stop_pids() {
  local grace=$1; shift
  local pids=("$@") alive i
  ((${#pids[@]})) || return 0
  kill -TERM "${pids[@]}" 2>/dev/null
  for ((i = 0; i < grace * 10; i++)); do
    alive=()
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
    ((${#alive[@]})) || return 0
    sleep 0.1
  done
  kill -KILL "${alive[@]}" 2>/dev/null
  for p in "${alive[@]}"; do wait "$p" 2>/dev/null; done
  return 0
}

# ------------------------------------------- leftovers of killed earlier runs
for old in "$base_dir"/epx-slurm.*; do
  [[ -d "$old" && -f "$old/harness.pid" ]] || continue
  old_pid=$(cat "$old/harness.pid" 2>/dev/null)
  if [[ -n "$old_pid" ]] && kill -0 "$old_pid" 2>/dev/null &&
     tr '\0' ' ' <"/proc/$old_pid/cmdline" 2>/dev/null | grep -q 'single_node\.sh'; then
    continue  # a run in progress (another user of this machine): leave it
  fi
  mapfile -t stale < <(procs_using "$old")
  log "removing leftovers of an earlier run: $old (processes: ${stale[*]:-none})"
  stop_pids 3 "${stale[@]}"
  [[ -f "$old/keep" ]] || rm -rf "$old"
done

# -------------------------------------------------------------- our directory
tmp=$(mktemp -d "$base_dir/epx-slurm.XXXXXX") || skip "cannot create a directory in $base_dir"
chmod 700 "$tmp"
echo $$ >"$tmp/harness.pid"
mkdir -p "$tmp"/{munge,state,spool/slurmd-"$host",log,run,tmpfs}
started=()      # PIDs of the daemons we started, in start order
watchdog=
srun_pid=
hook_pid=       # --during or --after CMD while it runs
job_id=         # --during/--after: the submitted job
status=1
cleaned=0

print_logs() {  # print_logs [FILE...]: the last lines of the daemons' logs
  local f files=("$@")
  ((${#files[@]})) || files=("$tmp"/log/*)
  for f in "${files[@]}"; do
    [[ -s "$f" ]] || continue
    echo "----- ${f#"$tmp"/} (last 15 lines) -----" >&2
    tail -n 15 "$f" >&2
  done
  ((keep)) || echo "----- (--keep keeps $tmp with every log) -----" >&2
}

print_job_output() {  # --sbatch: the job's output file, once
  local f
  for f in "$tmp"/job/slurm-*.out; do
    [[ -e "$f" && ! -e "$f.shown" ]] || continue
    echo "----- output of the batch job (${f##*/}) -----"
    cat "$f"
    echo "----- end of ${f##*/} -----"
    : >"$f.shown"
  done
}

cleanup() {
  ((cleaned)) && return
  cleaned=1
  trap '' INT TERM USR1
  exec 1>&"$out_fd" 2>&"$err_fd"
  [[ -n "$watchdog" ]] && kill "$watchdog" 2>/dev/null
  # Interrupted while the job runs: cancel it (every job of our own cluster is
  # ours), which ends its tasks and srun within KillWait; then srun itself.
  if [[ -n "$srun_pid" ]] && kill -0 "$srun_pid" 2>/dev/null; then
    if ((${#started[@]} >= 2)) && kill -0 "${started[1]}" 2>/dev/null; then
      timeout 5 env SLURM_CONF="$slurm_conf" scancel --quiet --full --user=root 2>/dev/null
    fi
    local i
    for ((i = 0; i < 80; i++)); do kill -0 "$srun_pid" 2>/dev/null || break; sleep 0.1; done
    stop_pids 2 "$srun_pid"
  fi
  # A followed job (--during/--after) still in the queue: cancel it too.
  if [[ -n "$job_id" ]] && ((${#started[@]} >= 2)) && kill -0 "${started[1]}" 2>/dev/null; then
    timeout 5 env SLURM_CONF="$slurm_conf" scancel --quiet --full --user=root 2>/dev/null
  fi
  [[ -n "$hook_pid" ]] && stop_pids 2 "$hook_pid"
  [[ "$mode" == sbatch ]] && print_job_output
  # Daemons in reverse start order: slurmd, slurmctld, munged.
  local rev=()
  for ((i = ${#started[@]} - 1; i >= 0; i--)); do rev+=("${started[i]}"); done
  stop_pids 5 "${rev[@]}"
  # Anything else this run started (slurmstepd, job tasks): found by our directory.
  local rest=()
  mapfile -t rest < <(procs_using "$tmp")
  if ((${#rest[@]})); then
    log "stopping leftover processes of this run: $(for p in "${rest[@]}"; do printf "%s(%s) " "$p" "$(tr "\0" " " <"/proc/$p/cmdline" 2>/dev/null | cut -c1-60)"; done)"
    stop_pids 3 "${rest[@]}"
  fi
  if ((keep)); then
    touch "$tmp/keep"
    rm -f "$tmp/harness.pid"
    log "kept $tmp"
  else
    rm -rf "$tmp"
  fi
  log "stopped what this run started; exit status $status"
}
on_signal() {
  trap '' INT TERM
  exec 1>&"$out_fd" 2>&"$err_fd"
  log "got SIG$1: stopping"
  status=$((128 + $2))
  exit "$status"
}
on_timeout() {
  trap '' INT TERM USR1
  exec 1>&"$out_fd" 2>&"$err_fd"
  log "TIMEOUT: the whole run passed ${timeout_s}s; stopping"
  print_logs
  status=124
  exit 124
}
trap 'cleanup' EXIT
trap 'on_signal INT 2' INT
trap 'on_signal TERM 15' TERM
trap 'on_timeout' USR1

# Watchdog: USR1 to this shell when the time is up.
# Only a sleep that ran out sends it (not one killed with our process group).
bash -c 's=; trap '\''[[ -n $s ]] && kill $s 2>/dev/null; exit 0'\'' TERM; sleep "$1" & s=$!; wait $s && kill -USR1 "$2"' \
  watchdog "$timeout_s" "$$" &
watchdog=$!

# ------------------------------------------------------------------- munge
# Our own key and socket: nothing under /etc/munge or /run/munge is touched.
munge_socket=$tmp/munge/munge.socket.2
mungekey --create --keyfile="$tmp/munge/munge.key" >"$tmp/log/mungekey.out" 2>&1 ||
  dd if=/dev/urandom of="$tmp/munge/munge.key" bs=1024 count=1 status=none ||
  skip "cannot create a munge key: $(cat "$tmp/log/mungekey.out")"
chmod 600 "$tmp/munge/munge.key"
setsid munged -F --force --key-file="$tmp/munge/munge.key" --socket="$munge_socket" \
  --pid-file="$tmp/run/munged.pid" --log-file="$tmp/log/munged.log" --seed-file="$tmp/munge/munged.seed" \
  --num-threads=2 >"$tmp/log/munged.out" 2>&1 &
started+=($!)

# wait_until SECONDS COMMAND...: poll every 0.1 s until COMMAND succeeds (0),
# one of our daemons exits (1, its PID in $dead_pid), or time is up (2). With
# $bind_log set: also 1 (the daemon started last) as soon as that log says
# the port is taken (slurmctld retries binding for ~10 s before it gives up).
dead_pid=
bind_log=
bound_fail() {  # the daemon of log $1 failed to bind its port
  grep -q 'Address already in use' "$1" 2>/dev/null
}
wait_until() {
  local limit=$1; shift
  local i p
  for ((i = 0; i < limit * 10; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    if [[ -n "$bind_log" ]] && bound_fail "$bind_log"; then
      dead_pid=${started[-1]}
      return 1
    fi
    for p in "${started[@]}"; do
      kill -0 "$p" 2>/dev/null || { dead_pid=$p; return 1; }
    done
    sleep 0.1
  done
  return 2
}
wait_for() {  # wait_for SECONDS WHAT COMMAND...: wait_until, or skip
  local limit=$1 what=$2; shift 2
  wait_until "$limit" "$@"
  case $? in
    0) return 0 ;;
    1) print_logs; skip "a daemon exited while waiting for $what (pid $dead_pid)" ;;
    *) print_logs; skip "timed out after ${limit}s waiting for $what" ;;
  esac
}
munge_works() { munge -n -S "$munge_socket" | unmunge -S "$munge_socket"; }
wait_for 10 "munged" munge_works

# ----------------------------------------------------------------- ports
# Two free TCP ports (not listening now, not in the ephemeral range, and not
# consecutive with each other, since SlurmctldPort may be a range).
port_free() {
  if ((have_ss)) && ss -Htan "( sport = :$1 )" 2>/dev/null | grep -q .; then return 1; fi
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}
pick_port() {
  local p tries
  for ((tries = 0; tries < 200; tries++)); do
    p=$((20000 + RANDOM % 12000))
    [[ " $* " == *" $p "* ]] && continue
    port_free "$p" && { echo "$p"; return 0; }
  done
  return 1
}
pick_ports() {  # sets ctld_port and slurmd_port
  ctld_port=$(pick_port) || skip "no free TCP port"
  slurmd_port=$(pick_port "$ctld_port" $((ctld_port + 1))) || skip "no free TCP port"
}

# ---------------------------------------------------------------- slurm.conf
cpus=$((ntasks > 8 ? ntasks : 8))
cluster=epx$(basename "$tmp" | tr -dc 'a-z0-9' | tail -c 8)
# Job IDs start at a random number: OpenMPI names its shared-memory segments
# and session directory after the job (the PMIx namespace slurm.pmix.JOB.STEP),
# so two of these clusters running at once on one host, both at job 1, would
# map each other's segments (seen: a segfault in btl vader).
first_job_id=$((((RANDOM << 15) | RANDOM) % 60000000 + 1000))
# SLURM_CONF is given to each Slurm command, not exported, so that only the
# daemons, srun and the job's tasks carry it (procs_using finds them by it).
slurm_conf=$tmp/slurm.conf
with_conf() { SLURM_CONF=$slurm_conf "$@"; }
write_conf() {
cat >"$slurm_conf" <<EOF
# Written by $prog_name for one run; removed with $tmp.
ClusterName=$cluster
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again
# (default 120 s); sched_interval: the main scheduling pass (default 60 s),
# which starts a requeued job once it may.
AuthInfo=socket=$munge_socket,cred_expire=15
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool/slurmd-%n
SlurmctldPidFile=$tmp/run/slurmctld.pid
SlurmdPidFile=$tmp/run/slurmd-%n.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
TmpFS=$tmp/tmpfs
# No cgroups here (a container or VM without systemd): processes are tracked
# by walking /proc, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
# The node claims CPUs=$cpus whatever the hardware has, so -n 4 and -n 8 fit
# on a 2-core machine (ranks then share cores).
SlurmdParameters=config_overrides
ReturnToService=2
MessageTimeout=10
TCPTimeout=5
KillWait=2
UnkillableStepTimeout=30
InactiveLimit=0
MinJobAge=10
FirstJobId=$first_job_id
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=epx Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}
# Slurm reads cgroup.conf beside slurm.conf if it exists; none is wanted.

# Start slurmctld, then slurmd. The ports were free a moment ago; should one
# be taken in between ("Address already in use"), retry with new ones.
# EPX_SLURM_PORTS=CTLD,SLURMD fixes them for the first attempt.
node_idle() { [[ "$(with_conf sinfo -h -n "$host" -o %t 2>/dev/null)" == idle* ]]; }
# scontrol ping only once our slurmctld listens: against a closed port, or
# one that another program holds, it takes MessageTimeout (10 s) to give up.
listens() { ((!have_ss)) || ss -Htlnp "( sport = :$1 )" 2>/dev/null | grep -q "pid=$2,"; }
ctld_up() { listens "$ctld_port" "${started[-1]}" && with_conf scontrol ping; }
drop_last_daemon() {  # stop and forget the daemon started last
  stop_pids 5 "${started[-1]}"
  wait "${started[-1]}" 2>/dev/null
  unset 'started[-1]'
}
for attempt in 1 2 3; do
  if [[ $attempt == 1 && "${EPX_SLURM_PORTS:-}" =~ ^([0-9]+),([0-9]+)$ ]]; then
    ctld_port=${BASH_REMATCH[1]} slurmd_port=${BASH_REMATCH[2]}
  else
    pick_ports
  fi
  write_conf
  rm -rf "${tmp:?}/state"/* "$tmp/spool/slurmd-$host"/*
  log "munged up; starting slurmctld (port $ctld_port) and slurmd (port $slurmd_port) for node $host in $tmp, first job id $first_job_id"
  setsid env SLURM_CONF="$slurm_conf" slurmctld -D -i -f "$slurm_conf" >"$tmp/log/slurmctld.out" 2>&1 &
  started+=($!)
  bind_log=$tmp/log/slurmctld.out
  wait_until 20 ctld_up
  rc=$?
  if ((rc == 1)) && [[ "$dead_pid" == "${started[-1]}" ]] && bound_fail "$tmp/log/slurmctld.out"; then
    log "slurmctld: port $ctld_port was taken meanwhile; trying other ports"
    drop_last_daemon
    continue
  fi
  if ((rc != 0)); then
    print_logs
    ((rc == 1)) && skip "slurmctld did not come up: a daemon exited (pid $dead_pid)"
    skip "slurmctld did not answer in 20s"
  fi
  setsid env SLURM_CONF="$slurm_conf" slurmd -D -f "$slurm_conf" -N "$host" >"$tmp/log/slurmd.out" 2>&1 &
  started+=($!)
  bind_log=$tmp/log/slurmd.out
  wait_until 30 node_idle
  rc=$?
  bind_log=
  if ((rc == 1)) && [[ "$dead_pid" == "${started[-1]}" ]] && bound_fail "$tmp/log/slurmd.out"; then
    log "slurmd: port $slurmd_port was taken meanwhile; trying other ports"
    drop_last_daemon   # slurmd
    drop_last_daemon   # this attempt's slurmctld
    continue
  fi
  if ((rc != 0)); then
    print_logs
    ((rc == 1)) && skip "node $host did not come up: a daemon exited (pid $dead_pid)"
    skip "node $host not idle after 30s"
  fi
  break
done
((${#started[@]} == 3)) || { print_logs; skip "Slurm's ports were taken three times over"; }
echo "${started[*]}" >"$tmp/run/daemons.pids"
log "node $host idle (daemons: munged ${started[0]}, slurmctld ${started[1]}, slurmd ${started[2]})"

# --------------------------------------------------------------------- run
if [[ "$mode" == srun ]]; then
  srun_cmd=(env SLURM_CONF="$slurm_conf" srun -n "$ntasks" --mpi="$mpi_type" --kill-on-bad-exit=1 --wait=30 --immediate=20
            "${srun_extra[@]}" -- "$@")
else
  [[ -r "$1" ]] || { log "no batch script '$1'"; exit 2; }
  script=$(readlink -f "$1"); shift
  mkdir -p "$tmp/job"
  n_arg=()
  ((ntasks_given)) && n_arg=(--ntasks="$ntasks")
  # The job's environment is ours (sbatch --export=ALL), SLURM_CONF included.
  srun_cmd=(env SLURM_CONF="$slurm_conf" sbatch --wait --quiet --chdir="$tmp/job"
            --output="$tmp/job/slurm-%j.out" "${n_arg[@]}" "${srun_extra[@]}" "$script" "$@")
fi

# --during/--after: run_hook WHAT CMD starts `bash -c CMD` in the job's
# directory (hook_pid); wait_hook WHAT waits for it, interruptibly (the traps
# run meanwhile), and sets hook_status.
hook_status=0
run_hook() {
  local what=$1 cmd=$2
  log "$what: $cmd"
  (cd "$tmp/job" && EPX_SLURM_JOB_ID=$job_id SLURM_CONF=$slurm_conf exec bash -c "$cmd") &
  hook_pid=$!
}
wait_hook() {
  local what=$1
  wait "$hook_pid"
  hook_status=$?
  hook_pid=
  ((hook_status == 0)) || log "$what exited with status $hook_status"
}

# --during/--after: follow job $job_id with scontrol until it ends in a final
# state, through its requeues; sets job_state, job_restarts, job_exit,
# job_reason. Returns 1 when the job is held (it would never end) or
# scontrol stops answering.
job_state='' job_restarts='' job_exit='' job_reason=''
follow_job() {
  local line last='' failures=0
  while :; do
    line=$(timeout 15 env SLURM_CONF="$slurm_conf" scontrol -o show job "$job_id" 2>&1)
    if [[ "$line" =~ JobState=([A-Z_]+) ]]; then
      job_state=${BASH_REMATCH[1]}
      [[ "$line" =~ Restarts=([0-9]+) ]] && job_restarts=${BASH_REMATCH[1]}
      [[ "$line" =~ ExitCode=([0-9]+:[0-9]+) ]] && job_exit=${BASH_REMATCH[1]}
      [[ "$line" =~ Reason=([^ ]+) ]] && job_reason=${BASH_REMATCH[1]}
      failures=0
    elif ((++failures >= 20)); then
      log "scontrol show job $job_id does not answer: $line"
      return 1
    else
      sleep 0.5
      continue
    fi
    if [[ "$job_state $job_restarts $job_reason" != "$last" ]]; then
      last="$job_state $job_restarts $job_reason"
      log "job $job_id: $job_state, restarts $job_restarts, reason $job_reason, exit code $job_exit"
    fi
    case $job_state in
      COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|PREEMPTED|BOOT_FAIL|DEADLINE|OUT_OF_MEMORY)
        log "job $job_id ended: $job_state, restarts $job_restarts, exit code $job_exit"
        return 0 ;;
      REQUEUE_HOLD|SPECIAL_EXIT)
        log "job $job_id is held ($job_state): it will not run again by itself"
        return 1 ;;
      PENDING)
        if [[ "$job_reason" == JobHeld* || "$job_reason" == *held_state* ]]; then
          log "job $job_id is held ($job_reason): it will not run again by itself"
          return 1
        fi ;;
    esac
    sleep 0.5
  done
}

if ((follow)); then
  submit=(env SLURM_CONF="$slurm_conf" sbatch --parsable --chdir="$tmp/job"
          --output="$tmp/job/slurm-%j.out" "${n_arg[@]}" "${srun_extra[@]}" "$script" "$@")
  log "submitting: ${submit[*]:1}"
  "${submit[@]}" >"$tmp/job/submitted" &
  srun_pid=$!
  wait "$srun_pid"
  status=$?
  srun_pid=
  job_id=$(cut -d';' -f1 "$tmp/job/submitted")
  if ((status != 0)) || [[ ! "$job_id" =~ ^[0-9]+$ ]]; then
    log "sbatch exited with status $status, job id '$job_id'"
    job_id=
    print_logs "$tmp/log/slurmctld.log"
    exit 1
  fi
  log "submitted batch job $job_id"
  if [[ -n "$during_cmd" ]]; then run_hook "--during" "$during_cmd"; fi
  follow_job
  followed=$?
  if ((followed != 0)); then
    status=1
  elif [[ "$job_state" == COMPLETED && "$job_exit" == 0:0 ]]; then
    status=0
  else
    status=${job_exit%%:*}
    ((status != 0)) || status=1
  fi
  if [[ -n "$during_cmd" && -n "$hook_pid" ]]; then
    if ((followed == 0)); then
      wait_hook "--during"
      ((hook_status == 0)) || status=1
    else
      stop_pids 2 "$hook_pid"   # the job will not end by itself: no need to wait for CMD
      hook_pid=
    fi
  fi
  print_job_output
  if [[ -n "$after_cmd" ]] && ((followed == 0)); then
    run_hook "--after" "$after_cmd"
    wait_hook "--after"
    ((hook_status == 0 || status != 0)) || status=1
  fi
  log "job $job_id: exit status $status"
  ((status == 0)) || print_logs "$tmp/log/slurmctld.log" "$tmp/log/slurmd.log"
  exit "$status"
fi
log "running: ${srun_cmd[*]:1}"
"${srun_cmd[@]}" &
srun_pid=$!
wait "$srun_pid"
status=$?
srun_pid=
print_job_output
log "$mode exited with status $status"
if ((status != 0)); then
  print_logs "$tmp/log/slurmd.out"
fi
exit "$status"
