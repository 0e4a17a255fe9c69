"""The coordinator's round observer: a span per round with its time split into
phases, per-round metrics mirroring vLLM's spec_decode counters, the
generation span around the rounds, and the round loop reporting to it."""

from __future__ import annotations

import pytest
from opentelemetry.trace import StatusCode
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specdec.core.gamma import StaticGamma
from specdec.core.interfaces import DraftToken, RoundResult, SamplingParams, SessionState, Verdict
from specdec.core.rounds import Limits, run_rounds
from specdec.telemetry import tracing
from specdec.telemetry.calls import ClientCalls, RpcRecord
from specdec.telemetry.metrics import ROUND_PHASES, CoordinatorMetrics
from specdec.telemetry.observer import CoordinatorObserver, GenerationInfo, generation_span, record_generation


def _result(gamma, accepted, draft_s=0.010, verify_s=0.020):
    return RoundResult(list(range(accepted + 1)), gamma, accepted, draft_s, verify_s, None)


def _round(observer, index, result, *records):
    """One round as the loop reports it, with ``records`` made by its calls."""
    observer.round_started(index)
    for rec in records:
        with ClientCalls(rec.side, f"specdec.v1.{rec.side.title()}Service").call("X") as call:
            call.record(rec)
    observer.round_finished(result)


def test_round_span_splits_the_round_into_phases(provider):
    observer = CoordinatorObserver(CoordinatorMetrics())
    with tracing.tracer().start_as_current_span("parent"):
        _round(observer, 3, _result(gamma=4, accepted=2),
               RpcRecord("draft", observed_s=0.010, compute_s=0.006, copy_s=0.001, bytes_out=40, bytes_in=400),
               RpcRecord("target", observed_s=0.020, queue_s=0.002, compute_s=0.015, bytes_out=500, bytes_in=12))
    spans = {s.name: s for s in provider.memory.get_finished_spans()}
    rnd = spans["specdec.round"]
    assert rnd.parent.span_id == spans["parent"].context.span_id
    calls = [s for s in provider.memory.get_finished_spans() if s.name.endswith("/X")]
    assert [c.parent.span_id for c in calls] == [rnd.context.span_id] * 2  # the RPCs are the round's children
    a = rnd.attributes
    assert (a["specdec.round"], a["specdec.gamma"], a["specdec.accepted"], a["specdec.tokens"]) == (3, 4, 2, 3)
    assert (a["specdec.bytes_out"], a["specdec.bytes_in"]) == (540, 412)
    assert a["specdec.draft.network_s"] == pytest.approx(0.003)
    assert a["specdec.target.network_s"] == pytest.approx(0.003)
    assert a["specdec.target.queue_s"] == pytest.approx(0.002)
    assert a["specdec.draft.copy_s"] == pytest.approx(0.001) and "specdec.target.copy_s" not in a  # 0: not set
    parts = ("specdec.draft.compute_s", "specdec.target.compute_s", "specdec.draft.copy_s", "specdec.target.queue_s",
             "specdec.draft.network_s", "specdec.target.network_s")
    assert sum(a[k] for k in parts) == pytest.approx(0.030)
    assert a["specdec.round_s"] > 0 and a["specdec.coordinator_s"] == pytest.approx(
        max(0.0, a["specdec.round_s"] - 0.030))


def test_rounds_without_calls_count_as_compute(provider):
    """A round whose sides are local models: all of each side's time is compute."""
    observer = CoordinatorObserver()
    _round(observer, 0, _result(gamma=2, accepted=1, draft_s=0.004, verify_s=0.007))
    (rnd,) = provider.memory.get_finished_spans()
    assert rnd.attributes["specdec.draft.compute_s"] == pytest.approx(0.004)
    assert rnd.attributes["specdec.target.compute_s"] == pytest.approx(0.007)
    assert "specdec.draft.network_s" not in rnd.attributes


def test_a_failed_round_is_marked_on_its_span(provider):
    observer = CoordinatorObserver()
    observer.round_started(0)
    observer.round_failed(ValueError("the target refused"))
    (rnd,) = provider.memory.get_finished_spans()
    assert rnd.status.status_code == StatusCode.ERROR and "the target refused" in rnd.status.description
    assert [e.name for e in rnd.events] == ["exception"]


