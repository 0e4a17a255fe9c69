"""Client authentication end to end: a coordinator started with bearer tokens
refuses every RPC but health without a valid one, and a named session belongs
to the client that created it."""

from __future__ import annotations

import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_e2e import Cluster, Proc, greedy_ref, model_service

from specdec.proto import specdec_pb2 as pb
from specdec.serving import errors
from specdec.serving.client import Client

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
IDS = [100, 101, 102]


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    target, draft = models
    logdir = tmp_path_factory.mktemp("auth-logs")
    tokens = logdir / "tokens"
    tokens.write_text(f"# who may call\nalice {ALICE}\nbob {BOB}\n")
    with Cluster() as procs:
        procs["D"] = model_service("draft", "draft", draft, logdir, "--trace-file", str(logdir / "spans.jsonl"))
        procs["T"] = model_service("target", "target", target, logdir, "--trace-file", str(logdir / "spans.jsonl"))
        common = ["coordinator", "--draft", procs["D"].address, "--target", procs["T"].address,
                  "--tokenizer", str(target), "--auth-tokens-file", str(tokens)]
        procs["C"] = Proc("coordinator", [*common, "--trace-file", str(logdir / "spans.jsonl")], logdir)
        procs["Cq"] = Proc("coordinator-no-reflection", [*common, "--no-reflection"], logdir)
        procs["Cl"] = Proc("coordinator-rate-limited", [*common, "--client-rate", "4", "--client-burst", "4"], logdir)
        yield procs.ready()


def call_every_rpc(address: str, metadata=()) -> dict[str, grpc.StatusCode]:
    """Each Coordinator RPC (from the service descriptor, so a new one cannot
    slip past) with an empty request: the status it ends with."""
    codes = {}
    with grpc.insecure_channel(address) as channel:
        for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
            path = f"/{method.containing_service.full_name}/{method.name}"
            try:
                if method.server_streaming:
                    list(channel.unary_stream(path)(b"", metadata=metadata, timeout=10))
                else:
                    channel.unary_unary(path)(b"", metadata=metadata, timeout=10)
                codes[method.name] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                codes[method.name] = e.code()
    return codes


def reflection_code(address: str, metadata=()) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        try:
            list(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10))
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def test_every_rpc_but_health_needs_a_valid_token(stack):
    address = stack["C"].address
    for metadata in ((), (("authorization", "Bearer not-a-token-of-anyone"),), (("authorization", ALICE),)):
        codes = call_every_rpc(address, metadata)
        assert set(codes) >= {"Generate", "CloseSession"}
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (metadata, codes)
        assert reflection_code(address, metadata) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(address) as channel:  # probes need no token
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert reflection_code(address, (("authorization", f"Bearer {ALICE}"),)) == grpc.StatusCode.OK
    assert reflection_code(stack["Cq"].address, (("authorization", f"Bearer {ALICE}"),)) == \
        grpc.StatusCode.UNIMPLEMENTED
    log = stack["C"].log()
    assert ALICE not in log and BOB not in log and "not-a-token-of-anyone" not in log


def test_a_session_belongs_to_the_client_that_made_it(stack, reference):
    address = stack["C"].address
    with Client(address, timeout=60, token=ALICE) as alice, Client(address, timeout=60, token=BOB) as bob:
        first = alice.complete(prompt_ids=IDS, max_new_tokens=8, session_id="chat-1")
        with pytest.raises(errors.PermissionDenied, match="belongs to another client"):
            bob.complete(prompt_ids=[33], max_new_tokens=8, session_id="chat-1")
        with pytest.raises(errors.PermissionDenied):
            bob.close_session("chat-1")
        assert bob.complete(prompt_ids=[33], max_new_tokens=4, session_id="chat-2").stats.history_tokens == 0
        second = alice.complete(prompt_ids=[33], max_new_tokens=8, session_id="chat-1")
        assert second.stats.history_tokens == len(IDS) + 8  # bob changed nothing of it
        assert second.token_ids == greedy_ref(reference, IDS + first.token_ids + [33], 8)
        assert alice.close_session("chat-1") is True
    with Client(address, timeout=60) as nobody, pytest.raises(errors.Unauthenticated, match="no credentials"):
        nobody.complete(prompt_ids=IDS, max_new_tokens=4)


def test_logs_and_spans_hold_no_token_no_session_suffix_and_no_prompt_text(stack):
    secret = "def very_private_function_name():"
    with Client(stack["C"].address, timeout=60, token=ALICE) as alice:
        alice.complete(secret, max_new_tokens=8, session_id="private-chat")
        alice.complete(" more", max_new_tokens=8, session_id="private-chat")
        alice.close_session("private-chat")
    spans_file = stack["C"].log_path.parent / "spans.jsonl"
    deadline = time.monotonic() + 20  # the batch processors export every few seconds

    def spans() -> str:
        return spans_file.read_text() if spans_file.exists() else ""

    while "private-chat" not in spans():  # the conversation's id, on its Generate spans
        assert time.monotonic() < deadline, "no span of the requests was written"
        time.sleep(0.5)
    texts = {name: stack[name].log() for name in ("C", "D", "T")} | {"spans": spans()}
    for name, text in texts.items():
        assert ALICE not in text and BOB not in text, name
        assert secret not in text and "very_private" not in text, name
        assert not re.search(r"~[0-9a-f]{12}", text), f"{name} holds a session's secret suffix"


def test_a_client_flooding_past_its_rate_is_refused_and_the_others_are_served(stack, reference):
    """alice sends as fast as she can from four threads; bob one request at a
    time. alice is refused with a retry hint once past 4 requests/s; bob never
    is, and his latency stays that of an idle coordinator."""
    import threading
    import time

    address, want = stack["Cl"].address, greedy_ref(reference, IDS, 4)
    with Client(address, timeout=60, token=BOB) as bob:
        started = time.perf_counter()
        bob.complete(prompt_ids=IDS, max_new_tokens=4)
        idle_s = time.perf_counter() - started
    refused, served, stop = [], [], threading.Event()

    def flood():
        with Client(address, timeout=60, token=ALICE) as alice:
            while not stop.is_set():
                try:
                    alice.complete(prompt_ids=IDS, max_new_tokens=4)
                    served.append(1)
                except errors.ResourceExhausted as e:
                    refused.append(e.retry_after_s)

    threads = [threading.Thread(target=flood) for _ in range(4)]
    for t in threads:
        t.start()
    latencies = []
    try:
        with Client(address, timeout=60, token=BOB) as bob:
            for _ in range(6):
                started = time.perf_counter()
                assert bob.complete(prompt_ids=IDS, max_new_tokens=4).token_ids == want
                latencies.append(time.perf_counter() - started)
                time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert refused and all(r is not None and 0 < r <= 1.0 for r in refused)
    assert len(served) < len(refused)
    median = sorted(latencies)[len(latencies) // 2]
    print(f"bob's latency idle {idle_s * 1e3:.0f} ms, under alice's flood {median * 1e3:.0f} ms (median of "
          f"{len(latencies)}); alice {len(served)} served, {len(refused)} refused")
