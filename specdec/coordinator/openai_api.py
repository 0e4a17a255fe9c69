"""The coordinator's OpenAI-compatible HTTP API: thin, as the gRPC servicer
is. Decode the request (:mod:`specdec.coordinator.openai_protocol`), run the
turn through the coordinator's :class:`ClientStreams` -- the same admission,
per-client limits, turn context, cancellation and drain as gRPC's Generate --
and encode its events in OpenAI's shapes, whole or as server-sent events.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health`` (200 while the coordinator's gRPC health
is SERVING, 503 otherwise). Before a route: :mod:`specdec.coordinator.http_guard`
(span, metrics, body size, bearer token). Errors: :mod:`specdec.coordinator.openai_errors`.

A request's own faults (a parameter, its token budget) are found first; then
the turn is admitted (the coordinator's and the client's limits) and only then
is the model pair checked and a chat rendered: a client past its limits costs
only its refusal. A streamed response sends a chunk per round as the round
commits (no buffering, here or, by its headers, in a proxy); errors found before
the first round (a bad parameter, a limit, another client's session) are an HTTP
status, later ones an error event before ``[DONE]``. An error no handler
expects (a bug) is a 500 ``server_error`` in the same shape, its traceback
logged once. A client that goes away, streamed or not, cancels its turn: the
turn ends its session in both services.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from specdec.coordinator.chat import ChatTemplate
from specdec.coordinator.engine import LONG_PROMPT_CHARS, REPLICA_WAIT_S, Coordinator
from specdec.coordinator.http_guard import CRASH_LOGGED, HttpGuard
from specdec.coordinator.openai_errors import (
    HttpError,
    ModelNotFound,
    http_error,
    status_error,
    validation_error,
)
from specdec.coordinator.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    ParameterError,
    Reply,
    chat_budget,
    chat_job,
    collected,
    completion_job,
)
from specdec.coordinator.streams import ClientStreams, client_address
from specdec.core.text import excerpt
from specdec.serving import auth, errors
from specdec.serving.config import CoordinatorConfig
from specdec.serving.generation import Delta, GenerateJob, GenerationStats
from specdec.serving.names import hidden_in

log = logging.getLogger("specdec.coordinator")

# What a streamed response's headers say to proxies: send each chunk on at once.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE_STATUS = 499  # as nginx logs a request its client closed (counted, never seen by the client)


class ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


class OpenAIApi:
    """The routes. ``serving()``: whether the coordinator's health is SERVING."""

    def __init__(self, engine: Coordinator, streams: ClientStreams, config: CoordinatorConfig,
                 serving: Callable[[], bool], chat: ChatTemplate | None = None):
        self.engine, self.streams, self.config, self.serving = engine, streams, config, serving
        self.chat = chat or ChatTemplate(config.chat_template or None)
        self.started = int(time.time())

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        request.state.session_id = body.session_id or ""
        job = completion_job(body, self.config.max_new_tokens_cap)  # the request's own faults first
        reply = Reply(chat=False, model="")

        async def admitted() -> GenerateJob:
            reply.model = await self._model(body.model)
            return job

        return await self._answer(request, admitted, reply, body)

    async def chat_completions(self, body: ChatRequest, request: Request) -> Response:
        request.state.session_id = body.session_id or ""
        budget = chat_budget(body, self.config.max_new_tokens_cap)  # the request's own faults first
        reply = Reply(chat=True, model="")
        size = len(await request.body())

        async def admitted() -> GenerateJob:  # the template rendered only for a turn admitted
            reply.model = await self._model(body.model)  # (and the pair checked: the tokenizer is the target's)
            try:
                prompt = await self._render(body.messages, size)
            except errors.InvalidRequest as e:  # (a message's own field named where it is at fault)
                if getattr(e, "param", None) is None:
                    raise ParameterError(str(e), "messages") from None
                raise
            return chat_job(body, prompt, budget)

        return await self._answer(request, admitted, reply, body)

    async def _render(self, messages: list, size: int) -> str:
        """The chat's prompt; a long one (``size``: the request's bytes) rendered
        on a worker thread, not on the event loop every stream shares (as the
        engine tokenises a long prompt)."""
        if size > LONG_PROMPT_CHARS:
            return await asyncio.to_thread(self.chat.render, self.engine.tokenizer, messages)
        return self.chat.render(self.engine.tokenizer, messages)

    async def models(self) -> Response:
        pair = await self.engine.pair(wait_s=REPLICA_WAIT_S)
        name = self.config.served_model_name or pair.target_name
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.started, "owned_by": "specdec",
             "max_model_len": pair.context}]})

    async def health(self) -> Response:
        if self.serving():
            return JSONResponse({"status": "SERVING"})
        return error_response(HttpError(503, "service_unavailable_error", "the coordinator is not serving (its "
                                        "session directory is unreachable, or it is shutting down)",
                                        retry_after_s=1.0))

    async def _model(self, requested: str | None) -> str:
        """The served model's name (the pair checked: the tokenizer is the
        target's); ModelNotFound when the request names another."""
        pair = await self.engine.pair(wait_s=REPLICA_WAIT_S)
        served = self.config.served_model_name or pair.target_name
        if requested is not None and requested != served:
            raise ModelNotFound(f"the model {excerpt(requested)} is not served here: this server serves "
                                f"{served!r} (GET /v1/models)")
        return served

    async def _answer(self, request: Request, job: Callable[[], Awaitable[GenerateJob]], reply: Reply,
                      body) -> Response:
        """The turn, admitted before ``job()`` makes its job (see ClientStreams.generate)."""
        caller = auth.current_client() or client_address(request.client)  # what per-client limits count
        size = len(await request.body())
        events = self.streams.generate(job, caller, size)
        if not body.stream:
            text, stats = collected(await until_disconnected(request.receive, _all(events)))
            return JSONResponse(reply.response(text, stats))
        try:  # the first event before any header: what fails before the turn streams is an HTTP status
            first = await until_disconnected(request.receive, anext(events))
        except BaseException:
            await events.aclose()
            raise
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(sse(reply, first, events, usage), events)


