"""Requests far larger than any valid one: refused before they are read
(coordinator, draft) or refused and their memory given back (target), so ten
of 10 MB in a row do not add up in any service's memory."""

from __future__ import annotations

import time

import grpc
import pytest
from test_e2e import greedy_ref, one_of_each

from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving.client import Client

TEN_MB = 10 << 20


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    with one_of_each(models, tmp_path_factory.mktemp("limits-logs")) as procs:
        yield procs.ready()


def rss_mb(proc) -> float:
    with open(f"/proc/{proc.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def refused(send, stub) -> grpc.StatusCode:
    try:
        result = send(stub)
        if hasattr(result, "__iter__"):
            list(result)
    except grpc.RpcError as e:
        return e.code()
    raise AssertionError("a 10 MB request was served")


def test_ten_requests_of_ten_megabytes_leave_memory_where_it_was(stack, reference):
    big_ids = [5] * (TEN_MB // 2)  # ~2 bytes each on the wire
    with Client(stack["C"].address, timeout=60) as c:
        c.complete(prompt_ids=[100, 101], max_new_tokens=8)  # every service warm
    calls = {
        "C": (pb_grpc.CoordinatorStub, lambda s: s.Generate(pb.GenerateRequest(prompt="x" * TEN_MB, max_new_tokens=4),
                                                           timeout=30)),
        "D": (pb_grpc.DraftServiceStub, lambda s: s.Propose(pb.ProposeRequest(session_id="big", new_tokens=big_ids,
                                                                              gamma=2), timeout=30)),
        "T": (pb_grpc.TargetServiceStub, lambda s: s.Verify(pb.VerifyRequest(session_id="big", new_tokens=big_ids),
                                                            timeout=30)),
    }
    # The first one sizes buffers that stay; the ten after it must not add up.
    channels = {name: grpc.insecure_channel(stack[name].address, options=[("grpc.max_send_message_length", 64 << 20)])
                for name in calls}
    stubs = {name: stub_cls(channels[name]) for name, (stub_cls, _) in calls.items()}
    for name, (_, send) in calls.items():
        refused(send, stubs[name])
    time.sleep(1.0)
    before = {name: rss_mb(p) for name, p in stack.items()}
    for name, (_, send) in calls.items():
        codes = {refused(send, stubs[name]) for _ in range(10)}
        assert codes <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT}, (name, codes)
    for channel in channels.values():
        channel.close()
    time.sleep(1.5)
    grown = {name: rss_mb(p) - before[name] for name, p in stack.items()}
    assert all(g < 50 for g in grown.values()), f"MB grown: {grown}"
    with Client(stack["C"].address, timeout=60) as c:  # and still serving
        assert c.complete(prompt_ids=[100, 101], max_new_tokens=8).token_ids == greedy_ref(reference, [100, 101], 8)
