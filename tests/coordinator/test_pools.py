"""Replica pools: address specs, least-loaded picking, health from a real gRPC
health service on loopback and from reported failures, DNS re-resolution.

The pool runs on an event loop: each test that uses one is an ``async def``
run on a fresh loop by :func:`on_loop` (no pytest-asyncio here)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.coordinator.pools import DnsName, ReplicaPool, ReplicaStatus, parse_addresses, resolve
from specdec.coordinator.remote import ServiceClient
from specdec.serving import errors
from specdec.serving.server import TARGET_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def on_loop(test):
    """Run the async test on a fresh event loop (fixtures still reach it: pytest
    reads the signature through functools.wraps)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return run


class FakeClient:
    def __init__(self, address: str):
        self.address, self.closed = address, False

    async def close(self) -> None:
        self.closed = True


class FakeHealth:
    """A checker answering from a dict: address -> (serving, why not); SERVING by default."""

    def __init__(self):
        self.states: dict[str, tuple[bool, str]] = {}
        self.checks = 0

    async def __call__(self, client):
        self.checks += 1
        return self.states.get(client.address, (True, ""))


def fake_pool(spec="a:1,b:2,c:3", **kw) -> ReplicaPool:
    kw.setdefault("checker", FakeHealth())
    return ReplicaPool("target", spec, FakeClient, health_interval_s=None, **kw)


# ------------------------------------------------------------------ addresses

@pytest.mark.parametrize("spec, expected", [
    ("a:1", ["a:1"]),
    ("a:1,b:2", ["a:1", "b:2"]),
    (" a:1 , b:02 ", ["a:1", "b:2"]),
    ("10.0.0.1:50053", ["10.0.0.1:50053"]),
    ("[::1]:50053,localhost:1", ["[::1]:50053", "localhost:1"]),
    ("unix:/tmp/t.sock", ["unix:/tmp/t.sock"]),
    ("unix:///tmp/t.sock,a:1", ["unix:///tmp/t.sock", "a:1"]),
    ("dns:///target.default.svc.cluster.local:50053", DnsName("target.default.svc.cluster.local", 50053)),
    ("dns:///[::1]:7", DnsName("::1", 7)),
])
def test_parse_addresses(spec, expected):
    assert parse_addresses(spec) == expected


def test_dns_name_prints_as_written():
    assert str(parse_addresses("dns:///t:5")) == "dns:///t:5"
    assert str(parse_addresses("dns:///[::1]:5")) == "dns:///[::1]:5"


@pytest.mark.parametrize("spec, message", [
    ("", "no address given"),
    ("a", "needs HOST:PORT"),
    (":5", "needs HOST:PORT"),
    ("a:0", "from 1 to 65535"),
    ("a:70000", "from 1 to 65535"),
    ("a:x", "from 1 to 65535"),
    ("::1:5", "needs brackets"),
    ("[zz]:5", "not an IPv6 address"),
    ("bad host!:5", "not a host name"),
    ("a:1,,b:2", "empty entry"),
    ("a:1,", "empty entry"),
    ("a:1,a:01", "listed twice"),
    ("a:1,dns:///b:2", "stands alone"),
    ("dns:///b:2,c:3", "stands alone"),
    ("dns://8.8.8.8/b:2", "DNS server"),
    ("dns:b:2", "three slashes"),
    ("dns:///b", "needs HOST:PORT"),
    ("ipv4:1.2.3.4:5", "ipv4: scheme is not supported"),
    ("unix:", "needs a socket path"),
])
def test_parse_addresses_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_addresses(spec)


def test_resolve_localhost():
    found = resolve("localhost", 5)
    assert found and found == sorted(set(found))
    assert set(found) <= {"127.0.0.1:5", "[::1]:5"}


@on_loop
async def test_dns_pool_of_localhost():
    pool = ReplicaPool("draft", "dns:///localhost:5", FakeClient, health_interval_s=None, checker=FakeHealth())
    try:
        await pool.resolve_now()
        assert [s.address for s in pool.snapshot()] == resolve("localhost", 5)
        assert (await pool.pick()).client.address in resolve("localhost", 5)
    finally:
        await pool.close()


def test_bad_role():
    with pytest.raises(ValueError, match="role"):
        ReplicaPool("verifier", "a:1", FakeClient, health_interval_s=None)


# ------------------------------------------------------------------ choosing