async def _all(events: AsyncIterator) -> list:
    async with contextlib.aclosing(events):
        return [event async for event in events]


async def sse(reply: Reply, first: Delta | GenerationStats, events: AsyncIterator, usage: bool
              ) -> AsyncIterator[bytes]:
    """The turn's events as server-sent events, ``data: [DONE]`` last; an
    error after the first one is an error event (OpenAI's shape)."""
    async with contextlib.aclosing(events):
        event, opening = first, True
        try:
            while True:
                for chunk in reply.stream(event, opening, usage):
                    yield _event(chunk)
                opening = False
                if isinstance(event, GenerationStats):
                    break
                event = await anext(events)
        except Exception as e:  # (a cancellation is not answered: the client is gone)
            failure = http_error(e)
            bug = failure.type == "server_error"  # (its traceback logged, as the catch-all handler logs one)
            log.log(logging.ERROR if bug else logging.INFO, "a streamed %s ended with %d: %s",
                    "chat" if reply.chat else "completion", failure.status, failure.type, exc_info=e if bug else None)
            yield _event(failure.body())
    yield b"data: [DONE]\n\n"


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream(Response):
    """A server-sent event stream whose chunks are sent as they come. The
    chunks are made by a task of their own: when the client goes away it is
    cancelled, once, and the turn it drives ends (Starlette's StreamingResponse
    would cancel it again and again, through its cleanup). ``events``, the
    turn the chunks come from, is closed however the response ends, even
    before its first chunk."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], events: AsyncIterator):
        self.chunks, self.events = chunks, events
        self.status_code = 200
        self.background = None
        self.init_headers(STREAM_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        with contextlib.suppress(ClientGone):
            await until_disconnected(receive, self._send_all(send))

    async def _send_all(self, send) -> None:
        try:
            async with contextlib.aclosing(self.chunks) as chunks:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()  # (closed already, unless the chunks never started)


async def until_disconnected(receive, work: Awaitable):
    """``work``'s result, run as a task; ClientGone, with the task cancelled
    and its cleanup done, if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait([task])  # the turn's cleanup: its sessions end in the services
    if task.cancelled() and gone.done() and not gone.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(receive) -> None:
    """Returns when the client has disconnected (the request body was read before)."""
    with contextlib.suppress(Exception):  # a connection that fails is one that is gone
        while (await receive())["type"] != "http.disconnect":
            pass


# ------------------------------------------------------------------ the application


def error_response(error: HttpError) -> Response:
    """``error`` in OpenAI's shape, encoded once (:meth:`HttpError.encoded`, as the guard's refusals)."""
    return Response(error.encoded(), status_code=error.status, headers=error.headers(), media_type="application/json")


def _no_own_telemetry() -> dict:
    """FastAPI's own OpenTelemetry spans, metrics and logs, off where it has
    them: the guard traces and counts each request once, and nothing records a
    request's values (prompts, session ids) as FastAPI's validation logs would."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


def make_app(api: OpenAIApi, *, max_body_bytes: int, tokens: auth.Tokens | None = None, metrics=None):
    """The ASGI application: the routes, every error in OpenAI's shape, behind the guard."""
    app = FastAPI(title="specdec", openapi_url=None, docs_url=None, redoc_url=None, **_no_own_telemetry())
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])

    async def refused(request: Request, exc: Exception) -> Response:
        error = http_error(exc)
        log.info("%s %s -> %d: %s", request.method, request.url.path, error.status,
                 hidden_in(error.message, getattr(request.state, "session_id", "")))
        return error_response(error)

    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(list(exc.errors())))

    async def http_status(request: Request, exc: HTTPException) -> Response:
        return error_response(status_error(exc.status_code, str(exc.detail)))

    async def gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_GONE_STATUS)

    async def crashed(request: Request, exc: Exception) -> Response:
        """What no handler above expects (a bug): 500 in OpenAI's shape, its
        traceback logged here, once (Starlette raises it on to the guard, which
        lets it go: uvicorn would log it again). No request content is logged."""
        setattr(request.state, CRASH_LOGGED, True)
        log.error("%s %s -> 500: %s", request.method, request.url.path, type(exc).__name__, exc_info=exc)
        return error_response(http_error(exc))

    for kind in (errors.SpecdecError, ValueError, TimeoutError, MemoryError):
        app.add_exception_handler(kind, refused)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_status)
    app.add_exception_handler(ClientGone, gone)
    app.add_exception_handler(Exception, crashed)
    return HttpGuard(app, max_body_bytes=max_body_bytes, tokens=tokens, metrics=metrics)
