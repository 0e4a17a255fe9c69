"""The coordinator's calls to the draft and target services, as telemetry sees
them: a CLIENT span per call carrying W3C trace context in the call's metadata
(so the service's SERVER span is its child), and per Propose/Verify the
client-observed time split with the server's own account (``ServerTiming`` in
the reply): network + serialisation = observed − (queue + compute + copy).

The span is named and attributed as OpenTelemetry's gRPC instrumentation names
them (``/specdec.v1.DraftService/Propose``, ``rpc.*``). The coordinator's
channels are synchronous and Propose's stream is read inside the round loop's
generator, so the span is not made current: a context attached there would
leak into the loop between yields.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode

from specdec.telemetry import tracing
from specdec.telemetry.metrics import CoordinatorMetrics


@dataclasses.dataclass
class RpcRecord:
    """One Propose or Verify as the coordinator saw it, with the server's own account."""

    side: str  # "draft" | "target"
    observed_s: float  # call start to last response, at the client
    queue_s: float = 0.0
    compute_s: float = 0.0
    copy_s: float = 0.0
    computed_tokens: int = 0
    bytes_out: int = 0
    bytes_in: int = 0

    @classmethod
    def of_call(cls, side: str, observed_s: float, timing, bytes_out: int, bytes_in: int) -> RpcRecord:
        """With the service's account of the call, decoded from the reply
        (a :class:`specdec.serving.timing.CallTiming`)."""
        return cls(side, observed_s, timing.queue_s, timing.compute_s, timing.copy_s, timing.computed_tokens,
                   bytes_out, bytes_in)

    @property
    def server_s(self) -> float:
        return self.queue_s + self.compute_s + self.copy_s

    @property
    def network_s(self) -> float:
        """Network + serialisation: what the client waited beyond the server's work
        (clamped at 0: the two clocks are read at slightly different moments)."""
        return max(0.0, self.observed_s - self.server_s)


# The RPC records of the round in progress in this context (set by the round
# observer, see specdec.telemetry.observer): a call's record joins its round.
current_round_calls: contextvars.ContextVar[list[RpcRecord] | None] = contextvars.ContextVar(
    "specdec_round_calls", default=None)


class ClientCalls:
    """The coordinator's calls to one service (``side``: "draft" | "target")."""

    def __init__(self, side: str, service: str, metrics: CoordinatorMetrics | None = None):
        self.side, self.service, self.metrics = side, service, metrics

    @contextlib.contextmanager
    def call(self, method: str) -> Iterator[Call]:
        """Around one attempt of ``method``: pass ``call.metadata`` to the stub.
        An ``RpcError`` leaving the block marks the span failed with its code."""
        if not tracing.enabled():
            yield Call(self, trace.INVALID_SPAN, None)
            return
        if not tracing.recording():  # an unsampled request: pass the decision on, make no span
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            yield Call(self, trace.INVALID_SPAN, tuple(carrier.items()))
            return
        span = tracing.tracer().start_span(
            f"/{self.service}/{method}", kind=trace.SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": self.service, "rpc.method": method,
                        "rpc.grpc.status_code": grpc.StatusCode.OK.value[0]})
        carrier = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        try:
            yield Call(self, span, tuple(carrier.items()))
        except grpc.RpcError as e:
            code, details = _status(e)
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))
            raise
        except GeneratorExit:  # the reader stopped mid-stream: grpc cancels the call
            span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
            raise
        except Exception as e:
            span.record_exception(e)
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
        finally:
            span.end()


@dataclasses.dataclass
class Call:
    """One call in progress (see :meth:`ClientCalls.call`): ``metadata`` carries
    its trace context (None when tracing is off)."""

    calls: ClientCalls
    span: trace.Span
    metadata: tuple | None

    def record(self, rec: RpcRecord) -> None:
        """The completed call, with the server's own account of it: on the
        CLIENT span, on the round in progress and in the metrics."""
        if self.span.is_recording():
            # The split only: the server's parts are on its SERVER span, the bytes on the round span.
            self.span.set_attributes({"specdec.observed_s": rec.observed_s, "specdec.server_s": rec.server_s,
                                      "specdec.network_s": rec.network_s})
        calls = current_round_calls.get()
        if calls is not None:
            calls.append(rec)
        if self.calls.metrics is not None:
            self.calls.metrics.observe_call(rec.side, rec.network_s, rec.bytes_out, rec.bytes_in)


def _status(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    try:
        return error.code(), error.details() or ""
    except Exception:  # an RpcError that is not a call's
        return grpc.StatusCode.UNKNOWN, str(error)
