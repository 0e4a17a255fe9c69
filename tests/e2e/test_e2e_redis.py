"""Coordinator replicas sharing a session directory in a real redis-server
(started here; never skipped): sessions continue across coordinators, the lease
keeps two off one session, a coordinator killed mid-stream is resumed through
another with each token once, and a Redis outage is a fast UNAVAILABLE for a
new request and a NOT_SERVING health until it is back, while the streams in
flight ride it out (or, past ``--directory-outage``, end resumable)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time

import grpc
import pytest
import redis as redis_py
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis_server import RedisServer
from test_e2e import coordinator, model_service

from specdec import SpeculativeDecoder
from specdec.coordinator.redis_directory import RedisDirectory
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import convert, errors
from specdec.serving.client import Client, Delta
from specdec.serving.generation import GenerateJob

from service_harness import LoopThread

LEASE = ("--lease", "1")  # a killed coordinator's sessions are free again after 1 s


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    """Redis, one draft, one target, and coordinators A and B sharing the
    directory; X too, which rides out outages of only 2 s (--lease 1 +
    --directory-outage 1)."""
    target, draft = models
    logdir = tmp_path_factory.mktemp("redis-logs")
    redis = RedisServer(logdir / "redis").start()
    procs = {}
    try:
        procs["D"] = model_service("draft", "draft", draft, logdir)
        procs["T"] = model_service("target", "target", target, logdir)
        for name in ("A", "B"):
            procs[name] = coordinator(f"coordinator-{name}", procs["D"], procs["T"], target, logdir,
                                      "--redis", redis.url, *LEASE)
        procs["X"] = coordinator("coordinator-X", procs["D"], procs["T"], target, logdir, "--redis", redis.url,
                                 *LEASE, "--directory-outage", "1")
        for p in procs.values():
            p.wait_serving()
        yield procs, redis, logdir
    finally:
        for p in procs.values():
            p.stop()
        redis.stop()


@pytest.fixture(scope="module")
def reference(models):
    return SpeculativeDecoder(target=models[0])


def greedy(reference, ids, n):
    return reference.generate(list(ids), max_new_tokens=n, gamma=0).token_ids


def prompt(reference, text="def fibonacci(n):"):
    return reference.tokenizer.encode(text, add_special_tokens=False)


def test_two_coordinators_continue_each_others_sessions(stack, reference):
    procs, _, _ = stack
    p1, p2 = prompt(reference), prompt(reference, "\n    return")
    with Client(procs["A"].address, timeout=60) as a, Client(procs["B"].address, timeout=60) as b:
        t1 = a.complete(prompt_ids=p1, max_new_tokens=16, session_id="shared", gamma_policy="static:3")
        t2 = b.complete(prompt_ids=p2, max_new_tokens=16, session_id="shared", gamma_policy="static:3")
        assert t2.stats.history_tokens == len(p1) + 16
        assert t2.token_ids == greedy(reference, p1 + t1.token_ids + p2, 16)
        assert a.close_session("shared") is True
        with pytest.raises(errors.SessionNotFound):
            b.close_session("shared")


def test_the_lease_keeps_a_second_coordinator_off_a_session(stack, reference):
    """Another coordinator (here: the test, through the same directory code)
    holds the session's lease: B waits briefly, then refuses, saying why."""
    procs, redis, _ = stack
    loop = LoopThread()  # the other coordinator's event loop: it renews the lease while held
    other = RedisDirectory(redis.url, ttl_s=60, lease_s=1.0)
    held, done = threading.Event(), threading.Event()

    async def hold() -> None:
        async with other.hold("leased"):
            held.set()
            while not done.is_set():
                await asyncio.sleep(0.05)

    holding = asyncio.run_coroutine_threadsafe(hold(), loop.loop)
    try:
        assert held.wait(10)
        with Client(procs["B"].address, timeout=60) as b:
            started = time.monotonic()
            with pytest.raises(errors.FailedPrecondition, match="busy on another coordinator"):
                b.complete(prompt_ids=[40], max_new_tokens=4, session_id="leased")
            assert time.monotonic() - started < 5  # it waits briefly, not a call deadline
        done.set()
        holding.result(10)
        with Client(procs["B"].address, timeout=60) as b:  # released: B takes it
            assert len(b.complete(prompt_ids=[40], max_new_tokens=4, session_id="leased").token_ids) == 4
    finally:
        done.set()
        loop.call(other.close())
        loop.close()


