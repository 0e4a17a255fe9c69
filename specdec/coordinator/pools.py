"""Pools of draft or target replicas: which replica a new session is pinned to,
and which replicas are fit to take one.

``--draft`` / ``--target`` name one replica (``HOST:PORT``, ``unix:PATH``),
several (``a:1,b:2``), or ``dns:///NAME:PORT``: every address NAME resolves to,
looked up again every few seconds. A Kubernetes headless Service resolves to
the IP of each ready pod, so scaling a Deployment adds and removes replicas.

A session's KV state lives in the replica that served it, so the
pool chooses only for a session that is not pinned yet: the healthy replica
with the fewest sessions pinned through this pool. A pinned session finds its
replica again by address (:meth:`ReplicaPool.get`, :meth:`ReplicaPool.pin`);
one whose address dropped out of DNS stays usable while sessions are pinned
to it (its pod may well be alive, draining), takes no new session, and is
closed at the first re-resolution after its last session left.

Health comes from the standard gRPC health service (every specdec service
registers its own name there) asked by a background task on the coordinator's
event loop, and from failed calls the coordinator reports: a replica that
failed a call stays out until a health check says SERVING again, because a
service that is shutting down still answers the calls in flight but no longer
wants new sessions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2

from specdec.serving import errors
from specdec.serving.server import DRAFT_SERVICE, TARGET_SERVICE

log = logging.getLogger("specdec.coordinator")

# The name each role's services answer health checks for.
HEALTH_SERVICES = {"draft": DRAFT_SERVICE, "target": TARGET_SERVICE}

FORMS = "HOST:PORT, a comma-separated list of them, unix:PATH or dns:///NAME:PORT"

# Schemes gRPC knows that a pool does not: an address list has to be a list of replicas.
_OTHER_SCHEMES = {"ipv4", "ipv6", "unix-abstract", "vsock", "xds", "google-c2p"}
_HOST = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")


# ------------------------------------------------------------------ addresses

@dataclasses.dataclass(frozen=True)
class DnsName:
    """``dns:///NAME:PORT``: every address NAME resolves to, on PORT."""

    name: str
    port: int

    def __str__(self) -> str:
        return f"dns:///{_host_port(self.name, self.port)}"


def parse_addresses(spec: str) -> list[str] | DnsName:
    """The replicas a ``--draft`` / ``--target`` value names: a list of gRPC
    targets (ports normalised, order kept) or a :class:`DnsName` to resolve.
    ValueError says what is wrong with it."""
    text = spec.strip()
    if not text:
        raise ValueError(f"no address given: expected {FORMS}")
    if text.startswith("dns:"):
        return _parse_dns(text)
    addresses: list[str] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            raise ValueError(f"{spec!r}: an empty entry in the address list (a stray comma?)")
        if entry.startswith("dns:"):
            raise ValueError(f"{spec!r}: {entry} cannot be listed with other addresses: a dns:/// name stands "
                             "alone (it already means every address the name resolves to)")
        address = _parse_one(entry)
        if address in addresses:
            raise ValueError(f"{spec!r}: {address} is listed twice")
        addresses.append(address)
    return addresses


def _parse_one(entry: str) -> str:
    if entry.startswith("unix:"):
        if not entry[len("unix:"):].strip("/"):
            raise ValueError(f"{entry!r}: unix: needs a socket path, e.g. unix:/run/specdec/target.sock")
        return entry
    scheme = entry.split(":", 1)[0]
    if scheme in _OTHER_SCHEMES:
        raise ValueError(f"{entry!r}: the {scheme}: scheme is not supported here: give {FORMS}")
    host, port = _split_host_port(entry)
    return _host_port(host, port)


def _parse_dns(text: str) -> DnsName:
    if not text.startswith("dns:///"):
        if text.startswith("dns://"):
            raise ValueError(f"{text!r}: a DNS server of its own (dns://SERVER/NAME) is not supported: write "
                             "dns:///NAME:PORT (the system's resolver)")
        raise ValueError(f"{text!r}: write dns:///NAME:PORT (three slashes)")
    rest = text[len("dns:///"):]
    if "," in rest:
        raise ValueError(f"{text!r}: a dns:/// name stands alone (it already means every address the name "
                         "resolves to)")
    host, port = _split_host_port(rest)
    return DnsName(host.strip("[]"), port)


