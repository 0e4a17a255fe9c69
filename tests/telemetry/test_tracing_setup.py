"""The tracer provider a service installs: exporters and sampler from the
standard OTEL_* environment, the SDK's own exporters, nothing when nothing is
configured, and no private OpenTelemetry attribute anywhere in specdec."""

from __future__ import annotations

import pathlib
import re

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

from specdec.telemetry import tracing

TELEMETRY = pathlib.Path(tracing.__file__).parent


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


def test_unsupported_exporter_settings_are_ignored_with_a_warning(caplog):
    """The OpenTelemetry spec: an unknown value warns and is ignored."""
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "zipkin,console"}) == ["console"]
    assert "exporter 'zipkin' is not supported" in caplog.text
    exporter = tracing.otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert "http/json is not supported" in caplog.text and isinstance(exporter, GrpcSpanExporter)
    exporter.shutdown()


def test_sdk_disabled_turns_the_trace_file_off_too(tmp_path, caplog):
    trace_file = tmp_path / "spans.jsonl"
    assert tracing.setup_tracing("specdec-x", trace_file, environ={"OTEL_SDK_DISABLED": "true"}) is None
    assert not tracing.enabled() and not trace_file.exists()
    assert "tracing is off" in caplog.text


@pytest.mark.parametrize("protocol, exporter_class", [("grpc", GrpcSpanExporter), ("http/protobuf", HttpSpanExporter)])
def test_otlp_protocol_selects_the_sdks_exporter(protocol, exporter_class):
    exporter = tracing.otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": protocol})
    assert type(exporter) is exporter_class
    exporter.shutdown()


def test_the_sampler_is_the_standard_environments(tmp_path, monkeypatch):
    """OTEL_TRACES_SAMPLER / _ARG as the SDK reads them: parent-based ratio
    sampling keeps a trace whole (children follow the root's decision)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    monkeypatch.setattr(tracing.atexit, "register", lambda *args: None)  # the test provider is shut down here
    provider = tracing.setup_tracing("specdec-x", tmp_path / "spans.jsonl", environ={})
    try:
        assert provider is not None and tracing.enabled()
        assert "ParentBased" in provider.sampler.get_description()
        assert "0.25" in provider.sampler.get_description()
        roots = [tracing.tracer().start_span("root") for _ in range(400)]
        sampled = [r for r in roots if r.is_recording()]
        assert 40 < len(sampled) < 160  # 100 expected
        with trace.use_span(sampled[0]):  # a sampled parent's children are all sampled ...
            assert all(tracing.tracer().start_span("child").is_recording() for _ in range(50))
        unsampled = next(r for r in roots if not r.is_recording())
        with trace.use_span(unsampled):  # ... and an unsampled one's none
            assert not any(tracing.tracer().start_span("child").is_recording() for _ in range(50))
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER = None  # as the provider fixture resets it
        from opentelemetry.util._once import Once

        trace._TRACER_PROVIDER_SET_ONCE = Once()


def test_specdec_reads_no_private_opentelemetry_attribute():
    """Nothing in the telemetry package reaches into an object's private
    attributes (``x._name``): the OpenTelemetry packages can be upgraded
    within their compatible ranges without breaking it."""
    hits = [f"{path.name}:{n}: {line.strip()}"
            for path in sorted(TELEMETRY.glob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\._[a-z]", line)]
    assert hits == []
