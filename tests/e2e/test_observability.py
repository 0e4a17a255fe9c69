"""Observability end to end: draft, target and coordinator as three
processes, exporting OTLP/gRPC to a real receiver started here and serving
Prometheus metrics; one Generate must be one trace across the three, with the
right parent/child links and attributes, and the counters must move by exactly
what the generation did."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_e2e import coordinator, model_service

from specdec.serving.client import Client
from specdec.serving.server import free_port
from specdec.tools.otlp_receiver import OtlpReceiver

from tiny_models import add_byte_tokenizer, make_noisy_copy, make_tiny_llama

PROMPT = "def f(x):"
SERVICES = {"specdec-coordinator", "specdec-draft", "specdec-target"}


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def stack(receiver, tmp_path_factory):
    """D + T + C exporting to ``receiver`` (batches every 100 ms) and to one shared
    trace file, each with a metrics port."""
    root = tmp_path_factory.mktemp("obs")
    target = add_byte_tokenizer(make_tiny_llama(root / "target", vocab_size=260, layers=2, max_positions=512,
                                                seed=0, logit_scale=4.0))
    draft = add_byte_tokenizer(make_noisy_copy(target, root / "draft", noise=0.05, seed=1))
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    ports = {role: free_port() for role in ("draft", "target", "coordinator")}
    trace_file = root / "spans.jsonl"
    procs = []
    with pytest.MonkeyPatch.context() as mp:  # the processes inherit this environment
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("OTEL_SERVICE_NAME", raising=False)
        try:
            flags = lambda role: ["--metrics-port", str(ports[role]), "--trace-file", str(trace_file)]  # noqa: E731
            d = model_service("draft", "draft", draft, root, *flags("draft"))
            procs.append(d)
            t = model_service("target", "target", target, root, *flags("target"))
            procs.append(t)
            c = coordinator("coordinator", d, t, target, root, *flags("coordinator"))
            procs.append(c)
            for p in procs:
                p.wait_serving()
            yield {"draft": d, "target": t, "coordinator": c, "metrics": ports, "trace_file": trace_file}
        finally:
            for p in procs:
                p.stop()


def _generate(stack, **kw):
    with Client(stack["coordinator"].address, timeout=60) as client:
        return client.complete(PROMPT, max_new_tokens=24, gamma_policy="static:3", **kw)


# ---------------------------------------------------------------- traces


def test_one_generate_is_one_trace_across_the_three_services(stack, receiver):
    out = _generate(stack, session_id="trace-me")
    stats = out.stats

    def complete(spans):
        gen = [s for s in spans if s["attributes"].get("gen_ai.conversation.id") == "trace-me"]
        if not gen:
            return False
        mine = [s for s in spans if s["trace_id"] == gen[0]["trace_id"]]
        servers = {(s["service"], s["name"]) for s in mine if s["kind"] == "SERVER"}
        return {("specdec-draft", "/specdec.v1.DraftService/ProposeAll"),
                ("specdec-target", "/specdec.v1.TargetService/Verify")} <= servers

    spans = receiver.wait_for(complete)
    (gen,) = [s for s in spans if s["attributes"].get("gen_ai.conversation.id") == "trace-me"]
    trace = [s for s in spans if s["trace_id"] == gen["trace_id"]]
    by_id = {s["span_id"]: s for s in trace}
    assert {s["service"] for s in trace} == SERVICES

    # The generation span: GenAI semantic conventions, child of the Generate server span (the root).
    a = gen["attributes"]
    assert gen["service"] == "specdec-coordinator" and gen["name"].startswith("text_completion ")
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] and a["gen_ai.request.max_tokens"] == 24
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == stats.prompt_tokens == len(PROMPT.encode())
    assert a["gen_ai.usage.output_tokens"] == stats.generated_tokens
    root = by_id[gen["parent_span_id"]]
    assert (root["name"], root["kind"], root["parent_span_id"]) == ("/specdec.v1.Coordinator/Generate", "SERVER", None)

    # A span per round, in order, with what the round did.
    rounds = sorted((s for s in trace if s["name"] == "specdec.round"), key=lambda s: s["start_ns"])
    assert all(s["parent_span_id"] == gen["span_id"] for s in rounds)
    assert [s["attributes"]["specdec.gamma"] for s in rounds] == stats.gammas
    assert [s["attributes"]["specdec.accepted"] for s in rounds] == stats.accepted_per_round
    for r in rounds:
        ra = r["attributes"]
        assert ra["specdec.bytes_out"] > 0 and ra["specdec.bytes_in"] > 0
        assert ra["specdec.target.compute_s"] > 0 and "specdec.target.network_s" in ra
        if ra["specdec.gamma"]:
            assert ra["specdec.draft.compute_s"] > 0 and "specdec.draft.network_s" in ra
    for side in ("draft", "target"):  # gRPC's own time shows, over the generation's calls
        assert sum(r["attributes"].get(f"specdec.{side}.network_s", 0.0) for r in rounds) > 0

    # Every RPC: a coordinator CLIENT span under a round, and the service's SERVER span under it.
    clients = [s for s in trace if s["kind"] == "CLIENT" and s["name"].endswith(("/ProposeAll", "/Verify"))]
    assert len(clients) == stats.rounds + sum(1 for g in stats.gammas if g)
    for c in clients:
        assert by_id[c["parent_span_id"]]["name"] == "specdec.round"
        ca = c["attributes"]
        assert ca["specdec.server_s"] > 0
        # Clamped at 0: the two clocks are read at slightly different moments.
        assert ca["specdec.network_s"] == pytest.approx(max(0.0, ca["specdec.observed_s"] - ca["specdec.server_s"]))
        method = c["name"].rsplit("/", 1)[1]
        assert (ca["rpc.system"], ca["rpc.method"], ca["rpc.grpc.status_code"]) == ("grpc", method, 0)
    for s in trace:
        if s["kind"] == "SERVER" and s["service"] in ("specdec-draft", "specdec-target"):
            parent = by_id[s["parent_span_id"]]
            assert (parent["kind"], parent["service"], parent["name"]) == ("CLIENT", "specdec-coordinator", s["name"])
            if s["name"].endswith(("/ProposeAll", "/Verify")):
                assert s["attributes"]["specdec.server.compute_s"] > 0


# ---------------------------------------------------------------- metrics


def _scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _get(sample: dict, name: str, **labels) -> float:
    return sample.get((name, frozenset(labels.items())), 0.0)


def _sum(sample: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in sample.items() if n == name and want <= set(ls))


def test_metrics_move_by_what_the_generation_did(stack):
    ports = stack["metrics"]
    before = {role: _scrape(port) for role, port in ports.items()}
    stats = _generate(stack).stats
    after = {role: _scrape(port) for role, port in ports.items()}

    def delta(role, name, **labels):
        return _get(after[role], name, **labels) - _get(before[role], name, **labels)

    drafting = sum(1 for g in stats.gammas if g)
    c = "coordinator"
    drafted = delta(c, "specdec_spec_decode_num_draft_tokens_total")
    accepted = delta(c, "specdec_spec_decode_num_accepted_tokens_total")
    assert drafted == stats.drafted_tokens == sum(stats.gammas) > 0
    assert accepted == stats.accepted_tokens
    rejected = sum(g - a for g, a in zip(stats.gammas, stats.accepted_per_round, strict=True))
    assert accepted + rejected == drafted
    assert delta(c, "specdec_spec_decode_num_drafts_total") == drafting
    per_pos = {i: delta(c, "specdec_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(max(stats.gammas))}
    assert sum(per_pos.values()) == accepted
    assert per_pos == {i: sum(1 for a in stats.accepted_per_round if a > i) for i in per_pos}
    assert delta(c, "specdec_accepted_length_count") == drafting
    assert delta(c, "specdec_accepted_length_sum") == accepted
    assert delta(c, "specdec_rounds_total") == stats.rounds
    assert delta(c, "specdec_generated_tokens_total") == stats.generated_tokens
    assert _get(after[c], "specdec_gamma") == stats.gammas[-1]
    assert delta(c, "specdec_round_phase_seconds_count", phase="network") == stats.rounds
    assert delta(c, "specdec_rpc_network_seconds_count", side="draft") == drafting
    assert delta(c, "specdec_rpc_network_seconds_count", side="target") == stats.rounds
    assert delta(c, "specdec_generate_requests_total", finish_reason=stats.finish_reason) == 1

    d, t = "draft", "target"
    assert delta(d, "specdec_draft_proposed_tokens_total", service="draft") == drafted
    assert delta(d, "specdec_rpc_server_duration_seconds_count", service="draft", method="ProposeAll") == drafting
    assert delta(t, "specdec_target_verified_draft_tokens_total", service="target") == drafted
    assert delta(t, "specdec_target_accepted_tokens_total", service="target") == accepted
    assert delta(t, "specdec_rpc_server_duration_seconds_count", service="target", method="Verify") == stats.rounds
    # The target ran the prompt and one token per round besides the drafts it judged.
    assert delta(t, "specdec_server_computed_tokens_total", service="target") == \
        stats.prompt_tokens + drafted + stats.rounds - 1
    for role in (d, t):  # the one-shot session was ended in both services; nothing was evicted
        assert delta(role, "specdec_active_sessions", service=role) == 0
        assert _get(after[role], "specdec_session_evictions_total", service=role) == 0


def test_errors_are_counted_by_grpc_code(stack):
    from specdec.serving import errors

    port = stack["metrics"]["coordinator"]
    before = _sum(_scrape(port), "specdec_rpc_errors_total", method="Generate", code="INVALID_ARGUMENT")
    with Client(stack["coordinator"].address, timeout=30) as client, pytest.raises(errors.InvalidRequest):
        client.complete(PROMPT, max_new_tokens=24, gamma_policy="static:99999")
    after = _sum(_scrape(port), "specdec_rpc_errors_total", method="Generate", code="INVALID_ARGUMENT")
    assert after - before == 1



# ---------------------------------------------------------------- the trace file


def test_trace_report_reads_the_services_trace_file(stack, tmp_path, capsys):
    import json
    import time

    from specdec.cli import main

    stats = _generate(stack, session_id="report-me").stats
    path = stack["trace_file"]
    deadline = time.monotonic() + 30
    while True:  # the coordinator's batch holding this generation's spans
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if any(s["attributes"].get("gen_ai.conversation.id") == "report-me" for s in lines):
            break
        assert time.monotonic() < deadline, "the generation span never reached the trace file"
        time.sleep(0.1)
    assert {s["service"] for s in lines} == SERVICES  # three processes appending to one file

    png = tmp_path / "rounds.png"
    assert main(["trace-report", str(path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("report-me"))
    assert f" {stats.rounds} " in row and f" {stats.generated_tokens} " in row
    assert "network + serialisation" in out and "round (wall)" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_cancelled_generate_still_ends_its_spans(stack, receiver):
    """Leaving the stream early closes the round loop on its worker thread, in the
    call's trace context: the generation span ends (and is exported), the
    services free the session."""
    import time

    from specdec.serving.client import Delta

    def held():
        return (stack["draft"].model_info("draft").active_sessions,
                stack["target"].model_info("target").active_sessions)

    before = held()  # named sessions of other tests stay held
    with Client(stack["coordinator"].address, timeout=60) as client:
        for event in client.generate(PROMPT, max_new_tokens=200, gamma_policy="static:2", session_id="cancel-me"):
            if isinstance(event, Delta) and event.token_ids:
                break  # cancels the call
    spans = receiver.wait_for(lambda spans: any(
        s["attributes"].get("gen_ai.conversation.id") == "cancel-me" for s in spans))
    (gen,) = [s for s in spans if s["attributes"].get("gen_ai.conversation.id") == "cancel-me"]
    assert "gen_ai.usage.output_tokens" not in gen["attributes"]  # it never finished
    deadline = time.monotonic() + 10
    while held() != before:
        assert time.monotonic() < deadline, "the cancelled session is still held"
        time.sleep(0.1)
