"""gRPC clients of the draft and target services (``grpc.aio``, on the
coordinator's event loop), shaped as the round machine's asynchronous Proposer
and Verifier (specdec.core.rounds), so the coordinator runs the very same round
as the in-process decoder.

Every call carries a deadline and the session's round id, and goes to the
turn's replica of its role (:mod:`specdec.coordinator.pinning`). When a service answers
NOT_FOUND (it evicted the session, or restarted), the side reports the session
lost and the round machine asks again from position 0 with the whole token
history: the service re-pre-fills and the round goes on as if nothing happened
-- the output cannot change, because the history is exactly what the service
held before (and the coordinator first checks that
the service still serves the same model: a restart loses sessions too).

A replica that fails (UNAVAILABLE, a deadline, a call cancelled as it shuts
down) is reported to its pool. A failed target call is sent at once to another
healthy target, pre-filled from position 0; with none, it is repeated with the
same round id, so a call the service did apply is not applied twice: for up to
3 s when the service could not be reached, once when it refused itself
(shutting down, loading); a target that stays down fails the request with
UNAVAILABLE naming it. A failed draft call never fails the request: the round
goes on with the drafts that arrived, the next on another draft or at γ = 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc

from specdec.coordinator.admission import KVWaits
from specdec.coordinator.pinning import Pinned
from specdec.coordinator.pools import Replica
from specdec.core.interfaces import Drafted, Propose, SessionLost, Verdict, Verify
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import convert as conv
from specdec.serving import errors
from specdec.serving.generation import ModelFacts
from specdec.serving.names import shown
from specdec.serving.server import DRAFT_SERVICE, TARGET_SERVICE
from specdec.telemetry.calls import ClientCalls, RpcRecord

log = logging.getLogger("specdec.coordinator")

# Generous message limits: a dense q is vocab × γ × 4 bytes (4 MB at 128k × 8).
# Reconnect quickly: a restarted (or late-starting) service is picked up within a
# couple of seconds instead of after gRPC's default backoff of up to two minutes.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class ServiceClient:
    """One draft or target service: channel, stub, deadlines, error translation.
    Its channel is a ``grpc.aio`` one: made, used and closed on the
    coordinator's event loop."""

    def __init__(self, role: str, address: str, *, call_timeout_s: float, info_timeout_s: float, metrics=None,
                 credentials: Callable[[], grpc.ChannelCredentials] | None = None, server_name: str = ""):
        self.role = role  # "draft" | "target"
        self.address = address
        self.call_timeout_s = call_timeout_s
        self.info_timeout_s = info_timeout_s
        # TLS: the current credentials (renewed files are read again), and the
        # name the service's certificate must carry when the address (an IP) is not it.
        self._credentials, self._server_name = credentials, server_name
        self._lost: list[Callable[[], None]] = []  # on_connection_lost callbacks
        self._watch: asyncio.Task | None = None  # follows the current channel's connectivity
        self._closing: set[asyncio.Task] = set()
        # Each call traced and timed when telemetry is on (``metrics``: a CoordinatorMetrics).
        self.calls = ClientCalls(role, DRAFT_SERVICE if role == "draft" else TARGET_SERVICE, metrics)
        self.timed_out_at = float("-inf")  # when a call last ran out its deadline
        self._open(credentials() if credentials else None)

    def _open(self, credentials: grpc.ChannelCredentials | None) -> None:
        if credentials is None:
            channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        else:
            named = [("grpc.ssl_target_name_override", self._server_name)] if self._server_name else []
            channel = grpc.aio.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS + named)
        self.channel, self._in_use = channel, credentials
        self.stub = (pb_grpc.DraftServiceStub if self.role == "draft" else pb_grpc.TargetServiceStub)(channel)
        self._watch = asyncio.get_running_loop().create_task(self._follow(channel))

    async def _follow(self, channel: grpc.aio.Channel) -> None:
        """Call the on_connection_lost callbacks whenever ``channel`` leaves READY."""
        previous = channel.get_state()
        while channel is self.channel:
            await channel.wait_for_state_change(previous)
            state = channel.get_state()
            if previous == grpc.ChannelConnectivity.READY and state != grpc.ChannelConnectivity.READY:
                self._connection_lost(channel)
            previous = state

    def _connection_lost(self, channel: grpc.aio.Channel) -> None:
        """The channel left READY. Its calls have failed or it went idle, so if
        the TLS files were renewed meanwhile, this is when a new channel takes
        over: the next connection presents the renewed certificate, not the one
        this channel was made with (which expires)."""
        renewed = self._credentials() if self._credentials else None
        if channel is self.channel and renewed is not self._in_use:
            self._open(renewed)
            log.info("%s service %s: reconnecting with renewed TLS credentials", self.role, self.address)
            closing = asyncio.get_running_loop().create_task(channel.close(grace=None))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        for lost in self._lost:
            lost()

    def on_connection_lost(self, lost: Callable[[], None]) -> None:
        """Call ``lost()`` (on the event loop) whenever the channel leaves READY:
        the connection dropped, so what answers next may be another process (a
        restart, perhaps with another model or other limits) or, after the
        channel's idle timeout, the same one."""
        self._lost.append(lost)

    async def model_info(self) -> ModelFacts:
        """A service that is still starting (not listening yet, or loading its
        model and answering UNAVAILABLE) gets until the deadline. Round calls do
        not wait: a dead service must fail them at once."""
        deadline = time.monotonic() + self.info_timeout_s
        while True:
            try:
                with self.calls.call("GetModelInfo") as call:
                    return conv.model_facts_from_proto(await self.stub.GetModelInfo(
                        conv.model_info_request(), timeout=max(0.1, deadline - time.monotonic()), wait_for_ready=True,
                        metadata=call.metadata))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + 0.2 > deadline:
                    raise self.translate(e, "GetModelInfo") from None
                await asyncio.sleep(0.2)

    async def end_session(self, session_id: str) -> bool:
        """Free the session's state in the service; best effort (a dead service
        holds nothing to free), so failures are logged, not raised."""
        # A service that just let a round call run out its deadline (hung, or
        # overloaded) would likely hold the request's error back by the whole
        # info timeout too: it gets a second; its TTL frees what it keeps.
        hung = time.monotonic() - self.timed_out_at < self.call_timeout_s
        try:
            with self.calls.call("EndSession") as call:
                reply = await self.stub.EndSession(
                    conv.end_session_request(session_id),
                    timeout=min(1.0, self.info_timeout_s) if hung else self.info_timeout_s, metadata=call.metadata)
                return conv.ended_from_proto(reply)
        except grpc.RpcError as e:
            log.warning("EndSession(%s) on %s service %s failed: %s", shown(session_id), self.role, self.address,
                        _details(e))
            return False
        except (ValueError, RuntimeError, grpc.aio.UsageError) as e:  # the channel is closed: shutting down
            log.warning("EndSession(%s) on %s service %s not sent: %s (the service frees it after its TTL)",
                        shown(session_id), self.role, self.address, e)
            return False

    def translate(self, e: grpc.RpcError, method: str) -> Exception:
        """A failed call -> the exception the coordinator's client should see,
        naming the service so a user knows which process to look at."""
        code = errors.rpc_status(e)[0]
        where = f"{self.role} service at {self.address}"
        if code == grpc.StatusCode.CANCELLED:  # a stopping server cancels its calls (or our channel closed)
            return errors.Unavailable(f"{where} cancelled {method} (is it shutting down or restarting?): "
                                      f"{_details(e)}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.timed_out_at = time.monotonic()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return errors.Unavailable(f"{where} did not answer {method} ({code.name}): {_details(e)}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # every replica tried is full: back off, then retry
            return errors.ResourceExhausted(f"{where} refused {method}: {_details(e)} (no other {self.role} "
                                            f"replica took it)", retry_after_s=1.0)
        err = errors.from_rpc_error(e)
        err.args = (f"{where} failed {method}: {_details(e)}",)
        return err

    async def close(self) -> None:
        self._lost.clear()
        channel, self.channel = self.channel, None
        if self._watch is not None:
            self._watch.cancel()
        await channel.close(grace=None)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _details(e: grpc.RpcError) -> str:
    return errors.rpc_status(e)[1] or str(e)


@dataclasses.dataclass
class SideStats:
    """What one service did for one request: its calls as the coordinator saw
    them, each with the service's own account (:class:`specdec.telemetry.calls.RpcRecord`)."""

    prefill_tokens: int = 0  # history tokens (re-)run: first call, and after an eviction
    prepared_rounds: int = 0  # (the draft) rounds whose drafts were all made ahead, before the call
    calls: list[RpcRecord] = dataclasses.field(default_factory=list)

    def total(self, field: str) -> float:
        return sum(getattr(c, field) for c in self.calls)

    @property
    def network_s(self) -> float:
        """Network + serialisation: what the coordinator waited beyond the
        service's own time (queue, compute, copies), summed over calls."""
        return self.total("network_s")


class _Retries:
    """What one failed call may do. UNAVAILABLE: repeat it with the same round id
    (a service that did apply it answers from its record instead of applying it
    twice): once after 0.2 s if the service itself refused (shutting down, still
    loading), every 0.2 s for up to REPEAT_FOR_S if it could not be reached, long
    enough for the channel's next reconnect attempt (its backoff is at most
    2 s) to find a restarted service. NOT_FOUND, once: the service lost the
    session; start it again from position 0 with the whole history, after
    ``before_refill()`` (the coordinator checks that the service still serves
    the model the turn started with; it raises to stop the turn).
    RESOURCE_EXHAUSTED from the service (its KV budget or session cap, once no
    other replica has room): repeated after a wait, while ``kv_waits`` lets
    the turn wait (:class:`specdec.coordinator.admission.KVWaits`)."""

    REPEAT_AFTER_S = 0.2
    REPEAT_FOR_S = 3.0

    def __init__(self, before_refill, kv_waits: KVWaits | None = None) -> None:
        self.before_refill = before_refill
        self.repeat_until: float | None = None
        self.refilled = False
        self.kv_waits = kv_waits
        self.kv_until: float | None = None
        self.kv_attempts = 0

    async def after(self, e: grpc.RpcError, position: int, client: ServiceClient, session_id: str) -> str | None:
        code = e.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            if self.repeat_until is None:
                window = self.REPEAT_AFTER_S if errors.raised_by_server(e) else self.REPEAT_FOR_S
                self.repeat_until = time.monotonic() + window
                log.info("%s service at %s unavailable (%s): repeating the call for up to %.1f s", client.role,
                         client.address, _details(e), window)
            if time.monotonic() < self.repeat_until:
                await asyncio.sleep(self.REPEAT_AFTER_S)
                return "repeat"
            return None
        if code == grpc.StatusCode.NOT_FOUND and not self.refilled and position > 0:
            self.refilled = True
            await self.before_refill(client)  # a lost session may mean another process: is it still the same model?
            log.info("%s service lost session %s (%s): re-pre-filling it from the history",
                     client.role, shown(session_id), _details(e))
            return "refill"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and self.kv_waits is not None and errors.raised_by_server(e):
            return "repeat" if await self._wait_for_room() else None
        return None

    async def _wait_for_room(self) -> bool:
        if self.kv_until is None:
            self.kv_until = time.monotonic() + self.kv_waits.wait_s
        if time.monotonic() >= self.kv_until or not await self.kv_waits.wait(self.kv_attempts):
            return False
        self.kv_attempts += 1
        return True


@dataclasses.dataclass
class RemoteSession:
    """What the proposer and the verifier of one turn share: the session's name
    in the services, what to check before re-pre-filling a service that lost it
    (awaited; may raise: see _Retries), whether a replica may take the turn over
    (awaited: it serves the turn's model), and the metrics."""

    key: str
    before_refill: Callable[[ServiceClient], Awaitable[None]]
    may_take_over: Callable[[Replica], Awaitable[bool]]
    metrics: object = None  # a CoordinatorMetrics, or None
    kv_waits: KVWaits | None = None  # how long the target's verifications may wait for KV room

    def refilled(self, role: str, cause: str) -> None:
        if self.metrics is not None:
            self.metrics.prefills.labels(role, cause).inc()


# Codes that say a replica is dead, draining or hung, not that the call was wrong.
REPLICA_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.CANCELLED})


