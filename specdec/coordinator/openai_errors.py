"""Errors of the HTTP API: the one place an exception becomes an HTTP status,
and every error in OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

:func:`http_error` decides by the error's type, as
:func:`specdec.serving.errors.status_for` does for gRPC:

==============================================  ======  ===========================
exception                                       status  type
==============================================  ======  ===========================
InvalidRequest, ValueError (a bad parameter)    400     invalid_request_error
Unauthenticated                                 401     authentication_error
PermissionDenied (another client's session)     403     permission_error
NotFound, SessionNotFound (an unknown model)    404     not_found_error
FailedPrecondition (a session busy)             409     conflict_error
ClientLimitExceeded (one client's limits)       429     rate_limit_error (Retry-After)
ResourceExhausted, MemoryError (the
coordinator's streams, a target's KV budget)    503     service_unavailable_error (Retry-After)
Unavailable, Draining                           503     service_unavailable_error (Retry-After)
TimeoutError                                    504     timeout_error
anything else (a bug: its traceback logged)     500     server_error
==============================================  ======  ===========================

A request body past ``--max-message-bytes`` is 413, an unknown route 404, a
wrong method 405: FastAPI's own errors, in the same shape.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math

from specdec.serving import errors

log = logging.getLogger("specdec.coordinator")

DEFAULT_RETRY_AFTER_S = 1.0  # a 429 or 503 that names no time


@dataclasses.dataclass(frozen=True)
class HttpError:
    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def encoded(self) -> bytes:
        """The JSON body, as every response of the API writes its JSON (compact, UTF-8)."""
        return json.dumps(self.body(), ensure_ascii=False, separators=(",", ":")).encode()


_BY_TYPE: tuple[tuple[type[BaseException], int, str], ...] = (
    # Most specific first: a ClientLimitExceeded is a ResourceExhausted, a SessionNotFound no NotFound.
    (errors.ClientLimitExceeded, 429, "rate_limit_error"),
    (errors.ResourceExhausted, 503, "service_unavailable_error"),
    (errors.Unavailable, 503, "service_unavailable_error"),
    (MemoryError, 503, "service_unavailable_error"),
    (errors.Unauthenticated, 401, "authentication_error"),
    (errors.PermissionDenied, 403, "permission_error"),
    (errors.NotFound, 404, "not_found_error"),
    (errors.SessionNotFound, 404, "not_found_error"),
    (errors.FailedPrecondition, 409, "conflict_error"),
    (ValueError, 400, "invalid_request_error"),  # InvalidRequest is one
    (TimeoutError, 504, "timeout_error"),
)


def http_error(exc: BaseException) -> HttpError:
    """What ``exc`` is answered with (the one mapping: see the module's table)."""
    for kind, status, name in _BY_TYPE:
        if isinstance(exc, kind):
            retry = getattr(exc, "retry_after_s", None)
            if status in (429, 503) and retry is None:
                retry = DEFAULT_RETRY_AFTER_S
            code = getattr(exc, "openai_code", None) or {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(status)
            return HttpError(status, name, str(exc) or type(exc).__name__, getattr(exc, "param", None), code,
                             retry)
    # (not the exception's own text: it may hold the server's internals; the log has it)
    return HttpError(500, "server_error", f"internal server error ({type(exc).__name__}): the coordinator's log "
                     "has the details")


class ModelNotFound(errors.NotFound):
    """A request names a model this server does not serve."""

    openai_code = "model_not_found"
    param = "model"


def too_large(limit: int) -> HttpError:
    return HttpError(413, "invalid_request_error", f"the request body is larger than this server takes "
                     f"({limit} bytes: its --max-message-bytes)", code="request_too_large")


def status_error(status: int, detail: str) -> HttpError:
    """FastAPI's own HTTP errors (an unknown route, a method not allowed) in OpenAI's shape."""
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "invalid_request_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    return HttpError(status, kind, detail)


def validation_error(problems: list[dict]) -> HttpError:
    """FastAPI's RequestValidationError (a body that does not parse or fit the
    request's model): 400 naming the first parameter at fault."""
    if not problems:
        return HttpError(400, "invalid_request_error", "the request body is not valid")
    first = problems[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where)[:64] or None  # a client's own key, bounded
    if param is None and first.get("type") != "json_invalid":  # no body, or not an object ([], "text", 5)
        return HttpError(400, "invalid_request_error", "the request body must be a JSON object (send "
                         "Content-Type: application/json)")
    if first.get("type") == "extra_forbidden":
        message = f"{param} is not a parameter this server (specdec) knows: leave it out"
    elif first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    elif first.get("type") == "missing":
        message = f"{param} is required"
    else:
        message = f"{param}: {first.get('msg', 'is not valid')}" if param else first.get("msg", "invalid request")
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more problems)"
    return HttpError(400, "invalid_request_error", message, param)
