"""Telemetry pieces in isolation: exporter selection from OTEL_*, the JSON-lines
file exporter, round spans and their time split, the coordinator's and services'
metrics over HTTP, and ``specdec trace-report`` on a recorded file."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from specdec.telemetry import otlp_encode, observe as telemetry, tracing
from specdec.cli import main as cli_main
from specdec.telemetry.metrics import ROUND_PHASES, CoordinatorMetrics, MetricsServer, ServiceMetrics
from specdec.proto import specdec_pb2 as pb
from specdec.core.interfaces import RoundResult
from specdec.serving.sessions import StoreStats


def _reset_global_provider() -> None:
    """OpenTelemetry allows one global provider per process; tests swap it (as
    OpenTelemetry's own test utilities do)."""
    from opentelemetry.util._once import Once

    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@pytest.fixture
def provider():
    """A global provider for one test, exporting to memory; removed afterwards."""
    _reset_global_provider()
    p = TracerProvider(resource=Resource.create({"service.name": "specdec-test"}))
    memory = InMemorySpanExporter()
    p.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(p)
    p.memory = memory
    yield p
    p.shutdown()
    _reset_global_provider()


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("env, expected", [
    ({}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
])
def test_exporters_come_from_the_standard_environment(env, expected):
    assert tracing.exporter_names(env) == expected


def test_nothing_configured_installs_nothing():
    assert tracing.setup_tracing("specdec-x", None, environ={}) is None
    assert not tracing.enabled()
    with telemetry.TRACE_ONLY.round(0) as scope:  # the shared no-op scope
        assert scope is telemetry._NULL_SCOPE
    assert telemetry.ServiceTelemetry.for_role("draft").server_interceptors() == []


def test_unsupported_exporter_settings_are_ignored_with_a_warning(caplog):
    """The OpenTelemetry spec: an unknown value warns and is ignored."""
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "zipkin,console"}) == ["console"]
    assert "exporter 'zipkin' is not supported" in caplog.text
    exporter = tracing._otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert "http/json is not supported" in caplog.text and isinstance(exporter, otlp_encode.OTLPSpanExporter)
    exporter.shutdown()


def test_sdk_disabled_turns_the_trace_file_off_too(tmp_path, caplog):
    trace_file = tmp_path / "spans.jsonl"
    assert tracing.setup_tracing("specdec-x", trace_file, environ={"OTEL_SDK_DISABLED": "true"}) is None
    assert not tracing.enabled() and not trace_file.exists()
    assert "tracing is off" in caplog.text


@pytest.mark.parametrize("protocol, exporter_class", [("grpc", otlp_encode.OTLPSpanExporter),
                                                     ("http/protobuf", HttpSpanExporter)])
def test_otlp_protocol_selects_the_exporter(protocol, exporter_class):
    exporter = tracing._otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": protocol})
    assert isinstance(exporter, exporter_class)
    exporter.shutdown()


def test_metrics_port_flag_and_environment():
    import argparse

    parser = argparse.ArgumentParser()
    telemetry.add_arguments(parser, "draft")
    args = parser.parse_args([])
    assert telemetry.setup_from_args(args, "draft", environ={}).metrics is None
    t = telemetry.setup_from_args(args, "draft", environ={"SPECDEC_DRAFT_METRICS_PORT": "9464"})
    assert t.metrics_port == 9464 and isinstance(t.metrics, ServiceMetrics)
    t = telemetry.setup_from_args(parser.parse_args(["--metrics-port", "9999"]), "coordinator", environ={})
    assert isinstance(t.metrics, CoordinatorMetrics)
    with pytest.raises(ValueError, match="SPECDEC_DRAFT_METRICS_PORT"):
        telemetry.setup_from_args(args, "draft", environ={"SPECDEC_DRAFT_METRICS_PORT": "x"})


# ---------------------------------------------------------------- rounds


def _result(gamma, accepted, draft_s=0.010, verify_s=0.020):
    tokens = list(range(accepted + 1))
    return RoundResult(tokens, gamma, accepted, draft_s, verify_s, None)


