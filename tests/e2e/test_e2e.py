"""End to end over real loopback sockets: draft, target and coordinator as three
separate processes (``python -m specdec.cli ...``), driven with specdec.Client.

The processes start once per module (all in parallel); tests that kill or signal
a process start their own. References come from the in-process decoder on the
same model directories.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import threading
import time

import grpc
import pytest

from specdec import SamplingParams
from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import errors
from specdec.serving.client import Client, Delta, Stats
from specdec.serving.server import free_port

from service_harness import ServiceProcess

REPO = pathlib.Path(__file__).resolve().parents[2]
CONTEXT = 1024  # the models fixture's context (conftest.py)
CAP = 900  # the coordinators' --max-new-tokens-cap
PROMPT = "def fibonacci(n):"


class Proc(ServiceProcess):
    """One ``specdec`` sub-command in its own process on a free loopback port, logging to a file."""

    def __init__(self, name: str, args: list[str], logdir: pathlib.Path):
        self.port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        argv = [sys.executable, "-m", "specdec.cli", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        super().__init__(name, argv, logdir, f"127.0.0.1:{self.port}", env=env, cwd=REPO)


def model_service(name, role, model, logdir, *extra):
    return Proc(name, [f"{role}-service", "--model", str(model), *extra], logdir)


def coordinator(name, draft: Proc, target: Proc, tokenizer, logdir, *extra):
    return Proc(name, ["coordinator", "--draft", draft.address, "--target", target.address,
                       "--tokenizer", str(tokenizer), "--max-new-tokens-cap", str(CAP), *extra], logdir)


class Cluster(dict):
    """Service processes by name, all stopped when the ``with`` block ends
    (however it ends); :meth:`ready` waits until each one serves."""

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.values():
            p.stop()

    def ready(self) -> Cluster:
        for p in self.values():
            p.wait_serving()
        return self


def one_of_each(models, logdir, *coordinator_args) -> Cluster:
    """D + T + C: a draft, a target and a coordinator in front of them."""
    target, draft = models
    procs = Cluster()
    try:
        procs["D"] = model_service("draft", "draft", draft, logdir)
        procs["T"] = model_service("target", "target", target, logdir)
        procs["C"] = coordinator("coordinator", procs["D"], procs["T"], target, logdir, *coordinator_args)
    except BaseException:
        procs.__exit__()
        raise
    return procs


@pytest.fixture(scope="module")
def cluster(models, tmp_path_factory):
    """Started together, once: D + T + C (most tests); T1 (--max-sessions 1) + C1
    for eviction, T1 is then killed by the kill test; Cs to receive SIGTERM;
    Tr, with Cr, to receive SIGTERM mid-generation (a rolling restart)."""
    target, draft = models
    logdir = tmp_path_factory.mktemp("e2e-logs")
    with Cluster() as procs:
        procs["D"] = model_service("draft", "draft", draft, logdir)
        procs["T"] = model_service("target", "target", target, logdir)
        procs["T1"] = model_service("target1", "target", target, logdir, "--max-sessions", "1")
        procs["C"] = coordinator("coordinator", procs["D"], procs["T"], target, logdir,
                                 "--max-message-bytes", str(1 << 20))
        procs["C1"] = coordinator("coordinator1", procs["D"], procs["T1"], target, logdir)
        procs["Tr"] = model_service("target-restarted", "target", target, logdir)
        procs["Cr"] = coordinator("coordinator-restarted-target", procs["D"], procs["Tr"], target, logdir)
        procs["Cs"] = coordinator("coordinator-drained", procs["D"], procs["T"], target, logdir,
                                  "--drain-grace", "30")
        procs["Cg"] = coordinator("coordinator-short-grace", procs["D"], procs["T"], target, logdir,
                                  "--drain-grace", "0.1")
        yield procs.ready()


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster["C"].address, timeout=60) as c:
        yield c


def greedy_ref(reference, ids, n):
    return reference[0].generate(list(ids), max_new_tokens=n, gamma=0).token_ids


def prompt_ids(reference, text=PROMPT):
    return reference[0].tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------ correctness


def test_greedy_output_identical_to_target_only(client, reference):
    ids = prompt_ids(reference)
    expected = greedy_ref(reference, ids, 48)
    for policy in ("heuristic", "static:3", "static:0"):
        out = client.complete(prompt_ids=ids, max_new_tokens=48, gamma_policy=policy)
        assert out.token_ids == expected, policy
        assert out.stats.finish_reason == "length" and out.stats.generated_tokens == 48
        assert out.stats.prompt_tokens == len(ids)
        assert sum(out.stats.accepted_per_round) == out.stats.accepted_tokens
    # static:0 is plain decoding: one token, then --plain-tokens (4) a call
    assert out.stats.rounds == 1 + 47 // 4 + 1 and out.stats.drafted_tokens == 0
    # speculation actually happened: fewer rounds than tokens
    spec = client.complete(prompt_ids=ids, max_new_tokens=48, gamma_policy="heuristic")
    assert spec.stats.accepted_tokens > 0 and spec.stats.rounds < 48
    # a text prompt: same ids, and the streamed text is the full decode
    text = client.complete(PROMPT, max_new_tokens=48)
    assert text.token_ids == expected
    assert text.text == reference[0].tokenizer.decode(expected, skip_special_tokens=True)


def test_stats_split_round_time_and_count_bytes(client, reference):
    ids = prompt_ids(reference)
    greedy = client.complete(prompt_ids=ids, max_new_tokens=32, gamma_policy="static:3").stats
    sampled = client.complete(prompt_ids=ids, max_new_tokens=32, gamma_policy="static:3",
                              temperature=1.0, seed=5).stats
    for s in (greedy, sampled):
        assert s.draft_compute_s > 0 and s.target_compute_s > 0
        # Network + serialisation over a request's calls: never all of it clamped away on loopback.
        assert s.draft_network_s > 0 and s.target_network_s > 0
        assert s.draft_compute_s + s.target_compute_s + s.network_s <= s.elapsed_s
        assert s.bytes_sent > 0 and s.bytes_received > 0
    # Sampling ships each draft's q to the target and back, as (id, prob) pairs:
    # by default its top DEFAULT_DRAFT_TOP_K (256 of this vocabulary's 260), with
    # draft_top_k=16 far fewer bytes.
    assert sampled.bytes_per_round > greedy.bytes_per_round + 3 * 200 * 4
    small = client.complete(prompt_ids=ids, max_new_tokens=32, gamma_policy="static:3", temperature=1.0, seed=5,
                            draft_top_k=16).stats
    assert small.bytes_per_round + 3 * 200 * 4 < sampled.bytes_per_round


def test_text_deltas_are_streamed_per_round_and_whole(client, reference):
    events = list(client.generate(PROMPT, max_new_tokens=40, gamma_policy="static:2"))
    deltas, stats = events[:-1], events[-1]
    assert isinstance(stats, Stats) and all(isinstance(d, Delta) for d in deltas)
    assert len(deltas) >= stats.rounds - 1  # one per round (the text tail may add one)
    ids = [t for d in deltas for t in d.token_ids]
    tok = reference[0].tokenizer
    assert "".join(d.text for d in deltas) == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_cuts_before_it(client, reference):
    ids = prompt_ids(reference)
    tok = reference[0].tokenizer
    full = tok.decode(greedy_ref(reference, ids, 60), skip_special_tokens=True)
    k = next(i for i in range(8, len(full) - 2)
             if "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i)
    stop = full[k:k + 2]
    out = client.complete(prompt_ids=ids, max_new_tokens=60, stop=["never-there", stop])
    assert out.stats.finish_reason == "stop"
    assert out.text == full[:k]


def test_seeded_sampling_reproducible_and_same_as_in_process(client, reference):
    ids = prompt_ids(reference)
    kw = dict(prompt_ids=ids, max_new_tokens=40, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    a = client.complete(gamma_policy="static:4", **kw)
    b = client.complete(gamma_policy="static:4", **kw)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 40
    local = reference[1].generate(ids, max_new_tokens=40, gamma=4,
                                  sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234))
    assert a.token_ids == local.token_ids
    c = client.complete(gamma_policy="static:4", **{**kw, "seed": 99})
    assert c.token_ids != a.token_ids
    # a truncated (sparse) draft distribution: still exactly the in-process result
    sparse = client.complete(gamma_policy="static:4", draft_top_k=8, **kw)
    local = reference[1].generate(ids, max_new_tokens=40, gamma=4, draft_top_k=8,
                                  sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234))
    assert sparse.token_ids == local.token_ids
    # draft_top_k=0 asks for the dense q, as in process (unset: the coordinator's default)
    dense = client.complete(gamma_policy="static:4", draft_top_k=0, **kw)
    local = reference[1].generate(ids, max_new_tokens=40, gamma=4, draft_top_k=0,
                                  sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234))
    assert dense.token_ids == local.token_ids


def test_multi_turn_session_prefills_only_the_suffix(client, reference):
    tok = reference[0].tokenizer
    p1, p2 = prompt_ids(reference), tok.encode("\n    return", add_special_tokens=False)
    # A policy that drafts every round keeps the draft in step (γ = 0 rounds let it lag).
    t1 = client.complete(prompt_ids=p1, max_new_tokens=20, session_id="multi-turn", gamma_policy="static:3")
    assert t1.stats.target_prefill_tokens == len(p1) and t1.stats.session_id == "multi-turn"
    assert t1.stats.history_tokens == 0  # a new session
    t2 = client.complete(prompt_ids=p2, max_new_tokens=20, session_id="multi-turn", gamma_policy="static:3")
    history = p1 + t1.token_ids + p2
    assert t2.stats.history_tokens == len(p1) + 20
    assert t2.token_ids == greedy_ref(reference, history, 20)
    # only the new prompt (and the last generated token, never run yet) went through the target
    assert t2.stats.target_prefill_tokens == len(p2) + 1
    assert t2.stats.draft_prefill_tokens < len(history) // 2
    assert client.close_session("multi-turn") is True


def test_a_turn_ending_inside_a_plain_round_leaves_the_next_turn_exact(client, reference):
    """The last round of a static:0 turn decoded more than the turn kept (its
    token budget ended inside it): the target holds tokens nobody committed, and
    the next turn, plain and then drafting, rolls them back."""
    tok = reference[0].tokenizer
    p1, p2 = prompt_ids(reference), tok.encode("\n    return", add_special_tokens=False)
    t1 = client.complete(prompt_ids=p1, max_new_tokens=7, session_id="cut-plain", gamma_policy="static:0")
    assert t1.token_ids == greedy_ref(reference, p1, 7)
    assert t1.stats.rounds == 3  # 1 token, then 4, then 4 of which the budget keeps 2
    t2 = client.complete(prompt_ids=p2, max_new_tokens=9, session_id="cut-plain", gamma_policy="static:0")
    history = p1 + t1.token_ids + p2
    assert t2.token_ids == greedy_ref(reference, history, 9)
    assert t2.stats.target_prefill_tokens == len(p2) + 1  # rolled back, not re-pre-filled
    t3 = client.complete(prompt_ids=p2, max_new_tokens=12, session_id="cut-plain", gamma_policy="static:3")
    assert t3.token_ids == greedy_ref(reference, history + t2.token_ids + p2, 12)
    assert client.close_session("cut-plain") is True


def test_eviction_and_refill_give_identical_output(cluster, reference):
    """T1 holds one session: B evicts A, and A's next turn is re-pre-filled from
    the coordinator's history."""
    tok = reference[0].tokenizer
    pa, pb_, p2 = prompt_ids(reference), tok.encode("class A:", add_special_tokens=False), [10, 32, 32]
    with Client(cluster["C1"].address, timeout=60) as c:
        a1 = c.complete(prompt_ids=pa, max_new_tokens=16, session_id="evict-A")
        b1 = c.complete(prompt_ids=pb_, max_new_tokens=16, session_id="evict-B")
        assert cluster["T1"].model_info("target").active_sessions == 1
        a2 = c.complete(prompt_ids=p2, max_new_tokens=16, session_id="evict-A")
        history = pa + a1.token_ids + p2
        assert a1.token_ids == greedy_ref(reference, pa, 16)
        assert b1.token_ids == greedy_ref(reference, pb_, 16)
        assert a2.token_ids == greedy_ref(reference, history, 16)
        assert a2.stats.target_prefill_tokens >= len(history)  # the whole history again
        c.close_session("evict-A")
        c.close_session("evict-B")
    assert "re-pre-filling" in cluster["C1"].log()