def test_a_coordinator_killed_mid_stream_is_resumed_through_another(stack, models, reference):
    procs, redis, logdir = stack
    target, _ = models
    doomed = coordinator("coordinator-killed", procs["D"], procs["T"], target, logdir, "--redis", redis.url, *LEASE)
    try:
        doomed.wait_serving()
        ids = prompt(reference)
        expected = greedy(reference, ids, 200)
        got, deltas = [], 0
        with Client([doomed.address, procs["B"].address], timeout=60) as client:
            for event in client.generate(prompt_ids=ids, max_new_tokens=200, session_id="survivor",
                                         gamma_policy="static:2"):
                if isinstance(event, Delta):
                    got += event.token_ids
                    deltas += 1
                    if deltas == 3:
                        doomed.proc.send_signal(signal.SIGKILL)
                else:
                    stats = event
            assert client.address == procs["B"].address  # the turn ended through B
        assert doomed.proc.wait(10) == -signal.SIGKILL
        assert got == expected  # no token lost or repeated
        assert stats.generated_tokens == 200 and stats.finish_reason == "length"
    finally:
        doomed.stop()


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_redis_down_is_a_fast_unavailable_then_service_resumes(stack, reference):
    procs, redis, _ = stack
    address = procs["A"].address
    with Client(address, timeout=60) as client:
        client.complete(prompt_ids=[40, 41], max_new_tokens=4, session_id="outage")
        redis.stop()
        try:
            started = time.monotonic()
            with pytest.raises(errors.Unavailable, match="session directory"):
                client.complete(prompt_ids=[42], max_new_tokens=4, session_id="outage")
            assert time.monotonic() - started < 3
            wait_for(lambda: health(address) == health_pb2.HealthCheckResponse.NOT_SERVING)
            # not ready, yet alive: a liveness probe must not restart it for Redis's outage
            assert health(address, "liveness") == health_pb2.HealthCheckResponse.SERVING
            # One-shot requests need no directory: they still work.
            assert len(client.complete(prompt_ids=[40], max_new_tokens=3).token_ids) == 3
        finally:
            redis.start()  # empty: it forgot every session
        wait_for(lambda: health(address) == health_pb2.HealthCheckResponse.SERVING)
        out = client.complete(prompt_ids=[42], max_new_tokens=4, session_id="outage")
        assert out.stats.history_tokens == 0  # a fresh session, and it says so


