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

**Sessions per client** (``--client-max-sessions``). A session that counts
against a client (:attr:`SessionRecord.client`: its token's name, or its
address) is a member of that client's sorted set, under the SHA-256 of the
client's name::

    specdec:client:{<sha256>}:sessions   the session digests, each scored by its expiry (ms, Redis's clock)

The scripts that write a session add it there or refresh its score, as they
refresh its keys' TTL, having first dropped the members past their expiry; the
one that deletes a session removes it. So the count follows closing and expiry,
and a new session is refused, nothing written, by the same script that would
create it: coordinators sharing Redis count together, and two creations at the
cap cannot both pass. A session Redis evicted for memory (``volatile-lru``)
stays a member until a refusal looks: a client at its cap has its least
recently written members checked, those whose session is gone dropped. These
scripts touch the session's slot and the client's (and that look, sessions'
keys they were not given): one Redis (what ``--redis`` connects to) runs them
whole; a Redis Cluster would refuse them (CROSSSLOT).

**The lease.** A request takes the session's lease with one script — the lease
key set only if absent (SET NX PX) to a token one higher than any before
(INCR) — renews it every third of the lease time while it runs, and deletes it
at the end. Every write is a script that first checks the lease key still holds
the writer's token: a coordinator that stalled past its lease while another took
over finds another token there and writes nothing (a fencing token). A
coordinator that dies holds its sessions for at most the lease time.

Everything runs on the caller's event loop (the coordinator's one loop), with
redis-py's asyncio client: each command is awaited with a short deadline
(``timeout_s``), so an unreachable Redis fails a new request within about a
second with UNAVAILABLE; the leases a request holds are renewed by one task on
that loop, started by the first lease taken and cancelled by :meth:`RedisDirectory.close`.