async def _repeat_or_raise(retries: _Retries, e: grpc.RpcError, position: int, client: ServiceClient,
                           session: RemoteSession, method: str) -> None:
    """After a failed call: return to repeat it; SessionLost when the service
    lost the session (the round machine re-pre-fills it); else the call's error."""
    action = await retries.after(e, position, client, session.key)
    if action is None:
        raise client.translate(e, method) from None
    if action == "refill":
        session.refilled(client.role, "evicted")
        raise SessionLost(client.role, "evicted") from None


async def _move(pinned: Pinned, session: RemoteSession, cause: str, exclude: Iterable[str] = ()) -> bool:
    """Move the turn's ``pinned`` role to another replica that serves its model."""
    if not await pinned.move(cause, session.may_take_over, exclude):
        return False
    session.refilled(pinned.role, "moved")
    return True


class RemoteProposer:
    """The draft service as a :class:`specdec.core.interfaces.Proposer` for one
    session. A draft replica that fails mid-turn (unreachable, draining, out of
    time) costs speculation, never the turn: the round verifies the drafts that
    arrived (perhaps none), and the next round moves to another healthy draft,
    re-pre-filled from the history, or drafts nothing (γ = 0) while there is
    none. One out of KV memory drafts nothing for that round."""

    def __init__(self, pinned: Pinned, session: RemoteSession, stats: SideStats, draft_top_k: int = 0,
                 target_vocab_size: int = 0):
        self.pinned, self.session, self.stats, self.draft_top_k = pinned, session, stats, draft_top_k
        self.target_vocab_size = target_vocab_size  # the draft proposes only ids the target holds too
        self.full: set[str] = set()  # replicas that answered the turn RESOURCE_EXHAUSTED

    async def propose(self, call: Propose) -> Drafted:
        retries = _Retries(self.session.before_refill)
        if not self.pinned.fit():
            if not await _move(self.pinned, self.session, "unhealthy" if self.pinned.replica else "none left"):
                return Drafted([])
            raise SessionLost("draft", "moved")
        client = self.pinned.client
        request = conv.propose_request(self.session.key, call.round_id, call.position, call.new_tokens, call.gamma,
                                       call.params, self.draft_top_k, self.target_vocab_size)
        while True:
            try:
                with client.calls.call("ProposeAll") as rpc:
                    started = time.perf_counter()  # after the span's setup: that is the coordinator's time
                    raw = await client.stub.ProposeAll(request, timeout=client.call_timeout_s, metadata=rpc.metadata)
                    waited = time.perf_counter() - started
                    reply = conv.draft_reply_from_proto(raw)
                    rpc.record(self._account(reply, call, waited, conv.wire_bytes(request)))
                # When the first draft existed, as seen here: the drafting after it took what it took there.
                return Drafted(reply.drafts, max(0.0, waited - reply.drafting_s))
            except grpc.RpcError as e:
                if await self._gave_up(e, client):
                    return Drafted([])
                await _repeat_or_raise(retries, e, call.position, client, self.session, "ProposeAll")

    async def _gave_up(self, e: grpc.RpcError, client: ServiceClient) -> bool:
        """A failure of the replica (not of the request) ends the drafting of
        this round; one that is dead or leaving is reported to the pool. One at
        its KV budget hands the session to another draft that has room (raises
        SessionLost), if there is one."""
        code = e.code()
        if code not in REPLICA_FAILURES and code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return False
        if code in REPLICA_FAILURES:
            self.pinned.failed(f"Propose failed ({code.name}): {_details(e)}",
                               hung=code == grpc.StatusCode.DEADLINE_EXCEEDED)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                client.timed_out_at = time.monotonic()
        else:
            self.full.add(client.address)
            if await _move(self.pinned, self.session, "at its KV budget", self.full):
                raise SessionLost("draft", "moved") from None
        log.warning("%s: draft service at %s failed Propose (%s: %s): this round verifies no drafts%s",
                    shown(self.session.key), client.address, code.name, _details(e),
                    "" if code == grpc.StatusCode.RESOURCE_EXHAUSTED else "; the next moves to another draft")
        return True

    def _account(self, reply: conv.DraftReply, call: Propose, waited_s: float, sent: int) -> RpcRecord:
        s = self.stats
        # The first forward runs the history the draft lacks; then one token per draft.
        if not s.calls or call.position == 0:
            s.prefill_tokens += max(0, reply.timing.computed_tokens - (call.gamma - 1))
        s.prepared_rounds += reply.prepared
        if self.session.metrics is not None and call.gamma:
            self.session.metrics.draft_rounds.labels("yes" if reply.prepared else "no").inc()
        s.calls.append(RpcRecord.of_call("draft", waited_s, reply.timing, sent, reply.wire_bytes))
        return s.calls[-1]


