"""Typed errors and the one place they become gRPC status codes.

Service code raises plain Python exceptions that say what went wrong
(``SessionNotFound("session 'abc' is not held ...")``); the server's one
interceptor (:mod:`specdec.serving.interceptor`) turns them into a status code
plus that message on the wire. Nothing in a
servicer calls ``context.abort`` by hand, so every service answers the same way:

==========================  =====================
exception                   status
==========================  =====================
InvalidRequest, ValueError  INVALID_ARGUMENT
SessionNotFound             NOT_FOUND
PositionMismatch            FAILED_PRECONDITION
FailedPrecondition          FAILED_PRECONDITION
ResourceExhausted           RESOURCE_EXHAUSTED
ClientLimitExceeded         RESOURCE_EXHAUSTED
MemoryError (a KV pool's)   RESOURCE_EXHAUSTED
Unauthenticated             UNAUTHENTICATED
PermissionDenied            PERMISSION_DENIED
Draining, Unavailable       UNAVAILABLE
TimeoutError                DEADLINE_EXCEEDED
grpc.aio.AioRpcError        its own code (a downstream call failed)
anything else               INTERNAL (logged with its traceback)
==========================  =====================

On the client side :func:`from_rpc_error` maps a status back to these types, so
the coordinator can write ``except SessionNotFound:`` around a service call.
A RESOURCE_EXHAUSTED or UNAVAILABLE status may carry ``retry-after`` trailing
metadata: the seconds to wait before trying again (``retry_after_s`` of
:class:`ResourceExhausted` and :class:`Unavailable`).
"""

from __future__ import annotations

import math

import grpc


class SpecdecError(Exception):
    """Base of the errors that carry their own gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequest(SpecdecError, ValueError):
    """The request itself is wrong (a field out of range, ids outside the vocab ...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class SessionNotFound(SpecdecError):
    """The service holds no such session (never started, ended, evicted or expired).
    The caller re-pre-fills it from its own token history with position 0."""

    code = grpc.StatusCode.NOT_FOUND


class NotFound(SpecdecError):
    """What the request asks for does not exist here (e.g. a model's tokenizer)."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(SpecdecError):
    """The request is well-formed but the system is not in a state to run it
    (e.g. draft and target speak different vocabularies)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PositionMismatch(FailedPrecondition):
    """The caller believes the service holds more of the session than it does."""

    def __init__(self, session_id: str, position: int, held: int):
        self.session_id, self.position, self.held = session_id, position, held
        super().__init__(
            f"session {session_id!r}: request is at position {position} but the service "
            f"holds only {held} tokens"
        )


class ResourceExhausted(SpecdecError):
    """Out of a capacity (streams, KV memory). ``retry_after_s``, when set, is
    sent as ``retry-after`` trailing metadata (seconds): when to try again."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str = "", retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClientLimitExceeded(ResourceExhausted):
    """One client is at one of its own limits (its streams at once, its request
    rate, its named sessions); the coordinator has room for the others. Over gRPC
    a RESOURCE_EXHAUSTED like any other; the HTTP API answers it 429, where a
    coordinator-wide refusal (its streams, a target's KV budget) is 503."""


class Unauthenticated(SpecdecError):
    """No credentials, or ones the server does not accept."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SpecdecError):
    """An authenticated client asked for what is not its own (another's session)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(SpecdecError):
    """Try again later or elsewhere (e.g. the model is still loading).
    ``retry_after_s``, when set, is sent as ``retry-after`` trailing metadata:
    the server says the call is worth trying again after that long (a turn cut
    short by a session-directory outage, resumable once it is over)."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str = "", retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Draining(Unavailable):
    """The server is shutting down and takes no new work."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: SessionNotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message an exception is answered with."""
    if isinstance(exc, SpecdecError):
        return exc.code, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or exc.code().name
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc) or "out of memory"
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc) or "not implemented"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def rpc_status(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """Client side: a failed call's code and details (UNKNOWN and the error's
    text for an RpcError that carries neither)."""
    try:
        return err.code(), err.details() or ""
    except Exception:  # not a call's error
        return grpc.StatusCode.UNKNOWN, str(err)


# Trailing metadata on every status a specdec server sends on purpose: the error's
# type. A caller tells a service's own refusal (UNAVAILABLE "shutting down") from a
# transport failure (UNAVAILABLE "failed to connect") by it.
ERROR_TYPE_KEY = "specdec-error"


RETRY_AFTER_KEY = "retry-after"


def trailing_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """What a specdec server sends with the status of ``exc``: its type, and
    the retry hint of a ResourceExhausted that carries one."""
    metadata = ((ERROR_TYPE_KEY, type(exc).__name__),)
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        metadata += ((RETRY_AFTER_KEY, f"{max(1, math.ceil(retry))}"),)
    return metadata


def raised_by_server(err: grpc.RpcError) -> str | None:
    """Client side: the error type a specdec server answered with, or None when
    the status did not come from one (a connection failure, a deadline)."""
    try:
        metadata = err.trailing_metadata() or ()
    except Exception:  # not a call's error
        return None
    return next((value for key, value in metadata if key == ERROR_TYPE_KEY), None)


def from_rpc_error(err: grpc.RpcError) -> SpecdecError:
    """Client side: the typed error for a failed call (the caller re-raises it).
    ``PositionMismatch`` comes back as its base ``FailedPrecondition``."""
    code, details = rpc_status(err)
    cls = _BY_CODE.get(code, SpecdecError)
    out = cls(details or code.name)
    if cls is SpecdecError:
        out.code = code
    if cls in (ResourceExhausted, Unavailable):
        out.retry_after_s = retry_after(err)
    return out


def retry_after(err: grpc.RpcError) -> float | None:
    """Client side: the ``retry-after`` hint of a failed call, in seconds (None: none)."""
    try:
        metadata = err.trailing_metadata() or ()
        return next((float(value) for key, value in metadata if key == RETRY_AFTER_KEY), None)
    except Exception:  # not a call's error, or not a number
        return None
