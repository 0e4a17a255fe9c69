"""Draft and target gRPC services, in this process, over loopback sockets."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.core.interfaces import SamplingParams
from specdec.models.local import DraftRule, draft_tokens, new_draft_sequence, verify_drafts
from specdec.models.runner import ModelRunner
from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import convert as pc
from specdec.serving import errors

from service_harness import LoopThread, channel, start_service

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, top_k=10, seed=1234)


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def services(loop, tiny_pair):
    target_dir, draft_dir, _ = tiny_pair
    draft = start_service(loop, "draft", draft_dir, gamma_max=8, max_sessions=4)
    target = start_service(loop, "target", target_dir, gamma_max=8, max_sessions=4,
                           max_message_bytes=1 << 20)
    yield draft, target
    for s in (draft, target):
        loop.call(s.stop())


@pytest.fixture(scope="module")
def stubs(services):
    draft, target = services
    dch, tch = channel(draft), channel(target)
    yield pb_grpc.DraftServiceStub(dch), pb_grpc.TargetServiceStub(tch)
    dch.close()
    tch.close()


@pytest.fixture(scope="module")
def local(tiny_pair, device):
    target_dir, draft_dir, _ = tiny_pair
    return ModelRunner(target_dir, device), ModelRunner(draft_dir, device)


_ids = iter(range(10**6))


def new_session() -> str:
    return f"s{next(_ids)}"


def propose(stub, sid, position, new_tokens, gamma, params=GREEDY, round_id=0, top_k=0):
    req = pc.propose_request(sid, round_id, position, new_tokens, gamma, params, top_k)
    return list(stub.Propose(req, timeout=20))


def verify(stub, sid, position, new_tokens, drafts, params=GREEDY, round_id=0, decode=0):
    return stub.Verify(pc.verify_request(sid, round_id, position, new_tokens, drafts, params, decode), timeout=20)


# ---------------------------------------------------------------- the round


def test_propose_streams_gamma_tokens_like_local(stubs, local):
    draft_stub, _ = stubs
    _, draft_runner = local
    sid = new_session()
    msgs = propose(draft_stub, sid, 0, PROMPT, 5)
    expected = list(draft_tokens(draft_runner, new_draft_sequence(draft_runner), 0, PROMPT, 5, GREEDY))
    assert [m.token for m in msgs] == [d.token for d in expected]
    assert not any(m.HasField("q") for m in msgs)  # greedy: no q on the wire
    assert [m.HasField("timing") for m in msgs] == [False] * 4 + [True]
    # the prompt and the first four drafts went through the model (the fifth is not run yet)
    assert msgs[-1].timing.computed_tokens == len(PROMPT) + 4
    assert msgs[-1].timing.compute_s > 0


def test_propose_sampling_sends_the_truncated_q_it_sampled_from(stubs, local):
    draft_stub, _ = stubs
    _, draft_runner = local
    msgs = propose(draft_stub, new_session(), 0, PROMPT, 4, SAMPLED, top_k=6)
    expected = list(draft_tokens(draft_runner, new_draft_sequence(draft_runner), 0, PROMPT, 4, SAMPLED, DraftRule(6)))
    for m, d in zip(msgs, expected, strict=True):
        q = pc.draft_token_from_proto(m, vocab_size=32).q
        assert m.token == d.token and len(m.q.ids) == 6 and m.token in m.q.ids
        assert torch.equal(q.ids, d.q.ids) and torch.allclose(q.probs, d.q.probs)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_verify_equals_local_verify(stubs, local, params):
    draft_stub, target_stub = stubs
    target_runner, _ = local
    sid = new_session()
    drafts = [pc.draft_token_from_proto(m) for m in propose(draft_stub, sid, 0, PROMPT, 4, params)]
    reply = verify(target_stub, sid, 0, PROMPT, drafts, params)
    expected = verify_drafts(target_runner, target_runner.new_sequence(), 0, PROMPT, drafts, params)
    assert (reply.accepted, reply.next_token) == (expected.accepted, expected.next_token)
    assert reply.timing.computed_tokens == len(PROMPT) + 4
    # the next round pre-fills only the target's own next token plus the new drafts
    position = len(PROMPT) + reply.accepted + 1
    reply2 = verify(target_stub, sid, position, [], drafts[:2], params)
    assert reply2.timing.computed_tokens == 1 + 2


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_verify_decodes_the_tokens_asked_for_after_its_verdict(stubs, local, params):
    """decode_tokens: the tokens plain decoding gives, one round at a time."""
    _, target_stub = stubs
    target_runner, _ = local
    sid = new_session()
    reply = verify(target_stub, sid, 0, PROMPT, [], params, decode=4)
    seq = target_runner.new_sequence()
    expected = [verify_drafts(target_runner, seq, 0, PROMPT, [], params).next_token]
    for _ in range(4):
        expected.append(verify_drafts(target_runner, seq, len(seq.tokens), [], [], params).next_token)
    assert [reply.next_token, *reply.decoded_tokens] == expected
    assert reply.timing.computed_tokens == len(PROMPT) + 4
    # the session holds them all: the next round goes on after the last
    again = verify(target_stub, sid, len(PROMPT) + 5, [], [], params)
    assert again.timing.computed_tokens == 1


def test_decoding_stops_after_an_end_of_sequence_token(services, stubs, local):
    _, target = services
    _, target_stub = stubs
    target_runner, _ = local
    seq = target_runner.new_sequence()
    plain = [verify_drafts(target_runner, seq, 0, PROMPT, [], GREEDY).next_token]
    for _ in range(5):
        plain.append(verify_drafts(target_runner, seq, len(seq.tokens), [], [], GREEDY).next_token)
    runner = target.host.worker.runner
    eos, runner.eos_token_ids = runner.eos_token_ids, {plain[3]}
    try:
        reply = verify(target_stub, new_session(), 0, PROMPT, [], decode=5)
    finally:
        runner.eos_token_ids = eos
    assert [reply.next_token, *reply.decoded_tokens] == plain[:plain.index(plain[3]) + 1]


def test_second_prompt_prefills_only_the_suffix(stubs):
    _, target_stub = stubs
    sid = new_session()
    first = verify(target_stub, sid, 0, PROMPT, [])
    assert first.timing.computed_tokens == len(PROMPT)
    held = len(PROMPT) + 1  # the prompt and the target's next token
    second = verify(target_stub, sid, held, [7, 8, 9], [])
    assert second.timing.computed_tokens == 1 + 3  # the pending next token and the new turn


def test_retried_round_is_answered_not_applied_twice(stubs, services):
    draft_stub, target_stub = stubs
    _, target = services
    sid = new_session()
    drafts = [pc.draft_token_from_proto(m) for m in propose(draft_stub, sid, 0, PROMPT, 3, round_id=1)]
    again = [pc.draft_token_from_proto(m) for m in propose(draft_stub, sid, 0, PROMPT, 3, round_id=1)]
    assert [d.token for d in again] == [d.token for d in drafts]
    first = verify(target_stub, sid, 0, PROMPT, drafts, round_id=1)
    held = target.host.sessions._sessions[sid].state.tokens[:]
    retry = verify(target_stub, sid, 0, PROMPT, drafts, round_id=1)
    assert retry == first
    assert target.host.sessions._sessions[sid].state.tokens == held
    # the same round id for a different request is refused
    with pytest.raises(grpc.RpcError) as e:
        verify(target_stub, sid, 0, PROMPT[:-1], drafts, round_id=1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "round_id 1" in e.value.details()


def test_position_mismatch_is_failed_precondition(stubs):
    _, target_stub = stubs
    sid = new_session()
    verify(target_stub, sid, 0, PROMPT, [])
    with pytest.raises(grpc.RpcError) as e:
        verify(target_stub, sid, 50, [1], [])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "position 50" in e.value.details() and f"only {len(PROMPT) + 1} tokens" in e.value.details()


def test_not_found_after_end_session(stubs):
    draft_stub, target_stub = stubs
    sid = new_session()
    propose(draft_stub, sid, 0, PROMPT, 2)
    verify(target_stub, sid, 0, PROMPT, [])
    for stub in stubs:
        assert stub.EndSession(pb.EndSessionRequest(session_id=sid)).existed
        assert not stub.EndSession(pb.EndSessionRequest(session_id=sid)).existed
    with pytest.raises(grpc.RpcError) as e:
        verify(target_stub, sid, len(PROMPT), [1], [])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and sid in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        propose(draft_stub, sid, 3, [], 2)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # position 0 starts it afresh (what the coordinator does to re-pre-fill)
    assert verify(target_stub, sid, 0, PROMPT, []).timing.computed_tokens == len(PROMPT)


def test_evicted_session_answers_not_found_and_info_counts(stubs, device):
    _, target_stub = stubs
    sids = [new_session() for _ in range(5)]  # the services hold at most 4
    for sid in sids:
        verify(target_stub, sid, 0, PROMPT, [])
    info = target_stub.GetModelInfo(pb.ModelInfoRequest())
    block = 16  # the CPU's KV block: tokens are counted in whole blocks
    assert info.active_sessions == 4 and info.cached_tokens == 4 * block * -(-(len(PROMPT) + 1) // block)
    assert (info.vocab_size, info.max_context, info.device, info.gamma_max) == (32, 128, device, 8)
    with pytest.raises(grpc.RpcError) as e:
        verify(target_stub, sids[0], len(PROMPT) + 1, [], [])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    verify(target_stub, sids[-1], len(PROMPT) + 1, [], [])  # the most recent one is still there


# ---------------------------------------------------------------- hygiene


def test_health_serving_and_reflection_lists_services(services):
    for service, name in zip(services, ["specdec.v1.DraftService", "specdec.v1.TargetService"], strict=True):
        with channel(service) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for svc in ("", name):
                status = health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name for r in replies for s in r.list_services_response.service}
            assert {name, "grpc.health.v1.Health"} <= names


def test_health_not_serving_until_loaded_and_while_draining(loop, tiny_pair, monkeypatch):
    from specdec.draft_service.servicer import DRAFT
    from specdec.serving.config import DraftConfig
    from specdec.serving.model_host import ModelHost, start_model_service

    gate = threading.Event()
    real_load = ModelHost.load

    async def slow_load(self, runner=None):
        import asyncio
        while not gate.is_set():
            await asyncio.sleep(0.02)
        await real_load(self, runner)

    monkeypatch.setattr(ModelHost, "load", slow_load)
    config = DraftConfig(model=str(tiny_pair[1]), host="127.0.0.1", port=0)
    service, loading = loop.call(start_model_service(config, DRAFT, wait_loaded=False))
    with channel(service) as ch:
        health = health_pb2_grpc.HealthStub(ch)

        def check():
            return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

        assert check() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:  # calls are refused clearly meanwhile
            pb_grpc.DraftServiceStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
        gate.set()
        deadline = time.time() + 20
        while check() != health_pb2.HealthCheckResponse.SERVING:
            assert time.time() < deadline
            time.sleep(0.05)
        # draining: NOT_SERVING at once while an in-flight call still finishes
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        slow = _slow_model(service.host, 0.3)
        stream = pb_grpc.DraftServiceStub(ch).Propose(
            pc.propose_request("drain", 0, 0, PROMPT, 3, GREEDY), timeout=20)
        first = next(stream)
        drained = threading.Thread(target=loop.call, args=(service.stop(grace_s=10),))
        drained.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()  # an open Watch is an in-flight call too: it would hold the drain
        rest = list(stream)
        assert len([first, *rest]) == 3  # the in-flight stream completed
        drained.join(20)
        assert not drained.is_alive()  # the drain ended within its grace
        slow.undo()


def test_a_stopping_service_finishes_the_generations_it_holds(loop, tiny_pair):
    """SIGTERM's first step (run_service calls it before the server stops):
    NOT_SERVING, new sessions refused with a clear UNAVAILABLE, the sessions it
    holds answered until none has had a call for the gap."""
    service = start_service(loop, "target", tiny_pair[0])
    with channel(service) as ch:
        stub = pb_grpc.TargetServiceStub(ch)
        sid = new_session()
        verify(stub, sid, 0, PROMPT, [])  # a generation under way
        finishing = asyncio.run_coroutine_threadsafe(service.finish_generations(20.0, gap_s=0.5), loop.loop)
        health = health_pb2_grpc.HealthStub(ch)
        assert (health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                == health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError) as e:
            verify(stub, new_session(), 0, PROMPT, [])
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "cannot start: this service is shutting down" in e.value.details()
        # the service's own refusal, which a caller tells from "could not connect"
        assert errors.raised_by_server(e.value) == "Draining"
        for i in range(1, 5):  # its next rounds are answered, 0.3 s apart (inside the gap)
            time.sleep(0.3)
            verify(stub, sid, len(PROMPT) + i, [], [], round_id=i)
            assert not finishing.done()
        ended = time.monotonic()
        finishing.result(10)
        assert 0.4 < time.monotonic() - ended < 5  # one gap after the last call, not the 20 s
    loop.call(service.stop())


class _slow_model:
    """Make every forward pass of ``host``'s model take ``delay`` seconds more."""

    def __init__(self, host, delay: float):
        runner = host.worker.runner
        self.runner, self.real = runner, runner.run_passes

        def run_passes(*a, **k):
            time.sleep(delay)
            return self.real(*a, **k)

        runner.run_passes = run_passes

    def undo(self):
        self.runner.run_passes = self.real


