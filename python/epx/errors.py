"""Exceptions: one class per epx_status, all under EpxError.

Each class also derives from the built-in exception a Python caller would expect for that kind of failure
(ValueError for bad input, TimeoutError for a wait that ran out, NotImplementedError for an unsupported
mode), so code written against deep_ep's assertion errors or generic handlers still catches them.
"""

from __future__ import annotations


class EpxError(RuntimeError):
    """A failure reported by libepx. `status` is the epx_status value, `str(e)` the library's message."""

    status = -1

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgumentError(EpxError, ValueError):
    status = 1


class BufferTooSmallError(EpxError, ValueError):
    status = 2


class CudaError(EpxError):
    status = 3


class TimeoutError(EpxError, TimeoutError):  # noqa: A001 - shadows the builtin on purpose, as epx.TimeoutError
    status = 4


class BootstrapError(EpxError):
    status = 5


class NotSupportedError(EpxError, NotImplementedError):
    status = 6


class FailedStateError(EpxError):
    status = 7


class InternalError(EpxError):
    status = 8


class RemoteError(EpxError):
    status = 9


_BY_STATUS = {cls.status: cls for cls in (InvalidArgumentError, BufferTooSmallError, CudaError, TimeoutError,
                                          BootstrapError, NotSupportedError, FailedStateError, InternalError,
                                          RemoteError)}


def error_for(status: int, message: str) -> EpxError:
    """The exception for a non-zero status (an unknown status still gets an EpxError, never a crash)."""
    cls = _BY_STATUS.get(int(status), EpxError)
    return cls(message, int(status))
