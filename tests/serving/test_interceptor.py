"""The one server interceptor: errors become statuses, each call gets a SERVER
span (the caller's child, current while the handler runs) and is counted."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from specdec.proto import specdec_pb2 as pb
from specdec.serving.server import GrpcServer
from specdec.telemetry import server_spans
from specdec.telemetry.metrics import ServiceMetrics


def _serve_and_call(calls, metrics=None):
    """A GrpcServer with a fake Verify and a streaming Propose on a loopback
    port; ``calls(verify, propose, channel)`` runs against it. Each handler
    records the span that was current while it ran."""
    seen = []

    async def verify(request, context):
        seen.append(trace.get_current_span())
        if request.session_id == "bad":
            raise ValueError("draft_tokens[0] = 9999 is outside the vocabulary")
        if request.session_id == "bug":
            raise RuntimeError("boom")
        return pb.VerifyResponse(accepted=1, timing=pb.ServerTiming(compute_s=0.004, computed_tokens=3))

    async def propose(request, context):
        seen.append(trace.get_current_span())
        if request.session_id == "bad":
            yield pb.DraftToken()
            raise ValueError("gamma = 99 is above the limit")
        if request.session_id == "big":  # more than flow control lets through before the client reads
            for _ in range(64):
                yield pb.DraftToken(q=pb.Distribution(probs=bytes(1 << 20)))
        for _ in range(2):
            yield pb.DraftToken()

    handler = grpc.method_handlers_generic_handler("specdec.v1.TargetService", {
        "Verify": grpc.unary_unary_rpc_method_handler(
            verify, request_deserializer=pb.VerifyRequest.FromString,
            response_serializer=pb.VerifyResponse.SerializeToString),
        "Propose": grpc.unary_stream_rpc_method_handler(
            propose, request_deserializer=pb.ProposeRequest.FromString,
            response_serializer=pb.DraftToken.SerializeToString)})

    async def main():
        server = GrpcServer(["specdec.v1.TargetService"], metrics=metrics)
        server.server.add_generic_rpc_handlers((handler,))
        port = server.bind("127.0.0.1", 0)
        await server.start()
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                v = channel.unary_unary("/specdec.v1.TargetService/Verify",
                                        request_serializer=pb.VerifyRequest.SerializeToString,
                                        response_deserializer=pb.VerifyResponse.FromString)
                p = channel.unary_stream("/specdec.v1.TargetService/Propose",
                                         request_serializer=pb.ProposeRequest.SerializeToString,
                                         response_deserializer=pb.DraftToken.FromString)
                await calls(v, p, channel)
        finally:
            await server.server.stop(None)

    asyncio.run(main())
    return seen


def _traceparent(trace_id: int, span_id: int, sampled: bool):
    return (("traceparent", f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"),)


def test_server_span_is_the_callers_child_and_current_in_the_handler(provider):
    async def calls(verify, propose, channel):
        await verify(pb.VerifyRequest(session_id="s"), metadata=_traceparent(0xABC, 0x123, sampled=True))
        assert len([m async for m in propose(pb.ProposeRequest(), metadata=_traceparent(0xABC, 0x456, True))]) == 2
        await verify(pb.VerifyRequest(session_id="s"))  # no caller context: a root span

    before = time.time_ns()
    seen = _serve_and_call(calls)
    verify, propose, root = sorted(provider.memory.get_finished_spans(), key=lambda s: s.start_time)
    assert before < verify.start_time < verify.end_time < propose.start_time < propose.end_time < root.start_time
    assert [s.kind for s in (verify, propose, root)] == [trace.SpanKind.SERVER] * 3
    assert (verify.context.trace_id, verify.parent.span_id, verify.parent.is_remote) == (0xABC, 0x123, True)
    assert (propose.context.trace_id, propose.parent.span_id) == (0xABC, 0x456)
    assert root.parent is None
    assert verify.name == "/specdec.v1.TargetService/Verify" and propose.name == "/specdec.v1.TargetService/Propose"
    a = verify.attributes
    assert (a["rpc.system"], a["rpc.service"], a["rpc.method"], a["rpc.grpc.status_code"]) == \
        ("grpc", "specdec.v1.TargetService", "Verify", 0)
    assert a["net.peer.ip"] == "127.0.0.1" and a["net.peer.port"] > 0  # which caller
    assert (a["specdec.server.compute_s"], a["specdec.server.computed_tokens"]) == (pytest.approx(0.004), 3)
    # The handler ran inside the SERVER span: spans it starts are its children.
    assert [s.get_span_context().span_id for s in seen] == [s.context.span_id for s in (verify, propose, root)]


def test_unsampled_callers_get_no_server_span(provider):
    async def calls(verify, propose, channel):
        await verify(pb.VerifyRequest(session_id="s"), metadata=_traceparent(0xABC, 0x123, sampled=False))

    (current,) = _serve_and_call(calls)
    assert provider.memory.get_finished_spans() == ()
    assert not current.is_recording() and current.get_span_context().trace_id == 0xABC  # the decision travels on


@pytest.mark.parametrize("peer, attributes", [
    ("ipv4:10.0.0.7:51234", {"net.peer.ip": "10.0.0.7", "net.peer.port": 51234}),
    ("ipv6:%5B::1%5D:443", {"net.peer.ip": "::1", "net.peer.port": 443}),
    ("unix:/tmp/specdec.sock", {}),
    ("", {}),
])
def test_peer_address_attributes(peer, attributes):
    assert server_spans._peer_attributes(peer) == attributes


def test_failed_calls_are_answered_with_their_status_and_mark_the_span(provider):
    async def calls(verify, propose, channel):
        for session, code in (("bad", grpc.StatusCode.INVALID_ARGUMENT), ("bug", grpc.StatusCode.INTERNAL)):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await verify(pb.VerifyRequest(session_id=session), metadata=_traceparent(0xABC, 0x123, True))
            assert failed.value.code() == code
        assert "outside the vocabulary" in failed.value.details() or "boom" in failed.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as failed:  # mid-stream
            [m async for m in propose(pb.ProposeRequest(session_id="bad"), metadata=_traceparent(0xABC, 0x1, True))]
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "above the limit" in failed.value.details()
        assert dict(failed.value.trailing_metadata())["specdec-error"] == "ValueError"

    _serve_and_call(calls)
    bad, bug, bad_stream = sorted(provider.memory.get_finished_spans(), key=lambda s: s.start_time)
    assert all(s.parent is not None and s.context.trace_id == 0xABC for s in (bad, bug, bad_stream))
    assert bad_stream.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.status.status_code == trace.StatusCode.ERROR and "outside the vocabulary" in bad.status.description
    assert bad.events == ()  # a bad request is not a bug: no traceback on the span
    assert bug.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert [e.name for e in bug.events] == ["exception"]


def test_errors_are_mapped_and_counted_with_tracing_off():
    metrics = ServiceMetrics("target")

    async def calls(verify, propose, channel):
        for session, code in (("bad", grpc.StatusCode.INVALID_ARGUMENT), ("bug", grpc.StatusCode.INTERNAL)):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await verify(pb.VerifyRequest(session_id=session))
            assert failed.value.code() == code
        await verify(pb.VerifyRequest(session_id="s", draft_tokens=[1, 2]))

    _serve_and_call(calls, metrics)
    for code in ("INVALID_ARGUMENT", "INTERNAL"):
        assert metrics.registry.get_sample_value(
            "specdec_rpc_errors_total", {"service": "target", "method": "Verify", "code": code}) == 1
    assert metrics.registry.get_sample_value("specdec_target_verified_draft_tokens_total", {"service": "target"}) == 2
    assert metrics.registry.get_sample_value("specdec_server_computed_tokens_total", {"service": "target"}) == 3


def test_the_interceptors_own_failure_is_answered_internal(provider, monkeypatch):
    """A bug in making the span is a status the client can read, INTERNAL, as
    every other bug, not grpc's UNKNOWN."""
    def broken(*args, **kwargs):
        raise RuntimeError("sampler bug")

    monkeypatch.setattr("specdec.serving.interceptor.start_server_span", broken)

    async def calls(verify, propose, channel):
        for call in (verify(pb.VerifyRequest(session_id="s"), metadata=_traceparent(0xABC, 0x123, True)),
                     propose(pb.ProposeRequest(), metadata=_traceparent(0xABC, 0x123, True)).read()):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call
            assert failed.value.code() == grpc.StatusCode.INTERNAL and "sampler bug" in failed.value.details()

    assert _serve_and_call(calls) == []  # the handlers never ran


