/* probe_mpi: the smallest check that an MPI launch works the way epx needs it.
 *
 * MPI_Init_thread(MPI_THREAD_MULTIPLE) and the provided level, rank and size,
 * the node split (MPI_Comm_split_type SHARED), an Allreduce, a 4 MiB ring
 * exchange, and an MPI-3
 * shared window (MPI_Win_allocate_shared) that every rank of a node writes and
 * reads. Prints one line per rank ("probe: rank R of N ...") and, on rank 0,
 * "probe: OK size=N" when everything checked out. Exits 0 on success, 1 on a
 * wrong result (every rank agrees through a final Allreduce), and aborts if
 * MPI itself fails.
 *
 * Build: mpicc -O2 -o probe_mpi probe_mpi.c
 * Run:   srun -n 4 --mpi=pmix ./probe_mpi      (or mpirun -n 4 ./probe_mpi)
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "SINGLE";
    case MPI_THREAD_FUNNELED: return "FUNNELED";
    case MPI_THREAD_SERIALIZED: return "SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MULTIPLE";
    default: return "?";
  }
}

int main(int argc, char **argv) {
  int provided = -1;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
    fprintf(stderr, "probe: MPI_Init_thread failed\n");
    return 1;
  }
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int bad = 0;
  if (provided != MPI_THREAD_MULTIPLE) {
    fprintf(stderr, "probe: rank %d: MPI_THREAD_MULTIPLE requested, %s provided\n", rank,
            level_name(provided));
    bad = 1;
  }

  /* Ranks of this node (the shared-memory split epx's topology uses). */
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int local_rank = 0, local_size = 0;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);

  char host[MPI_MAX_PROCESSOR_NAME];
  int host_len = 0;
  MPI_Get_processor_name(host, &host_len);
  const char *slurm_procid = getenv("SLURM_PROCID");
  printf("probe: rank %d of %d on %s (local %d of %d) pid %d thread %s SLURM_PROCID=%s\n", rank, size,
         host, local_rank, local_size, (int)getpid(), level_name(provided),
         slurm_procid ? slurm_procid : "-");
  fflush(stdout);

  /* Allreduce: the sum of 1..size. */
  long mine = rank + 1, sum = 0;
  MPI_Allreduce(&mine, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (sum != (long)size * (size + 1) / 2) {
    fprintf(stderr, "probe: rank %d: allreduce gave %ld, expected %ld\n", rank, sum,
            (long)size * (size + 1) / 2);
    bad = 1;
  }

  /* A ring exchange of 4 MiB (large enough for the rendezvous/single-copy
   * path of the shared-memory transport, which some containers forbid). */
  {
    const int count = 1 << 20;
    int *out = malloc(sizeof(int) * count), *in = malloc(sizeof(int) * count);
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    for (int i = 0; i < count; ++i) out[i] = rank * 7 + i;
    MPI_Sendrecv(out, count, MPI_INT, next, 7, in, count, MPI_INT, prev, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    for (int i = 0; i < count; ++i) {
      if (in[i] != prev * 7 + i) {
        fprintf(stderr, "probe: rank %d: ring message from %d wrong at %d\n", rank, prev, i);
        bad = 1;
        break;
      }
    }
    free(out);
    free(in);
  }

  /* Shared window: 64 bytes per rank (padded, as epx pads its windows); each
   * rank writes its segment, then reads every peer's segment directly. */
  const MPI_Aint seg = 64;
  long *base = NULL;
  MPI_Win win;
  if (MPI_Win_allocate_shared(seg, 1, MPI_INFO_NULL, node, &base, &win) != MPI_SUCCESS) {
    fprintf(stderr, "probe: rank %d: MPI_Win_allocate_shared failed\n", rank);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Win_lock_all(MPI_MODE_NOCHECK, win);
  base[0] = 1000 + rank;
  MPI_Win_sync(win);
  MPI_Barrier(node);
  MPI_Win_sync(win);
  for (int peer = 0; peer < local_size; ++peer) {
    MPI_Aint peer_size = 0;
    int disp = 0;
    long *peer_base = NULL;
    MPI_Win_shared_query(win, peer, &peer_size, &disp, &peer_base);
    int peer_world = -1;
    /* The node communicator keeps world order (key = world rank), so the
     * peer's world rank is found by translating its node rank. */
    MPI_Group world_group, node_group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Comm_group(node, &node_group);
    MPI_Group_translate_ranks(node_group, 1, &peer, world_group, &peer_world);
    MPI_Group_free(&world_group);
    MPI_Group_free(&node_group);
    if (peer_size < seg || peer_base == NULL || peer_base[0] != 1000 + peer_world) {
      fprintf(stderr, "probe: rank %d: shared window of local peer %d reads %ld (size %ld), expected %d\n",
              rank, peer, peer_base ? peer_base[0] : -1L, (long)peer_size, 1000 + peer_world);
      bad = 1;
    }
  }
  MPI_Win_unlock_all(win);
  MPI_Win_free(&win);
  MPI_Comm_free(&node);

  int any_bad = 0;
  MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) {
    if (any_bad) {
      printf("probe: FAILED size=%d\n", size);
    } else {
      printf("probe: OK size=%d thread=%s allreduce=%ld ring=4MiB shared-window=yes\n", size, level_name(provided), sum);
    }
  }
  MPI_Finalize();
  return any_bad ? 1 : 0;
}