def test_round_span_splits_the_round_into_phases(provider):
    metrics = CoordinatorMetrics()
    observer = telemetry.RoundObserver(metrics)
    with tracing.tracer().start_as_current_span("parent"):
        with observer.round(3) as scope:
            scope.calls.append(telemetry.RpcRecord("draft", observed_s=0.010, compute_s=0.006, copy_s=0.001,
                                                   bytes_out=40, bytes_in=400))
            scope.calls.append(telemetry.RpcRecord("target", observed_s=0.020, queue_s=0.002, compute_s=0.015,
                                                   bytes_out=500, bytes_in=12))
            scope.done(_result(gamma=4, accepted=2))
    spans = {s.name: s for s in provider.memory.get_finished_spans()}
    rnd = spans["specdec.round"]
    assert rnd.parent.span_id == spans["parent"].context.span_id
    a = rnd.attributes
    assert (a["specdec.round"], a["specdec.core.gamma"], a["specdec.accepted"], a["specdec.tokens"]) == (3, 4, 2, 3)
    assert (a["specdec.bytes_out"], a["specdec.bytes_in"]) == (540, 412)
    assert a["specdec.draft.network_s"] == pytest.approx(0.003)
    assert a["specdec.target.network_s"] == pytest.approx(0.003)
    assert a["specdec.target.queue_s"] == pytest.approx(0.002)
    assert a["specdec.draft.copy_s"] == pytest.approx(0.001) and "specdec.target.copy_s" not in a  # 0: not set
    phases = sum(a[k] for k in ("specdec.draft.compute_s", "specdec.target.compute_s", "specdec.draft.copy_s",
                                "specdec.target.queue_s", "specdec.draft.network_s", "specdec.target.network_s",
                                "specdec.coordinator_s"))
    assert phases == pytest.approx(a["specdec.round_s"], abs=1e-9) or a["specdec.coordinator_s"] == 0


def test_a_rounds_telemetry_waits_for_the_next_call_and_keeps_its_times(provider, caplog):
    """Inside a generation, a round's attributes, metrics and span ends wait
    until the next call is on its way (``Call.while_waiting``) or the
    generation ends; what they record is the round's own times."""
    metrics = CoordinatorMetrics()
    observer = telemetry.RoundObserver(metrics)
    calls = telemetry.ClientCalls("draft", "specdec.v1.DraftService")
    seen = {}

    def finished():
        return sorted(s.name for s in provider.memory.get_finished_spans())

    def events():
        for index in range(2):
            with observer.round(index) as scope:
                with calls.call("Propose") as call:
                    seen[f"before wait {index}"] = finished()
                    call.while_waiting()
                    seen[f"after wait {index}"] = finished()
                scope.done(_result(gamma=4, accepted=2))
            seen[f"ended {index}"] = time.time_ns()
            telemetry.later(lambda: 1 / 0)  # put-off work that fails is logged, never raised
            yield index
            time.sleep(0.02)
        yield type("Stats", (), {"generated_tokens": 6, "finish_reason": "length", "rounds": 2,
                                 "drafted_tokens": 8, "accepted_tokens": 4})()

    list(telemetry.observe_generation(events(), metrics=metrics, model="m", max_tokens=6, temperature=0.0,
                                      input_tokens=3, conversation_id="c"))
    assert seen["before wait 0"] == seen["after wait 0"] == []
    assert seen["before wait 1"] == [] and seen["after wait 1"] == ["/specdec.v1.DraftService/Propose",
                                                                     "specdec.round"]
    rounds = sorted((s for s in provider.memory.get_finished_spans() if s.name == "specdec.round"),
                    key=lambda s: s.start_time)
    assert [r.attributes["specdec.round"] for r in rounds] == [0, 1]
    assert rounds[0].end_time <= seen["ended 0"] < rounds[1].start_time  # not when the span was handed on
    assert [s.name for s in provider.memory.get_finished_spans()][-1] == "text_completion m"  # the rounds first
    assert metrics.registry.get_sample_value("specdec_spec_decode_num_drafts_total") == 2
    assert caplog.text.count("ZeroDivisionError") == 2


def test_outside_a_generation_telemetry_is_not_put_off(provider):
    ran = []
    telemetry.later(ran.append, 1)
    assert ran == [1]


def _generation(events, metrics=None):
    return telemetry.observe_generation(events, metrics=metrics, model="m", max_tokens=8, temperature=0.0,
                                        input_tokens=3, conversation_id="c")


def test_work_is_put_off_only_while_a_generation_step_runs(provider):
    """Between steps the caller's context is its own (the coordinator steps
    several generations on shared threads); a generation closed part-way
    still ends every span, its own last."""
    observer = telemetry.RoundObserver()

    def events():
        for index in range(3):
            with observer.round(index) as scope:
                scope.done(_result(gamma=4, accepted=2))
            yield index

    steps = _generation(events())
    assert next(steps) == 0
    assert telemetry._LATER.get() is None
    ran = []
    telemetry.later(ran.append, "now")
    assert ran == ["now"]
    assert provider.memory.get_finished_spans() == ()  # round 0's end waits for a call or the end
    steps.close()
    names = [s.name for s in provider.memory.get_finished_spans()]
    assert names == ["specdec.round", "text_completion m"]