def test_eight_concurrent_sessions_all_correct(client, reference):
    prompts = [prompt_ids(reference, f"def f{i}(x{i}):") for i in range(8)]
    expected = [greedy_ref(reference, p, 32) for p in prompts]
    results: dict[int, list[int]] = {}

    def run(i):
        policy = ("heuristic", "static:2", "static:5", "static:0")[i % 4]
        session = f"concurrent-{i}" if i % 2 else ""
        results[i] = client.complete(prompt_ids=prompts[i], max_new_tokens=32,
                                     gamma_policy=policy, session_id=session).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(8)] == expected
    for i in range(1, 8, 2):
        client.close_session(f"concurrent-{i}")


# ------------------------------------------------------------------ lifecycle


def _wait_for(predicate, timeout=10.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.05)


def test_client_cancellation_frees_state_in_both_services(cluster, client, reference):
    d0 = cluster["D"].model_info("draft").active_sessions
    t0 = cluster["T"].model_info("target").active_sessions
    stream = client.generate(prompt_ids=prompt_ids(reference), max_new_tokens=CAP - 100,
                             gamma_policy="static:2")
    next(stream), next(stream)
    assert cluster["D"].model_info("draft").active_sessions == d0 + 1
    assert cluster["T"].model_info("target").active_sessions == t0 + 1
    stream.close()  # leaving the loop cancels the call
    _wait_for(lambda: cluster["D"].model_info("draft").active_sessions == d0
              and cluster["T"].model_info("target").active_sessions == t0)


