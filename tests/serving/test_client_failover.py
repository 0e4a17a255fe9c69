"""When the client goes on through the next coordinator: a coordinator gone or
draining; or one that answered UNAVAILABLE with a retry-after hint (its session
directory was down past --directory-outage), after that hint. Not for another
UNAVAILABLE the coordinator answered itself. No network: the channels are lazy."""

from __future__ import annotations

import time

import grpc
import pytest

from specdec.serving import client as client_module
from specdec.serving import errors
from specdec.serving.client import Client
from specdec.serving.generation import GenerateJob


class Failed(grpc.RpcError):
    """A failed call as grpc raises it: a code, details and trailing metadata."""

    def __init__(self, code=grpc.StatusCode.UNAVAILABLE, error_type: str | None = "Unavailable",
                 retry_after: str | None = None):
        self._code, self._metadata = code, []
        if error_type is not None:
            self._metadata.append((errors.ERROR_TYPE_KEY, error_type))
        if retry_after is not None:
            self._metadata.append((errors.RETRY_AFTER_KEY, retry_after))

    def code(self):
        return self._code

    def details(self):
        return "the session directory ..."

    def trailing_metadata(self):
        return self._metadata


@pytest.fixture
def client(monkeypatch):
    slept = []
    monkeypatch.setattr(client_module.time, "sleep", slept.append)
    with Client(["127.0.0.1:1", "127.0.0.1:2"]) as c:
        c.slept = slept
        yield c


NAMED = GenerateJob(prompt_ids=(1,), session_id="s", turn_id="t")


def test_a_retry_after_hint_is_followed_through_the_next_coordinator(client):
    assert client._fail_over(Failed(retry_after="5"), NAMED, 3, time.monotonic() + 30)
    assert client.address == "127.0.0.1:2" and client.slept == [5.0]


def test_the_hint_is_cut_to_the_failover_time_left(client):
    assert client._fail_over(Failed(retry_after="5"), NAMED, 3, time.monotonic() + 2)
    assert 1.5 < client.slept[0] <= 2


@pytest.mark.parametrize("failed", [Failed(), Failed(grpc.StatusCode.FAILED_PRECONDITION, "FailedPrecondition", "5")])
def test_without_a_hint_the_coordinators_own_answer_is_raised(client, failed):
    assert not client._fail_over(failed, NAMED, 3, time.monotonic() + 30)
    assert client.address == "127.0.0.1:1"


def test_a_hint_does_not_resend_a_one_shot_request_that_streamed(client):
    assert not client._fail_over(Failed(retry_after="1"), GenerateJob(prompt_ids=(1,)), 2, time.monotonic() + 30)


def test_the_hint_reaches_the_raised_error():
    raised = errors.from_rpc_error(Failed(retry_after="5"))
    assert isinstance(raised, errors.Unavailable) and raised.retry_after_s == 5.0
