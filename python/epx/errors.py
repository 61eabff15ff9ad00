"""The exceptions of epx (docs/python.md, "Errors").

Every epx status maps to one class here; `epx.Error` is their base (a
RuntimeError) and carries `.code`, the C++ status name ("InvalidArgument", ...).
"""


class Error(RuntimeError):
    """An epx call failed; `.code` is the C++ status name, the message epx's."""

    code = "Unknown"

    def __init__(self, message="", code=None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(Error, ValueError):
    code = "InvalidArgument"


class OutOfRangeError(Error, ValueError):
    code = "OutOfRange"


class FailedPreconditionError(Error):
    code = "FailedPrecondition"


class BufferInUseError(FailedPreconditionError):
    """A view of a Buffer's region was still referenced when a call would overwrite it."""


class StaleViewError(FailedPreconditionError):
    """A result's region was overwritten by a later call."""


class ResourceExhaustedError(Error):
    code = "ResourceExhausted"


class DeadlineExceededError(Error, TimeoutError):
    code = "DeadlineExceeded"


class AbortedError(Error):
    code = "Aborted"


class UnimplementedError(Error, NotImplementedError):
    code = "Unimplemented"


class InternalError(Error):
    code = "Internal"


class NotFoundError(Error, LookupError):
    code = "NotFound"


def _with_rank(rank, exc):
    """`exc` again, its message prefixed by "rank N: " (InprocWorld.run's re-raise)."""
    message = f"rank {rank}: {exc}"
    try:
        if isinstance(exc, Error):
            again = type(exc)(message, exc.code)
        else:
            again = type(exc)(message)
    except Exception:  # a class whose constructor takes other arguments
        again = Error(message, getattr(exc, "code", None))
    again.__cause__ = exc
    return again