def test_nothing_is_made_when_tracing_and_metrics_are_off():
    observer = CoordinatorObserver()
    observer.round_started(0)
    assert observer.open_round.get() is None
    observer.round_finished(_result(1, 1))  # nothing to close


def _values(registry) -> dict:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_round_metrics_mirror_vllm_spec_decode_counters():
    metrics = CoordinatorMetrics()
    observer = CoordinatorObserver(metrics)  # metrics without tracing
    rounds = [(4, 4), (4, 1), (0, 0), (3, 0), (2, 2)]
    for gamma, accepted in rounds:
        _round(observer, 0, _result(gamma, accepted))
    v = _values(metrics.registry)
    drafting = [(g, a) for g, a in rounds if g > 0]
    assert v[("specdec_spec_decode_num_drafts_total", ())] == len(drafting)
    assert v[("specdec_spec_decode_num_draft_tokens_total", ())] == sum(g for g, _ in rounds)
    assert v[("specdec_spec_decode_num_accepted_tokens_total", ())] == sum(a for _, a in rounds)
    per_pos = {int(labels[0][1]): n for (name, labels), n in v.items()
               if name == "specdec_spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {0: 3, 1: 2, 2: 1, 3: 1}  # every drafted position has a series, 0 until accepted
    assert v[("specdec_accepted_length_count", ())] == len(drafting)
    assert v[("specdec_rounds_total", ())] == len(rounds)
    assert v[("specdec_gamma", ())] == 2
    phases = {labels[0][1] for (name, labels) in v if name == "specdec_round_phase_seconds_count"}
    assert phases == set(ROUND_PHASES)


class _Proposer:
    def propose(self, call):
        for t in range(call.gamma):
            yield DraftToken(t, None)


class _Verifier:
    def verify(self, call):
        return Verdict(accepted=len(call.drafts), next_token=9)


def test_the_round_loop_reports_every_round_inside_the_generation_span(provider):
    """run_rounds, the coordinator's observer and the generation span together:
    one span per round, each the generation's child, then the usage."""
    metrics = CoordinatorMetrics()
    info = GenerationInfo(model="m", draft_model="d", max_tokens=8, temperature=0.0, input_tokens=2,
                          conversation_id="chat-1", gamma_policy="static:3")
    with generation_span(info) as span:
        results = list(run_rounds(_Proposer(), _Verifier(), SessionState([1, 2]), params=SamplingParams(seed=1),
                                  gamma_policy=StaticGamma(3), limits=Limits(8, 64),
                                  observer=CoordinatorObserver(metrics)))

        class Stats:
            generated_tokens, finish_reason, rounds, drafted_tokens, accepted_tokens = 8, "length", 2, 6, 6
            prompt_tokens = 2

        record_generation(span, metrics, Stats)
    assert [len(r.tokens) for r in results] == [4, 4]
    *rounds, gen = provider.memory.get_finished_spans()
    assert [r.attributes["specdec.round"] for r in rounds] == [0, 1]
    assert all(r.parent.span_id == gen.context.span_id for r in rounds)
    a = gen.attributes
    assert gen.name == "text_completion m" and a["gen_ai.conversation.id"] == "chat-1"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (2, 8)
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["specdec.rounds"] == 2
    assert metrics.registry.get_sample_value("specdec_generate_requests_total", {"finish_reason": "length"}) == 1
    assert metrics.registry.get_sample_value("specdec_rounds_total") == 2


def test_rounds_of_an_unsampled_generation_make_no_span_but_count(provider):
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    metrics = CoordinatorMetrics()
    observer = CoordinatorObserver(metrics)
    unsampled = NonRecordingSpan(SpanContext(0xABC, 0x123, is_remote=False, trace_flags=TraceFlags(0)))
    with trace.use_span(unsampled):
        _round(observer, 0, _result(gamma=3, accepted=2))
        assert trace.get_current_span() is unsampled  # nothing left attached
    assert provider.memory.get_finished_spans() == ()
    assert metrics.registry.get_sample_value("specdec_spec_decode_num_draft_tokens_total") == 3
