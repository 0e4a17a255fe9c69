"""Replica pools: address specs, least-loaded picking, health from a real gRPC
health service on loopback and from reported failures, DNS re-resolution."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator.pools import DnsName, ReplicaPool, ReplicaStatus, parse_addresses, resolve
from coordinator.remote import ServiceClient
from specdec.serving import errors
from specdec.serving.server import TARGET_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FakeClient:
    def __init__(self, address: str):
        self.address, self.closed = address, False

    def close(self) -> None:
        self.closed = True


class FakeHealth:
    """A checker answering from a dict: address -> (serving, why not); SERVING by default."""

    def __init__(self):
        self.states: dict[str, tuple[bool, str]] = {}
        self.checks = 0

    def __call__(self, client):
        self.checks += 1
        return lambda: self.states.get(client.address, (True, ""))


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


def test_dns_pool_of_localhost():
    pool = ReplicaPool("draft", "dns:///localhost:5", FakeClient, health_interval_s=None, checker=FakeHealth())
    try:
        assert [s.address for s in pool.snapshot()] == resolve("localhost", 5)
        assert pool.pick().client.address in resolve("localhost", 5)
    finally:
        pool.close()


def test_bad_role():
    with pytest.raises(ValueError, match="role"):
        ReplicaPool("verifier", "a:1", FakeClient, health_interval_s=None)


# ------------------------------------------------------------------ choosing

def test_least_loaded_with_pins():
    pool = fake_pool()
    assert [pool.pick().address for _ in range(3)] == ["a:1", "b:2", "c:3"]
    pool.unpin("b:2")
    assert pool.pick().address == "b:2"  # the only one with one session fewer
    assert pool.pin("c:3").address == "c:3"
    assert pool.pin("z:9") is None
    assert [(s.address, s.load) for s in pool.snapshot()] == [("a:1", 1), ("b:2", 1), ("c:3", 2)]
    assert pool.pick().address in ("a:1", "b:2")
    pool.unpin("z:9")  # unknown: ignored
    for _ in range(5):
        pool.unpin("a:1")
    assert pool.get("a:1").load == 0


def test_equal_loads_take_turns():
    pool = fake_pool()
    assert [pool.pick(pin=False).address for _ in range(4)] == ["a:1", "b:2", "c:3", "a:1"]
    assert all(s.load == 0 for s in pool.snapshot())


def test_exclude():
    pool = fake_pool()
    assert {pool.pick(exclude={"a:1"}, pin=False).address for _ in range(4)} == {"b:2", "c:3"}
    with pytest.raises(errors.Unavailable, match=r"a:1 \(excluded\), b:2 \(excluded\), c:3 \(excluded\)"):
        pool.pick(exclude=["a:1", "b:2", "c:3"])


def test_all_unhealthy_names_role_and_reasons():
    checker = FakeHealth()
    checker.states = {"a:1": (False, "health NOT_SERVING"), "b:2": (False, "unreachable (connection refused)")}
    pool = fake_pool("a:1,b:2", checker=checker)
    assert pool.check_now() == [ReplicaStatus("a:1", False, 0, "health NOT_SERVING"),
                                ReplicaStatus("b:2", False, 0, "unreachable (connection refused)")]
    with pytest.raises(errors.Unavailable) as e:
        pool.pick()
    assert str(e.value) == ("no healthy target replica: a:1 (health NOT_SERVING), "
                            "b:2 (unreachable (connection refused))")


def test_concurrent_picks_spread_evenly():
    pool = fake_pool()
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda _: pool.pick(), range(30)))
    assert [s.load for s in pool.snapshot()] == [10, 10, 10]


def test_pick_waits_for_a_starting_replica():
    checker = FakeHealth()
    checker.states["a:1"] = (False, "health NOT_SERVING")
    pool = fake_pool("a:1", checker=checker)
    pool.check_now()
    threading.Timer(0.3, checker.states.clear).start()
    started = time.monotonic()
    assert pool.pick(wait_s=3).address == "a:1"
    assert time.monotonic() - started < 2
    checker.states["a:1"] = (False, "health NOT_SERVING")
    pool.check_now()
    with pytest.raises(errors.Unavailable, match="NOT_SERVING"):
        pool.pick(wait_s=0.3)


def test_failure_keeps_a_replica_out_until_a_check():
    pool = fake_pool("a:1,b:2")
    pool.report_success("a:1")
    pool.report_failure("a:1", "Verify: UNAVAILABLE")
    pool.report_success("a:1")  # a call in flight finishing proves less than a check
    pool.report_failure("z:9")  # unknown: ignored
    assert {pool.pick(pin=False).address for _ in range(3)} == {"b:2"}
    assert pool.get("a:1").reason == "Verify: UNAVAILABLE"
    pool.check_now()
    assert {pool.pick(pin=False).address for _ in range(3)} == {"a:1", "b:2"}


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


def test_real_health_checks(health_server):
    server, servicer, address = health_server
    pool = ReplicaPool("target", address, service_client, health_interval_s=None, health_timeout_s=0.5)
    try:
        assert pool.check_now() == [ReplicaStatus(address, True, 0, "")]
        pool.report_failure(address, "Propose: UNAVAILABLE")
        with pytest.raises(errors.Unavailable, match=f"no healthy target replica: {address} "
                                                     r"\(Propose: UNAVAILABLE\)"):
            pool.pick(suspects=False)
        # with none healthy, one out only for a failed call is still worth a try
        assert pool.pick(pin=False).address == address
        pool.check_now()
        assert pool.pick().address == address

        servicer.set(TARGET_SERVICE, NOT_SERVING)
        assert pool.check_now()[0][1:] == (False, 1, "health NOT_SERVING")
        servicer.set(TARGET_SERVICE, SERVING)
        assert pool.check_now()[0].healthy

        server.stop(0).wait()
        status = pool.check_now()[0]
        assert not status.healthy and status.reason.startswith("unreachable (UNAVAILABLE")
        with pytest.raises(errors.Unavailable, match="unreachable"):
            pool.pick()
    finally:
        pool.close()
    assert pool.get(address) is None


def test_real_health_of_another_service(health_server):
    _, _, address = health_server  # serves the target's name only: the draft's is not there
    pool = ReplicaPool("draft", address, service_client, health_interval_s=None)
    try:
        assert "serves no specdec.v1.DraftService" in pool.check_now()[0].reason
    finally:
        pool.close()


def test_background_thread_checks_and_close_stops_it(health_server):
    _, servicer, address = health_server
    servicer.set(TARGET_SERVICE, NOT_SERVING)
    clients = []

    def make(a):
        clients.append(service_client(a))
        return clients[-1]

    pool = ReplicaPool("target", address, make, health_interval_s=0.05)
    deadline = time.monotonic() + 3
    while pool.snapshot()[0].healthy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.snapshot()[0].reason == "health NOT_SERVING"
    pool.close()
    assert not pool._thread.is_alive()
    with pytest.raises(ValueError):  # its channel is closed
        clients[0].channel.unary_unary("/x")(b"")


# ------------------------------------------------------------------ DNS

def test_dns_re_resolution():
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
    assert [s.address for s in pool.snapshot()] == ["10.0.0.1:5", "10.0.0.2:5"]
    assert pool.pick().address == "10.0.0.1:5"

    lookup = ["10.0.0.2:5", "10.0.0.3:5"]
    pool.resolve_now()
    assert [s.address for s in pool.snapshot()] == ["10.0.0.1:5", "10.0.0.2:5", "10.0.0.3:5"]
    assert pool.get("10.0.0.1:5").client is made["10.0.0.1:5"]  # pinned: still usable
    assert pool.snapshot()[0].reason.startswith("no longer resolved")
    assert {pool.pick(pin=False).address for _ in range(4)} == {"10.0.0.2:5", "10.0.0.3:5"}
    assert not made["10.0.0.1:5"].closed

    pool.unpin("10.0.0.1:5")
    pool.resolve_now()
    assert pool.get("10.0.0.1:5") is None and made["10.0.0.1:5"].closed

    lookup = OSError("[Errno -2] Name or service not known")
    pool.resolve_now()  # a failed lookup keeps what is known
    assert [s.address for s in pool.snapshot()] == ["10.0.0.2:5", "10.0.0.3:5"]

    lookup = []
    pool.resolve_now()
    assert made["10.0.0.2:5"].closed and made["10.0.0.3:5"].closed
    with pytest.raises(errors.Unavailable, match=r"no target replica: dns:///svc:5 resolves to no address$"):
        pool.pick()
    pool.close()


def test_dns_failed_first_lookup_is_named():
    def resolver(name, port):
        raise OSError("[Errno -2] Name or service not known")

    pool = ReplicaPool("draft", "dns:///gone:5", FakeClient, health_interval_s=None, resolver=resolver)
    with pytest.raises(errors.Unavailable, match=r"no draft replica: dns:///gone:5 resolves to no address "
                                                 r"\(\[Errno -2\] Name or service not known\)"):
        pool.pick()
    pool.close()


def test_unhealthy_dns_pool_names_its_spec():
    checker = FakeHealth()
    checker.states["10.0.0.1:5"] = (False, "health NOT_SERVING")
    pool = ReplicaPool("target", "dns:///svc:5", FakeClient, health_interval_s=None, checker=checker,
                       resolver=lambda name, port: ["10.0.0.1:5"])
    pool.check_now()
    with pytest.raises(errors.Unavailable, match=r"no healthy target replica of dns:///svc:5: 10.0.0.1:5 "
                                                 r"\(health NOT_SERVING\)"):
        pool.pick()
    pool.close()


def test_closed_channel_and_broken_checker_are_reasons(health_server):
    _, _, address = health_server
    client = service_client(address)
    client.close()
    pool = ReplicaPool("target", address, lambda a: client, health_interval_s=None)
    assert pool.check_now()[0].reason.startswith("channel closed")

    def broken(client):
        raise RuntimeError("boom")

    other = fake_pool("a:1", checker=broken)
    assert other.check_now() == [ReplicaStatus("a:1", False, 0, "health check failed: RuntimeError: boom")]


def test_a_replica_that_hung_stays_out_while_its_health_still_says_serving():
    now = [0.0]
    pool = fake_pool("a:1,b:2", clock=lambda: now[0])
    pool.report_failure("a:1", "Verify failed (DEADLINE_EXCEEDED)", hold_out_s=30.0)
    pool.check_now()  # SERVING, yet every call to it hangs
    assert {pool.pick(pin=False).address for _ in range(3)} == {"b:2"}
    pool.report_failure("b:2", "Verify failed (UNAVAILABLE)")
    with pytest.raises(errors.Unavailable):  # a hung replica is no fallback
        pool.pick(exclude={"b:2"})
    now[0] = 31.0
    pool.check_now()
    assert {s.address for s in pool.snapshot() if s.healthy} == {"a:1", "b:2"}
