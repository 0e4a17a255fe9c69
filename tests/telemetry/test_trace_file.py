"""The --trace-file exporter (one JSON span per line) and ``specdec trace-report``
reading it back."""

from __future__ import annotations

import json

from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from specdec.cli import main as cli_main
from specdec.core.interfaces import RoundResult
from specdec.telemetry.calls import ClientCalls, RpcRecord
from specdec.telemetry.observer import CoordinatorObserver, GenerationInfo, generation_span, record_generation
from specdec.telemetry.trace_file import JsonLinesSpanExporter


def _record_generation(rounds, session="chat-1"):
    """A generation of ``rounds`` (γ, accepted), as the coordinator reports one."""
    observer = CoordinatorObserver()
    info = GenerationInfo(model="tiny-target", draft_model="tiny-draft", max_tokens=32, temperature=0.0,
                          input_tokens=5, conversation_id=session, gamma_policy="adaptive")
    with generation_span(info) as span:
        for i, (gamma, accepted) in enumerate(rounds):
            observer.round_started(i)
            for rec in (RpcRecord("draft", 0.012, compute_s=0.008, bytes_out=30, bytes_in=300),
                        RpcRecord("target", 0.025, compute_s=0.019, copy_s=0.001)):
                with ClientCalls(rec.side, "specdec.v1.Service").call("X") as call:
                    call.record(rec)
            observer.round_finished(RoundResult(list(range(accepted + 1)), gamma, accepted, 0.012, 0.025, None))

        class Stats:
            generated_tokens = sum(a + 1 for _, a in rounds)
            finish_reason, drafted_tokens, accepted_tokens, prompt_tokens = "length", 0, 0, 5

        Stats.rounds = len(rounds)
        record_generation(span, None, Stats)


def test_file_exporter_writes_one_json_span_per_line(provider, tmp_path):
    path = tmp_path / "traces" / "spans.jsonl"
    exporter = JsonLinesSpanExporter(path)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _record_generation([(4, 3), (4, 4)])
    exporter.shutdown()
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    rounds = [s for s in spans if s["name"] == "specdec.round"]
    gen = spans[-1]
    assert len(rounds) == 2 and gen["name"] == "text_completion tiny-target"
    assert {s["trace_id"] for s in spans} == {gen["trace_id"]}
    assert all(s["parent_span_id"] == gen["span_id"] for s in rounds)
    assert gen["service"] == "specdec-test" and gen["kind"] == "INTERNAL"
    a = gen["attributes"]
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "tiny-target"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (5, 9)
    assert a["gen_ai.conversation.id"] == "chat-1" and a["gen_ai.request.max_tokens"] == 32
    assert a["gen_ai.response.finish_reasons"] == ["length"]


def test_trace_report_prints_tables_and_draws_rounds(provider, tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    exporter = JsonLinesSpanExporter(path)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _record_generation([(4, 3), (4, 4), (6, 0)], session="chat-1")
    _record_generation([(2, 2)], session="chat-2")
    exporter.shutdown()
    with open(path, "a") as f:
        f.write('{"truncated": \n')  # a half-written line is skipped, not fatal
    png = tmp_path / "out" / "rounds.png"
    assert cli_main(["trace-report", str(path), "--png", str(png)]) == 0
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
    assert cli_main(["trace-report", str(path)]) == 1
    assert "--trace-file" in capsys.readouterr().err
