"""Per-client limits: streams at once and a token-bucket request rate, each
client on its own."""

from __future__ import annotations

import pytest

from specdec.coordinator.admission import ClientLimits
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