def test_rounds_without_a_propose_do_not_pile_their_work_up(provider):
    """γ = 0 rounds send no Propose: beyond about two rounds' worth, work is done at once."""
    observer = telemetry.RoundObserver(CoordinatorMetrics())
    target = telemetry.ClientCalls("target", "specdec.v1.TargetService")
    finished = []

    def events():
        for index in range(10):
            with observer.round(index) as scope:
                with target.call("Verify"):
                    pass
                scope.done(_result(gamma=0, accepted=0))
            finished.append(len(provider.memory.get_finished_spans()))
            yield index

    list(_generation(events()))
    assert max(i - f // 2 for i, f in enumerate(finished, 1)) <= 3  # rounds whose two spans have not ended


def test_network_time_is_never_negative():
    rec = telemetry.RpcRecord("target", observed_s=0.010, compute_s=0.011)
    assert rec.network_s == 0.0


def test_in_process_rounds_count_as_compute(provider):
    with telemetry.TRACE_ONLY.round(0) as scope:
        scope.done(_result(gamma=2, accepted=1, draft_s=0.004, verify_s=0.007))
    (rnd,) = provider.memory.get_finished_spans()
    assert rnd.attributes["specdec.draft.compute_s"] == pytest.approx(0.004)
    assert rnd.attributes["specdec.target.compute_s"] == pytest.approx(0.007)
    assert "specdec.draft.network_s" not in rnd.attributes


def test_round_metrics_mirror_vllm_spec_decode_counters():
    metrics = CoordinatorMetrics()
    observer = telemetry.RoundObserver(metrics)  # metrics without tracing
    rounds = [(4, 4), (4, 1), (0, 0), (3, 0), (2, 2)]
    for gamma, accepted in rounds:
        with observer.round(0) as scope:
            scope.done(_result(gamma, accepted))
    v = _values(metrics.registry)
    drafting = [(g, a) for g, a in rounds if g > 0]
    assert v["specdec_spec_decode_num_drafts_total"] == len(drafting)
    assert v["specdec_spec_decode_num_draft_tokens_total"] == sum(g for g, _ in rounds)
    assert v["specdec_spec_decode_num_accepted_tokens_total"] == sum(a for _, a in rounds)
    per_pos = {int(p): n for p, n in v.by_label("specdec_spec_decode_num_accepted_tokens_per_pos_total",
                                                    "position").items()}
    assert per_pos == {0: 3, 1: 2, 2: 1, 3: 1}
    assert sum(per_pos.values()) == v["specdec_spec_decode_num_accepted_tokens_total"]
    assert v["specdec_accepted_length_count"] == len(drafting)
    assert v["specdec_rounds_total"] == len(rounds)
    assert v["specdec_gamma"] == 2
    assert v["specdec_generated_tokens_total"] == 0  # counted as delivered: observe_generation
    phases = set(v.by_label("specdec_round_phase_seconds_count", "phase"))
    assert phases == set(ROUND_PHASES)


# ---------------------------------------------------------------- metrics over HTTP


class _Values(dict):
    """Unlabelled sample name -> value; ``get(name, **labels)`` for labelled ones."""

    def __init__(self):
        super().__init__()
        self.labelled: dict[tuple[str, frozenset], float] = {}

    def get_labelled(self, name: str, **labels) -> float:
        return self.labelled[(name, frozenset(labels.items()))]

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(k)[label]: v for (n, k), v in self.labelled.items() if n == name and label in dict(k)}


def _values(registry_or_text) -> _Values:
    if not isinstance(registry_or_text, str):
        from prometheus_client import generate_latest

        registry_or_text = generate_latest(registry_or_text).decode()
    out = _Values()
    for family in text_string_to_metric_families(registry_or_text):
        for s in family.samples:
            if s.labels:
                out.labelled[(s.name, frozenset(s.labels.items()))] = s.value
            else:
                out[s.name] = s.value
    return out