def test_stop_then_send_the_next_message(client, reference):
    """A chat client cancels a turn and at once sends the next one on the same
    session: it is served (the coordinator waits for the cancelled turn to end),
    and the cancelled turn is not in the history."""
    p1, p2, p3 = prompt_ids(reference), [100, 101], [102, 103]
    out1 = client.complete(prompt_ids=p1, max_new_tokens=8, session_id="stop-then-send").token_ids
    stream = client.generate(prompt_ids=p2, max_new_tokens=CAP - 100, session_id="stop-then-send")
    next(stream), next(stream)
    stream.close()  # "stop generating"
    out3 = client.complete(prompt_ids=p3, max_new_tokens=8, session_id="stop-then-send").token_ids
    assert out3 == greedy_ref(reference, p1 + out1 + p3, 8)


def test_killed_target_gives_a_clear_error_not_a_hang(cluster):
    """Kills T1 (the eviction test is done with it) while C1 streams from it."""
    t1 = cluster["T1"]
    with Client(cluster["C1"].address, timeout=60) as c:
        stream = c.generate(prompt_ids=[100, 101, 102], max_new_tokens=CAP, gamma_policy="static:0")
        next(stream)
        t1.proc.kill()
        start = time.time()
        with pytest.raises(errors.Unavailable) as exc:
            for _ in stream:
                pass
        assert time.time() - start < 15
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
        assert "target service" in str(exc.value) and t1.address in str(exc.value)
    assert cluster["C1"].proc.poll() is None  # the coordinator itself is fine


