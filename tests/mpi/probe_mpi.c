/* probe_mpi: checks that an MPI launch spans the hosts it should, the way the
 * epx MPI transport uses MPI (tests/mpi/two_hosts.sh, docs/cluster.md).
 *
 *   probe_mpi [--bytes N] [--reps R] [--expect-nodes K] [--expect-local L] [--no-rma]
 *
 * 1. MPI_Init_thread(MPI_THREAD_MULTIPLE), provided level checked.
 * 2. Topology: MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) gives the node
 *    communicator; node id = rank among the node leaders (local rank 0).
 *    One line per rank: "probe_rank rank=R host=H node=N local_rank=L local_size=S".
 * 3. MPI_Win_allocate_shared inside each node (64-byte padded segments), every
 *    rank writes its own segment and reads its node peer's directly.
 * 4. One-sided MPI_Put across nodes (MPI_Win_allocate on the world, lock_all),
 *    unless --no-rma.
 * 5. Point to point: each rank exchanges N bytes (R times) with the rank that
 *    has the same local rank on the next node (Isend/Irecv, both directions at
 *    once), checks the content, and rank 0 prints the payload that crossed
 *    between node 0 and node 1:
 *      "probe_bytes a_to_b=X b_to_a=Y"   (node 0 -> node 1, node 1 -> node 0)
 *      "probe_time seconds=T mb_per_s=M" (the exchange, slowest rank; M counts
 *                                         a_to_b bytes / T, in 10^6 bytes/s)
 * Exit status 0 when every check passes, 1 otherwise ("probe_error ..." lines).
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int g_rank = -1;
static int g_fail = 0;

#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      fprintf(stderr, "probe_error rank=%d: ", g_rank);   \
      fprintf(stderr, __VA_ARGS__);                       \
      fprintf(stderr, "\n");                              \
      g_fail = 1;                                         \
    }                                                     \
  } while (0)

static MPI_Aint pad64(MPI_Aint n) { return (n + 63) / 64 * 64; }

static unsigned char pattern(int src, long long i) { return (unsigned char)(src * 131 + i * 7 + (i >> 11)); }

int main(int argc, char** argv) {
  long long bytes = 16LL << 20;
  int reps = 1, expect_nodes = 0, expect_local = 0, rma = 1;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--bytes") && i + 1 < argc) bytes = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--expect-nodes") && i + 1 < argc) expect_nodes = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--expect-local") && i + 1 < argc) expect_local = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--no-rma")) rma = 0;
    else { fprintf(stderr, "probe_mpi: unknown argument %s\n", argv[i]); return 2; }
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int size;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CHECK(provided == MPI_THREAD_MULTIPLE, "MPI_THREAD_MULTIPLE not provided (got %d)", provided);

  /* Topology. */
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_rank, MPI_INFO_NULL, &node);
  int lrank, lsize;
  MPI_Comm_rank(node, &lrank);
  MPI_Comm_size(node, &lsize);
  MPI_Comm leaders;
  MPI_Comm_split(MPI_COMM_WORLD, lrank == 0 ? 0 : MPI_UNDEFINED, g_rank, &leaders);
  int node_id = 0, nnodes = 0;
  if (lrank == 0) {
    MPI_Comm_rank(leaders, &node_id);
    MPI_Comm_size(leaders, &nnodes);
    MPI_Comm_free(&leaders);
  }
  MPI_Bcast(&node_id, 1, MPI_INT, 0, node);
  MPI_Bcast(&nnodes, 1, MPI_INT, 0, node);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  printf("probe_rank rank=%d host=%s node=%d local_rank=%d local_size=%d\n", g_rank, host, node_id, lrank, lsize);
  fflush(stdout);
  if (expect_nodes) CHECK(nnodes == expect_nodes, "%d nodes, expected %d", nnodes, expect_nodes);
  if (expect_local) CHECK(lsize == expect_local, "%d ranks on node %d, expected %d", lsize, node_id, expect_local);
  /* Every rank of a node must report the same host name, and nodes differ. */
  char* hosts = malloc((size_t)size * 256);
  int* nodes = malloc((size_t)size * sizeof(int));
  MPI_Allgather(host, 256, MPI_CHAR, hosts, 256, MPI_CHAR, MPI_COMM_WORLD);
  MPI_Allgather(&node_id, 1, MPI_INT, nodes, 1, MPI_INT, MPI_COMM_WORLD);
  for (int r = 0; r < size; ++r) {
    int same_host = strcmp(hosts + 256 * r, host) == 0;
    int same_node = nodes[r] == node_id;
    CHECK(same_host == same_node, "rank %d: host %s node %d, but I am host %s node %d", r, hosts + 256 * r,
          nodes[r], host, node_id);
  }

  /* The peers across nodes: the ranks with my local rank on the next and the
     previous node (the two-hop path's partners). */
  int next = -1, prev = -1;
  {
    int* lranks = malloc((size_t)size * sizeof(int));
    MPI_Allgather(&lrank, 1, MPI_INT, lranks, 1, MPI_INT, MPI_COMM_WORLD);
    for (int r = 0; r < size; ++r) {
      if (lranks[r] != lrank) continue;
      if (nodes[r] == (node_id + 1) % nnodes) next = r;
      if (nodes[r] == (node_id + nnodes - 1) % nnodes) prev = r;
    }
    free(lranks);
  }

  /* Shared window inside the node. */
  {
    const MPI_Aint seg = pad64(100); /* 100 bytes asked, 128 allocated */
    unsigned char* mine = NULL;
    MPI_Win win;
    MPI_Win_allocate_shared(seg, 1, MPI_INFO_NULL, node, &mine, &win);
    MPI_Win_lock_all(MPI_MODE_NOCHECK, win);
    for (MPI_Aint i = 0; i < seg; ++i) mine[i] = (unsigned char)(lrank * 17 + i);
    MPI_Win_sync(win);
    MPI_Barrier(node);
    MPI_Win_sync(win);
    int peer = (lrank + 1) % lsize;
    MPI_Aint psize;
    int pdisp;
    unsigned char* theirs = NULL;
    MPI_Win_shared_query(win, peer, &psize, &pdisp, &theirs);
    CHECK(psize == seg, "shared segment of local rank %d is %ld bytes, expected %ld", peer, (long)psize, (long)seg);
    int bad = 0;
    for (MPI_Aint i = 0; i < seg && theirs; ++i) bad += theirs[i] != (unsigned char)(peer * 17 + i);
    CHECK(theirs && bad == 0, "shared window: %d wrong bytes in local rank %d's segment", bad, peer);
    MPI_Win_unlock_all(win);
    MPI_Win_free(&win);
  }

  /* One-sided put across nodes. */
  if (rma && nnodes > 1 && next >= 0 && prev >= 0) {
    const MPI_Aint seg = pad64(4096);
    unsigned char* mine = NULL;
    MPI_Win win;
    MPI_Win_allocate(seg, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &mine, &win);
    memset(mine, 0, (size_t)seg);
    MPI_Barrier(MPI_COMM_WORLD);
    int target = next;
    unsigned char* src = malloc((size_t)seg);
    for (MPI_Aint i = 0; i < seg; ++i) src[i] = pattern(g_rank, i);
    MPI_Win_lock_all(0, win);
    MPI_Put(src, (int)seg, MPI_BYTE, target, 0, (int)seg, MPI_BYTE, win);
    MPI_Win_flush(target, win);
    MPI_Win_unlock_all(win);
    MPI_Barrier(MPI_COMM_WORLD);
    int from = prev;
    int bad = 0;
    MPI_Win_lock(MPI_LOCK_SHARED, g_rank, 0, win);
    for (MPI_Aint i = 0; i < seg; ++i) bad += mine[i] != pattern(from, i);
    MPI_Win_unlock(g_rank, win);
    CHECK(bad == 0, "MPI_Put from rank %d: %d wrong bytes", from, bad);
    free(src);
    MPI_Win_free(&win);
  }

  /* Point to point with the same local rank on the next / previous node. */
  long long sent_ab = 0, sent_ba = 0;
  double seconds = 0;
  if (nnodes > 1 && bytes > 0) {
    if (next >= 0 && prev >= 0) {
      unsigned char* sbuf = malloc((size_t)bytes);
      unsigned char* rbuf = malloc((size_t)bytes);
      for (long long i = 0; i < bytes; ++i) sbuf[i] = pattern(g_rank, i);
      const long long chunk = 1LL << 30; /* MPI counts are int */
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      for (int rep = 0; rep < reps; ++rep) {
        int nreq = 0;
        MPI_Request req[64];
        for (long long off = 0; off < bytes; off += chunk) {
          int n = (int)(bytes - off < chunk ? bytes - off : chunk);
          MPI_Irecv(rbuf + off, n, MPI_BYTE, prev, 7, MPI_COMM_WORLD, &req[nreq++]);
          MPI_Isend(sbuf + off, n, MPI_BYTE, next, 7, MPI_COMM_WORLD, &req[nreq++]);
        }
        MPI_Waitall(nreq, req, MPI_STATUSES_IGNORE);
      }
      double dt = MPI_Wtime() - t0;
      long long bad = 0;
      for (long long i = 0; i < bytes; ++i) bad += rbuf[i] != pattern(prev, i);
      CHECK(bad == 0, "point to point from rank %d: %lld wrong bytes", prev, bad);
      long long mine = bytes * reps;
      if (node_id == 0 && nodes[next] == 1) sent_ab = mine;
      if (node_id == 1 && nodes[next] == 0) sent_ba = mine;
      free(sbuf);
      free(rbuf);
      MPI_Reduce(&dt, &seconds, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    } else {
      CHECK(0, "no rank with local rank %d on the next node", lrank);
      double dt = 0;
      MPI_Reduce(&dt, &seconds, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    }
  }
  long long tot[2] = {sent_ab, sent_ba}, sum[2] = {0, 0};
  MPI_Reduce(tot, sum, 2, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
  int fail = 0;
  MPI_Allreduce(&g_fail, &fail, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (g_rank == 0) {
    printf("probe_nodes nodes=%d ranks=%d thread_multiple=%d\n", nnodes, size, provided == MPI_THREAD_MULTIPLE);
    printf("probe_bytes a_to_b=%lld b_to_a=%lld\n", sum[0], sum[1]);
    printf("probe_time seconds=%.6f mb_per_s=%.1f\n", seconds, seconds > 0 ? sum[0] / seconds / 1e6 : 0.0);
    printf("probe_result %s\n", fail ? "FAIL" : "OK");
    fflush(stdout);
  }
  free(hosts);
  free(nodes);
  MPI_Comm_free(&node);
  MPI_Finalize();
  return fail ? 1 : 0;
}
