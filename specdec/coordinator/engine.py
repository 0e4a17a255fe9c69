"""The coordinator's work, independent of gRPC serving, as a pipeline of named
pieces:

* :class:`specdec.coordinator.pair.PairRegistry` — what the draft and target serve,
  checked to work together;
* :class:`specdec.coordinator.requests.RequestCheck` — a job's checks, before any
  session is touched;
* :class:`specdec.coordinator.directory.SessionDirectory` — each session's history and
  last turn, and its lease: one request per session at a time (in memory, or
  in Redis shared by coordinator replicas);
* :class:`specdec.coordinator.learned_gamma.LearnedGamma` — adaptive γ's warm start;
* :class:`specdec.coordinator.turn.Turn` — the session's rounds, committed or rolled
  back, and the stats;

and the telemetry around them (a span per Generate, the round observer).

:meth:`Coordinator.generate` is an asynchronous generator on the server's one
event loop: every stream's rounds are awaited calls (grpc.aio), so no stream
holds a thread. Closing it early, or cancelling it (the client went away),
frees the session's state in both services.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from specdec.coordinator.admission import KVWaits
from specdec.coordinator.directory import InMemoryDirectory, SessionDirectory, SessionRecord
from specdec.coordinator.learned_gamma import LearnedGamma, regime
from specdec.coordinator.pair import PairInfo, PairRegistry
from specdec.coordinator.pinning import Pinned, pin
from specdec.coordinator.pools import DnsName, ReplicaPool, parse_addresses
from specdec.coordinator.remote import ServiceClient
from specdec.coordinator.requests import Request, RequestCheck
from specdec.coordinator.tokenizer_source import TokenizerSource
from specdec.coordinator.turn import Services, Turn, open_record
from specdec.core.gamma import AdaptiveGamma, StaticGamma
from specdec.serving import auth, errors
from specdec.serving.config import CoordinatorConfig
from specdec.serving.generation import Delta, GenerateJob, GenerationStats
from specdec.serving.names import check_name
from specdec.serving.tls import renewed_channel_credentials
from specdec.telemetry.observer import CoordinatorObserver, GenerationInfo, generation_span, record_generation

log = logging.getLogger("specdec.coordinator")

# How long a request waits for a healthy replica of a role (one starting, or
# back from a restart, is seen by the next health check) before UNAVAILABLE.
REPLICA_WAIT_S = 3.0
# Text prompts longer than this are tokenised off the event loop (~1 ms of CPU).
LONG_PROMPT_CHARS = 4096


class Coordinator:
    """Drives sessions over pools of draft and target replicas."""

    def __init__(self, config: CoordinatorConfig, tokenizer=None, directory: SessionDirectory | None = None,
                 tokenizers: TokenizerSource | None = None, metrics=None):
        """``tokenizer``: use this one; else ``tokenizers``, else ``--tokenizer``'s
        (by default the target's own, fetched from it)."""
        self.config = config
        self.metrics = metrics  # a specdec.telemetry.metrics.CoordinatorMetrics, or None
        if tokenizer is not None:
            tokenizers = TokenizerSource(tokenizer=tokenizer)
        self.tokenizers = tokenizers or TokenizerSource.for_config(config)
        self.tokenizer = self.tokenizers.tokenizer
        self.directory: SessionDirectory = directory or make_directory(config, metrics)
        self.pools = {role: make_pool(role, config, metrics) for role in ("draft", "target")}
        self.learned = LearnedGamma()
        self.pairs = PairRegistry(config.gamma_max, self.tokenizers.directory, on_change=self.learned.forget)
        self.checks = RequestCheck(config, self.tokenizer)
        self.observer = CoordinatorObserver(metrics)
        self.kv_waits = KVWaits(config.kv_wait_s, config.kv_wait_turns)
        self._background: set[asyncio.Task] = set()  # EndSession calls to replicas a session left
        if metrics is not None:
            metrics.watch_replicas(lambda: {role: pool.snapshot() for role, pool in self.pools.items()})

    async def pair(self, fresh: bool = False, wait_s: float = 0.0) -> PairInfo:
        """The pair a healthy draft and target serve (UNAVAILABLE naming the
        role that has none within ``wait_s``)."""
        draft = await self._answering("draft", fresh, wait_s)
        target = await self._answering("target", fresh, wait_s)
        pair = await self.pairs.get(draft, target)
        self.tokenizer = self.checks.tokenizer = await self.tokenizers.for_pair(pair.vocab_fingerprint, target)
        return pair

    async def _answering(self, role: str, fresh: bool, wait_s: float) -> ServiceClient:
        """A healthy replica of ``role`` whose ModelInfo is at hand or that
        answers for it; one that does not is reported out and the next tried."""
        tried: set[str] = set()
        failed: errors.Unavailable | None = None
        while True:
            try:
                replica = await self.pools[role].pick(exclude=tried, pin=False, wait_s=wait_s)
            except errors.Unavailable:
                if failed is not None:
                    raise failed from None
                raise
            try:
                await self.pairs.info(replica.client, fresh)
                return replica.client
            except errors.Unavailable as e:
                self.pools[role].report_failure(replica.address, f"GetModelInfo failed: {e}")
                tried.add(replica.address)
                failed = e

    async def generate(self, job: GenerateJob, cancelled: asyncio.Event | None = None
                       ) -> AsyncIterator[Delta | GenerationStats]:
        """Stream one completion: a Delta per round as soon as it commits, then
        the stats. Named sessions continue their history; one-shot sessions are
        freed at the end. ``cancelled``, set by the caller once its client has
        gone: no round starts after it, and the next request on the session
        waits for this one to end."""
        cancelled = cancelled or asyncio.Event()
        started = time.perf_counter()
        self.checks.check_sizes(job)  # a request's sizes first, before any service is asked anything
        checked = await self.pair(wait_s=REPLICA_WAIT_S)
        request = await self._validate(job, checked)
        client = auth.current_client()
        if client and job.session_id:
            await self._check_owner(job.session_id, client)
        caller = auth.current_caller()  # who a new session counts against (--client-max-sessions)
        await self.directory.check_cap(job.session_id, caller)  # before the lease: most refusals leave nothing
        # A resumed turn takes over from a coordinator that may have died
        # holding the session: its lease runs out within the lease time.
        wait_s = None if job.resume_after is None else self.config.lease_s + 1.0
        async with self.directory.hold(job.session_id, cancelled, wait_s) as lease:
            if lease is None:
                return
            record = await open_record(self.directory, job.session_id)
            claim(record, client)  # again, under the lease
            record.client = record.client or caller  # checked again when the record is first written
            async with self._pinned(record, request) as services:
                pair = await self.pairs.get(*services.clients())
                if pair != checked:  # these replicas serve other limits (a pool mid-upgrade): check again
                    request = await self._validate(job, pair)
                key = regime(request.params, request.draft_top_k)
                request = dataclasses.replace(request, policy=self.learned.warm_start(request.policy, key))
                continue_session(request.policy, record, key)
                turn = Turn(services, self.directory, request, pair, record, tokenizer=self.tokenizer, lease=lease)
                async with contextlib.aclosing(self._run(turn, request, key, cancelled, started)) as events:
                    async for event in events:
                        yield event

    async def _validate(self, job: GenerateJob, pair: PairInfo) -> Request:
        """The request's checks; a long text prompt is tokenised on a worker
        thread, not on the event loop every stream shares."""
        if len(job.prompt) > LONG_PROMPT_CHARS:
            return await asyncio.to_thread(self.checks.validate, job, pair)
        return self.checks.validate(job, pair)

    async def _run(self, turn: Turn, request: Request, key, cancelled: asyncio.Event, started: float
                   ) -> AsyncIterator[Delta | GenerationStats]:
        if turn.resume_after is not None and self.metrics is not None:
            self.metrics.turns_resumed.inc()
        with generation_span(_info(request, turn.pair, turn)) as span:
            async with contextlib.aclosing(turn.run(cancelled, started)) as events:
                async for event in events:
                    if isinstance(event, GenerationStats):
                        record_generation(span, self.metrics, event)
                        self.learned.finished(request.policy, key)
                        # The turn is complete and stored: its client may send the next
                        # one at once, which then waits for this lease, not refused.
                        cancelled.set()
                    elif self.metrics is not None:
                        self.metrics.observe_streamed(len(event.token_ids))
                    yield event

    @contextlib.asynccontextmanager
    async def _pinned(self, record: SessionRecord, request: Request) -> AsyncIterator[Services]:
        """The turn's replicas: the session's while they are fit, else the
        least-loaded healthy ones (a moved side starts from an empty cache);
        released when the turn ends."""
        drafting = not (isinstance(request.policy, StaticGamma) and request.policy.gamma == 0)
        pins: dict[str, Pinned] = {}
        try:
            for role in ("draft", "target") if drafting else ("target",):
                pinned, cause = await pin(self.pools[role], getattr(record, f"{role}_replica"), REPLICA_WAIT_S)
                pinned.on_move = lambda role, address, cause: self._moved(record, role, address, cause, True)
                pins[role] = pinned
                if cause:
                    self._moved(record, role, pinned.address, cause, False)
            pair_draft = pins["draft"].client if drafting else \
                (await self.pools["draft"].pick(pin=False, wait_s=REPLICA_WAIT_S)).client
            yield Services(pins.get("draft"), pins["target"], self.pairs, self.observer, self.metrics, pair_draft,
                           self.kv_waits)
        finally:
            for pinned in pins.values():
                pinned.release()

    def _moved(self, record: SessionRecord, role: str, address: str, cause: str, mid_turn: bool) -> None:
        previous = getattr(record, f"{role}_replica")
        setattr(record, f"{role}_replica", address)
        if not mid_turn:  # mid-turn the proposer or verifier re-pre-fills from the turn's own state
            setattr(record, f"{role}_synced", 0)
        if previous and cause != "new":
            log.info("%s: %s replica %s -> %s (%s)", record.session_id, role, previous, address, cause)
            self._end_elsewhere(role, previous, record.service_session_id)
        if self.metrics is not None:
            label = cause if not mid_turn else "failed" if "failed" in cause else \
                "kv budget" if "KV" in cause else "unhealthy"
            self.metrics.pins.labels(role, label).inc()
            if mid_turn:
                self.metrics.failovers.labels(role).inc()

    def _end_elsewhere(self, role: str, address: str, key: str) -> None:
        """The session left the replica at ``address``: tell it to free what it
        holds (in the background, best effort: one that died holds nothing, and
        one that does not answer frees it after its TTL)."""
        replica = self.pools[role].get(address)
        if replica is None or replica.address == "":
            return
        ending = asyncio.get_running_loop().create_task(replica.client.end_session(key))
        self._background.add(ending)
        ending.add_done_callback(self._background.discard)

    async def close_session(self, session_id: str) -> bool:
        """Forget a named session and free its state in both services."""
        if not session_id:
            raise errors.InvalidRequest("session_id is empty: name the session to close")
        check_name(session_id, "session_id")
        client = auth.current_client()
        if not await self._check_owner(session_id, client):
            raise _unknown(session_id)
        async with self.directory.hold(session_id) as lease:  # no Generate may start on it meanwhile
            record = await self.directory.get(session_id)
            if record is None:  # closed meanwhile
                raise _unknown(session_id)
            claim(record, client)  # again, under the lease
            await self.directory.delete(session_id, lease)
            replicas = [self.pools[role].get(getattr(record, f"{role}_replica")) for role in ("draft", "target")]
            await asyncio.gather(*(r.client.end_session(record.service_session_id) for r in replicas if r))
            return True

    async def _check_owner(self, session_id: str, client: str) -> bool:
        """Whether the session is stored; PermissionDenied if it is another
        client's. First, before the session's lease or anything else of it is
        touched: a client naming another's session holds up none of its turns.
        (Checked again under the lease: the owner cannot change meanwhile, but
        the session may have been closed.)"""
        owner = await self.directory.owner(session_id)
        if owner is not None:
            refuse_others(session_id, owner, client)
        return owner is not None

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()
        await self.directory.close()
        self.tokenizers.close()


def claim(record: SessionRecord, client: str) -> None:
    """A named session belongs to the client that created it: another client
    naming it is refused (PERMISSION_DENIED), never shown its history. Without
    authentication (client "") there are no owners; a session from before
    authentication was turned on goes to the first client that names it."""
    if client:
        refuse_others(record.session_id, record.owner, client)
        record.owner = client


def refuse_others(session_id: str, owner: str, client: str) -> None:
    """PermissionDenied if the session's ``owner`` is a client other than ``client``."""
    if client and owner and owner != client:
        raise errors.PermissionDenied(f"session {session_id!r} belongs to another client: choose another "
                                      f"session id")


def _unknown(session_id: str) -> errors.SessionNotFound:
    return errors.SessionNotFound(f"session {session_id!r} is unknown (never started, or already closed)")


def continue_session(policy, record: SessionRecord, key: tuple) -> None:
    """An adaptive policy starts from the acceptance the session's last turn saw,
    when it ran in the same regime (greedy, or the same sampling settings)."""
    state = record.gamma_state
    if isinstance(policy, AdaptiveGamma) and state and tuple(state.get("regime", ())) == key:
        policy.continue_session(state)


def make_pool(role: str, config: CoordinatorConfig, metrics=None) -> ReplicaPool:
    """The ``--draft`` or ``--target`` replicas, one ServiceClient each."""
    pools: list[ReplicaPool] = []

    credentials = renewed_channel_credentials(config.upstream_ca, config.upstream_cert, config.upstream_key) \
        if config.upstream_ca else None
    # A replica found through dns:///NAME is an IP: its certificate is checked for NAME.
    names = parse_addresses(getattr(config, role))
    server_name = config.upstream_server_name or (names.name if isinstance(names, DnsName) else "")

    def client(address: str) -> ServiceClient:
        made = ServiceClient(role, address, call_timeout_s=config.call_timeout_s,
                             info_timeout_s=config.info_timeout_s, metrics=metrics,
                             credentials=credentials, server_name=server_name)
        # A dropped connection (the process died or stopped) takes the replica
        # out at once, not at the next health sweep.
        made.on_connection_lost(lambda: pools and pools[0].report_failure(address, "its connection dropped"))
        return made

    pools.append(ReplicaPool(role, getattr(config, role), client))
    return pools[0]


def make_directory(config: CoordinatorConfig, metrics=None) -> SessionDirectory:
    """``--redis URL``: the directory every coordinator given that URL shares;
    otherwise one in this process's memory."""
    if not config.redis:
        return InMemoryDirectory(config.max_sessions, config.client_max_sessions, ttl_s=config.redis_ttl_s)
    from specdec.coordinator.redis_directory import RedisDirectory

    return RedisDirectory(config.redis, ttl_s=config.redis_ttl_s, lease_s=config.lease_s, metrics=metrics,
                          max_per_client=config.client_max_sessions, outage_s=config.directory_outage_s)


def _info(request: Request, pair: PairInfo, turn: Turn) -> GenerationInfo:
    job = request.job
    return GenerationInfo(model=pair.target_name, draft_model=pair.draft_name, max_tokens=job.max_new_tokens,
                          temperature=request.params.temperature, input_tokens=len(request.prompt_ids),
                          conversation_id=turn.record.session_id, gamma_policy=job.gamma_policy)