def test_sigterm_drains_in_flight_generation(cluster, reference):
    cs = cluster["Cs"]
    ids = [100, 101, 102]
    with Client(cs.address, timeout=60) as c:
        stream = c.generate(prompt_ids=ids, max_new_tokens=300, gamma_policy="static:0")
        got = list(next(stream).token_ids)
        cs.proc.send_signal(signal.SIGTERM)
        for event in stream:
            if isinstance(event, Delta):
                got += event.token_ids
            else:
                stats = event
    assert stats.finish_reason == "length" and got == greedy_ref(reference, ids, 300)
    assert cs.proc.wait(30) == 0
    assert "received SIGTERM" in cs.log() and "exited cleanly" in cs.log()


def test_a_target_stopped_mid_generation_finishes_it_first(cluster, reference):
    """A rolling restart: SIGTERM to the target while a generation goes through
    it. The target finishes the sessions it holds, so the stream completes with
    the right tokens; a request that would start a new session meanwhile is
    refused with a message saying why; then the target exits cleanly."""
    tr = cluster["Tr"]
    ids = [100, 101, 102]
    with Client(cluster["Cr"].address, timeout=60) as c:
        stream = c.generate(prompt_ids=ids, max_new_tokens=300, gamma_policy="static:2")
        got = list(next(stream).token_ids)
        tr.proc.send_signal(signal.SIGTERM)
        rounds_since = 0
        for event in stream:
            if isinstance(event, Delta):
                got += event.token_ids
                rounds_since += 1
                if rounds_since == 4:  # the target has handled the signal by now
                    with pytest.raises(errors.Unavailable, match="cannot start: this service is shutting down"):
                        c.complete(prompt_ids=ids, max_new_tokens=4)
            else:
                stats = event
    assert rounds_since > 4, "the generation ended before the new request was tried"
    assert stats.finish_reason == "length" and got == greedy_ref(reference, ids, 300)
    assert tr.proc.wait(30) == 0
    assert "finishing the generations in flight" in tr.log() and "exited cleanly" in tr.log()


