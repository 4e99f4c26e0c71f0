"""errors.py - one exception class per kvs_err code (client/kvstash.h).

Every failed libkvstash call becomes the class of its code, carrying the code
(.code) and the daemon's message (str(e), kvs_session_error): callers catch
what they can handle (ResourceExhausted: the pool is full) and let the rest
propagate with the daemon's explanation. Checks the binding makes itself,
before any call, raise the same classes with the code the C library would
have returned.
"""
from typing import Callable, Dict, NoReturn, Optional, Type

KVS_OK = 0
KVS_ERR_INVALID = -1
KVS_ERR_NOT_FOUND = -2
KVS_ERR_PERMISSION = -3
KVS_ERR_PRECONDITION = -4
KVS_ERR_EXHAUSTED = -5
KVS_ERR_UNAVAILABLE = -6
KVS_ERR_PROTOCOL = -7
KVS_ERR_SYSTEM = -8
KVS_ERR_DATA_LOSS = -9


class KvstashError(Exception):
    """Base of every kvstash error. code: the kvs_err (negative int), or None
    for errors that are no kvs_err (Unsupported)."""

    code: Optional[int] = None

    def __init__(self, message: str, code: Optional[int] = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(KvstashError):
    """KVS_ERR_INVALID: a value is out of range (INVALID_ARGUMENT)."""
    code = KVS_ERR_INVALID


class NotFound(KvstashError):
    """KVS_ERR_NOT_FOUND: no such sequence or pool."""
    code = KVS_ERR_NOT_FOUND


class PermissionDenied(KvstashError):
    """KVS_ERR_PERMISSION: another session's sequence, or unauthenticated."""
    code = KVS_ERR_PERMISSION


class FailedPrecondition(KvstashError):
    """KVS_ERR_PRECONDITION: e.g. a geometry mismatch, or reading a sketched list."""
    code = KVS_ERR_PRECONDITION


class ResourceExhausted(KvstashError):
    """KVS_ERR_EXHAUSTED: the pool (or a limit) is full."""
    code = KVS_ERR_EXHAUSTED


class Unavailable(KvstashError):
    """KVS_ERR_UNAVAILABLE: no daemon at the socket, it is shutting down, or
    a call passed its deadline."""
    code = KVS_ERR_UNAVAILABLE


class ProtocolError(KvstashError):
    """KVS_ERR_PROTOCOL: an unexpected reply, or another gRPC status."""
    code = KVS_ERR_PROTOCOL


class SystemError_(KvstashError):
    """KVS_ERR_SYSTEM: a local system call or the memory backend failed
    (named with a trailing underscore: Python's SystemError is a builtin)."""
    code = KVS_ERR_SYSTEM


class DataLoss(KvstashError):
    """KVS_ERR_DATA_LOSS: a value in the remote tier is missing or corrupt
    (a spilled victim or an export: expired, flushed, damaged)."""
    code = KVS_ERR_DATA_LOSS


class Unsupported(KvstashError):
    """What the binding cannot do here, e.g. a numpy view of a pool that is
    not host memory (the shadow backend). Not a kvs_err: code is None."""


BY_CODE: Dict[int, Type[KvstashError]] = {
    cls.code: cls for cls in (InvalidArgument, NotFound, PermissionDenied, FailedPrecondition,
                              ResourceExhausted, Unavailable, ProtocolError, SystemError_,
                              DataLoss)
}


def error_for(code: int, message: str) -> KvstashError:
    """The exception for kvs_err `code` with `message` (KvstashError for a
    code this binding does not know)."""
    cls = BY_CODE.get(code)
    if cls is None:
        return KvstashError(f"{message} (kvs_err {code})", code)
    return cls(message)


def raise_for(code: int, message: str) -> NoReturn:
    """Raise error_for(code, message)."""
    raise error_for(code, message)


def end_with_block(end: Callable[[], None], failing: bool) -> None:
    """Run `end` (a release or a detach) where a with block ends. While an
    exception is in flight (failing), an error of `end` is dropped: the
    exception that ended the block is the one to see."""
    if not failing:
        end()
        return
    try:
        end()
    except Exception:  # noqa: BLE001 - the exception in flight matters more
        pass
