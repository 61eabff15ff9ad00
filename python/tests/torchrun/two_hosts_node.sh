#!/bin/bash
# One epx.launch per emulated host: tests/mpi/two_hosts.sh starts this script
# once on each of its two hosts (under mpirun, which gives the host's number
# as OMPI_COMM_WORLD_RANK); epx.launch strips MPI's variables, so the program
# sees only the torchrun environment and meets through host a's address.
#
#   two_hosts.sh --np-per-host 1 -x PYTHONPATH -- two_hosts_node.sh PYTHON MASTER_ADDR PORT NPROC PROGRAM [ARGS...]
set -eu
python=$1 master=$2 port=$3 nproc=$4
shift 4
exec "$python" -m epx.launch --nnodes 2 --node-rank "${OMPI_COMM_WORLD_RANK:?not started by mpirun}" \
  --master-addr "$master" --master-port "$port" --nproc-per-node "$nproc" --timeout 240 "$@"
