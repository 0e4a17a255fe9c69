"""What every HTTP API request goes through before its route, as every gRPC
call goes through :mod:`specdec.serving.interceptor`: one ASGI middleware.

* **Tracing**: a SERVER span per request (``POST /v1/completions``), a child
  of its ``traceparent`` header, current while it is answered, so the turn's
  ``generate`` and round spans are its children; ``/health`` is not traced.
* **Metrics**: every request counted, and timed to its last byte, by route and
  status code (``specdec_http_requests``, ``specdec_http_server_duration_seconds``).
  Labels and span names are bounded whatever the client sends: a path not one
  of the API's routes is ``unmatched``, a method OpenTelemetry's HTTP
  conventions do not know is ``_OTHER``.
* **Size**: a body larger than ``--max-message-bytes`` is refused 413: by its
  Content-Length before it is read, or as it arrives past the bound.
* **Authentication**: with ``--auth-tokens``, every route but ``/health`` needs
  ``Authorization: Bearer TOKEN`` (401 without a known one), and the token's
  client is current while the request is answered (its sessions are its own).
* **Errors**: what the application's catch-all handler answered (a 500, its
  traceback logged there) is not raised on to the server, which would log it again.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware): the request's
route runs in this same task, so what is made current here is current there.
"""

from __future__ import annotations

import contextvars
import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from starlette.exceptions import HTTPException

from specdec.coordinator.openai_errors import HttpError, http_error, too_large
from specdec.serving import auth, errors
from specdec.telemetry import tracing
from specdec.telemetry.metrics import http_method
from specdec.telemetry.server_spans import end_http_span, start_http_span

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")
OPEN_ROUTES = ("/health",)  # no token needed: a load balancer's or kubelet's probe
UNTRACED_ROUTES = ("/health",)
# Set in the request's state by the application's catch-all handler: the error is answered and logged.
CRASH_LOGGED = "specdec_crash_logged"


class HttpGuard:
    """``tokens``: the clients that may call (None: anyone); ``metrics``: a
    CoordinatorMetrics (None: not counted)."""

    def __init__(self, app, *, max_body_bytes: int, tokens: auth.Tokens | None = None, metrics=None):
        self.app, self.max_body_bytes, self.tokens, self.metrics = app, max_body_bytes, tokens, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "unmatched"  # bounded labels, whatever is asked
        method = http_method(scope["method"])
        started, status = time.perf_counter(), [500]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        span, attached, client = trace.INVALID_SPAN, None, None
        try:
            if tracing.enabled() and route not in UNTRACED_ROUTES:
                span, current = start_http_span(method, route, _headers(scope), scope.get("client"))
                attached = otel_context.attach(current) if current is not None else None
            refusal = self._too_large(scope)
            if refusal is None:
                try:
                    client = self._authenticate(scope, route)
                except errors.Unauthenticated as e:
                    refusal = http_error(e)
            if refusal is not None:
                return await send_error(sending, refusal)
            try:
                await self.app(scope, self._bounded(receive), sending)
            except Exception:
                if not scope.get("state", {}).get(CRASH_LOGGED):
                    raise
        finally:
            if client is not None:
                auth.leave(client)
            if attached is not None:
                otel_context.detach(attached)
            end_http_span(span, status[0])
            if self.metrics is not None:
                self.metrics.observe_http(route, method, status[0], time.perf_counter() - started)

    def _too_large(self, scope) -> HttpError | None:
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return too_large(self.max_body_bytes)
        return None

    def _authenticate(self, scope, route: str) -> contextvars.Token | None:
        """The client made current (undo with auth.leave), or None: no tokens, or an open route."""
        if self.tokens is None or route in OPEN_ROUTES:
            return None
        headers = _headers(scope)
        given = headers.get(auth.METADATA_KEY)  # (in HTTP's words: the token's own checks say nothing of metadata)
        if given is None:
            raise errors.Unauthenticated("no credentials: send the header 'Authorization: Bearer <token>'")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthenticated("the Authorization header must be 'Bearer <token>'")
        return self.tokens.enter(headers.items())

    def _bounded(self, receive):
        """``receive``, refusing (413) a body that grows past the bound as it arrives."""
        received = 0

        async def bounded():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, too_large(self.max_body_bytes).message)
            return message

        return bounded


def _headers(scope) -> dict[str, str]:
    """The request's headers, names in lower case (as ASGI gives them)."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}


async def send_error(send, error: HttpError) -> None:
    """``error`` as a whole JSON response (OpenAI's shape)."""
    body = error.encoded()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in error.headers().items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
