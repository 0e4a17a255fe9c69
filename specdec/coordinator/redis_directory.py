"""The session directory in Redis, shared by coordinator replicas (``--redis URL``).

Keys, per session, all with the SHA-256 of the session id (never the id the
client gave) inside one hash tag, so that a Redis Cluster keeps them in one slot
and a script may touch them together::

    specdec:{<sha256>}:session   the record's session part (JSON)
    specdec:{<sha256>}:turn      its last turn (JSON), without its deltas
    specdec:{<sha256>}:deltas    the turn's deltas (a list: one JSON item appended per round)
    specdec:{<sha256>}:lease     the fencing token of the request driving it
    specdec:{<sha256>}:fence     the last token handed out (INCR)

Every key has a sliding idle TTL (``--redis-ttl``), refreshed by each write.

**The lease.** A request takes the session's lease with one script — the lease
key set only if absent (SET NX PX) to a token one higher than any before
(INCR) — renews it every third of the lease time while it runs, and deletes it
at the end. Every write is a script that first checks the lease key still holds
the writer's token: a coordinator that stalled past its lease while another took
over finds another token there and writes nothing (a fencing token). A
coordinator that dies holds its sessions for at most the lease time.

Everything runs on the caller's event loop (the coordinator's one loop), with
redis-py's asyncio client: each command is awaited with a short deadline
(``timeout_s``), so an unreachable Redis fails a request within about a second
with UNAVAILABLE; the leases a request holds are renewed by one task on that
loop, started by the first lease taken and cancelled by :meth:`RedisDirectory.close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from specdec.coordinator.directory import Lease, SessionRecord
from specdec.coordinator.leases import SessionLeases
from specdec.serving import errors
from specdec.serving.config import redacted_url

log = logging.getLogger("specdec.coordinator")

KEY_PREFIX = "specdec:"

# KEYS: lease, fence. ARGV: lease ms, idle TTL ms, the holder's nonce. -> the
# new token, or 0 if leased. The lease holds "token:nonce": a Redis restarted
# empty counts tokens from 1 again, and the nonce keeps a lease taken then from
# matching one a stalled coordinator still holds from before.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local token = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('SET', KEYS[1], token .. ':' .. ARGV[3], 'PX', ARGV[1])
return token
"""
# KEYS: lease. ARGV: token, lease ms. -> 1 if still ours.
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
# KEYS: lease. ARGV: token.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: lease, session, turn, deltas. ARGV: token, idle TTL ms, session JSON,
# turn JSON ('-': no turn), 'keep' (the stored deltas stay) or 'replace', then
# each delta's JSON. -> 1, or 0 if the lease is not the writer's.
_WRITE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
if ARGV[4] == '-' then redis.call('DEL', KEYS[3]) else redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[2]) end
if ARGV[4] == '-' or ARGV[5] == 'replace' then redis.call('DEL', KEYS[4]) end
for i = 6, #ARGV do redis.call('RPUSH', KEYS[4], ARGV[i]) end
redis.call('PEXPIRE', KEYS[4], ARGV[2])
return 1
"""
# KEYS: lease, session, turn, deltas. ARGV: token, idle TTL ms, the delta's
# index, its JSON. -> 1; 0 if the lease is not the writer's; -1 if the stored
# turn does not have exactly ``index`` deltas (it was rewritten meanwhile).
_ADD_DELTA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('EXISTS', KEYS[3]) == 0 or redis.call('LLEN', KEYS[4]) ~= tonumber(ARGV[3]) then return -1 end
redis.call('RPUSH', KEYS[4], ARGV[4])
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
return 1
"""
# KEYS: lease, session, turn, deltas. ARGV: token. -> keys deleted, or -1 if the lease is not ours.
_DELETE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
return redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
"""


def session_keys(session_id: str) -> dict[str, str]:
    digest = hashlib.sha256(session_id.encode()).hexdigest()
    return {part: f"{KEY_PREFIX}{{{digest}}}:{part}" for part in ("session", "turn", "deltas", "lease", "fence")}


class RedisDirectory:
    """The session directory in Redis, on the caller's event loop (see the module docstring).

    It may be made with or without a running loop: redis-py opens its
    connections on first use, and they belong to the loop that used them first,
    so one directory serves one event loop."""

    def __init__(self, url: str, *, ttl_s: float, lease_s: float = 5.0, lease_wait_s: float = 2.0,
                 timeout_s: float = 1.0, metrics=None):
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis {redacted_url(url)}: give a redis://, rediss:// or unix:// URL")
        self.where = redacted_url(url)
        self.metrics = metrics  # a specdec.telemetry.metrics.CoordinatorMetrics, or None
        self.ttl_ms = int(ttl_s * 1000)
        self.lease_ms = int(lease_s * 1000)
        self.lease_wait_s, self.timeout_s = lease_wait_s, timeout_s
        self._local = SessionLeases()  # one request per session in this process, as in memory
        self._held: dict[int, tuple[str, Lease]] = {}  # id(lease) -> (lease key, lease), renewed by the keeper
        self._keeper: asyncio.Task | None = None  # renews self._held; started by the first lease taken
        self._closed = False
        # One quick retry: the first command after Redis restarted finds the
        # pooled connection dead and reconnects; a Redis that stays down fails fast.
        self._redis = redis.asyncio.from_url(url, socket_timeout=timeout_s / 2, socket_connect_timeout=timeout_s / 2,
                                             retry=Retry(NoBackoff(), 1), decode_responses=True)
        self._scripts = {name: self._redis.register_script(lua) for name, lua in
                         (("acquire", _ACQUIRE), ("renew", _RENEW), ("release", _RELEASE), ("write", _WRITE),
                          ("add_delta", _ADD_DELTA), ("delete", _DELETE))}

    # ------------------------------------------------------------------ records

    async def get(self, session_id: str) -> SessionRecord | None:
        session, turn, deltas = await self._call("read", self._read(session_keys(session_id)))
        if session is None:
            return None
        turn = json.loads(turn) if turn else None
        if turn is not None:
            turn["deltas"] = [json.loads(d) for d in deltas]
        return SessionRecord.from_dicts(json.loads(session), turn)

    async def owner(self, session_id: str) -> str | None:
        session = await self._call("read", self._redis.get(session_keys(session_id)["session"]))
        return None if session is None else json.loads(session).get("owner", "")

    async def _read(self, keys: dict[str, str]) -> tuple:
        async with self._redis.pipeline(transaction=True) as pipe:  # one consistent view
            pipe.mget(keys["session"], keys["turn"])
            pipe.lrange(keys["deltas"], 0, -1)
            (session, turn), deltas = await pipe.execute()
        return session, turn, deltas

    async def put(self, record: SessionRecord, lease: Lease | None, keep_deltas: bool = False) -> None:
        record.updated_at = time.time()
        turn = record.turn_dict()
        deltas = turn.pop("deltas") if turn is not None else []
        deltas = ["keep"] if keep_deltas else ["replace", *map(_json, deltas)]
        written = await self._script("write", record.session_id, lease, self.ttl_ms, _json(record.session_dict()),
                                     "-" if turn is None else _json(turn), *deltas)
        if not written:
            raise _lost(record.session_id)

    async def add_delta(self, record: SessionRecord, lease: Lease | None) -> None:
        index = len(record.turn.deltas) - 1
        added = await self._script("add_delta", record.session_id, lease, self.ttl_ms, index,
                                   _json(record.turn.deltas[-1]))
        if added == 0:
            raise _lost(record.session_id)
        if added < 0:  # out of step with what is stored: write the whole record
            await self.put(record, lease)

    async def delete(self, session_id: str, lease: Lease | None) -> bool:
        deleted = await self._script("delete", session_id, lease)
        if deleted < 0:
            raise _lost(session_id)
        return deleted > 0

    async def _script(self, name: str, session_id: str, lease: Lease | None, *args) -> int:
        """One of the scripts that write, on the session's keys, with the writer's token."""
        keys = session_keys(session_id)
        return await self._call(name, self._scripts[name](
            keys=[keys["lease"], keys["session"], keys["turn"], keys["deltas"]], args=[_token(lease), *args]))

    # ------------------------------------------------------------------ leases

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str, cancelled: asyncio.Event | None = None,
                   wait_s: float | None = None) -> AsyncIterator[Lease | None]:
        async with self._local.hold(session_id, cancelled) as held:
            if not held or not session_id:  # cancelled first; or one-shot: nothing stored
                yield Lease(session_id) if held else None
                return
            lease = await self._acquire(session_id, self.lease_wait_s if wait_s is None else wait_s, cancelled)
            self._start_keeper()
            self._held[id(lease)] = (session_keys(session_id)["lease"], lease)
            try:
                yield lease
            finally:
                del self._held[id(lease)]
                await self._release(lease)

    async def _acquire(self, session_id: str, wait_s: float, cancelled: asyncio.Event | None) -> Lease:
        keys = session_keys(session_id)
        deadline = time.monotonic() + wait_s
        while True:
            nonce = uuid.uuid4().hex[:16]
            token = await self._call("lease", self._scripts["acquire"](
                keys=[keys["lease"], keys["fence"]], args=[self.lease_ms, self.ttl_ms, nonce]))
            if token:
                return Lease(session_id, int(token), nonce)
            if time.monotonic() >= deadline or (cancelled is not None and cancelled.is_set()):
                if self.metrics is not None:
                    self.metrics.lease_conflicts.inc()
                raise errors.FailedPrecondition(
                    f"session {session_id!r} is busy on another coordinator (a request there holds it); "
                    f"send this one when that request has ended")
            await asyncio.sleep(0.05)  # the holder ends, or its lease expires: try again

    async def _release(self, lease: Lease) -> None:
        try:
            await self._call("release", self._scripts["release"](
                keys=[session_keys(lease.session_id)["lease"]], args=[_token(lease)]))
        except errors.Unavailable as e:  # it expires by itself
            log.warning("could not release the lease of a session: %s", e)

    def _start_keeper(self) -> None:
        """Start renewing leases, on the loop taking them (the one this directory serves)."""
        if self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep_leases(), name="redis-directory-leases")

    async def _keep_leases(self) -> None:
        """Renew every held lease each third of the lease time, all at once
        (thousands of streams: one after another they would outlast the lease)."""
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            await asyncio.gather(*(self._renew(key, lease) for key, lease in list(self._held.values())))

    async def _renew(self, key: str, lease: Lease) -> None:
        try:
            if not await self._scripts["renew"](keys=[key], args=[_token(lease), self.lease_ms]):
                log.warning("a session's lease was lost (this coordinator stalled past %.1f s?): "
                            "its writes will be refused", self.lease_ms / 1000)
        except Exception as e:  # any failure: the next renewal tries again, the keeper goes on
            log.warning("renewing a session's lease failed: %s", e)

    # ------------------------------------------------------------------ plumbing

    async def check(self) -> None:
        await self._call("ping", self._redis.ping())

    async def _call(self, op: str, coroutine):
        """Await one operation (``op``: a key of _WHAT) within the timeout, its
        failures translated to Unavailable."""
        what = _WHAT[op]
        if self._closed:
            coroutine.close()
            raise errors.Unavailable(f"the session directory (Redis at {self.where}) is closed: the coordinator "
                                     "is shutting down")
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await coroutine
        except TimeoutError:
            self._count_error(op)
            raise errors.Unavailable(f"the session directory (Redis at {self.where}) did not answer within "
                                     f"{self.timeout_s:g} s when asked to {what}") from None
        except (redis.exceptions.RedisError, OSError) as e:
            self._count_error(op)
            raise errors.Unavailable(f"the session directory (Redis at {self.where}) could not {what}: "
                                     f"{e}") from None
        if self.metrics is not None:
            self.metrics.directory.labels(op).observe(time.perf_counter() - started)
        return result

    def _count_error(self, op: str) -> None:
        if self.metrics is not None:
            self.metrics.directory_errors.labels(op).inc()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.wait([self._keeper], timeout=self.timeout_s)  # off its connection before they close
        with contextlib.suppress(Exception):  # shutting down: Redis may be gone already
            async with asyncio.timeout(self.timeout_s):
                await self._redis.aclose()


# Each operation, as the error messages name it.
_WHAT = {"read": "read the session", "lease": "lease the session", "release": "release the session",
         "ping": "reach it", "write": "write the session", "add_delta": "record the session's delta",
         "delete": "delete the session"}


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _token(lease: Lease | None) -> str:
    if lease is None or not lease.token:
        raise errors.FailedPrecondition("a write to the shared session directory without the session's lease")
    return f"{lease.token}:{lease.nonce}"


def _lost(session_id: str) -> errors.FailedPrecondition:
    return errors.FailedPrecondition(
        f"session {session_id!r}: this coordinator lost the session's lease (it stalled past the lease time) "
        "and another coordinator drives it now; nothing was written")