**Outages.** A turn in flight rides out a Redis that cannot be written for up
to the lease time plus ``outage_s`` (``--directory-outage``): each write under
a held lease (the turn's record and deltas) is retried with back-off while its
stream waits, and a lease that vanished meanwhile (expired during a stall, or
Redis restarted empty) is taken again under a new token, the record re-seeded
from the turn's own, when that overwrites nothing another coordinator wrote
(:mod:`specdec.coordinator.outage`). The renewals ride the same way. Past the
bound the write fails with UNAVAILABLE and a retry-after hint.
:attr:`RedisDirectory.writes_failing_since` says when writes began to fail, and
:meth:`RedisDirectory.check` writes a short-lived key: health is NOT_SERVING
while Redis refuses writes, even one that answers PING (out of memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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

from specdec.coordinator.directory import Lease, SessionRecord, over_cap
from specdec.coordinator.leases import SessionLeases
from specdec.coordinator.outage import Backoff, HeldLease, may_reseed
from specdec.serving import errors
from specdec.serving.config import redacted_url
from specdec.serving.names import hidden_in

log = logging.getLogger("specdec.coordinator")

KEY_PREFIX = "specdec:"
MAX_RETAKES = 3  # a write that finds its lease gone this often after taking it again gives up
PROBE_TTL_MS = 10_000  # check()'s key, one per coordinator: gone soon after the coordinator is

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
# With KEYS[5], the client's sessions (see the module docstring). refused(now,
# cap): whether this session (KEYS[2]) would be refused: new (no KEYS[2], not a
# member) while the client holds ``cap`` (> 0), once the members past their
# expiry are dropped, and (full) of the 16 least recently written those whose
# session is gone before its expiry (Redis evicted it for memory: a bounded
# look, at keys not declared, see the module docstring). count(ttl, cap): false
# if refused, nothing changed; else this session added, or its expiry refreshed.
_COUNT = """
local function member() return string.match(KEYS[2], '{(%x+)}') end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function full(cap)
  if redis.call('ZCARD', KEYS[5]) < cap then return false end
  for _, m in ipairs(redis.call('ZRANGE', KEYS[5], 0, 15)) do
    local key = string.gsub(KEYS[2], '{%x+}', '{' .. m .. '}')
    if redis.call('EXISTS', key) == 0 then redis.call('ZREM', KEYS[5], m) end
  end
  return redis.call('ZCARD', KEYS[5]) >= cap
end
local function refused(now, cap)
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
  return cap > 0 and redis.call('EXISTS', KEYS[2]) == 0 and not redis.call('ZSCORE', KEYS[5], member())
    and full(cap)
end
local function count(ttl, cap)
  if #KEYS < 5 then return true end
  local now = now_ms()
  if refused(now, cap) then return false end
  redis.call('ZADD', KEYS[5], now + tonumber(ttl), member())
  if redis.call('PTTL', KEYS[5]) < tonumber(ttl) then redis.call('PEXPIRE', KEYS[5], ttl) end
  return true
end
"""
# KEYS: lease, session, turn, deltas, the client's sessions. ARGV: the cap. -> 1
# if the session would be refused (asked before its lease is taken).
_CHECK_CAP = _COUNT + """
return refused(now_ms(), tonumber(ARGV[1])) and 1 or 0
"""
# KEYS: lease, session, turn, deltas[, the client's sessions]. ARGV: token, idle
# TTL ms, session JSON, turn JSON ('-': no turn), 'keep' (the stored deltas stay)
# or 'replace', the client's cap (0: none), then each delta's JSON. -> 1; 0 if
# the lease is not the writer's; -1 if it would create a session past the cap.
_WRITE = _COUNT + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if not count(ARGV[2], tonumber(ARGV[6])) then return -1 end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
if ARGV[4] == '-' then redis.call('DEL', KEYS[3]) else redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[2]) end
if ARGV[4] == '-' or ARGV[5] == 'replace' then redis.call('DEL', KEYS[4]) end
for i = 7, #ARGV do redis.call('RPUSH', KEYS[4], ARGV[i]) end
redis.call('PEXPIRE', KEYS[4], ARGV[2])
return 1
"""
# KEYS: lease, session, turn, deltas[, the client's sessions]. ARGV: token, idle
# TTL ms, the delta's index, its JSON. -> 1; 0 if the lease is not the writer's;
# -1 if the stored turn does not have exactly ``index`` deltas (it was
# rewritten meanwhile).
_ADD_DELTA = _COUNT + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('EXISTS', KEYS[3]) == 0 or redis.call('LLEN', KEYS[4]) ~= tonumber(ARGV[3]) then return -1 end
redis.call('RPUSH', KEYS[4], ARGV[4])
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
count(ARGV[2], 0)
return 1
"""
# KEYS: lease, session, turn, deltas[, the client's sessions]. ARGV: token. ->
# keys deleted, or -1 if the lease is not ours.
_DELETE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if #KEYS == 5 then redis.call('ZREM', KEYS[5], string.match(KEYS[2], '{(%x+)}')) end
return redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
"""


def session_keys(session_id: str) -> dict[str, str]:
    digest = hashlib.sha256(session_id.encode()).hexdigest()
    return {part: f"{KEY_PREFIX}{{{digest}}}:{part}" for part in ("session", "turn", "deltas", "lease", "fence")}


def client_key(client: str) -> str:
    """The sorted set of the sessions that count against ``client``."""
    return f"{KEY_PREFIX}client:{{{hashlib.sha256(client.encode()).hexdigest()}}}:sessions"


def _riding(write):
    """A write of a session's record that rides out an outage of the directory
    (see :meth:`RedisDirectory._ride_out`) when its lease is held here."""
    @functools.wraps(write)
    async def ridden(self, record: SessionRecord, lease: Lease | None, *args, **kwargs):
        return await self._ride_out(record, lease, lambda: write(self, record, lease, *args, **kwargs))
    return ridden


class RedisDirectory:
    """The session directory in Redis, on the caller's event loop (see the module docstring).

    It may be made with or without a running loop: redis-py opens its
    connections on first use, and they belong to the loop that used them first,
    so one directory serves one event loop."""

    def __init__(self, url: str, *, ttl_s: float, lease_s: float = 5.0, lease_wait_s: float = 2.0,
                 timeout_s: float = 1.0, metrics=None, max_per_client: int = 0, outage_s: float = 30.0):
        """``max_per_client``: the sessions one client may hold (0: any number).
        ``outage_s``: how long beyond the lease time a turn's writes are retried."""
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis {redacted_url(url)}: give a redis://, rediss:// or unix:// URL")
        self.where = redacted_url(url)
        self.metrics = metrics  # a specdec.telemetry.metrics.CoordinatorMetrics, or None
        self.ttl_ms = int(ttl_s * 1000)
        self.max_per_client = max_per_client
        self.lease_ms = int(lease_s * 1000)
        self.lease_wait_s, self.timeout_s = lease_wait_s, timeout_s
        # Beyond the lease time: a stall that long lets the lease expire, and the turn takes it again.
        self.ride_s = lease_s + outage_s
        self.writes_failing_since: float | None = None  # monotonic time of the first failed write of an outage
        self._probe_key = f"{KEY_PREFIX}health:{uuid.uuid4().hex}"  # written by check(), expiring by itself
        self._local = SessionLeases()  # one request per session in this process, as in memory
        self._held: dict[int, HeldLease] = {}  # id(lease) -> the lease, renewed by the keeper
        self._keeper: asyncio.Task | None = None  # renews self._held; started by the first lease taken
        self._closed = False
        # One quick retry: the first command after Redis restarted finds the
        # pooled connection dead and reconnects; a Redis that stays down fails fast.
        self._redis = redis.asyncio.from_url(url, socket_timeout=timeout_s / 2, socket_connect_timeout=timeout_s / 2,
                                             retry=Retry(NoBackoff(), 1), decode_responses=True)
        self._scripts = {name: self._redis.register_script(lua) for name, lua in
                         (("acquire", _ACQUIRE), ("renew", _RENEW), ("release", _RELEASE), ("write", _WRITE),
                          ("add_delta", _ADD_DELTA), ("delete", _DELETE), ("check_cap", _CHECK_CAP))}

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

    @_riding
    async def put(self, record: SessionRecord, lease: Lease | None, keep_deltas: bool = False) -> None:
        record.updated_at = time.time()
        turn = record.turn_dict()
        deltas = turn.pop("deltas") if turn is not None else []
        mode, deltas = ("keep", []) if keep_deltas else ("replace", [_json(d) for d in deltas])
        written = await self._script("write", record.session_id, lease, self.ttl_ms, _json(record.session_dict()),
                                     "-" if turn is None else _json(turn), mode, self.max_per_client, *deltas,
                                     client=record.client)
        if written < 0:
            raise over_cap(record.client, self.max_per_client, self.ttl_ms / 1000)
        if not written:
            raise _lost(record.session_id)

    @_riding
    async def add_delta(self, record: SessionRecord, lease: Lease | None) -> None:
        index = len(record.turn.deltas) - 1
        added = await self._script("add_delta", record.session_id, lease, self.ttl_ms, index,
                                   _json(record.turn.deltas[-1]), client=record.client)
        if added == 0:
            raise _lost(record.session_id)
        if added < 0:  # out of step with what is stored: write the whole record
            await self.put(record, lease)

    async def delete(self, session_id: str, lease: Lease | None) -> bool:
        deleted = await self._script("delete", session_id, lease, client=await self._client_of(session_id))
        if deleted < 0:
            raise _lost(session_id)
        return deleted > 0

    async def check_cap(self, session_id: str, client: str) -> None:
        """ResourceExhausted if ``session_id`` is a new session and ``client`` holds
        its cap: asked before the session's lease, so that a refused request leaves
        nothing behind (its first write checks again, atomically)."""
        if not (self.max_per_client and client and session_id):
            return
        keys = session_keys(session_id)
        names = [keys["lease"], keys["session"], keys["turn"], keys["deltas"], client_key(client)]
        if await self._call("count", self._scripts["check_cap"](keys=names, args=[self.max_per_client])):
            raise over_cap(client, self.max_per_client, self.ttl_ms / 1000)

    async def _client_of(self, session_id: str) -> str:
        """The client the stored session counts against ("": none, or no such session)."""
        session = await self._call("read", self._redis.get(session_keys(session_id)["session"]))
        return json.loads(session).get("client", "") if session else ""

    async def _script(self, name: str, session_id: str, lease: Lease | None, *args, client: str = "") -> int:
        """One of the scripts that write, on the session's keys (and ``client``'s
        sessions, when it counts against one), with the writer's token."""
        keys = session_keys(session_id)
        names = [keys["lease"], keys["session"], keys["turn"], keys["deltas"]]
        if client:
            names.append(client_key(client))
        return await self._call(name, self._scripts[name](keys=names, args=[_token(lease), *args]))

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
            held = self._held[id(lease)] = HeldLease(session_keys(session_id)["lease"], lease)
            try:
                yield lease
            finally:
                # Marked first: a renewal in flight must not take back the lease released here (:meth:`_renew`).
                held.released = True
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
            await asyncio.gather(*(self._renew(held) for held in list(self._held.values())))

    def _holding(self, held: HeldLease) -> bool:
        """Whether ``held``'s request still holds it: its hold has not ended
        (the keeper renews a copy of :attr:`_held`, taken before)."""
        return not held.released and self._held.get(id(held.lease)) is held

    async def _renew(self, held: HeldLease) -> None:
        """Renew one lease; one that vanished (Redis restarted empty, or stalled
        past it) is taken again, as a write would (:meth:`_ride_out`) — but
        only while its request holds it: a renewal that finds the lease gone
        because the request's hold ended meanwhile and released it must not
        take it back (nothing would ever release it again; the session's next
        turn would wait, then be refused, until the lease expired)."""
        try:
            renewed = await self._call("renew", self._scripts["renew"](
                keys=[held.key], args=[_token(held.lease), self.lease_ms]))
        except errors.Unavailable as e:  # the next renewal tries again
            self._writes_failing(e)
            return
        except Exception as e:  # any failure: the next renewal tries again, the keeper goes on
            log.warning("renewing a session's lease failed: %s", e)
            return
        self._writes_succeed()
        if renewed or held.riding:  # (a write that is retrying takes the lease again itself)
            return
        if not self._holding(held):  # released by its request: gone as it should be
            return
        if held.gave_up or held.record is None:  # the turn is ending; or nothing written yet, to re-seed
            log.warning("a session's lease was lost (this coordinator stalled past %.1f s?): "
                        "its writes will be refused", self.lease_ms / 1000)
            return
        try:
            await self._retake(held)
        except Exception as e:  # refused (taken over) or unreachable again: the writes find out too
            log.warning("a session's lease vanished and was not taken again: %s",
                        hidden_in(str(e), held.lease.session_id))
            return
        if not self._holding(held):  # the hold ended while the lease was taken again: give it back
            await self._release(held.lease)

    # ------------------------------------------------------------------ outages

    async def _ride_out(self, record: SessionRecord, lease: Lease | None, write):
        """``write()`` (one try), retried with back-off while the directory
        cannot be written, for up to :attr:`ride_s`: the turn's stream waits
        meanwhile. A lease found gone is taken again (:meth:`_retake`) and the
        write tried again. Only under a lease this directory holds: a request's
        lease for its session, renewed here."""
        held = self._held.get(id(lease)) if lease is not None else None
        if held is None or held.riding:  # not ours to ride; or within a ridden write (add_delta's put)
            return await write()
        held.record, held.riding = record, True
        try:
            return await self._retried(held, write)
        finally:
            held.riding = False

    async def _retried(self, held: HeldLease, write):
        """:meth:`_ride_out`'s loop: a write that gave up once ends the turn, so
        later writes under the lease (the turn's last) are tried once."""
        backoff, retaken = Backoff(self.ride_s), 0
        while True:
            try:
                try:
                    result = await write()
                    self._writes_succeed()
                    return result
                except _LeaseLost:
                    self._writes_succeed()  # it answered
                    retaken += 1
                    if held.gave_up or retaken > MAX_RETAKES:
                        raise
                    await self._retake(held)  # then the write again, under the new token
            except errors.Unavailable as e:
                self._writes_failing(e)
                if held.gave_up or self._closed:  # the turn is ending already: one try
                    raise
                wait = backoff.next()
                if wait is None:
                    held.gave_up = True
                    raise self._gave_up(e) from None
                await asyncio.sleep(wait)

    def _gave_up(self, e: errors.Unavailable) -> errors.Unavailable:
        """The turn ends: what the directory holds of it is resumable, on any
        coordinator, once it answers (and this one's lease has gone)."""
        return errors.Unavailable(
            f"{e} (tried for {self.ride_s:g} s: --lease and --directory-outage); the turn did not finish: resume "
            "it (resume_after = deltas received) on any coordinator sharing the directory once it is back",
            retry_after_s=max(1.0, self.lease_ms / 1000))

    async def _retake(self, held: HeldLease) -> None:
        """Take a vanished lease again and re-seed the session's record from
        ``held.record``, or FailedPrecondition: another coordinator took the
        session over."""
        if not await self._call("lease", self._reseed(held)):
            raise _lost(held.lease.session_id)

    async def _reseed(self, held: HeldLease) -> bool:
        """One transaction, WATCHing the session's keys (tried again if one
        changes meanwhile): whether the lease is held here now, taken again under
        a new token with the record written whole where :func:`may_reseed` allows."""
        keys = session_keys(held.lease.session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(*(keys[k] for k in ("lease", "fence", "session", "turn", "deltas")))
                    current = await pipe.get(keys["lease"])
                    if current is not None:  # ours (a re-take whose reply was lost), or another's
                        return held.adopt(current)
                    fence, session, turn = await pipe.mget(keys["fence"], keys["session"], keys["turn"])
                    deltas = [json.loads(d) for d in await pipe.lrange(keys["deltas"], 0, -1)]
                    if not may_reseed(held.record, _loads(session), _loads(turn), deltas):
                        return False
                    token = int(fence or 0) + 1
                    pipe.multi()
                    pipe.set(keys["fence"], token, px=self.ttl_ms)
                    pipe.set(keys["lease"], f"{token}:{held.lease.nonce}", px=self.lease_ms)
                    self._queue_record(pipe, keys, held.record)
                    await pipe.execute()
                except redis.exceptions.WatchError:
                    continue
                held.lease.token = token
                log.warning("%s: the session's lease had vanished from the directory (Redis restarted or stalled): "
                            "taken again, the record re-seeded from the turn's",
                            hidden_in(held.lease.session_id, held.lease.session_id))
                return True

    def _queue_record(self, pipe, keys: dict[str, str], record: SessionRecord) -> None:
        """The record's keys written whole, as the write script does, on a MULTI."""
        record.updated_at = time.time()
        turn = record.turn_dict()
        deltas = turn.pop("deltas") if turn is not None else []
        pipe.set(keys["session"], _json(record.session_dict()), px=self.ttl_ms)
        if turn is None:
            pipe.delete(keys["turn"])
        else:
            pipe.set(keys["turn"], _json(turn), px=self.ttl_ms)
        pipe.delete(keys["deltas"])
        if deltas:
            pipe.rpush(keys["deltas"], *map(_json, deltas))
            pipe.pexpire(keys["deltas"], self.ttl_ms)

    def _writes_failing(self, e: errors.Unavailable) -> None:
        if self.writes_failing_since is None and not self._closed:
            self.writes_failing_since = time.monotonic()
            log.warning("%s; turns in flight wait, retrying, for up to %g s", e, self.ride_s)

    def _writes_succeed(self) -> None:
        if self.writes_failing_since is not None:
            log.info("the session directory takes writes again, after %.1f s",
                     time.monotonic() - self.writes_failing_since)
            self.writes_failing_since = None

    # ------------------------------------------------------------------ plumbing

    async def check(self) -> None:
        """Unavailable unless Redis takes a write now: one refusing writes (out
        of memory under ``noeviction``) answers PING, but no turn can run."""
        try:
            await self._call("ping", self._redis.set(self._probe_key, "1", px=PROBE_TTL_MS))
        except errors.Unavailable as e:
            self._writes_failing(e)
            raise
        self._writes_succeed()

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
         "ping": "take a write", "renew": "renew a session's lease", "write": "write the session",
         "add_delta": "record the session's delta", "delete": "delete the session",
         "count": "count the client's sessions"}


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _loads(value: str | None):
    return None if value is None else json.loads(value)


def _token(lease: Lease | None) -> str:
    if lease is None or not lease.token:
        raise errors.FailedPrecondition("a write to the shared session directory without the session's lease")
    return f"{lease.token}:{lease.nonce}"


class _LeaseLost(errors.FailedPrecondition):
    """A write found another lease than the writer's (a ridden write may take it again)."""


def _lost(session_id: str) -> _LeaseLost:
    return _LeaseLost(
        f"session {session_id!r}: this coordinator lost the session's lease (it stalled, or could not reach the "
        "session directory, past the lease time) and another coordinator took the session over; nothing was written")