class RemoteVerifier:
    """The target service as a :class:`specdec.core.interfaces.Verifier` for one
    session. A target replica that fails a call (or is out before one) is
    replaced by another healthy one that serves the same model, re-pre-filled
    from the committed history, and the call is sent there; with none, the
    call is repeated on the same replica as :class:`_Retries` says."""

    def __init__(self, pinned: Pinned, session: RemoteSession, stats: SideStats):
        self.pinned, self.session, self.stats = pinned, session, stats
        self.full: set[str] = set()  # replicas that answered the turn RESOURCE_EXHAUSTED

    async def verify(self, call: Verify) -> Verdict:
        retries = _Retries(self.session.before_refill, self.session.kv_waits)
        if not self.pinned.fit() and await _move(self.pinned, self.session, "unhealthy"):
            raise SessionLost("target", "moved")
        client = self.pinned.client
        request = conv.verify_request(self.session.key, call.round_id, call.position, call.new_tokens, call.drafts,
                                      call.params, call.decode)
        while True:
            try:
                with client.calls.call("Verify") as rpc:
                    started = time.perf_counter()
                    raw = await client.stub.Verify(request, timeout=client.call_timeout_s, metadata=rpc.metadata)
                    waited = time.perf_counter() - started
                    reply = conv.verify_reply_from_proto(raw)
                    record = RpcRecord.of_call("target", waited, reply.timing, conv.wire_bytes(request),
                                               reply.wire_bytes)
                    rpc.record(record)
                break
            except grpc.RpcError as e:
                await self._moved_after(e, client)
                await _repeat_or_raise(retries, e, call.position, client, self.session, "Verify")
        s = self.stats
        if not s.calls or call.position == 0:  # history the target lacked: all it ran but the drafts and decoding
            s.prefill_tokens += max(0, reply.timing.computed_tokens - len(call.drafts) - len(reply.verdict.decoded))
        s.calls.append(record)
        return reply.verdict

    async def _moved_after(self, e: grpc.RpcError, client: ServiceClient) -> None:
        """A failed replica (or one at its KV budget) hands the turn to another
        healthy target that serves the same model: raises SessionLost when it did."""
        if e.code() in REPLICA_FAILURES:
            self.pinned.failed(f"Verify failed ({e.code().name}): {_details(e)}",
                               hung=e.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
            if await _move(self.pinned, self.session, f"Verify failed ({e.code().name})"):
                raise SessionLost("target", "moved") from None
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its KV budget: another may have room
            self.full.add(client.address)
            if await _move(self.pinned, self.session, "at its KV budget", self.full):
                raise SessionLost("target", "moved") from None