def test_a_generation_cut_by_the_drain_grace_ends_its_session_in_both_services(cluster):
    """The grace runs out mid-generation: the client gets UNAVAILABLE saying
    why, and before the coordinator closes its channels the cancelled request
    ends its session on both services (it would otherwise stay there until
    their TTL)."""
    cg = cluster["Cg"]
    held = {"D": cluster["D"].model_info("draft").active_sessions,
            "T": cluster["T"].model_info("target").active_sessions}
    with Client(cg.address, timeout=60) as c:
        stream = c.generate(prompt_ids=[100, 101, 102], max_new_tokens=CAP, gamma_policy="static:2",
                            session_id="cut-by-drain")
        next(stream)
        assert cluster["T"].model_info("target").active_sessions == held["T"] + 1
        cg.proc.send_signal(signal.SIGTERM)
        with pytest.raises(errors.Unavailable) as cut:
            for _ in stream:
                pass
    assert "coordinator is shutting down and its drain grace (0.1 s) ran out" in str(cut.value), cut.value
    assert cg.proc.wait(30) == 0
    log = cg.log()
    assert "Traceback" not in log and "never retrieved" not in log, log
    for service, role in (("D", "draft"), ("T", "target")):
        assert cluster[service].model_info(role).active_sessions == held[service], f"{service} still holds it"


# ------------------------------------------------------------------ bad input

BAD_GENERATE = [
    # (id, generate kwargs, code, words the message must contain)
    ("empty prompt", dict(prompt=""), "INVALID_ARGUMENT", "prompt is empty"),
    ("both prompt kinds", dict(prompt="x", prompt_ids=[1]), "INVALID_ARGUMENT", "both prompt and prompt_ids"),
    ("prompt beyond context", dict(prompt_ids=[5] * CONTEXT), "INVALID_ARGUMENT", "context of 1024"),
    ("max_new_tokens 0", dict(max_new_tokens=0), "INVALID_ARGUMENT", "max_new_tokens"),
    ("max_new_tokens above cap", dict(max_new_tokens=CAP + 1), "INVALID_ARGUMENT",
     f"max_new_tokens must be in [1, {CAP}]"),
    ("gamma policy unknown", dict(gamma_policy="fast"), "INVALID_ARGUMENT", "gamma_policy 'fast'"),
    ("gamma policy unparsable", dict(gamma_policy="static:x"), "INVALID_ARGUMENT", "static:N needs an integer"),
    ("gamma out of range", dict(gamma_policy="static:99"), "INVALID_ARGUMENT", "gamma must be in [0, 16]"),
    ("negative temperature", dict(temperature=-0.5), "INVALID_ARGUMENT", "temperature"),
    ("top_p zero", dict(top_p=0.0), "INVALID_ARGUMENT", "top_p must be in (0, 1]"),
    ("top_p above one", dict(top_p=1.5), "INVALID_ARGUMENT", "top_p must be in (0, 1]"),
    ("token id above vocab", dict(prompt_ids=[1, 260]), "INVALID_ARGUMENT",
     "prompt_ids[1] = 260 is outside the vocabulary"),
    ("negative token id", dict(prompt_ids=[-3]), "INVALID_ARGUMENT", "outside the vocabulary"),
    ("empty stop string", dict(stop=[""]), "INVALID_ARGUMENT", "stop strings"),
    ("draft_top_k above vocab", dict(draft_top_k=1000), "INVALID_ARGUMENT", "draft_top_k"),
    ("oversized request", dict(prompt="x" * (2 << 20)), "RESOURCE_EXHAUSTED", ""),
]


@pytest.mark.parametrize("case,kwargs,code,words", BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_requests(client, case, kwargs, code, words):
    request = dict(prompt_ids=[1, 2, 3], max_new_tokens=4)
    if "prompt" in kwargs:
        request.pop("prompt_ids")
    request.update(kwargs)
    with pytest.raises(errors.SpecdecError) as exc:
        list(client.generate(**request))
    assert exc.value.code.name == code, str(exc.value)
    assert words in str(exc.value)


@pytest.mark.parametrize("sampling, words", [
    (pb.SamplingParams(temperature=0.5, top_p=1.5), "top_p must be in (0, 1]"),
    (pb.SamplingParams(temperature=float("nan")), "temperature must be a finite number"),
])
def test_bad_sampling_sent_past_the_client_is_refused_by_the_coordinator(client, sampling, words):
    """The Python client checks sampling settings itself; any other client's
    reach the coordinator, which refuses them the same way."""
    stub = pb_grpc.CoordinatorStub(client.channel)
    request = pb.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=4, sampling=sampling)
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Generate(request, timeout=30))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in exc.value.details()


