"""The one server interceptor of every specdec service: errors, tracing and
RPC metrics around each call, in one wrapper.

* **Errors.** Handlers just raise; an exception leaving one is answered with
  its status from :func:`specdec.serving.errors.status_for` and its message,
  plus trailing metadata naming the error type (so a caller can tell a
  service's own refusal from a transport failure), and logged — with the
  traceback if it is a bug (INTERNAL).
* **Tracing.** A SERVER span per call, child of the caller's W3C context
  (:mod:`specdec.telemetry.server_spans`), current while the handler runs (the
  coordinator's Generate span is its child), with the reply's ServerTiming and
  the status code.
* **Metrics.** Latency and errors by code; on a model service also its model
  work (the reply's ServerTiming), drafts proposed, drafts verified and accepted.

It wraps unary and server-streaming handlers, the only kinds specdec serves;
reflection's bidirectional stream gets the checks and the parsing alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import time

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from specdec.serving import auth
from specdec.serving.errors import InvalidRequest, PermissionDenied, SpecdecError, status_for, trailing_metadata
from specdec.serving.memory import after_refused
from specdec.serving.names import hidden_in
from specdec.serving.tls import peer_identities
from specdec.telemetry import tracing
from specdec.telemetry.metrics import RpcMetrics, ServiceMetrics
from specdec.telemetry.server_spans import record_timing, start_server_span

log = logging.getLogger(__name__)


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """``tokens``: the clients that may call (None: anyone); every RPC but
    health then needs a token (:mod:`specdec.serving.auth`)."""

    def __init__(self, metrics: RpcMetrics | None = None, tokens: auth.Tokens | None = None,
                 peers: frozenset[str] | None = None):
        self.metrics, self.tokens, self.peers = metrics, tokens, peers

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        guarded = (self.tokens is not None or self.peers is not None) and not method.startswith(auth.OPEN_SERVICES)
        tokens = _Guard(self.peers, self.tokens) if guarded else None
        if handler.request_streaming:  # reflection: no spans, but no way around the checks either
            return _parsed_stream(handler if tokens is None else _checked_bidi(handler, tokens), method)
        if handler.response_streaming:
            behavior = handler.unary_stream
            # A coroutine that writes its replies with context.write() (health's Watch) is wrapped as unary.
            wrap = self._stream if inspect.isasyncgenfunction(behavior) else self._unary
            return grpc.unary_stream_rpc_method_handler(
                wrap(behavior, method, tokens), request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, method, tokens),
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer)

    def _unary(self, behavior, full_method: str, tokens: _Guard | None):
        async def unary(request, context):
            call = _Call(self.metrics, full_method)
            client = None
            try:
                call.start_span(context)
                client = tokens.enter(context) if tokens is not None else None
                _check_parsed(request, full_method)
                response = await behavior(request, context)
                call.answered(request, _timing(response), 1, response)
                return response
            except BaseException as exc:
                await call.failed(exc, context, request)
                raise
            finally:
                if client is not None:
                    auth.leave(client)
                call.end()

        return unary

    def _stream(self, behavior, full_method: str, tokens: _Guard | None):
        async def stream(request, context):
            call = _Call(self.metrics, full_method)
            count, timing, client = 0, None, None
            try:
                call.start_span(context)
                client = tokens.enter(context) if tokens is not None else None
                _check_parsed(request, full_method)
                # Closed here, not left to the garbage collector, when the caller goes away:
                # the handler's own cleanups (stream slots) run at once.
                async with contextlib.aclosing(behavior(request, context)) as messages:
                    async for message in messages:
                        count += 1
                        timing = _timing(message) or timing
                        yield message
                call.answered(request, timing, count, None)
            except BaseException as exc:
                await call.failed(exc, context, request)
                raise
            finally:
                if client is not None:
                    with contextlib.suppress(ValueError):  # closed from another context (see _Call.end)
                        auth.leave(client)
                call.end()

        return stream


@dataclasses.dataclass(frozen=True)
class _Malformed:
    """A request body that did not parse: the handler is not called, the caller
    gets INVALID_ARGUMENT (grpc alone would answer an opaque INTERNAL)."""

    error: str


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # protobuf's DecodeError, invalid UTF-8 in a string field ...
            return _Malformed(type(e).__name__)

    return parse


def _check_parsed(request, method: str) -> None:
    if isinstance(request, _Malformed):
        raise InvalidRequest(f"{method}: the request is not a valid message ({request.error})")


def _parsed_stream(handler, method: str):
    """A request-streaming handler (reflection) given its requests parsed here:
    one that does not parse ends the call with INVALID_ARGUMENT, as a unary
    call's would (grpc alone answers UNKNOWN and logs a traceback)."""
    behavior = handler.stream_stream

    async def bidi(request_iterator, context):
        async def parsed():
            async for request in request_iterator:
                try:
                    _check_parsed(request, method)
                except InvalidRequest as e:
                    log.info("%s -> %s: %s", method, e.code.name, e)
                    await context.abort(e.code, str(e), trailing_metadata=trailing_metadata(e))
                yield request

        async for message in behavior(parsed(), context):
            yield message

    return grpc.stream_stream_rpc_method_handler(bidi, request_deserializer=_tolerant(handler.request_deserializer),
                                                 response_serializer=handler.response_serializer)


