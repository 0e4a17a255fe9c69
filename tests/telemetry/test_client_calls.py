"""The coordinator's calls to the services: a CLIENT span per call whose W3C
context travels in the call's metadata, the client/server time split, and
how a call that ended early is marked."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry import trace

from specdec.telemetry.calls import ClientCalls, RpcRecord, current_round_calls
from specdec.telemetry.metrics import CoordinatorMetrics


class _Failed(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


def test_client_call_spans_carry_their_context_and_the_split(provider):
    metrics = CoordinatorMetrics()
    calls = ClientCalls("target", "specdec.v1.TargetService", metrics)
    records: list[RpcRecord] = []
    token = current_round_calls.set(records)
    try:
        with calls.call("Verify") as call:
            (key, traceparent), = call.metadata
            rec = RpcRecord("target", observed_s=0.020, queue_s=0.002, compute_s=0.015, bytes_out=9, bytes_in=7)
            call.record(rec)
        with pytest.raises(_Failed):
            with calls.call("Verify"):
                raise _Failed()
    finally:
        current_round_calls.reset(token)
    assert records == [rec]  # the round in progress got the completed call
    ok, failed = provider.memory.get_finished_spans()
    # The service's SERVER span is the child of exactly this span.
    assert key == "traceparent" and traceparent.split("-")[1:3] == [f"{ok.context.trace_id:032x}",
                                                                     f"{ok.context.span_id:016x}"]
    assert ok.name == "/specdec.v1.TargetService/Verify" and ok.kind == trace.SpanKind.CLIENT
    a = ok.attributes
    assert (a["rpc.system"], a["rpc.service"], a["rpc.method"], a["rpc.grpc.status_code"]) == \
        ("grpc", "specdec.v1.TargetService", "Verify", 0)
    assert (a["specdec.observed_s"], a["specdec.server_s"]) == pytest.approx((0.020, 0.017))
    assert a["specdec.network_s"] == pytest.approx(0.003)
    assert failed.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert failed.status.status_code == trace.StatusCode.ERROR and "connection refused" in failed.status.description
    assert metrics.registry.get_sample_value("specdec_rpc_bytes_total", {"side": "target", "direction": "out"}) == 9
    assert metrics.registry.get_sample_value("specdec_rpc_network_seconds_count", {"side": "target"}) == 1


def test_client_calls_make_nothing_when_tracing_is_off():
    calls = ClientCalls("draft", "specdec.v1.DraftService")
    with calls.call("Propose") as call:
        assert call.metadata is None and not call.span.is_recording()
        call.record(RpcRecord("draft", observed_s=0.01))  # no round, no metrics: nowhere to go


def test_client_call_spans_say_how_a_call_ended_early(provider):
    calls = ClientCalls("draft", "specdec.v1.DraftService")

    def stream():
        with calls.call("Propose"):
            yield 1
            yield 2

    reader = stream()
    next(reader)
    reader.close()  # the round stopped reading mid-stream
    with pytest.raises(ValueError):
        with calls.call("Propose"):
            raise ValueError("bad draft token")
    cancelled, failed = provider.memory.get_finished_spans()
    assert cancelled.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert failed.status.status_code == trace.StatusCode.ERROR and "bad draft token" in failed.status.description
    assert [e.name for e in failed.events] == ["exception"]


@pytest.mark.parametrize("observed, server, network", [(0.010, 0.007, 0.003), (0.010, 0.011, 0.0)])
def test_network_time_is_what_the_client_waited_beyond_the_server(observed, server, network):
    """Clamped at 0: the two clocks are read at slightly different moments."""
    rec = RpcRecord("target", observed_s=observed, compute_s=server)
    assert rec.network_s == pytest.approx(network)


def test_a_record_of_a_call_takes_the_decoded_timing():
    from specdec.serving.timing import CallTiming

    rec = RpcRecord.of_call("draft", 0.02, CallTiming(0.001, 0.012, 0.002, 5, 2.0, 8.0, 0.01), 40, 400)
    assert rec == RpcRecord("draft", 0.02, 0.001, 0.012, 0.002, 5, 40, 400)
    assert rec.network_s == pytest.approx(0.005)


def test_below_an_unsampled_span_no_span_is_made_and_the_decision_travels(provider):
    """At a production sampling ratio most requests are not sampled: their calls
    make no span, and the services learn from the W3C context that the trace
    is not sampled (so they do not start traces of their own)."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    unsampled = NonRecordingSpan(SpanContext(0xABC, 0x123, is_remote=False, trace_flags=TraceFlags(0)))
    metrics = CoordinatorMetrics()
    with trace.use_span(unsampled):
        with ClientCalls("target", "specdec.v1.TargetService", metrics).call("Verify") as call:
            call.record(RpcRecord("target", observed_s=0.02, compute_s=0.015))
    (key, traceparent), = call.metadata
    assert (key, traceparent) == ("traceparent", f"00-{0xABC:032x}-{0x123:016x}-00")
    assert provider.memory.get_finished_spans() == ()
    assert metrics.registry.get_sample_value("specdec_rpc_network_seconds_count", {"side": "target"}) == 1