@on_loop
async def test_least_loaded_with_pins():
    pool = fake_pool()
    assert [(await pool.pick()).address for _ in range(3)] == ["a:1", "b:2", "c:3"]
    pool.unpin("b:2")
    assert (await pool.pick()).address == "b:2"  # the only one with one session fewer
    assert pool.pin("c:3").address == "c:3"
    assert pool.pin("z:9") is None
    assert [(s.address, s.load) for s in pool.snapshot()] == [("a:1", 1), ("b:2", 1), ("c:3", 2)]
    assert (await pool.pick()).address in ("a:1", "b:2")
    pool.unpin("z:9")  # unknown: ignored
    for _ in range(5):
        pool.unpin("a:1")
    assert pool.get("a:1").load == 0


@on_loop
async def test_snapshot_from_another_thread():
    pool = fake_pool()
    await pool.pick()
    assert await asyncio.to_thread(pool.snapshot) == pool.snapshot()  # a metrics scrape's thread


@on_loop
async def test_equal_loads_take_turns():
    pool = fake_pool()
    assert [(await pool.pick(pin=False)).address for _ in range(4)] == ["a:1", "b:2", "c:3", "a:1"]
    assert all(s.load == 0 for s in pool.snapshot())


@on_loop
async def test_exclude():
    pool = fake_pool()
    assert {(await pool.pick(exclude={"a:1"}, pin=False)).address for _ in range(4)} == {"b:2", "c:3"}
    with pytest.raises(errors.Unavailable, match=r"a:1 \(excluded\), b:2 \(excluded\), c:3 \(excluded\)"):
        await pool.pick(exclude=["a:1", "b:2", "c:3"])


@on_loop
async def test_all_unhealthy_names_role_and_reasons():
    checker = FakeHealth()
    checker.states = {"a:1": (False, "health NOT_SERVING"), "b:2": (False, "unreachable (connection refused)")}
    pool = fake_pool("a:1,b:2", checker=checker)
    assert await pool.check_now() == [ReplicaStatus("a:1", False, 0, "health NOT_SERVING"),
                                      ReplicaStatus("b:2", False, 0, "unreachable (connection refused)")]
    with pytest.raises(errors.Unavailable) as e:
        await pool.pick()
    assert str(e.value) == ("no healthy target replica: a:1 (health NOT_SERVING), "
                            "b:2 (unreachable (connection refused))")


@on_loop
async def test_concurrent_picks_spread_evenly():
    pool = fake_pool()
    await asyncio.gather(*(pool.pick() for _ in range(30)))
    assert [s.load for s in pool.snapshot()] == [10, 10, 10]


@on_loop
async def test_pick_waits_for_a_starting_replica():
    checker = FakeHealth()
    checker.states["a:1"] = (False, "health NOT_SERVING")
    pool = fake_pool("a:1", checker=checker)
    await pool.check_now()
    asyncio.get_running_loop().call_later(0.3, checker.states.clear)
    started = time.monotonic()
    assert (await pool.pick(wait_s=3)).address == "a:1"
    assert time.monotonic() - started < 2
    checker.states["a:1"] = (False, "health NOT_SERVING")
    await pool.check_now()
    with pytest.raises(errors.Unavailable, match="NOT_SERVING"):
        await pool.pick(wait_s=0.3)


@on_loop
async def test_failure_keeps_a_replica_out_until_a_check():
    pool = fake_pool("a:1,b:2")
    pool.report_success("a:1")
    pool.report_failure("a:1", "Verify: UNAVAILABLE")
    pool.report_success("a:1")  # a call in flight finishing proves less than a check
    pool.report_failure("z:9")  # unknown: ignored
    assert {(await pool.pick(pin=False)).address for _ in range(3)} == {"b:2"}
    assert pool.get("a:1").reason == "Verify: UNAVAILABLE"
    await pool.check_now()
    assert {(await pool.pick(pin=False)).address for _ in range(3)} == {"a:1", "b:2"}


# ------------------------------------------------------------------ real health service

@pytest.fixture
def health_server():
    """A gRPC server on loopback with grpc's standard health servicer only."""
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set(TARGET_SERVICE, SERVING)
    yield server, servicer, f"127.0.0.1:{port}"
    server.stop(0)


def service_client(address: str) -> ServiceClient:
    return ServiceClient("target", address, call_timeout_s=1, info_timeout_s=1)