def test_a_stream_cancelled_mid_send_ends_its_span_cleanly(provider, caplog):
    """The client goes away while the server is blocked sending: grpc leaves the
    handler's generator to be closed later, from another context."""
    async def calls(verify, propose, channel):
        call = propose(pb.ProposeRequest(session_id="big"), metadata=_traceparent(0xABC, 0x123, sampled=True))
        await call.read()
        call.cancel()
        for _ in range(100):  # until the server has given up on the stream
            if provider.memory.get_finished_spans():
                break
            await asyncio.sleep(0.05)

    _serve_and_call(calls)
    gc.collect()
    (span,) = provider.memory.get_finished_spans()
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert "Failed to detach context" not in caplog.text


def test_health_calls_are_counted_but_not_traced(provider):
    """Health Check aborts with NOT_FOUND for an unknown service; Watch is a
    coroutine that writes its replies (not an async generator). Probes call
    them every few seconds: they are counted, but make no trace."""
    async def calls(verify, propose, channel):
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        await verify(pb.VerifyRequest(session_id="s"))

    metrics = ServiceMetrics("target")
    _serve_and_call(calls, metrics)
    assert [s.name for s in provider.memory.get_finished_spans()] == ["/specdec.v1.TargetService/Verify"]
    errors = metrics.registry.get_sample_value(
        "specdec_rpc_errors_total", {"service": "target", "method": "Check", "code": "NOT_FOUND"})
    assert errors == 1