@dataclasses.dataclass(frozen=True)
class _Guard:
    """Who may call: with mutual TLS, a peer whose certificate names one of
    ``peers``; with tokens, a known bearer token (its client made current)."""

    peers: frozenset[str] | None
    tokens: auth.Tokens | None

    def enter(self, context) -> contextvars.Token | None:
        if self.peers is not None:
            names = peer_identities(context)
            if not names & self.peers:
                raise PermissionDenied(f"the peer's certificate names {sorted(names) or 'no identity'}, none of "
                                       f"the identities this service accepts (--tls-peer-identity)")
        return self.tokens.enter(context.invocation_metadata()) if self.tokens is not None else None


def _checked_bidi(handler, tokens: _Guard):
    """A request-streaming handler (reflection) behind the checks."""
    behavior = handler.stream_stream

    async def bidi(request_iterator, context):
        try:
            client = tokens.enter(context)
            if client is not None:
                auth.leave(client)
        except SpecdecError as e:
            await context.abort(e.code, str(e), trailing_metadata=trailing_metadata(e))
        async for message in behavior(request_iterator, context):
            yield message

    return grpc.stream_stream_rpc_method_handler(bidi, request_deserializer=handler.request_deserializer,
                                                 response_serializer=handler.response_serializer)


class _Call:
    """One call going through the interceptor."""

    def __init__(self, metrics: RpcMetrics | None, full_method: str):
        self.metrics, self.full_method = metrics, full_method
        self.method = full_method.rsplit("/", 1)[-1]
        self.start = time.perf_counter()
        self.span, self.token = trace.INVALID_SPAN, None

    def start_span(self, context) -> None:
        """The SERVER span, made current while the handler runs (when tracing is on)."""
        if tracing.enabled():
            self.span, current = start_server_span(self.full_method, context.invocation_metadata(), context.peer())
            if current is not None:
                self.token = otel_context.attach(current)

    def answered(self, request, timing, count: int, response) -> None:
        """``timing``: the reply's ServerTiming (None if it has none); ``count``
        the messages sent; ``response`` the reply of a unary call."""
        if timing is not None:
            record_timing(self.span, timing)
        if isinstance(self.metrics, ServiceMetrics):
            if timing is not None:
                self.metrics.observe_timing(timing)
            if self.method == "Propose":
                self.metrics.observe_proposed(count)
            elif self.method == "ProposeAll":
                self.metrics.observe_proposed(len(response.drafts))
            elif self.method == "Verify":
                self.metrics.observe_verified(len(request.draft_tokens), response.accepted)
        self._count(None)

    async def failed(self, exc: BaseException, context, request=None) -> None:
        """Answer ``exc`` with its status (unless it is a deliberate abort, a
        cancellation or shutdown), and record it; a large refused ``request``'s
        memory goes back to the system."""
        after_refused(request)
        if isinstance(exc, grpc.aio.AbortError):  # aborted on purpose: the code is on the context
            code = context.code() or grpc.StatusCode.UNKNOWN
        elif isinstance(exc, Exception):
            code, message = status_for(exc)
        else:  # cancelled by the client (CancelledError), or shutdown
            code = grpc.StatusCode.CANCELLED
        session_id = getattr(request, "session_id", "") if isinstance(getattr(request, "session_id", ""), str) else ""
        if self.span.is_recording():
            self.span.set_attribute("rpc.grpc.status_code", code.value[0])
            self.span.set_status(Status(StatusCode.ERROR, hidden_in(f"{code.name}: {exc}", session_id)))
            if code == grpc.StatusCode.INTERNAL:  # a bug, not a bad request: keep the traceback
                self.span.record_exception(exc)
        self._count(code.name)
        if isinstance(exc, Exception) and not isinstance(exc, grpc.aio.AbortError):
            if code == grpc.StatusCode.INTERNAL:
                log.error("%s failed: %s", self.full_method, message, exc_info=exc)
            else:
                log.info("%s -> %s: %s", self.full_method, code.name, hidden_in(message, session_id))
            await context.abort(code, message, trailing_metadata=trailing_metadata(exc))

    def _count(self, code: str | None) -> None:
        if self.metrics is not None:
            self.metrics.observe_rpc(self.method, time.perf_counter() - self.start, code)

    def end(self) -> None:
        """Undo making the span current, and end it. When a client goes away
        while a stream is blocked sending, grpc leaves the handler's generator
        to asyncio, which closes it later from another context: there is no
        attach to undo there."""
        token, self.token = self.token, None
        if isinstance(token, contextvars.Token):  # OpenTelemetry's default runtime context
            with contextlib.suppress(ValueError):  # created in a different Context
                token.var.reset(token)
        elif token is not None:
            otel_context.detach(token)
        self.span.end()


def _timing(message):
    """A reply's ServerTiming, if its type has one and it is set."""
    return message.timing if _has_timing_field(type(message)) and message.HasField("timing") else None


@functools.lru_cache(maxsize=64)
def _has_timing_field(message_type: type) -> bool:
    descriptor = getattr(message_type, "DESCRIPTOR", None)
    return descriptor is not None and "timing" in descriptor.fields_by_name
