"""The coordinator's telemetry of a Generate: its span (named and attributed
per the GenAI semantic conventions) and, through the round loop's observer
interface (:class:`specdec.core.interfaces.RoundObserver`), a span and metrics
per round: γ, accepted drafts, bytes, and the round's time split into disjoint
phases (:data:`specdec.telemetry.metrics.ROUND_PHASES`).

With tracing off and no metrics, every method returns at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from specdec.core.interfaces import RoundResult
from specdec.telemetry import tracing
from specdec.telemetry.calls import RpcRecord, current_round_calls
from specdec.telemetry.metrics import ROUND_PHASES, CoordinatorMetrics

SIDES = ("draft", "target")

# gen_ai.* semantic-convention attribute names (GenAI semconv, incubating).
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CONVERSATION = "gen_ai.conversation.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"


# ====================================================================== generations


@dataclasses.dataclass(frozen=True)
class GenerationInfo:
    """What a Generate's span says of the request."""

    model: str  # the target's name
    draft_model: str
    max_tokens: int
    temperature: float
    input_tokens: int
    conversation_id: str
    gamma_policy: str


@contextlib.contextmanager
def generation_span(info: GenerationInfo) -> Iterator[trace.Span]:
    """The current span while one Generate runs; every round span is its child."""
    attributes = {
        GEN_AI_OPERATION: "text_completion",
        GEN_AI_PROVIDER: "specdec",
        GEN_AI_REQUEST_MODEL: info.model,
        GEN_AI_MAX_TOKENS: info.max_tokens,
        GEN_AI_TEMPERATURE: info.temperature,
        GEN_AI_INPUT_TOKENS: info.input_tokens,
        GEN_AI_CONVERSATION: info.conversation_id,
        "specdec.draft.model": info.draft_model,
        "specdec.gamma_policy": info.gamma_policy,
    }
    with tracing.tracer().start_as_current_span(f"text_completion {info.model}", attributes=attributes) as span:
        yield span


def record_generation(span: trace.Span, metrics: CoordinatorMetrics | None, stats) -> None:
    """A finished Generate (``stats``: its :class:`specdec.serving.generation.GenerationStats`)
    on its span and in the request metrics."""
    if span.is_recording():
        span.set_attributes({
            GEN_AI_OUTPUT_TOKENS: stats.generated_tokens,
            GEN_AI_FINISH_REASONS: [stats.finish_reason],
            "specdec.rounds": stats.rounds,
            "specdec.drafted_tokens": stats.drafted_tokens,
            "specdec.accepted_tokens": stats.accepted_tokens,
        })
    if metrics is not None:
        metrics.observe_request(prompt_tokens=stats.prompt_tokens, finish_reason=stats.finish_reason)


# ====================================================================== rounds


@dataclasses.dataclass
class _OpenRound:
    index: int
    span: trace.Span
    start: float
    calls: list[RpcRecord]
    tokens: tuple  # context tokens to undo: the span made current, the calls list set


class CoordinatorObserver:
    """The round loop's observer in the coordinator: a span per round (current
    while the round runs, so the RPCs' CLIENT spans are its children) and the
    per-round metrics. Shared by every generation: a round's state lives in
    the context it runs in."""

    def __init__(self, metrics: CoordinatorMetrics | None = None):
        self.metrics = metrics
        # The round in progress in each context (generations run on many threads).
        self.open_round: contextvars.ContextVar[_OpenRound | None] = contextvars.ContextVar(
            "specdec_round", default=None)

    def round_started(self, index: int) -> None:
        traced = tracing.recording()
        if not traced and self.metrics is None:
            return
        span = tracing.tracer().start_span("specdec.round") if traced else trace.INVALID_SPAN
        calls: list[RpcRecord] = []
        tokens = (otel_context.attach(trace.set_span_in_context(span)) if traced else None,
                  current_round_calls.set(calls))
        self.open_round.set(_OpenRound(index, span, time.perf_counter(), calls, tokens))

    def round_finished(self, result: RoundResult) -> None:
        opened = self.close_round()
        if opened is None:
            return
        wall = time.perf_counter() - opened.start
        phases = round_phases(result, opened.calls, wall)
        if opened.span.is_recording():
            opened.span.set_attributes(round_attributes(opened.index, result, opened.calls, phases, wall))
        opened.span.end()
        if self.metrics is not None:
            self.metrics.observe_round(gamma=result.gamma, accepted=result.accepted, wall_s=wall, phases=phases)

    def round_failed(self, error: BaseException) -> None:
        opened = self.close_round()
        if opened is None:
            return
        if opened.span.is_recording():
            if isinstance(error, Exception):
                opened.span.record_exception(error)
            opened.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        opened.span.end()

    def close_round(self) -> _OpenRound | None:
        opened = self.open_round.get()
        if opened is not None:
            self.open_round.set(None)
            span_token, calls_token = opened.tokens
            current_round_calls.reset(calls_token)
            if span_token is not None:
                otel_context.detach(span_token)
        return opened


def round_phases(result: RoundResult, calls: list[RpcRecord], wall_s: float) -> dict[str, float]:
    """Split a round into the disjoint phases of :data:`ROUND_PHASES`.

    A side with recorded RPCs is split into its server's compute, queue and copy
    times and the network remainder; a side without (a local model) is all
    compute. The coordinator phase is what is left of the round's wall time."""
    phases = dict.fromkeys(ROUND_PHASES, 0.0)
    observed = {"draft": result.draft_s, "target": result.verify_s}
    for side in SIDES:
        mine = [c for c in calls if c.side == side]
        if not mine:
            phases[side] += observed[side]
            continue
        for c in mine:
            phases[side] += c.compute_s
            phases["queue"] += c.queue_s
            phases["copy"] += c.copy_s
            phases["network"] += c.network_s
    phases["coordinator"] = max(0.0, wall_s - sum(phases.values()))
    return phases


def round_attributes(index: int, result: RoundResult, calls: list[RpcRecord], phases: Mapping[str, float],
                     wall_s: float) -> dict:
    """The round span's attributes (what ``specdec trace-report`` reads back)."""
    attrs = {
        "specdec.round": index,
        "specdec.gamma": result.gamma,
        "specdec.accepted": result.accepted,
        "specdec.tokens": len(result.tokens),
        "specdec.bytes_out": sum(c.bytes_out for c in calls),
        "specdec.bytes_in": sum(c.bytes_in for c in calls),
        "specdec.round_s": wall_s,
        "specdec.coordinator_s": phases["coordinator"],
    }
    for side in SIDES:
        mine = [c for c in calls if c.side == side]
        if mine:
            attrs[f"specdec.{side}.compute_s"] = sum(c.compute_s for c in mine)
            attrs[f"specdec.{side}.queue_s"] = sum(c.queue_s for c in mine)
            attrs[f"specdec.{side}.network_s"] = sum(c.network_s for c in mine)
            copy_s = sum(c.copy_s for c in mine)
            if copy_s:  # absent = 0: never set on CPU
                attrs[f"specdec.{side}.copy_s"] = copy_s
        else:  # a local model: all of it is compute
            attrs[f"specdec.{side}.compute_s"] = phases[side]
    if result.finish_reason:
        attrs["specdec.finish_reason"] = result.finish_reason
    return attrs
