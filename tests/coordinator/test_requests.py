"""A Generate request's strings are bounded: too many or too long stop strings,
and an oversized γ policy, session id or turn id, are refused INVALID_ARGUMENT
before the coordinator asks any service anything (these coordinators have no
services: a request that got past the checks would be UNAVAILABLE), with a
message stating the bound and repeating no more than an excerpt of the input."""

from __future__ import annotations

import pytest

from specdec.coordinator.engine import Coordinator
from specdec.coordinator.requests import (
    MAX_GAMMA_POLICY_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    parse_gamma_policy,
)
from specdec.serving import errors
from specdec.serving.config import CoordinatorConfig
from specdec.serving.generation import GenerateJob

from service_harness import LoopThread, SyncEngine

NO_SERVICES = {"draft": "127.0.0.1:1", "target": "127.0.0.1:2", "info_timeout_s": 0.5}
MEGABYTE = 1 << 20
SHORT = 200  # characters: a message, not an echo


@pytest.fixture(scope="module")
def engine():
    loop = LoopThread()
    engine = SyncEngine(loop, lambda: Coordinator(CoordinatorConfig(**NO_SERVICES)))
    yield engine
    engine.close()
    loop.close()


def refused(engine, **job) -> str:
    with pytest.raises(errors.InvalidRequest) as e:
        list(engine.generate(GenerateJob(prompt_ids=(1, 2), max_new_tokens=64, **job)))
    assert len(str(e.value)) < SHORT
    return str(e.value)


def test_too_many_stop_strings_are_refused_at_once(engine):
    assert refused(engine, stop=("x" * 100,) * 20_000) == (
        f"too many stop strings (20000): at most {MAX_STOP_STRINGS} are allowed")
    assert "(65)" in refused(engine, stop=("x",) * (MAX_STOP_STRINGS + 1))


def test_a_stop_string_too_long_or_empty_is_refused(engine):
    too_long = ("ok", "x" * (MAX_STOP_CHARS + 1))
    assert refused(engine, stop=too_long) == (
        f"stop[1] has {MAX_STOP_CHARS + 1} characters: a stop string may have at most {MAX_STOP_CHARS}")
    assert refused(engine, stop=("ok", "")) == "stop strings must not be empty"


def test_a_megabyte_gamma_policy_or_id_is_refused_without_being_repeated(engine):
    assert refused(engine, gamma_policy="static:" + "9" * MEGABYTE).startswith(
        f"gamma_policy has {MEGABYTE + 7} characters, more than {MAX_GAMMA_POLICY_CHARS}")
    assert refused(engine, session_id="s" * MEGABYTE) == "session_id is longer than 256 characters"
    assert refused(engine, session_id="chat", turn_id="t" * MEGABYTE) == "turn_id is longer than 256 characters"


def test_a_bad_gamma_policy_is_repeated_as_an_excerpt():
    """Parsed elsewhere too (a coordinator's --gamma-policy): the message shows
    the start of the spec and its length, never all of it."""
    for spec in ("static:" + "x" * MEGABYTE, "y" * MEGABYTE):
        with pytest.raises(errors.InvalidRequest) as e:
            parse_gamma_policy(spec, 16)
        assert len(str(e.value)) < SHORT and f"… ({len(spec)} characters)" in str(e.value)
    with pytest.raises(errors.InvalidRequest, match="gamma_policy 'greedy' is not understood"):
        parse_gamma_policy("greedy", 16)  # a short one, whole


def test_a_coordinator_refuses_oversized_requests_over_grpc():
    """20,000 stop strings of 100 characters (2 MB, within the message limit)
    and a 1 MB γ policy, through a real coordinator and client: INVALID_ARGUMENT
    with a short message, not a long turn nor a status too large to send."""
    from specdec.coordinator.server import start_coordinator
    from specdec.serving.client import Client

    loop = LoopThread()
    config = CoordinatorConfig(**NO_SERVICES, host="127.0.0.1", port=0, tokenizer="none")
    coordinator = loop.call(start_coordinator(config))
    try:
        with Client(f"127.0.0.1:{coordinator.port}", timeout=30) as client:
            with pytest.raises(errors.InvalidRequest, match=r"too many stop strings \(20000\)"):
                client.complete(prompt_ids=[1, 2], max_new_tokens=64, stop=["x" * 100] * 20_000)
            with pytest.raises(errors.InvalidRequest) as e:
                client.complete(prompt_ids=[1, 2], max_new_tokens=64, gamma_policy="p" * MEGABYTE)
            assert str(e.value).startswith(f"gamma_policy has {MEGABYTE} characters") and len(str(e.value)) < SHORT
            with pytest.raises(errors.Unavailable):  # within the bounds: on to the (missing) services
                client.complete(prompt_ids=[1, 2], max_new_tokens=4, gamma_policy="static:2", session_id="s" * 256)
    finally:
        loop.call(coordinator.stop())
        loop.close()