def test_tokens_stream_as_drafted_and_other_calls_keep_answering(stubs, services):
    draft_stub, _ = stubs
    draft, _ = services
    slow = _slow_model(draft.host, 0.4)
    try:
        start = time.perf_counter()
        arrivals = []
        for _ in draft_stub.Propose(pc.propose_request(new_session(), 0, 0, PROMPT, 3, GREEDY), timeout=20):
            arrivals.append(time.perf_counter() - start)
            if len(arrivals) == 1:  # mid-stream, the event loop still answers at once
                t = time.perf_counter()
                draft_stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5)
                assert time.perf_counter() - t < 0.3
        assert arrivals[0] < 0.75 and arrivals[-1] > 1.1  # the first came long before the last
    finally:
        slow.undo()


def test_unexpected_errors_are_internal_with_the_message(stubs, services):
    _, target_stub = stubs
    _, target = services
    runner = target.host.worker.runner
    real = runner.run_passes

    def broken(*a, **k):
        raise RuntimeError("the device fell over")

    runner.run_passes = broken
    try:
        with pytest.raises(grpc.RpcError) as e:
            verify(target_stub, new_session(), 0, PROMPT, [])
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "RuntimeError: the device fell over" in e.value.details()
    finally:
        runner.run_passes = real
    verify(target_stub, new_session(), 0, PROMPT, [])


