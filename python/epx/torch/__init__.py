"""epx.torch: autograd functions over epx's exchange and an MoE nn.Module (docs/python.md, "epx.torch")."""
from .functions import Dispatched, combine, dispatch, dtype_name, fold_expanded, payload_dtype, route
from .distributed import transport
from .metrics import MetricsWriter
from .moe import (MoE, all_reduce_grads, all_reduce_sum, dense_init, expert_init, rank_generator, reshard,
                  rms_norm, swiglu)

__all__ = ["Dispatched", "MetricsWriter", "MoE", "all_reduce_grads", "all_reduce_sum", "combine", "dense_init",
           "dispatch", "dtype_name", "expert_init", "fold_expanded", "payload_dtype", "rank_generator", "reshard",
           "rms_norm", "route", "swiglu", "transport"]
