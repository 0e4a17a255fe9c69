"""Replica pools end to end: one coordinator over two drafts and three targets,
each a process of its own. Killing (SIGKILL) the target or the draft a stream
runs on, or stopping a target (SIGTERM, a rolling restart), costs the stream
time, never output: it goes on through another replica, with the tokens of an
uninterrupted greedy run, none lost or repeated."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from test_e2e import Cluster, Proc, greedy_ref, model_service

from specdec.serving import errors
from specdec.serving.client import Client, Delta

IDS = [100, 101, 102]
N = 600  # long enough that the fault lands mid-stream


@pytest.fixture(scope="module")
def pools(models, tmp_path_factory):
    target, draft = models
    logdir = tmp_path_factory.mktemp("failover-logs")
    with Cluster() as procs:
        for name in ("D1", "D2"):
            procs[name] = model_service(name, "draft", draft, logdir)
        for name in ("T1", "T2", "T3"):
            procs[name] = model_service(name, "target", target, logdir)
        drafts = ",".join(procs[n].address for n in ("D1", "D2"))
        targets = ",".join(procs[n].address for n in ("T1", "T2", "T3"))
        procs["C"] = Proc("coordinator", ["coordinator", "--draft", drafts, "--target", targets,
                                          "--tokenizer", str(target), "--call-timeout", "10"], logdir)
        procs["C1"] = Proc("coordinator-one-worker", ["coordinator", "--draft", drafts, "--target", targets,
                                                      "--tokenizer", str(target), "--max-streams", "1"], logdir)
        yield procs.ready()


def holding(procs, role, names):
    """The one process of ``names`` that holds a session now."""
    held = [n for n in names if procs[n].proc.poll() is None and procs[n].model_info(role).active_sessions]
    assert len(held) == 1, f"expected one {role} holding the stream's session, got {held}"
    return held[0]


def wait_idle(procs, timeout=10.0):
    """Until no live model service holds a session (earlier tests' cleanups done)."""
    deadline = time.monotonic() + timeout
    for name, role in (("D1", "draft"), ("D2", "draft"), ("T1", "target"), ("T2", "target"), ("T3", "target")):
        while procs[name].proc.poll() is None and procs[name].model_info(role).active_sessions:
            assert time.monotonic() < deadline, f"{name} still holds a session"
            time.sleep(0.05)


def stream_with_fault(procs, fault, policy="static:3"):
    """Generate N greedy tokens, calling ``fault()`` after the first delta;
    the tokens as streamed, and the stats."""
    wait_idle(procs)
    with Client(procs["C"].address, timeout=120) as c:
        stream = c.generate(prompt_ids=IDS, max_new_tokens=N, gamma_policy=policy)
        got = list(next(stream).token_ids)
        fault()
        stats = None
        for event in stream:
            if isinstance(event, Delta):
                got += event.token_ids
            else:
                stats = event
    return got, stats


def test_streams_beyond_max_streams_are_refused_with_a_retry_hint(pools, reference):
    with Client(pools["C1"].address, timeout=60) as c:
        stream = c.generate(prompt_ids=IDS, max_new_tokens=N, gamma_policy="static:0")
        next(stream)
        with pytest.raises(errors.ResourceExhausted, match="--max-streams 1") as exc:
            c.complete(prompt_ids=IDS, max_new_tokens=4)
        assert exc.value.retry_after_s == 1.0
        got = sum(len(e.token_ids) for e in stream if isinstance(e, Delta))
        assert got > 0
        # the stream is over: the next one is served
        assert c.complete(prompt_ids=IDS, max_new_tokens=8).token_ids == greedy_ref(reference, IDS, 8)


def test_new_sessions_spread_over_the_replicas(pools):
    """Three streams at once take the three targets, once the coordinator's
    health sweep (every 2 s) has seen each of them serving."""
    deadline = time.monotonic() + 15
    while True:
        wait_idle(pools)
        with Client(pools["C"].address, timeout=60) as c:
            streams = [c.generate(prompt_ids=IDS, max_new_tokens=N, gamma_policy="static:2") for _ in range(3)]
            for stream in streams:
                next(stream)
            held = {n: pools[n].model_info("target").active_sessions for n in ("T1", "T2", "T3")}
            for stream in streams:
                stream.close()
        if sorted(held.values()) == [1, 1, 1] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(held.values()) == [1, 1, 1], held
    wait_idle(pools)


def test_loadtest_conversations_over_the_pools_match_target_only_decoding(pools):
    """specdec loadtest's client: 4 sessions x 3 turns (named sessions, each
    turn on the history of the ones before), every turn checked afterwards."""
    from specdec.tools.loadtest import check_turns, run_load

    prompts = [[100 + i, 101 + i, 102 + i, 103 + i] * 5 for i in range(4)]
    request = {"max_new_tokens": 24, "temperature": 0.0, "top_p": 1.0, "gamma_policy": "adaptive"}
    report, turns = run_load(pools["C"].address, prompts, sessions=4, requests=12, duration_s=None,
                             request=request, turns=3)
    assert report.requests == 12 and not report.errors
    assert len(turns) == 12 and {len({t.session_id for t in turns})} == {4}
    assert max(len(t.history) for t in turns) == 20 + 24 + 16 + 24  # the third turn's history
    assert check_turns(pools["C"].address, turns, request) == 0


def test_a_killed_target_mid_stream_costs_no_token(pools, reference):
    victim = {}

    def kill():
        victim["name"] = holding(pools, "target", ("T1", "T2", "T3"))
        pools[victim["name"]].proc.kill()

    got, stats = stream_with_fault(pools, kill)
    assert got == greedy_ref(reference, IDS, N)  # nothing lost, nothing repeated, the target's tokens
    assert stats.finish_reason == "length" and stats.generated_tokens == N
    assert stats.target_prefill_tokens > len(IDS), "the new target was not re-pre-filled from the history"
    log = pools["C"].log()
    assert f"moved from {pools[victim['name']].address}" in log, log[-3000:]


def test_a_killed_draft_mid_stream_costs_speculation_only(pools, reference):
    victim = {}

    def kill():
        victim["name"] = holding(pools, "draft", ("D1", "D2"))
        pools[victim["name"]].proc.kill()

    got, stats = stream_with_fault(pools, kill)
    assert got == greedy_ref(reference, IDS, N)
    assert stats.finish_reason == "length"
    # Speculation resumed on the other draft: the last rounds drafted.
    assert sum(g > 0 for g in stats.gammas[-20:]) >= 15, stats.gammas[-20:]
    survivor = "D2" if victim["name"] == "D1" else "D1"
    assert f"to {pools[survivor].address}" in pools["C"].log()


def test_a_target_stopped_mid_stream_hands_its_session_over(pools, reference):
    """SIGTERM (a rolling restart): the target drains and health says
    NOT_SERVING; the stream moves to the target left, no request fails."""
    victim = {}

    def stop():
        live = [n for n in ("T1", "T2", "T3") if pools[n].proc.poll() is None]
        assert len(live) == 2, live
        victim["name"] = holding(pools, "target", live)
        pools[victim["name"]].proc.send_signal(signal.SIGTERM)

    got, stats = stream_with_fault(pools, stop, policy="adaptive")
    assert got == greedy_ref(reference, IDS, N)
    assert pools[victim["name"]].proc.wait(30) == 0
    # New work goes to the replica left, at once.
    with Client(pools["C"].address, timeout=60) as c:
        assert c.complete(prompt_ids=IDS, max_new_tokens=8).token_ids == greedy_ref(reference, IDS, 8)


def test_no_target_left_is_unavailable_naming_the_role(pools):
    for name in ("T1", "T2", "T3"):
        if pools[name].proc.poll() is None:
            pools[name].proc.kill()
            pools[name].proc.wait(10)
    start = time.monotonic()
    with Client(pools["C"].address, timeout=60) as c:
        with pytest.raises(errors.Unavailable) as exc:
            c.complete(prompt_ids=IDS, max_new_tokens=8)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    assert "target" in str(exc.value), exc.value
    assert time.monotonic() - start < 20