@on_loop
async def test_real_health_checks(health_server):
    server, servicer, address = health_server
    pool = ReplicaPool("target", address, service_client, health_interval_s=None, health_timeout_s=0.5)
    try:
        assert await pool.check_now() == [ReplicaStatus(address, True, 0, "")]
        pool.report_failure(address, "Propose: UNAVAILABLE")
        with pytest.raises(errors.Unavailable, match=f"no healthy target replica: {address} "
                                                     r"\(Propose: UNAVAILABLE\)"):
            await pool.pick(suspects=False)
        # with none healthy, one out only for a failed call is still worth a try
        assert (await pool.pick(pin=False)).address == address
        await pool.check_now()
        assert (await pool.pick()).address == address

        servicer.set(TARGET_SERVICE, NOT_SERVING)
        assert (await pool.check_now())[0][1:] == (False, 1, "health NOT_SERVING")
        servicer.set(TARGET_SERVICE, SERVING)
        assert (await pool.check_now())[0].healthy

        server.stop(0).wait()
        status = (await pool.check_now())[0]
        assert not status.healthy and status.reason.startswith("unreachable (UNAVAILABLE")
        with pytest.raises(errors.Unavailable, match="unreachable"):
            await pool.pick()
    finally:
        await pool.close()
    assert pool.get(address) is None


@on_loop
async def test_real_health_of_another_service(health_server):
    _, _, address = health_server  # serves the target's name only: the draft's is not there
    pool = ReplicaPool("draft", address, service_client, health_interval_s=None)
    try:
        assert "serves no specdec.v1.DraftService" in (await pool.check_now())[0].reason
    finally:
        await pool.close()


@on_loop
async def test_background_task_checks_and_close_stops_it(health_server):
    _, servicer, address = health_server
    servicer.set(TARGET_SERVICE, NOT_SERVING)
    clients = []

    def make(a):
        clients.append(service_client(a))
        return clients[-1]

    pool = ReplicaPool("target", address, make, health_interval_s=0.05)  # on the loop: starts its task
    deadline = time.monotonic() + 3
    while pool.snapshot()[0].healthy and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert pool.snapshot()[0].reason == "health NOT_SERVING"
    channel = clients[0].channel
    await pool.close()
    assert pool._task.done()
    with pytest.raises(grpc.aio.UsageError):  # its channel is closed
        await channel.unary_unary("/x")(b"")


def test_built_off_the_loop_a_pool_starts_its_task_only_when_told():
    checker = FakeHealth()
    pool = ReplicaPool("target", "a:1", FakeClient, health_interval_s=0.01, checker=checker)
    assert pool._task is None

    async def started():
        pool.start()
        pool.start()  # once is enough: the same task
        task = pool._task
        deadline = time.monotonic() + 3
        while checker.checks < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await pool.close()
        return task

    task = asyncio.run(started())
    assert checker.checks >= 2 and task.done() and pool.get("a:1") is None


# ------------------------------------------------------------------ DNS

@on_loop
async def test_dns_re_resolution():
    now = [0.0]
    lookup: list[str] | OSError = ["10.0.0.1:5", "10.0.0.2:5"]
    made: dict[str, FakeClient] = {}

    def resolver(name, port):
        assert (name, port) == ("svc", 5)
        if isinstance(lookup, OSError):
            raise lookup
        return list(lookup)

    def make(address):
        made[address] = FakeClient(address)
        return made[address]

    pool = ReplicaPool("target", "dns:///svc:5", make, health_interval_s=None, resolver=resolver,
                       checker=FakeHealth(), clock=lambda: now[0])
    await pool.resolve_now()
    assert [s.address for s in pool.snapshot()] == ["10.0.0.1:5", "10.0.0.2:5"]
    assert (await pool.pick()).address == "10.0.0.1:5"

    lookup = ["10.0.0.2:5", "10.0.0.3:5"]
    await pool.resolve_now()
    assert [s.address for s in pool.snapshot()] == ["10.0.0.1:5", "10.0.0.2:5", "10.0.0.3:5"]
    assert pool.get("10.0.0.1:5").client is made["10.0.0.1:5"]  # pinned: still usable
    assert pool.snapshot()[0].reason.startswith("no longer resolved")
    assert {(await pool.pick(pin=False)).address for _ in range(4)} == {"10.0.0.2:5", "10.0.0.3:5"}
    assert not made["10.0.0.1:5"].closed

    pool.unpin("10.0.0.1:5")
    await pool.resolve_now()
    assert pool.get("10.0.0.1:5") is None and made["10.0.0.1:5"].closed

    lookup = OSError("[Errno -2] Name or service not known")
    await pool.resolve_now()  # a failed lookup keeps what is known
    assert [s.address for s in pool.snapshot()] == ["10.0.0.2:5", "10.0.0.3:5"]

    lookup = []
    await pool.resolve_now()
    assert made["10.0.0.2:5"].closed and made["10.0.0.3:5"].closed
    with pytest.raises(errors.Unavailable, match=r"no target replica: dns:///svc:5 resolves to no address$"):
        await pool.pick()
    await pool.close()