def test_service_metrics_are_served_over_http():
    stats = StoreStats(active_sessions=3, cached_tokens=120, evictions=2, expirations=1, created=6)
    metrics = ServiceMetrics("target", sessions=lambda: stats)
    metrics.observe_verified(drafts=4, accepted=3)
    metrics.observe_rpc("Verify", 0.01, None)
    metrics.observe_rpc("Verify", 0.01, "NOT_FOUND")
    server = MetricsServer(metrics.registry, 0, "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
    finally:
        server.close()
    v = _values(text)
    get = v.get_labelled
    assert get("specdec_active_sessions", service="target") == 3
    assert get("specdec_cached_kv_tokens", service="target") == 120
    assert get("specdec_session_evictions_total", service="target") == 2
    assert get("specdec_target_verified_draft_tokens_total", service="target") == 4
    assert get("specdec_target_accepted_tokens_total", service="target") == 3
    assert get("specdec_rpc_errors_total", service="target", method="Verify", code="NOT_FOUND") == 1
    assert get("specdec_rpc_server_duration_seconds_count", service="target", method="Verify") == 2


def test_separate_services_keep_separate_registries():
    a, b = CoordinatorMetrics(), CoordinatorMetrics()
    a.observe_round(gamma=3, accepted=3, wall_s=0.01, phases={})
    assert _values(a.registry)["specdec_spec_decode_num_draft_tokens_total"] == 3
    assert _values(b.registry)["specdec_spec_decode_num_draft_tokens_total"] == 0


def test_delivered_tokens_are_counted_and_every_drafted_position_has_a_series():
    """Tokens counted are those the client got (a round's tokens past a stop
    string are dropped); per-position acceptance has a series, 0 until
    accepted, for every position drafted (as vLLM's)."""
    from coordinator.engine import Delta

    m = CoordinatorMetrics()
    m.observe_round(gamma=3, accepted=1, wall_s=0.01, phases={})

    class Stats:
        generated_tokens, finish_reason, rounds, drafted_tokens, accepted_tokens = 3, "stop", 2, 3, 1

    events = (e for e in [Delta([5, 6], "ab"), Delta([7], "c"), Stats()])  # the round made 4; the 4th was past "stop"
    list(telemetry.observe_generation(events, metrics=m, model="m", max_tokens=8, temperature=0.0,
                                      input_tokens=2, conversation_id=""))
    v = _values(m.registry)
    assert v["specdec_generated_tokens_total"] == 3
    assert v.by_label("specdec_spec_decode_num_accepted_tokens_per_pos_total", "position") == \
        {"0": 1.0, "1": 0.0, "2": 0.0}


# ---------------------------------------------------------------- file exporter and report


def _record_generation(provider, rounds, session="chat-1"):
    observer = telemetry.RoundObserver()

    class Stats:
        generated_tokens = sum(a + 1 for _, a in rounds)
        finish_reason, rounds_, drafted_tokens, accepted_tokens = "length", len(rounds), 0, 0

    Stats.rounds = len(rounds)

    def events():
        for i, (gamma, accepted) in enumerate(rounds):
            with observer.round(i) as scope:
                scope.calls.append(telemetry.RpcRecord("draft", 0.012, compute_s=0.008, bytes_out=30, bytes_in=300))
                scope.calls.append(telemetry.RpcRecord("target", 0.025, compute_s=0.019, copy_s=0.001))
                scope.done(_result(gamma, accepted, draft_s=0.012, verify_s=0.025))
            yield i
        yield Stats()

    list(telemetry.observe_generation(events(), metrics=None, model="tiny-target", max_tokens=32,
                                      temperature=0.0, input_tokens=5, conversation_id=session))


def test_file_exporter_writes_one_json_span_per_line(provider, tmp_path):
    path = tmp_path / "traces" / "spans.jsonl"
    exporter = tracing.JsonLinesSpanExporter(path)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _record_generation(provider, [(4, 3), (4, 4)])
    exporter.shutdown()
    lines = path.read_text().splitlines()
    spans = [json.loads(line) for line in lines]
    assert [s["name"] for s in spans] == ["specdec.round", "specdec.round", "text_completion tiny-target"]
    gen = spans[-1]
    assert {s["trace_id"] for s in spans} == {gen["trace_id"]}
    assert all(s["parent_span_id"] == gen["span_id"] for s in spans[:2])
    assert gen["service"] == "specdec-test" and gen["kind"] == "INTERNAL"
    a = gen["attributes"]
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "tiny-target"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (5, 9)
    assert a["gen_ai.conversation.id"] == "chat-1" and a["gen_ai.request.max_tokens"] == 32
    assert a["gen_ai.response.finish_reasons"] == ["length"]


def _trace_report(*argv) -> int:
    """``specdec trace-report ARGV``."""
    return cli_main(["trace-report", *argv])


def test_trace_report_prints_tables_and_draws_rounds(provider, tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    exporter = tracing.JsonLinesSpanExporter(path)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _record_generation(provider, [(4, 3), (4, 4), (6, 0)], session="chat-1")
    _record_generation(provider, [(2, 2)], session="chat-2")
    exporter.shutdown()
    with open(path, "a") as f:
        f.write('{"truncated": \n')  # a half-written line is skipped, not fatal
    png = tmp_path / "out" / "rounds.png"
    assert _trace_report(str(path), "--png", str(png)) == 0
    out = capsys.readouterr().out
    assert "2 generation(s), 4 round(s)" in out
    assert "chat-1" in out and "chat-2" in out
    for phase in ("draft compute", "target compute", "device copies", "network + serialisation", "coordinator"):
        assert phase in out
    row = next(line for line in out.splitlines() if line.startswith("chat-1"))
    assert " 3 " in row and "50.0%" in row  # 3 rounds; 7 of 14 drafts accepted
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_report_without_rounds_explains(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert _trace_report(str(path)) == 1
    assert "--trace-file" in capsys.readouterr().err


# ---------------------------------------------------------------- the coordinator's calls


class _Failed(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


def test_client_call_spans_carry_their_context_and_the_split(provider):
    metrics = CoordinatorMetrics()
    calls = telemetry.ClientCalls("target", "specdec.v1.TargetService", metrics)
    observer = telemetry.RoundObserver(metrics)
    with observer.round(0) as scope:
        with calls.call("Verify") as call:
            (key, traceparent), = call.metadata
            rec = telemetry.RpcRecord("target", observed_s=0.020, queue_s=0.002, compute_s=0.015, bytes_out=9,
                                      bytes_in=7)
            call.record(rec)
        with pytest.raises(_Failed):
            with calls.call("Verify"):
                raise _Failed()
        assert scope.calls == [rec]
        scope.done(RoundResult([1], 1, 0, 0.0, 0.02, None))
    spans = provider.memory.get_finished_spans()
    ok, failed = [s for s in spans if s.kind == trace.SpanKind.CLIENT]
    (round_span,) = [s for s in spans if s.name == "specdec.round"]
    # The service's SERVER span is the child of exactly this span.
    assert key == "traceparent" and traceparent.split("-")[1:3] == [f"{ok.context.trace_id:032x}",
                                                                     f"{ok.context.span_id:016x}"]
    assert ok.name == "/specdec.v1.TargetService/Verify" and ok.parent.span_id == round_span.context.span_id
    a = ok.attributes
    assert (a["rpc.system"], a["rpc.service"], a["rpc.method"], a["rpc.grpc.status_code"]) == \
        ("grpc", "specdec.v1.TargetService", "Verify", 0)
    assert (a["specdec.observed_s"], a["specdec.server_s"]) == pytest.approx((0.020, 0.017))
    assert a["specdec.network_s"] == pytest.approx(0.003)
    assert failed.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert failed.status.status_code == trace.StatusCode.ERROR and "connection refused" in failed.status.description
    assert metrics.registry.get_sample_value("specdec_rpc_bytes_total", {"side": "target", "direction": "out"}) == 9


def test_client_calls_cost_nothing_when_off():
    calls = telemetry.ClientCalls("draft", "specdec.v1.DraftService")
    with calls.call("Propose") as call:
        assert call.metadata is None and not call.span.is_recording()
        call.record(telemetry.RpcRecord("draft", observed_s=0.01))  # ignored


def test_receiver_that_keeps_nothing_still_counts(provider):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    from specdec.tools.otlp_receiver import OtlpReceiver

    with OtlpReceiver(keep=False) as receiver:
        exporter = OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)
        for name in ("a", "b", "c"):
            with tracing.tracer().start_as_current_span(name):
                pass
        exporter.export(provider.memory.get_finished_spans())
        exporter.shutdown()
        assert (receiver.span_count, receiver.exports, receiver.spans) == (3, 1, [])


def test_round_spans_encode_for_otlp_as_the_sdk_encodes_them(provider):
    """The coordinator's round and CLIENT spans, through the fast encoder
    (``tests/test_otlp_encode.py`` covers every kind of span and value)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    draft = telemetry.ClientCalls("draft", "specdec.v1.DraftService")
    timing = pb.ServerTiming(queue_s=1e-4, compute_s=0.01, copy_s=0.0, computed_tokens=4)
    with telemetry.TRACE_ONLY.round(3) as scope:
        with draft.call("Propose") as call:
            call.record(telemetry.RpcRecord.of_call("draft", 0.012, timing, 100, 200))
        scope.done(RoundResult([1, 2, 3], 4, 2, 0.01, 0.01, None))
    spans = provider.memory.get_finished_spans()
    assert len(spans) == 2
    assert ExportTraceServiceRequest.FromString(otlp_encode.encode_spans(spans)) == encode_spans(spans)


def test_client_call_spans_say_how_a_call_ended_early(provider):
    calls = telemetry.ClientCalls("draft", "specdec.v1.DraftService")

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


# ---------------------------------------------------------------- the services' SERVER spans


def _serve_and_call(calls, metrics=None, role="target"):
    """A GrpcServer with the interceptors a ``role`` service process installs
    (the ServerObserver, which maps errors too, or else a plain ErrorInterceptor),
    a fake Verify and a streaming Propose on a loopback port;
    ``calls(verify, propose, channel)`` runs against it. Each handler records
    the span that was current while it ran. ``metrics``: a ServiceMetrics for
    the observer to count into."""
    import asyncio

    from specdec.proto import specdec_pb2 as pb
    from specdec.serving.server import GrpcServer

    seen = []

    async def verify(request, context):
        seen.append(trace.get_current_span())
        if request.session_id == "bad":
            raise ValueError("draft_tokens[0] = 9999 is outside the vocabulary")
        if request.session_id == "bug":
            raise RuntimeError("boom")
        return pb.VerifyResponse(accepted=1)

    async def propose(request, context):
        seen.append(trace.get_current_span())
        if request.session_id == "bad":
            yield pb.DraftToken()
            raise ValueError("gamma = 99 is above the limit")
        if request.session_id == "big":  # more than flow control lets through before the client reads
            for _ in range(64):
                yield pb.DraftToken(q=pb.Distribution(probs=bytes(1 << 20)))
        for _ in range(2):
            yield pb.DraftToken()

    handler = grpc.method_handlers_generic_handler("specdec.v1.TargetService", {
        "Verify": grpc.unary_unary_rpc_method_handler(
            verify, request_deserializer=pb.VerifyRequest.FromString,
            response_serializer=pb.VerifyResponse.SerializeToString),
        "Propose": grpc.unary_stream_rpc_method_handler(
            propose, request_deserializer=pb.ProposeRequest.FromString,
            response_serializer=pb.DraftToken.SerializeToString)})

    async def main():
        server = GrpcServer(["specdec.v1.TargetService"],
                            interceptors=telemetry.ServiceTelemetry(role, metrics).server_interceptors())
        server.server.add_generic_rpc_handlers((handler,))
        port = server.bind("127.0.0.1", 0)
        await server.server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                v = channel.unary_unary("/specdec.v1.TargetService/Verify",
                                        request_serializer=pb.VerifyRequest.SerializeToString,
                                        response_deserializer=pb.VerifyResponse.FromString)
                p = channel.unary_stream("/specdec.v1.TargetService/Propose",
                                         request_serializer=pb.ProposeRequest.SerializeToString,
                                         response_deserializer=pb.DraftToken.FromString)
                await calls(v, p, channel)
        finally:
            await server.server.stop(None)

    asyncio.run(main())
    return seen


def _traceparent(trace_id: int, span_id: int, sampled: bool):
    return (("traceparent", f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"),)


# The coordinator's SERVER span is current while Generate runs (its spans are
# children); the model services' handlers make no spans, so theirs is made
# once the reply has gone.
SERVER_ROLES = ["coordinator", "target"]


@pytest.mark.parametrize("role", SERVER_ROLES)
def test_server_span_is_the_callers_child(provider, role):
    from specdec.proto import specdec_pb2 as pb

    async def calls(verify, propose, channel):
        await verify(pb.VerifyRequest(session_id="s"), metadata=_traceparent(0xABC, 0x123, sampled=True))
        assert len([m async for m in propose(pb.ProposeRequest(), metadata=_traceparent(0xABC, 0x456, True))]) == 2
        await verify(pb.VerifyRequest(session_id="s"))  # no caller context: a root span

    before = time.time_ns()
    seen = _serve_and_call(calls, role=role)
    verify, propose, root = sorted(provider.memory.get_finished_spans(), key=lambda s: s.start_time)
    assert before < verify.start_time < verify.end_time < propose.start_time < propose.end_time < root.start_time
    assert [s.kind for s in (verify, propose, root)] == [trace.SpanKind.SERVER] * 3
    assert (verify.context.trace_id, verify.parent.span_id, verify.parent.is_remote) == (0xABC, 0x123, True)
    assert (propose.context.trace_id, propose.parent.span_id) == (0xABC, 0x456)
    assert root.parent is None
    assert verify.name == "/specdec.v1.TargetService/Verify" and propose.name == "/specdec.v1.TargetService/Propose"
    a = verify.attributes
    assert (a["rpc.system"], a["rpc.service"], a["rpc.method"], a["rpc.grpc.status_code"]) == \
        ("grpc", "specdec.v1.TargetService", "Verify", 0)
    assert a["net.peer.ip"] == "127.0.0.1" and a["net.peer.port"] > 0  # which caller
    if role == "coordinator":  # the handler ran inside the SERVER span (spans it starts are its children)
        assert [s.get_span_context().span_id for s in seen] == [s.context.span_id for s in (verify, propose, root)]
    else:
        assert seen == [trace.INVALID_SPAN] * 3


@pytest.mark.parametrize("role", SERVER_ROLES)
def test_unsampled_callers_get_no_server_span(provider, role):
    from specdec.proto import specdec_pb2 as pb

    async def calls(verify, propose, channel):
        await verify(pb.VerifyRequest(session_id="s"), metadata=_traceparent(0xABC, 0x123, sampled=False))

    (current,) = _serve_and_call(calls, role=role)
    assert provider.memory.get_finished_spans() == ()
    assert not current.is_recording()
    assert current.get_span_context().trace_id == (0xABC if role == "coordinator" else 0)


def test_a_model_services_span_is_made_after_its_reply(provider, monkeypatch):
    """The span is made at the event loop's next turn, after the reply has been
    handed to grpc, and carries the call's own start and end times."""
    import asyncio

    from specdec.telemetry import light_spans
    from specdec.proto import specdec_pb2 as pb

    made, tasks = [], []
    real = light_spans.start_span

    def start_span(*args, **kwargs):
        made.append(time.time_ns())
        tasks.append(asyncio.current_task())  # None: a loop callback, not the call's own task
        return real(*args, **kwargs)

    monkeypatch.setattr(light_spans, "start_span", start_span)
    replies = []

    async def calls(verify, propose, channel):
        await verify(pb.VerifyRequest(session_id="s"), metadata=_traceparent(0xABC, 0x123, sampled=True))
        replies.append(time.time_ns())
        await asyncio.sleep(0.2)

    _serve_and_call(calls)
    (span,) = provider.memory.get_finished_spans()
    assert tasks == [None]  # made after the handler returned, from the event loop, not in line
    assert span.start_time < span.end_time < made[0]  # the call's times, not the moment the span was made
    assert span.end_time < replies[0]


@pytest.mark.parametrize("peer, attributes", [
    ("ipv4:10.0.0.7:51234", {"net.peer.ip": "10.0.0.7", "net.peer.port": 51234}),
    ("ipv6:%5B::1%5D:443", {"net.peer.ip": "::1", "net.peer.port": 443}),
    ("unix:/tmp/specdec.sock", {}),
    ("", {}),
])
def test_peer_address_attributes(peer, attributes):
    assert telemetry._peer_attributes(peer) == attributes


@pytest.mark.parametrize("role", SERVER_ROLES)
def test_failed_calls_mark_the_server_span(provider, role):
    from specdec.proto import specdec_pb2 as pb

    async def calls(verify, propose, channel):
        for session, code in (("bad", grpc.StatusCode.INVALID_ARGUMENT), ("bug", grpc.StatusCode.INTERNAL)):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await verify(pb.VerifyRequest(session_id=session), metadata=_traceparent(0xABC, 0x123, True))
            assert failed.value.code() == code
        with pytest.raises(grpc.aio.AioRpcError) as failed:  # mid-stream
            [m async for m in propose(pb.ProposeRequest(session_id="bad"), metadata=_traceparent(0xABC, 0x1, True))]
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "above the limit" in failed.value.details()

    _serve_and_call(calls, role=role)
    bad, bug, bad_stream = sorted(provider.memory.get_finished_spans(), key=lambda s: s.start_time)
    assert all(s.parent is not None and s.context.trace_id == 0xABC for s in (bad, bug, bad_stream))
    assert bad_stream.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.status.status_code == trace.StatusCode.ERROR and "outside the vocabulary" in bad.status.description
    assert bad.events == ()  # a bad request is not a bug: no traceback on the span
    assert bug.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert [e.name for e in bug.events] == ["exception"]


def test_the_observer_is_the_servers_one_error_interceptor():
    """Traced or counted, a call passes one wrapper: the observer maps errors
    itself (each extra interceptor costs ~75 µs of CPU per call), and still
    answers INVALID_ARGUMENT / INTERNAL as the plain ErrorInterceptor does."""
    import asyncio

    from specdec.serving.errors import ErrorInterceptor
    from specdec.proto import specdec_pb2 as pb
    from specdec.serving.server import GrpcServer

    metrics = telemetry.ServiceMetrics("target")
    (observer,) = telemetry.ServiceTelemetry("target", metrics).server_interceptors()

    async def kinds(interceptors):  # a grpc.aio server is made inside a running loop
        return [type(i) for i in GrpcServer(["x"], interceptors=interceptors).interceptors]

    assert asyncio.run(kinds([observer])) == [telemetry.ServerObserver]
    assert asyncio.run(kinds([])) == [ErrorInterceptor]

    async def calls(verify, propose, channel):
        for session, code in (("bad", grpc.StatusCode.INVALID_ARGUMENT), ("bug", grpc.StatusCode.INTERNAL)):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await verify(pb.VerifyRequest(session_id=session))
            assert failed.value.code() == code

    _serve_and_call(calls, metrics)  # metrics only: tracing off
    for code in ("INVALID_ARGUMENT", "INTERNAL"):
        assert metrics.registry.get_sample_value(
            "specdec_rpc_errors_total", {"service": "target", "method": "Verify", "code": code}) == 1


def test_the_observers_own_failure_is_answered_internal(provider, monkeypatch):
    """A bug in the observer itself (here: making the span current in the
    coordinator) is a status the client can read, INTERNAL, as every other
    bug, not grpc's UNKNOWN."""
    from specdec.telemetry import light_spans
    from specdec.proto import specdec_pb2 as pb

    def broken(*args, **kwargs):
        raise RuntimeError("sampler bug")

    monkeypatch.setattr(light_spans, "start_span", broken)

    async def calls(verify, propose, channel):
        for call in (verify(pb.VerifyRequest(session_id="s"), metadata=_traceparent(0xABC, 0x123, True)),
                     propose(pb.ProposeRequest(), metadata=_traceparent(0xABC, 0x123, True)).read()):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call
            assert failed.value.code() == grpc.StatusCode.INTERNAL and "sampler bug" in failed.value.details()

    assert _serve_and_call(calls, role="coordinator") == []  # the handlers never ran


def test_a_span_that_cannot_be_made_after_the_reply_is_logged(provider, monkeypatch, caplog):
    """In a model service the span is made after the reply: the call succeeds,
    and the lost span is logged."""
    from specdec.telemetry import light_spans
    from specdec.proto import specdec_pb2 as pb

    def broken(*args, **kwargs):
        raise RuntimeError("sampler bug")

    monkeypatch.setattr(light_spans, "start_span", broken)

    async def calls(verify, propose, channel):
        assert (await verify(pb.VerifyRequest(session_id="s"), metadata=_traceparent(0xABC, 0x123, True))).accepted == 1
        assert len([m async for m in propose(pb.ProposeRequest(), metadata=_traceparent(0xABC, 0x123, True))]) == 2

    assert len(_serve_and_call(calls)) == 2
    assert caplog.text.count("could not be made") == 2 and "sampler bug" in caplog.text


def test_a_stream_cancelled_mid_send_ends_its_span_cleanly(provider, caplog):
    """The client goes away while the server is blocked sending: grpc leaves the
    handler's generator to be closed later, from another context."""
    import asyncio

    from specdec.proto import specdec_pb2 as pb

    async def calls(verify, propose, channel):
        call = propose(pb.ProposeRequest(session_id="big"), metadata=_traceparent(0xABC, 0x123, sampled=True))
        await call.read()
        call.cancel()
        for _ in range(100):  # until the server has given up on the stream
            if provider.memory.get_finished_spans():
                break
            await asyncio.sleep(0.05)

    _serve_and_call(calls)
    import gc

    gc.collect()
    (span,) = provider.memory.get_finished_spans()
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert "Failed to detach context" not in caplog.text


def test_health_calls_pass_through_the_observer_counted_but_not_traced(provider):
    """Health Check aborts with NOT_FOUND for an unknown service; Watch is a
    coroutine that writes its replies (not an async generator). Probes call
    them every few seconds: they are counted, but make no trace."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def calls(verify, propose, channel):
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        await verify(pb.VerifyRequest(session_id="s"))

    from specdec.proto import specdec_pb2 as pb

    metrics = telemetry.ServiceMetrics("target")
    _serve_and_call(calls, metrics)
    assert [s.name for s in provider.memory.get_finished_spans()] == ["/specdec.v1.TargetService/Verify"]
    errors = metrics.registry.get_sample_value(
        "specdec_rpc_errors_total", {"service": "target", "method": "Check", "code": "NOT_FOUND"})
    assert errors == 1
