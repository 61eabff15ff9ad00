# Four in-process ranks (threads, as 2 emulated nodes) dispatch their tokens
# to the ranks holding their top-2 experts and combine the results back.
import numpy as np

import epx

T, H, E, K = 32, 16, 8, 2  # tokens per rank, hidden, experts (2 per rank), top-k


def rank_main(t):
    buf = epx.Buffer(t, num_experts=E, hidden=H, dtype="f32", max_tokens_per_rank=T, max_topk=K)
    rng = np.random.default_rng(t.rank)
    x = rng.standard_normal((T, H), dtype=np.float32)
    topk_idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    r = buf.dispatch(x, topk_idx)        # r.recv_x: a zero-copy view of this rank's receive region
    y = 2 * r.recv_x                     # "experts": any function of the rows, in receive order
    out = buf.combine(y, r.handle)       # out[t] = the sum of y over the ranks that received token t
    ranks = np.array([len(set(ids // (E // t.num_ranks))) for ids in topk_idx])
    assert np.allclose(out, 2 * x * ranks[:, None])
    return r.recv_x.shape[0]


world = epx.InprocWorld(num_ranks=4, num_nodes=2)
print("rows received per rank:", world.run(rank_main))