def test_concurrent_sessions_over_two_coordinators(stack, reference):
    procs, _, _ = stack
    ids = prompt(reference)
    expected = greedy(reference, ids, 24)
    failures = []

    def one(i: int) -> None:
        address = procs["A" if i % 2 else "B"].address
        with Client(address, timeout=60) as c:
            out = c.complete(prompt_ids=ids, max_new_tokens=24, session_id=f"many-{i}", gamma_policy="static:2")
            if out.token_ids != expected:
                failures.append(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures


# ------------------------------------------------------------------ riding out a directory outage

RIDE_TOKENS = 300  # per stream: in flight through the outage


def streams_ride_out(procs, reference, name: str, fault, outage_s: float) -> None:
    """Four named streams, two through A and two through B; ``fault()`` (an
    outage of ``outage_s``) once each has streamed a few tokens. Each completes
    with all its tokens once, as target-only greedy decoding; and each was in
    flight through the outage."""
    ids = prompt(reference)
    expected = greedy(reference, ids, RIDE_TOKENS)
    going = [threading.Event() for _ in range(4)]
    results: dict[int, object] = {}

    def one(i: int) -> None:
        got, stats = [], None
        try:
            with Client(procs["AB"[i % 2]].address, timeout=120) as c:
                for event in c.generate(prompt_ids=ids, max_new_tokens=RIDE_TOKENS, session_id=f"{name}-{i}",
                                        gamma_policy="static:2"):
                    if isinstance(event, Delta):
                        got += event.token_ids
                        if len(got) >= 8:
                            going[i].set()
                    else:
                        stats = event
            results[i] = (got, stats, time.monotonic())
        except Exception as e:  # reported below, naming the stream
            results[i] = e
        finally:
            going[i].set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for event in going:
        assert event.wait(60)
    fault_at = time.monotonic()
    fault()
    for t in threads:
        t.join(120)
    for i in range(4):
        assert not isinstance(results[i], Exception), f"stream {i}: {results[i]}"
        got, stats, ended = results[i]
        assert got == expected and stats.generated_tokens == RIDE_TOKENS and stats.finish_reason == "length"
        assert ended > fault_at + outage_s  # it was still streaming when the outage began


def test_streams_in_flight_ride_out_redis_killed_and_restarted_empty(stack, reference):
    procs, redis, _ = stack

    def kill_and_restart() -> None:
        redis.stop()  # SIGKILL
        time.sleep(2)
        redis.start()  # empty: each turn's record is re-seeded by its coordinator

    streams_ride_out(procs, reference, "killed", kill_and_restart, 2)


def test_streams_in_flight_ride_out_a_redis_stall(stack, reference):
    procs, redis, _ = stack

    def stall() -> None:
        redis.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(3)  # past the 1 s lease: each is taken again
        finally:
            redis.proc.send_signal(signal.SIGCONT)

    streams_ride_out(procs, reference, "stalled", stall, 3)


def test_an_outage_past_the_bound_ends_the_stream_resumable_elsewhere(stack, reference):
    """X rides out 2 s: a longer stall ends its stream with UNAVAILABLE and a
    retry-after hint, health NOT_SERVING meanwhile; the turn then resumes
    through B after the deltas received, each token once."""
    procs, redis, _ = stack
    ids = prompt(reference)
    expected = greedy(reference, ids, 200)
    job = GenerateJob(prompt_ids=tuple(ids), max_new_tokens=200, session_id="past-bound", turn_id="turn-1",
                      gamma_policy="static:2")
    got, deltas = [], 0
    with grpc.insecure_channel(procs["X"].address) as ch:
        try:
            with pytest.raises(grpc.RpcError) as failed:
                for message in pb_grpc.CoordinatorStub(ch).Generate(convert.generate_request(job), timeout=60):
                    got += convert.event_from_proto(message).token_ids
                    deltas += 1
                    if deltas == 3:
                        redis.proc.send_signal(signal.SIGSTOP)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
            assert "--directory-outage" in failed.value.details() and errors.retry_after(failed.value) == 1
            wait_for(lambda: health(procs["X"].address) == health_pb2.HealthCheckResponse.NOT_SERVING)
        finally:
            redis.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: health(procs["X"].address) == health_pb2.HealthCheckResponse.SERVING)
    resumed = dataclasses.replace(job, resume_after=deltas)
    with grpc.insecure_channel(procs["B"].address) as ch:
        for message in pb_grpc.CoordinatorStub(ch).Generate(convert.generate_request(resumed), timeout=60):
            event = convert.event_from_proto(message)
            if isinstance(event, Delta):
                got += event.token_ids
            else:
                stats = event
    assert got == expected and stats.finish_reason == "length"


def test_health_is_not_serving_while_redis_refuses_writes(stack):
    procs, redis, _ = stack
    address = procs["A"].address
    raw = redis_py.Redis.from_url(redis.url)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", 1)  # full: every write refused, PING still answered
    try:
        wait_for(lambda: health(address) == health_pb2.HealthCheckResponse.NOT_SERVING)
        assert raw.ping()
    finally:
        raw.config_set("maxmemory", 0)
    wait_for(lambda: health(address) == health_pb2.HealthCheckResponse.SERVING)