REFLECTION_SERVICES = ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")
GARBAGE = b"\xff\xff"  # not a protobuf message: a field tag whose varint never ends


def _raw_calls_to_health_and_reflection(tokens=None, metadata=None):
    """Bytes straight onto the wire (no serializer) to gRPC health on the
    service port and on the plaintext health port, and to each reflection
    service: (what, port, code, details or replies) for every call, and the
    (port, service) pairs the server lists by reflection."""
    from grpc_reflection.v1alpha import reflection_pb2

    from specdec.serving import auth

    listing = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    results = []

    async def check(channel, body):
        return await channel.unary_unary("/grpc.health.v1.Health/Check")(body, timeout=5)

    async def watch(channel, body):
        call = channel.unary_stream("/grpc.health.v1.Health/Watch")(body, timeout=5)
        first = await call.read()
        call.cancel()
        return first

    async def reflect(channel, service, bodies):
        call = channel.stream_stream(f"/{service}/ServerReflectionInfo")(iter(bodies), timeout=5, metadata=metadata)
        return [reply async for reply in call]

    async def record(what, where, call):
        try:
            results.append((what, where, grpc.StatusCode.OK, await call))
        except grpc.aio.AioRpcError as e:
            results.append((what, where, e.code(), e.details()))

    async def main():
        server = GrpcServer(["specdec.v1.TargetService"], tokens=tokens and auth.parse_tokens(tokens))
        port = server.bind("127.0.0.1", 0)
        health_port = server.bind_health("127.0.0.1", 0)
        await server.start()
        await server.set_serving(True)
        try:
            for where, at in (("service port", port), ("health port", health_port)):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{at}") as channel:
                    await record("Check", where, check(channel, GARBAGE))
                    await record("Watch", where, watch(channel, GARBAGE))
                    for service in REFLECTION_SERVICES:
                        await record(f"{service} listing", where, reflect(channel, service, [listing]))
                        await record(service, where, reflect(channel, service, [GARBAGE]))
                        if results[-2][2] == grpc.StatusCode.OK:  # served here (else refused before a second message)
                            await record(f"{service} after a valid request", where,
                                         reflect(channel, service, [listing, GARBAGE]))
        finally:
            await server.stop()

    asyncio.run(main())
    served = set()
    for what, where, code, replies in results:
        if what.endswith(" listing") and code == grpc.StatusCode.OK:
            served |= {(where, s.name) for s in reflection_pb2.ServerReflectionResponse.FromString(
                replies[0]).list_services_response.service}
    return results, served


def test_malformed_bodies_to_health_and_reflection_are_invalid_argument_on_every_port(caplog):
    """As every specdec RPC: a body that does not parse is INVALID_ARGUMENT with
    a short message, logged without a traceback, never grpc's UNKNOWN."""
    caplog.set_level("INFO")
    results, served = _raw_calls_to_health_and_reflection()
    assert ("service port", "grpc.reflection.v1alpha.ServerReflection") in served
    assert ("grpc.reflection.v1alpha.ServerReflection after a valid request", "service port") in {
        (what, where) for what, where, *_ in results}
    for what, where, code, details in results:
        service = what.split(" ")[0]
        if what.endswith(" listing"):
            assert code == (grpc.StatusCode.OK if (where, service) in served else grpc.StatusCode.UNIMPLEMENTED)
        elif service in REFLECTION_SERVICES and (where, service) not in served:
            assert code == grpc.StatusCode.UNIMPLEMENTED, (what, where, code, details)  # not served there
        else:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, where, code, details)
            assert "not a valid message" in details and len(details) < 200, details
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], caplog.text
    assert "Traceback" not in caplog.text


def test_reflection_behind_tokens_checks_the_token_then_the_body(caplog):
    token = "a-token-of-the-test-client"

    def garbage_answer(metadata) -> grpc.StatusCode:
        results, _ = _raw_calls_to_health_and_reflection(f"alice:{token}", metadata)
        (code,) = [code for what, where, code, _ in results
                   if what == "grpc.reflection.v1alpha.ServerReflection" and where == "service port"]
        return code

    assert garbage_answer((("authorization", f"Bearer {token}"),)) == grpc.StatusCode.INVALID_ARGUMENT
    assert garbage_answer(None) == grpc.StatusCode.UNAUTHENTICATED
    assert "Traceback" not in caplog.text
