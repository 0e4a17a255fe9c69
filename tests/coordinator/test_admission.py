"""The coordinator's streams in all (number and memory), and per-client limits:
streams at once and a token-bucket request rate, each
client on its own."""

from __future__ import annotations

import pytest

from specdec.coordinator.admission import REQUEST_COPIES, STREAM_BASE_BYTES, ClientLimits, StreamLimits
from specdec.serving import errors


def test_streams_at_once_are_counted_per_client_and_released_once():
    limits = ClientLimits(max_streams=2)
    a1, a2 = limits.admit("alice"), limits.admit("alice")
    with pytest.raises(errors.ResourceExhausted, match="--client-max-streams 2") as exc:
        limits.admit("alice")
    assert exc.value.retry_after_s == 1.0
    limits.admit("bob")  # bob is not alice
    a1()
    a1()  # twice counts once
    limits.admit("alice")
    with pytest.raises(errors.ResourceExhausted):
        limits.admit("alice")
    a2()


def test_the_rate_allows_a_burst_then_one_request_per_interval():
    now = [0.0]
    limits = ClientLimits(rate=2.0, burst=3.0, clock=lambda: now[0])
    for _ in range(3):
        limits.admit("alice")()
    with pytest.raises(errors.ResourceExhausted, match="past its request rate") as exc:
        limits.admit("alice")
    assert exc.value.retry_after_s == pytest.approx(0.5)
    limits.admit("bob")()  # a flood by alice costs bob nothing
    now[0] = 0.5
    limits.admit("alice")()
    with pytest.raises(errors.ResourceExhausted):
        limits.admit("alice")


def test_no_limits_admit_everyone():
    limits = ClientLimits()
    for _ in range(100):
        limits.admit("alice")


# ------------------------------------------------------------------ the coordinator's streams in all


def test_streams_in_all_are_bounded_in_number_and_in_memory():
    limits = StreamLimits(max_streams=3, max_bytes=1 << 20)
    small = limits.admit(1000)
    with pytest.raises(errors.ResourceExhausted, match=r"--max-stream-memory 1 MiB") as exc:
        limits.admit(600_000)  # held twice: 1.2 MB, past 1 MiB with the small one's share
    assert exc.value.retry_after_s == 1.0
    assert limits.streams == 1  # a refusal takes nothing
    big = limits.admit(300_000)
    small()
    small()  # twice counts once
    assert limits.streams == 1 and limits.bytes == STREAM_BASE_BYTES + REQUEST_COPIES * 300_000
    others = [limits.admit(10) for _ in range(2)]
    with pytest.raises(errors.ResourceExhausted, match="--max-streams 3"):
        limits.admit(10)
    for release in [big, *others]:
        release()
    assert (limits.streams, limits.bytes) == (0, 0)


def test_a_coordinator_refuses_a_request_past_its_stream_memory_over_grpc():
    """A real coordinator with --max-stream-memory 1: a 600 kB request is refused
    RESOURCE_EXHAUSTED with a retry hint before any work; a small one is admitted
    (and fails only because no service is up)."""
    from specdec.coordinator.server import start_coordinator
    from specdec.serving.client import Client
    from specdec.serving.config import CoordinatorConfig

    from service_harness import LoopThread

    loop = LoopThread()
    config = CoordinatorConfig(draft="127.0.0.1:1", target="127.0.0.1:2", host="127.0.0.1", port=0,
                               tokenizer="none", max_stream_memory_mb=1, info_timeout_s=0.5)
    coordinator = loop.call(start_coordinator(config))
    try:
        with Client(f"127.0.0.1:{coordinator.port}", timeout=30) as client:
            with pytest.raises(errors.ResourceExhausted, match="--max-stream-memory 1 MiB") as exc:
                client.complete(prompt_ids=[7] * 600_000, max_new_tokens=4)  # 600 kB on the wire
            assert exc.value.retry_after_s == 1.0
            with pytest.raises(errors.Unavailable):
                client.complete(prompt_ids=[7, 8, 9], max_new_tokens=4)
    finally:
        loop.call(coordinator.stop())
        loop.close()
