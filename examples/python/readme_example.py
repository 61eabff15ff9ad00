# Two ranks (threads of this process) each run an epx MoE layer on their own
# tokens: epx routes them, dispatches them to the rank holding their experts,
# combines the outputs back; backward runs epx's backward passes. Under mpirun
# each process is one rank: use transport = epx.mpi_transport() instead.
import torch

import epx
import epx.torch


def train_step(transport):
    layer = epx.torch.MoE(hidden=64, ffn_hidden=128, num_experts=8, topk=2, transport=transport,
                          num_shared_experts=1, aux_loss_coeff=0.01, expert_bias=True)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(transport.rank))  # this rank's tokens
    out = layer(x)  # [32, 64]
    loss = out.square().mean() + layer.aux_loss
    loss.backward()
    epx.torch.all_reduce_grads(layer.dense_parameters(), transport)  # router, norm, shared experts
    optimizer.step()
    layer.update_bias()  # aux-loss-free balancing with the global load
    return loss.item(), layer.load["max_vio"]


world = epx.InprocWorld(num_ranks=2)
for rank, (loss, max_vio) in enumerate(world.run(train_step)):
    print(f"rank {rank}: loss {loss:.4f}, MaxVio {max_vio:.2f}")