def test_prompt_ids_may_be_arrays_tensors_or_iterators(client):
    """Token ids as tokenizers and models hand them out: numpy and torch
    integers (an array has no truth value, so the client must not ask it one)."""
    import numpy as np
    import torch

    expected = client.complete(prompt_ids=[0, 7, 9], max_new_tokens=4).token_ids
    for ids in (np.array([0, 7, 9]), torch.tensor([0, 7, 9]), iter([0, 7, 9]), np.array([0, 7, 9], dtype=np.int32)):
        assert client.complete(prompt_ids=ids, max_new_tokens=4, stop=None).token_ids == expected, type(ids)
    assert client.complete(prompt_ids=np.array([0]), max_new_tokens=2).stats.prompt_tokens == 1
    with pytest.raises(errors.InvalidRequest, match=r"prompt_ids\[1\] = 2.5 is not a token id"):
        client.complete(prompt_ids=[1, 2.5], max_new_tokens=2)
    with pytest.raises(errors.InvalidRequest, match=r"a batch of one\? pass ids\[0\]"):
        client.complete(prompt_ids=torch.tensor([[0, 7, 9]]), max_new_tokens=2)
    for bad in (7, "7", [True]):
        with pytest.raises(errors.InvalidRequest, match="token id"):
            client.complete(prompt_ids=bad, max_new_tokens=2)


def test_bad_session_calls_and_still_serving(client, cluster):
    with pytest.raises(errors.SessionNotFound, match="'no-such-session' is unknown"):
        client.close_session("no-such-session")
    client.complete(prompt_ids=[1, 2, 3], max_new_tokens=4, session_id="closed-one")
    assert client.close_session("closed-one") is True
    with pytest.raises(errors.SessionNotFound, match="closed-one"):
        client.close_session("closed-one")
    # after all the bad input above, every service still serves
    assert client.complete(prompt_ids=[1, 2, 3], max_new_tokens=8).stats.generated_tokens == 8
    for name in ("D", "T", "C"):
        assert cluster[name].proc.poll() is None
    assert "serving specdec.v1.Coordinator on 127.0.0.1" in cluster["C"].log()


# ------------------------------------------------------------------ command line


def test_generate_cli_streams_from_the_coordinator(cluster, reference, capsys):
    import json

    from specdec.cli import main

    ids = prompt_ids(reference)
    expected = greedy_ref(reference, ids, 24)
    address = cluster["C"].address
    assert main(["generate", "--coordinator", address, "--max-new-tokens", "24", "--json", PROMPT]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["token_ids"] == expected and record["finish_reason"] == "length"
    assert record["text"] == reference[0].tokenizer.decode(expected)
    assert main(["generate", "--coordinator", address, "--max-new-tokens", "24", "--session", "cli",
                 "--gamma-policy", "static:2", PROMPT]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == record["text"] and "24 tokens" in out.err and "finish length" in out.err
    assert main(["generate", "--coordinator", address, "--max-new-tokens", "901", PROMPT]) == 1
    assert "INVALID_ARGUMENT: max_new_tokens must be in [1, 900], got 901" in capsys.readouterr().err


def test_loadtest_reports_throughput_latency_and_errors(cluster, tmp_path, capsys):
    import json

    from specdec.cli import main

    address, report_path = cluster["C"].address, tmp_path / "load.json"
    assert main(["loadtest", "--coordinator", address, "--sessions", "3", "--requests", "6", "--max-new-tokens",
                 "12", "--prompt", "def f(x):", "--prompt", "class A:", "--json", str(report_path),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "3 concurrent, 6 requests" in printed and "errors         none" in printed
    report = json.loads(report_path.read_text())
    assert report["requests"] == 6 and report["tokens"] == 6 * 12 and report["errors"] == {}
    assert report["tokens_per_second"] > 0 and 0 < report["ttft_p50_s"] <= report["ttft_p99_s"]
    assert 0 < report["itl_p50_s"] <= report["itl_p99_s"]
    # refused requests are counted by status code, and make the exit status 1
    assert main(["loadtest", "--coordinator", address, "--sessions", "2", "--requests", "2", "--max-new-tokens",
                 "901", "--prompt", "x", "--no-progress"]) == 1
    assert "INVALID_ARGUMENT 2" in capsys.readouterr().out
    assert main(["loadtest", "--coordinator", address, "--sessions", "0"]) == 2
