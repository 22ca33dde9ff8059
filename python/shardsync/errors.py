"""The shardsync exception hierarchy: one base class, one subclass per C++ StatusCode.

The native module raises these with the C++ message, the CLI's flag names replaced by the Python
arguments they correspond to ("rollout tp=3: num_attention_heads 32 is not divisible by tp" where
the CLI says "--tp 3: ..."). Pure Python, importable without `_C`.
"""

from __future__ import annotations

from typing import Dict, Type

__all__ = [
    "Error",
    "InvalidArgumentError",
    "FailedPreconditionError",
    "NotFoundError",
    "DataLossError",
    "DeadlineExceededError",
    "UnavailableError",
    "InternalError",
    "UnimplementedError",
    "PermissionDeniedError",
    "AbortedError",
    "OutOfRangeError",
    "error_for_code",
]


class Error(Exception):
    """Base of every shardsync error. `code` is the C++ StatusCode name ("invalid_argument")."""

    code: str = "unknown"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(Error, ValueError):
    """The caller's input is wrong (a field, a size, a name)."""

    code = "invalid_argument"


class FailedPreconditionError(Error):
    """The system is not in a state to do this (poisoned, not connected)."""

    code = "failed_precondition"


class NotFoundError(Error, LookupError):
    """A named thing (tensor, key, file) does not exist."""

    code = "not_found"


class DataLossError(Error):
    """Bytes arrived wrong (checksum mismatch, corrupt file)."""

    code = "data_loss"


class DeadlineExceededError(Error, TimeoutError):
    """A wait ran past its timeout."""

    code = "deadline_exceeded"


class UnavailableError(Error, ConnectionError):
    """A peer or service cannot be reached or died."""

    code = "unavailable"


class InternalError(Error):
    """A bug or an unexpected library error."""

    code = "internal"


class UnimplementedError(Error, NotImplementedError):
    """Not supported by this build or transport."""

    code = "unimplemented"


class PermissionDeniedError(Error, PermissionError):
    """Wrong token."""

    code = "permission_denied"


class AbortedError(Error):
    """Cancelled because another rank failed."""

    code = "aborted"


class OutOfRangeError(Error, IndexError):
    """An index or region outside its bounds."""

    code = "out_of_range"


# Keyed by the numeric StatusCode value of include/shardsync/status.h.
_BY_CODE: Dict[int, Type[Error]] = {
    1: InvalidArgumentError,
    2: FailedPreconditionError,
    3: NotFoundError,
    4: DataLossError,
    5: DeadlineExceededError,
    6: UnavailableError,
    7: InternalError,
    8: UnimplementedError,
    9: PermissionDeniedError,
    10: AbortedError,
    11: OutOfRangeError,
}


def error_for_code(code: int) -> Type[Error]:
    """The exception class of a StatusCode value (Error for an unknown code)."""
    return _BY_CODE.get(int(code), Error)