def _bad_inputs():
    """(name, service, request, status code, words the message must contain)."""
    INV = grpc.StatusCode.INVALID_ARGUMENT
    sampled = pc.sampling_to_proto(SAMPLED)
    dense = pc.dist_to_proto(torch.full((32,), 1 / 32))

    def P(**kw):
        base = dict(session_id="bad", position=0, new_tokens=PROMPT, gamma=2)
        return pb.ProposeRequest(**{**base, **kw})

    def V(**kw):
        base = dict(session_id="bad", position=0, new_tokens=PROMPT, draft_tokens=[1])
        return pb.VerifyRequest(**{**base, **kw})

    return [
        ("gamma too large", "draft", P(gamma=99), INV, ["gamma 99", "[0, 8]"]),
        ("token outside vocab", "draft", P(new_tokens=[1, 999]), INV, ["new_tokens", "999", "vocabulary"]),
        ("negative temperature", "draft", P(sampling=pb.SamplingParams(temperature=-1, seed=1)), INV, ["temperature"]),
        ("top_p above 1", "draft", P(sampling=pb.SamplingParams(temperature=1, top_p=1.5, seed=1)), INV, ["top_p"]),
        ("top_p zero", "target", V(sampling=pb.SamplingParams(temperature=1, top_p=0.0, seed=1)), INV, ["top_p"]),
        ("no seed under sampling", "draft", P(sampling=pb.SamplingParams(temperature=1)), INV, ["seed"]),
        ("empty session id", "draft", P(session_id=""), INV, ["session_id"]),
        ("empty prompt", "target", V(new_tokens=[], draft_tokens=[]), INV, ["empty"]),
        ("beyond context", "draft", P(new_tokens=[1] * 127), INV, ["context of 128"]),
        ("too many drafts", "target", V(draft_tokens=[1] * 9), INV, ["draft_tokens 9", "[0, 8]"]),
        ("too many to decode", "target", V(decode_tokens=9), INV, ["decode_tokens 9", "[0, 8]"]),
        ("decoding beyond context", "target", V(new_tokens=[1] * 120, decode_tokens=8), INV,
         ["+ 8 decode_tokens", "context of 128"]),
        ("draft outside vocab", "target", V(draft_tokens=[32]), INV, ["draft_tokens", "32"]),
        ("q missing", "target", V(sampling=sampled), INV, ["draft_q has 0", "1 draft_tokens"]),
        ("q count mismatch", "target", V(sampling=sampled, draft_q=[dense, dense]), INV, ["draft_q has 2"]),
        ("dense q too long", "target",
         V(sampling=sampled, draft_q=[pc.dist_to_proto(torch.ones(40) / 40)]), INV, ["draft_q[0]", "40 values"]),
        ("q negative", "target",
         V(sampling=sampled, draft_q=[pc.dist_to_proto(torch.full((32,), -1.0))]), INV, ["draft_q[0]", ">= 0"]),
        ("q excludes draft", "target",
         V(sampling=sampled, draft_q=[pb.Distribution(ids=[2], probs=pc.dist_to_proto(torch.ones(1)).probs)]),
         INV, ["draft_q[0]", "probability 0"]),
        ("short dense q excludes draft", "target",  # covers ids 0 only: draft 1 lies past it
         V(sampling=sampled, draft_q=[pc.dist_to_proto(torch.ones(1))]), INV, ["draft_q[0]", "probability 0"]),
        ("unknown session", "target", V(session_id="never-seen", position=4), grpc.StatusCode.NOT_FOUND,
         ["never-seen"]),
        ("oversized", "target", V(new_tokens=[1] * (1 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, []),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_bad_input_gets_clear_status_and_server_keeps_serving(stubs, case):
    name, which, request, code, words = case
    draft_stub, target_stub = stubs
    with pytest.raises(grpc.RpcError) as e:
        if which == "draft":
            list(draft_stub.Propose(request, timeout=10))
        else:
            target_stub.Verify(request, timeout=10)
    assert e.value.code() == code, e.value.details()
    for word in words:
        assert word in e.value.details()
    # still serving
    assert len(propose(draft_stub, new_session(), 0, PROMPT, 2)) == 2
    verify(target_stub, new_session(), 0, PROMPT, [])


def test_service_help(capsys):
    from specdec.cli import main

    for command, port in (("draft-service", "50052"), ("target-service", "50053")):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        for flag in ("--model", "--device", "--port", "--max-sessions", "--session-ttl", "--max-cached-tokens"):
            assert flag in out
        assert port in out and f"SPECDEC_{command.split('-')[0].upper()}_PORT" in out


@pytest.mark.parametrize("command", ["draft-service", "coordinator"])
@pytest.mark.parametrize("busy", ["--port", "--metrics-port"])
def test_a_busy_port_is_one_line_and_exit_status_1(command, busy, capfd):
    """No traceback, no asyncio noise from a half-started server: the message."""
    import gc
    import socket

    from specdec.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = [command, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", busy, str(port)]
        if command == "coordinator":
            argv += ["--draft", "127.0.0.1:1", "--target", "127.0.0.1:2"]
        assert main(argv) == 1
        gc.collect()  # a server left unstopped complains when collected
    err = capfd.readouterr().err
    assert f"specdec {command}: error: cannot " in err and f"127.0.0.1:{port}" in err
    assert "Traceback" not in err and "never awaited" not in err and "Event loop is closed" not in err


# ---------------------------------------------------------------- the model it serves


def test_model_info_names_the_architecture_and_the_kv_block(stubs):
    _, target_stub = stubs
    info = target_stub.GetModelInfo(pb.ModelInfoRequest())
    assert info.architecture == "LlamaForCausalLM (model_type 'llama')"
    assert info.kv_block_size == 16 and info.kv_budget_tokens % 16 == 0
    assert not info.has_tokenizer


def test_get_tokenizer_without_one_is_not_found(stubs):
    _, target_stub = stubs
    with pytest.raises(grpc.RpcError) as e:
        list(target_stub.GetTokenizer(pb.TokenizerRequest(), timeout=20))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "has no tokenizer files" in e.value.details()


def test_get_tokenizer_streams_the_files_in_pieces(loop, tmp_path, monkeypatch):
    """The bundled target's tokenizer, in pieces of at most TOKENIZER_CHUNK bytes, whole again."""
    from specdec.models import bundled
    from specdec.serving import model_host

    monkeypatch.setattr(model_host, "TOKENIZER_CHUNK", 50_000)
    target = start_service(loop, "target", bundled.target_path())
    try:
        with channel(target) as ch:
            chunks = list(pb_grpc.TargetServiceStub(ch).GetTokenizer(pb.TokenizerRequest(), timeout=20))
        assert all(len(c.data) <= 50_000 for c in chunks)
        whole: dict[str, bytes] = {}
        for c in chunks:
            whole[c.file] = whole.get(c.file, b"") + c.data
        for name, data in whole.items():
            assert data == (bundled.target_path() / name).read_bytes()
        assert "tokenizer.json" in whole and len(chunks) > len(whole)
    finally:
        loop.call(target.stop())
