"""epx: expert parallelism for Mixture-of-Experts models, from Python (docs/python.md).

The exchange (Buffer: dispatch, combine, their backward passes, ...), the
transports (InprocWorld, mpi_transport, socket_transport) and routing come from
the extension epx._epx; torchrun_transport and launched_transport (processes
started by torchrun, epx.launch or mpirun) from epx._environment; the exception
classes from epx.errors.
"""

import numpy as _np

from .errors import (  # noqa: F401
    AbortedError,
    BufferInUseError,
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    ResourceExhaustedError,
    StaleViewError,
    UnimplementedError,
)
from . import _args, _epx

_args.explain_all(_epx)  # one-line errors for arguments pybind11 cannot convert
from ._epx import *  # noqa: E402,F401,F403
from ._epx import __version__  # noqa: F401
from ._environment import launched_transport, torchrun_transport  # noqa: E402,F401


def bf16_from_f32(a):
    """float32 values -> their bf16 bits as uint16 (round to nearest even; NaN kept quiet)."""
    bits = _np.ascontiguousarray(a, dtype=_np.float32).view(_np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return _np.where(nan, (bits >> 16) | 0x40, rounded).astype(_np.uint16)


def bf16_to_f32(a):
    """bf16 bits (uint16) -> float32 values (exact)."""
    return (_np.asarray(a, dtype=_np.uint16).astype(_np.uint32) << 16).view(_np.float32)