def _split_host_port(entry: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` -> (host as written, port)."""
    host, colon, port = entry.rpartition(":")
    if not colon or not host:
        raise ValueError(f"{entry!r}: needs HOST:PORT (the port is not optional)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r}: the port must be a number from 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{entry!r}: {host} is not an IPv6 address") from None
    elif ":" in host:
        raise ValueError(f"{entry!r}: an IPv6 address needs brackets, e.g. [::1]:{port}")
    elif not _HOST.fullmatch(host):
        raise ValueError(f"{entry!r}: {host!r} is not a host name or IP address")
    return host, int(port)


def _host_port(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def resolve(name: str, port: int) -> list[str]:
    """Every address ``name`` resolves to (IPv4 and IPv6) as gRPC targets,
    sorted, each once; OSError (socket.gaierror) when the lookup fails.
    It blocks: the pool runs it in a worker thread, off the event loop."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({_host_port(info[4][0], port) for info in infos
                   if info[0] in (socket.AF_INET, socket.AF_INET6)})


# ------------------------------------------------------------------ health

Health = tuple[bool, str]  # (serving, why not)
# Asks one client: awaits its answer. A sweep awaits every replica's at once,
# so it takes one timeout, not one per replica.
Checker = Callable[[Any], Awaitable[Health]]


CHECK_METHOD = "/grpc.health.v1.Health/Check"
_serialize = health_pb2.HealthCheckRequest.SerializeToString
_deserialize = health_pb2.HealthCheckResponse.FromString


def grpc_health_checker(service: str, timeout_s: float) -> Checker:
    """Asks ``grpc.health.v1.Health/Check`` for ``service`` over the client's
    ``channel`` (a ``grpc.aio`` channel; None once the client is closed)."""
    request = health_pb2.HealthCheckRequest(service=service)

    async def check(client) -> Health:
        channel = client.channel
        if channel is None:  # ServiceClient.close() drops its channel
            return False, "channel closed (the client was closed)"
        # A plain method, not health_pb2_grpc.HealthStub: the stub's registered
        # method crashed the process (grpc 1.85, sync channels) when made on a
        # closed channel, and a sweep may meet a replica closed meanwhile; a
        # plain call on a closed aio channel only raises UsageError.
        try:
            call = channel.unary_unary(CHECK_METHOD, request_serializer=_serialize, response_deserializer=_deserialize)
            reply = await call(request, timeout=timeout_s)
        except grpc.RpcError as e:
            return _failed(e, service, timeout_s)
        except (ValueError, RuntimeError, grpc.aio.UsageError) as e:  # the channel is closed
            return False, f"channel closed ({e})"
        except asyncio.CancelledError:
            # Closing a channel cancels its calls: the replica left the pool
            # (or the pool closed) during the sweep. Only a cancelled sweep goes on up.
            if asyncio.current_task().cancelling():
                raise
            return False, "channel closed (the check was cancelled)"
        return _serving(reply.status)

    return check


def _failed(e: grpc.RpcError, service: str, timeout_s: float) -> Health:
    code, details = errors.rpc_status(e)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return True, "no health service"  # it answered; there is nothing more to ask it
    if code == grpc.StatusCode.NOT_FOUND:
        return False, f"serves no {service} (health NOT_FOUND: the address of another service?)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return False, f"health check timed out after {timeout_s:g} s"
    return False, f"unreachable ({code.name}: {details})"


def _serving(status: int) -> Health:
    if status == health_pb2.HealthCheckResponse.SERVING:
        return True, ""
    return False, f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"


# ------------------------------------------------------------------ the pool

NOT_CHECKED = "not checked yet"


@dataclasses.dataclass(eq=False)
class Replica:
    """One service replica: its address and client, and what the pool knows of
    it (changed by the pool on its event loop; from another thread, read it
    through :meth:`ReplicaPool.snapshot`)."""

    address: str
    client: Any
    # A replica nobody checked yet is given the benefit of the doubt: the
    # client's own calls wait for a service that is still starting.
    healthy: bool = True
    reason: str = NOT_CHECKED
    load: int = 0  # sessions pinned to it through the pool
    resolved: bool = True  # still among the addresses the spec names
    # Out only because a call failed, no health check since: with no healthy
    # replica left, it is still worth a try (a blip, or a restart).
    suspect: bool = False
    # A replica that ran a call out of its deadline (hung, yet perhaps still
    # answering health checks) stays out until then, whatever they say.
    out_until: float = float("-inf")


class ReplicaStatus(NamedTuple):
    address: str
    healthy: bool
    load: int
    reason: str  # why it takes no new session, or a note ("not checked yet"); "" when fine


class ReplicaPool:
    """The replicas of one role ("draft" or "target"), one client each
    (``make_client(address)``), health-checked every ``health_interval_s`` by a
    background task (None: only by :meth:`check_now`, as tests do) and, for a
    ``dns:///`` spec, re-resolved every ``resolve_interval_s``.

    The pool lives on one event loop, the one its clients use: build it there
    (``make_client`` is called at once for a list of addresses) and call its
    methods there. Only :meth:`snapshot` may be called from another thread
    (a metrics scrape). Built on a running loop, the pool starts its task
    itself; built off one, it starts nothing until :meth:`start` is called on
    the loop. A ``dns:///`` pool knows no replica until its first lookup: the
    task's first step, the first :meth:`pick`, or ``await resolve_now()``."""

    RETRY_S = 0.25  # how often a waiting pick looks again

    def __init__(self, role: str, spec: str, make_client: Callable[[str], Any], *,
                 health_service: str | None = None, health_interval_s: float | None = 2.0,
                 health_timeout_s: float = 1.0, resolve_interval_s: float = 10.0,
                 resolver: Callable[[str, int], list[str]] = resolve, checker: Checker | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if role not in HEALTH_SERVICES:
            raise ValueError(f"role must be one of {sorted(HEALTH_SERVICES)}, not {role!r}")
        self.role, self.spec = role, spec
        self.names = parse_addresses(spec)
        self.dns = self.names if isinstance(self.names, DnsName) else None
        self.health_interval_s, self.resolve_interval_s = health_interval_s, resolve_interval_s
        self._make_client, self._resolver, self._clock = make_client, resolver, clock
        self._checker = checker or grpc_health_checker(health_service or HEALTH_SERVICES[role], health_timeout_s)
        # Everything but snapshot() runs on the loop; the lock is for snapshot()
        # from a scrape thread, so it is only ever held for a few statements.
        self._lock = threading.Lock()
        self._resolving = asyncio.Lock()  # one re-resolution at a time: each adds what it found
        self._sweeping = asyncio.Lock()  # held by a waiting pick's health sweep
        self._stop = asyncio.Event()
        self._replicas: dict[str, Replica] = {}
        self._last_pick = ""
        self._resolved_at = float("-inf")
        self._lookup_error = ""
        self._task: asyncio.Task | None = None
        if self.dns is None:
            self._replicas = {address: Replica(address, make_client(address)) for address in self.names}
        if health_interval_s is not None and _loop_running():
            self.start()

    def start(self) -> None:
        """Start the background task: health sweeps every ``health_interval_s``
        and, for a ``dns:///`` pool, lookups every ``resolve_interval_s`` (the
        first at once). Call it on the running loop; it does nothing when the
        task runs already, the pool is closed or ``health_interval_s`` is None."""
        if self._task is not None or self._stop.is_set() or self.health_interval_s is None:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(self.health_interval_s),
                                                            name=f"{self.role}-replicas")

    # -------------------------------------------------------------- choosing

    async def pick(self, exclude: Iterable[str] = (), *, pin: bool = True, wait_s: float = 0.0,
                   suspects: bool = True) -> Replica:
        """The healthy replica with the fewest pinned sessions (round robin
        among equals), not one of ``exclude``; pinned to the caller when
        ``pin`` (in the same step, so concurrent picks spread out). With none
        healthy, and ``suspects``: one that is out only because a call failed
        (no health check has said otherwise since). With no such replica,
        checks again every RETRY_S for up to ``wait_s`` (services that are
        still starting), then raises Unavailable saying why each is out."""
        excluded = set(exclude)
        deadline = self._clock() + wait_s
        if self.dns is not None and self._resolved_at == float("-inf"):
            await self._first_lookup()
        while True:
            try:
                return self._pick(excluded, pin, suspects)
            except errors.Unavailable:
                if self._clock() >= deadline or self._stop.is_set():
                    raise
            await self._wait_stop(min(self.RETRY_S, max(0.0, deadline - self._clock())))
            if self.dns is not None and not self._replicas:
                await self.resolve_now()
            if not self._sweeping.locked():  # one sweep at a time, however many wait
                async with self._sweeping:
                    await self.check_now()

    def _pick(self, excluded: set[str], pin: bool, suspects: bool) -> Replica:
        with self._lock:
            fit = [r for r in self._replicas.values() if r.address not in excluded and r.healthy and r.resolved]
            if not fit and suspects:
                fit = [r for r in self._replicas.values() if r.address not in excluded and r.suspect and r.resolved]
            if not fit:
                raise errors.Unavailable(self._none_fit(excluded))
            least = min(r.load for r in fit)
            ties = sorted((r for r in fit if r.load == least), key=lambda r: r.address)
            chosen = next((r for r in ties if r.address > self._last_pick), ties[0])
            self._last_pick = chosen.address
            if pin:
                chosen.load += 1
            return chosen

    def _none_fit(self, excluded: set[str]) -> str:
        if not self._replicas:
            why = f" ({self._lookup_error})" if self._lookup_error else ""
            return f"no {self.role} replica: {self.spec} resolves to no address{why}"
        outs = ", ".join(f"{r.address} ({self._why_out(r, excluded)})" for r in self._sorted())
        source = f" of {self.spec}" if self.dns is not None else ""
        return f"no healthy {self.role} replica{source}: {outs}"

    @staticmethod
    def _why_out(r: Replica, excluded: set[str]) -> str:
        if r.address in excluded:
            return "excluded"
        return r.reason if not r.healthy else "no longer resolved"

    def get(self, address: str) -> Replica | None:
        """The replica at ``address`` (a pinned session's), healthy or not;
        None if the pool has none there (any more)."""
        with self._lock:
            return self._replicas.get(address)

    def pin(self, address: str) -> Replica | None:
        """Count one more session on the replica at ``address`` (a session this
        coordinator takes over, pinned elsewhere before); None if there is none."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is not None:
                replica.load += 1
            return replica

    def pin_if_fit(self, address: str) -> Replica | None:
        """Count one more session on the replica at ``address`` if it is fit for
        one (healthy, still resolved), in one step; None if it is not."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is None or not (replica.healthy and replica.resolved):
                return None
            replica.load += 1
            return replica

    def unpin(self, address: str) -> None:
        """A session left the replica at ``address`` (ended, forgotten, re-pinned)."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is not None and replica.load > 0:
                replica.load -= 1

    # -------------------------------------------------------------- health

    def report_failure(self, address: str, reason: str = "a call failed", hold_out_s: float = 0.0) -> None:
        """A call could not reach the replica or it refused work (UNAVAILABLE, a
        deadline): it takes no new session until a health check says SERVING,
        and not before ``hold_out_s`` from now (a replica that hung).
        Errors of the request itself (NOT_FOUND, INVALID_ARGUMENT) are no reason."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is not None:
                replica.suspect = (replica.healthy or replica.suspect) and not hold_out_s
                replica.out_until = max(replica.out_until, self._clock() + hold_out_s)
                self._set_health(replica, False, reason)

    def report_success(self, address: str) -> None:
        """A call succeeded. That proves less than a health check (a draining
        replica still finishes its calls), so it only settles a replica nobody
        checked yet; one that is out stays out until a check."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is not None and replica.healthy and replica.reason == NOT_CHECKED:
                replica.reason = ""

    async def check_now(self) -> list[ReplicaStatus]:
        """One health sweep over every replica, all asked at once; the pool after it."""
        with self._lock:
            replicas = list(self._replicas.values())
        answers = await asyncio.gather(*(self._check(r) for r in replicas))
        with self._lock:
            for replica, (healthy, reason) in zip(replicas, answers, strict=True):
                if healthy and self._clock() < replica.out_until:
                    continue  # it hung on a call: out for a while, whatever its health says
                self._set_health(replica, healthy, reason)
                replica.suspect = False
        return self.snapshot()

    async def _check(self, replica: Replica) -> Health:
        try:
            return await self._checker(replica.client)
        except Exception as e:  # a checker's bug must not stop the sweep of the others
            return False, f"health check failed: {type(e).__name__}: {e}"

    def _set_health(self, replica: Replica, healthy: bool, reason: str) -> None:
        if replica.healthy and not healthy:
            log.warning("%s replica %s is out: %s", self.role, replica.address, reason)
        elif healthy and not replica.healthy:
            log.info("%s replica %s is back (was: %s)", self.role, replica.address, replica.reason)
        replica.healthy, replica.reason = healthy, reason

    # -------------------------------------------------------------- DNS

    async def resolve_now(self) -> None:
        """Look the dns:/// name up again: new addresses join (unchecked), those
        gone leave once no session is pinned to them. A failed lookup changes
        nothing: a DNS hiccup must not empty the pool."""
        if self.dns is None:
            return
        async with self._resolving:
            await self._lookup(self.dns)

    async def _first_lookup(self) -> None:
        """The first lookup, once, however many picks arrive before it ends."""
        async with self._resolving:
            if self._resolved_at == float("-inf") and self.dns is not None:
                await self._lookup(self.dns)

    async def _lookup(self, dns: DnsName) -> None:
        try:
            # The resolver blocks (getaddrinfo): a worker thread waits for it, not the loop.
            found = set(await asyncio.to_thread(self._resolver, dns.name, dns.port))
        except OSError as e:
            with self._lock:
                self._resolved_at, self._lookup_error = self._clock(), str(e)
            log.warning("%s replicas: looking up %s failed (%s); keeping the %d known", self.role, self.spec,
                        e, len(self._replicas))
            return
        if self._stop.is_set():
            return  # the pool closed during the lookup: no client to make now
        gone, new = self._apply_lookup(found)
        added = [r for r in (self._new_replica(address) for address in new) if r is not None]
        with self._lock:
            self._replicas.update((r.address, r) for r in added)
        await asyncio.gather(*(_close(replica.client) for replica in gone))
        if gone or new:
            log.info("%s replicas of %s: %s joined, %s left", self.role, self.spec, new or "none",
                     [r.address for r in gone] or "none")

    def _apply_lookup(self, found: set[str]) -> tuple[list[Replica], list[str]]:
        with self._lock:
            self._resolved_at, self._lookup_error = self._clock(), ""
            for replica in self._replicas.values():
                replica.resolved = replica.address in found
            gone = [r for r in self._replicas.values() if not r.resolved and r.load == 0]
            for replica in gone:
                del self._replicas[replica.address]
            return gone, sorted(found - self._replicas.keys())

    def _new_replica(self, address: str) -> Replica | None:
        try:
            return Replica(address, self._make_client(address))
        except Exception as e:
            log.warning("%s replica %s left out: its client could not be made: %s", self.role, address, e)
            return None

    # -------------------------------------------------------------- the rest

    def snapshot(self) -> list[ReplicaStatus]:
        """Every replica, by address, for metrics and logs (from any thread)."""
        with self._lock:
            return [ReplicaStatus(r.address, r.healthy, r.load, self._note(r)) for r in self._sorted()]

    @staticmethod
    def _note(r: Replica) -> str:
        if r.resolved:
            return r.reason
        return "no longer resolved" + (f"; {r.reason}" if r.reason else "")

    def _sorted(self) -> list[Replica]:
        return sorted(self._replicas.values(), key=lambda r: r.address)

    async def _run(self, interval_s: float) -> None:
        while True:
            try:
                # An empty pool looks again at every sweep: its first pods may just have come up.
                due = self._clock() - self._resolved_at >= self.resolve_interval_s or not self._replicas
                if self.dns is not None and due:
                    await self.resolve_now()
                await self.check_now()
            except Exception:  # the task outlives any one bad sweep
                log.exception("%s replicas: health sweep failed", self.role)
            if await self._wait_stop(interval_s):
                return

    async def _wait_stop(self, seconds: float) -> bool:
        """Wait ``seconds``, or less if the pool closes meanwhile; True if it did."""
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop checking and close every replica's client."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # (not `await task`: that would raise its CancelledError here)
        with self._lock:
            replicas, self._replicas = list(self._replicas.values()), {}
        await asyncio.gather(*(_close(replica.client) for replica in replicas))


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _close(client) -> None:
    try:
        await client.close()
    except Exception as e:  # closing is best effort; the next one must still be closed
        log.warning("closing the client of %s failed: %s", getattr(client, "address", client), e)