@on_loop
async def test_dns_failed_first_lookup_is_named():
    def resolver(name, port):
        raise OSError("[Errno -2] Name or service not known")

    pool = ReplicaPool("draft", "dns:///gone:5", FakeClient, health_interval_s=None, resolver=resolver)
    with pytest.raises(errors.Unavailable, match=r"no draft replica: dns:///gone:5 resolves to no address "
                                                 r"\(\[Errno -2\] Name or service not known\)"):
        await pool.pick()  # the pool's first pick makes its first lookup
    await pool.close()


@on_loop
async def test_unhealthy_dns_pool_names_its_spec():
    checker = FakeHealth()
    checker.states["10.0.0.1:5"] = (False, "health NOT_SERVING")
    pool = ReplicaPool("target", "dns:///svc:5", FakeClient, health_interval_s=None, checker=checker,
                       resolver=lambda name, port: ["10.0.0.1:5"])
    await pool.resolve_now()
    await pool.check_now()
    with pytest.raises(errors.Unavailable, match=r"no healthy target replica of dns:///svc:5: 10.0.0.1:5 "
                                                 r"\(health NOT_SERVING\)"):
        await pool.pick()
    await pool.close()


@on_loop
async def test_closed_channel_and_broken_checker_are_reasons(health_server):
    _, _, address = health_server
    client = service_client(address)
    await client.close()
    pool = ReplicaPool("target", address, lambda a: client, health_interval_s=None)
    assert (await pool.check_now())[0].reason.startswith("channel closed")

    async def broken(client):
        raise RuntimeError("boom")

    other = fake_pool("a:1", checker=broken)
    assert await other.check_now() == [ReplicaStatus("a:1", False, 0, "health check failed: RuntimeError: boom")]


class ChannelOnly:
    """A client that is only a channel, closed or not by the test."""

    def __init__(self, address: str):
        self.address, self.channel = address, grpc.aio.insecure_channel(address)

    async def close(self) -> None:
        await self.channel.close()


def slow_check(request, context):
    time.sleep(2)
    return health_pb2.HealthCheckResponse(status=SERVING)


@on_loop
async def test_a_closed_channel_and_one_closed_during_the_check_are_reasons():
    # A health service that answers after 2 s: the check is still in flight when its channel closes.
    check = grpc.unary_unary_rpc_method_handler(
        slow_check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1),
                         handlers=[grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": check})])
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        pool = ReplicaPool("target", address, ChannelOnly, health_interval_s=None)
        client = pool.get(address).client
        sweep = asyncio.create_task(pool.check_now())
        await asyncio.sleep(0.3)
        await client.close()  # cancels the call in flight: a reason, not the sweep's end
        assert (await sweep)[0].reason == "channel closed (the check was cancelled)"
        assert (await pool.check_now())[0].reason.startswith("channel closed (")
        await pool.close()
    finally:
        server.stop(0)


@on_loop
async def test_a_replica_that_hung_stays_out_while_its_health_still_says_serving():
    now = [0.0]
    pool = fake_pool("a:1,b:2", clock=lambda: now[0])
    pool.report_failure("a:1", "Verify failed (DEADLINE_EXCEEDED)", hold_out_s=30.0)
    await pool.check_now()  # SERVING, yet every call to it hangs
    assert {(await pool.pick(pin=False)).address for _ in range(3)} == {"b:2"}
    pool.report_failure("b:2", "Verify failed (UNAVAILABLE)")
    with pytest.raises(errors.Unavailable):  # a hung replica is no fallback
        await pool.pick(exclude={"b:2"})
    now[0] = 31.0
    await pool.check_now()
    assert {s.address for s in pool.snapshot() if s.healthy} == {"a:1", "b:2"}
