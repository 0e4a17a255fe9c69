"""Arbitrary and malformed requests to every RPC of every service (hypothesis),
and to gRPC health and reflection on the service port and on the plaintext
health port (--health-port): each is answered with a proper status, never
UNKNOWN or INTERNAL, and the services still serve a valid request afterwards."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor as pd
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_e2e import Cluster, coordinator, greedy_ref, model_service

from specdec.proto import specdec_pb2 as pb
from specdec.serving.client import Client
from specdec.serving.server import free_port

BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
SERVICES = {"Coordinator": "C", "DraftService": "D", "TargetService": "T"}
INTS = {pd.FieldDescriptor.TYPE_INT32: 2**31, pd.FieldDescriptor.TYPE_INT64: 2**63,
        pd.FieldDescriptor.TYPE_UINT32: None, pd.FieldDescriptor.TYPE_UINT64: None}


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    """D + T + C, each also answering health checks on a plaintext health port
    of its own (``.health_address``), as the manifests run them."""
    target, draft = models
    logdir = tmp_path_factory.mktemp("fuzz-logs")
    health = {name: free_port() for name in SERVICES.values()}
    with Cluster() as procs:
        procs["D"] = model_service("draft", "draft", draft, logdir, "--health-port", str(health["D"]))
        procs["T"] = model_service("target", "target", target, logdir, "--health-port", str(health["T"]))
        procs["C"] = coordinator("coordinator", procs["D"], procs["T"], target, logdir, "--call-timeout", "5",
                                 "--health-port", str(health["C"]))
        for name, proc in procs.items():
            proc.health_address = f"127.0.0.1:{health[name]}"
        yield procs.ready()


def scalar(field: pd.FieldDescriptor) -> st.SearchStrategy:
    t = field.type
    if t in INTS:
        bound = INTS[t]
        small = st.integers(-3, 300) if bound else st.integers(0, 300)
        return st.one_of(small, st.integers(-bound, bound - 1) if bound else st.integers(0, 2**32 - 1))
    if t in (pd.FieldDescriptor.TYPE_FLOAT, pd.FieldDescriptor.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if t == pd.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == pd.FieldDescriptor.TYPE_STRING:
        return st.text(max_size=40)
    if t == pd.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if t == pd.FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    return message(field.message_type)


def message(desc: pd.Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Messages of type ``desc`` with arbitrary values in arbitrary fields."""
    # specdec's own messages by name; health's and reflection's from their descriptors
    cls = pb.__dict__.get(desc.name) if desc.file.name == pb.DESCRIPTOR.name else message_factory.GetMessageClass(desc)
    if cls is None or depth > 2:
        return st.just(None)
    fields = {}
    for f in desc.fields:
        value = message(f.message_type, depth + 1) if f.type == pd.FieldDescriptor.TYPE_MESSAGE else scalar(f)
        is_repeated = getattr(f, "is_repeated", None)
        repeated = is_repeated if is_repeated is not None else f.label == pd.FieldDescriptor.LABEL_REPEATED
        fields[f.name] = st.lists(value, max_size=6) if repeated else value
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: _build(cls, kw))


def _build(cls, kw):
    m = cls()
    for name, value in kw.items():
        if value is None:
            continue
        field = getattr(m, name)
        if isinstance(value, list):
            if value and not isinstance(value[0], (int, float, str, bytes, bool)):
                field.extend([v for v in value if v is not None])
            else:
                field.extend(value)
        elif hasattr(field, "CopyFrom") and not isinstance(value, (int, float, str, bytes, bool)):
            field.CopyFrom(value)
        else:
            setattr(m, name, value)
    return m


METHODS = [(service, method) for service in SERVICES for method in pb.DESCRIPTOR.services_by_name[service].methods]


def call(stack, service: str, method, body: bytes) -> grpc.StatusCode:
    path = f"/{method.containing_service.full_name}/{method.name}"
    with grpc.insecure_channel(stack[SERVICES[service]].address) as channel:
        try:
            if method.server_streaming:
                list(channel.unary_stream(path)(body, timeout=15))
            else:
                channel.unary_unary(path)(body, timeout=15)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


@pytest.mark.parametrize("service, method", METHODS, ids=[f"{s}.{m.name}" for s, m in METHODS])
def test_every_rpc_answers_arbitrary_requests_with_a_proper_status(stack, service, method):
    bodies = st.one_of(st.binary(max_size=64),  # mostly not a message at all
                       message(method.input_type).map(lambda m: m.SerializeToString()))

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(bodies)
    def check(body):
        code = call(stack, service, method, body)
        assert code not in BAD, f"{service}.{method.name} answered {code.name} to {body!r}"

    check()


HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


def call_any(address: str, path: str, method, body: bytes) -> grpc.StatusCode:
    """One call of any shape with ``body`` as its (first) request; a stream that
    answered is cancelled after its first reply (health's Watch never ends)."""
    with grpc.insecure_channel(address) as channel:
        try:
            if method.client_streaming:
                list(channel.stream_stream(path)(iter([body]), timeout=15))
            elif method.server_streaming:
                replies = channel.unary_stream(path)(body, timeout=15)
                next(replies, None)
                replies.cancel()
            else:
                channel.unary_unary(path)(body, timeout=15)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


@pytest.mark.parametrize("name", sorted(SERVICES.values()))
def test_health_and_reflection_answer_arbitrary_requests_with_a_proper_status_on_every_port(stack, name):
    # what each port serves besides the service's own RPCs: the health port, health alone
    served = {stack[name].address: (HEALTH, REFLECTION), stack[name].health_address: (HEALTH,)}
    calls = [(address, service, method) for address, services in served.items()
             for service in services for method in service.methods]
    bodies = st.one_of(st.binary(max_size=64),
                       *(message(method.input_type).map(lambda m: m.SerializeToString()) for _, _, method in calls))

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(bodies)
    def check(body):
        for address, service, method in calls:
            code = call_any(address, f"/{service.full_name}/{method.name}", method, body)
            assert code not in BAD, f"{name} {address}: {service.name}.{method.name} answered {code.name} to {body!r}"

    check()
    for address in served:  # health still answers on both ports
        stack[name].wait_serving(timeout=10, address=address)
    garbage = b"\xff\xff"  # no message: a field tag whose varint never ends
    for address, service, method in calls:
        code = call_any(address, f"/{service.full_name}/{method.name}", method, garbage)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{name} {address}: {method.name} answered {code.name}"


def test_the_services_still_serve_afterwards(stack, reference):
    with Client(stack["C"].address, timeout=60) as c:
        assert c.complete(prompt_ids=[100, 101], max_new_tokens=8).token_ids == greedy_ref(reference, [100, 101], 8)
    for name in ("C", "D", "T"):
        log = stack[name].log()
        assert "Traceback" not in log, f"{name}:\n{log[-3000:]}"
