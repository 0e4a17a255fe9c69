"""The Python client of a specdec coordinator.

    import specdec
    client = specdec.Client("localhost:50051")
    for event in client.generate("def fib(n):", max_new_tokens=64):
        if isinstance(event, specdec.serving.client.Delta):
            print(event.text, end="", flush=True)
        else:                                   # the final Stats
            print(f"\\n{event.tokens_per_second:.1f} tok/s, acceptance {event.acceptance_rate:.0%}")

    # or all at once
    out = client.complete("def fib(n):", max_new_tokens=64, session_id="chat-1")
    client.close_session("chat-1")

Synchronous on purpose (a plain gRPC channel): streaming is an ordinary for-loop,
and leaving the loop early cancels the request, which frees the session's state
in both model services. Failed calls raise the typed errors of
:mod:`specdec.serving.errors` (``InvalidRequest`` is a ``ValueError``; every error has
``.code``, the gRPC status).

Given several coordinators (``specdec.Client(["c1:50051", "c2:50051"])``, which
share a ``--redis`` session directory), a stream that breaks because its
coordinator died or is draining goes on through the next coordinator:
a named session's turn is resumed after the last delta received, so the loop
sees each token once; a one-shot request is sent again only if none of it had
arrived. So does a stream that ends with UNAVAILABLE and a retry-after hint (its
coordinator's session directory was down past ``--directory-outage``), after
that hint. It keeps trying for ``failover_s`` seconds (default 30 with several
coordinators; 0, no retry, with one).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence

import grpc

from specdec.core.interfaces import SamplingParams
from specdec.core.text import excerpt
from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import convert, errors
from specdec.serving.generation import Delta, GenerateJob, GenerationStats
from specdec.serving.tls import channel_credentials, is_loopback

DEFAULT_ADDRESS = "localhost:50051"

log = logging.getLogger("specdec.client")


# The final event of a stream (the coordinator fills the same dataclass).
Stats = GenerationStats


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    stats: Stats


TOKEN_ENV = "SPECDEC_TOKEN"
TLS_ENV = "SPECDEC_CLIENT_TLS"


def _tls_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """The client's TLS, from the arguments or else the SPECDEC_CLIENT_TLS_* variables (None: plaintext)."""
    ca = ca if ca is not None else os.environ.get(f"{TLS_ENV}_CA", "")
    cert = cert if cert is not None else os.environ.get(f"{TLS_ENV}_CERT", "")
    key = key if key is not None else os.environ.get(f"{TLS_ENV}_KEY", "")
    if (cert or key) and not ca:
        raise ValueError("tls_cert and tls_key need tls_ca (the CA that signed the coordinator's certificate)")
    return channel_credentials(ca, cert, key) if ca else None


def _loopback(address: str) -> bool:
    """A coordinator address on this machine only (HOST:PORT, [IPv6]:PORT, unix:PATH)."""
    return address.startswith("unix:") or is_loopback(address.rsplit(":", 1)[0] if ":" in address else address)


class Client:
    """A connection to a coordinator (``specdec coordinator`` / ``specdec serve``).
    ``token``: the bearer token of a coordinator that authenticates its clients
    (default: the ``SPECDEC_TOKEN`` environment variable, if set). ``tls_ca``:
    reach the coordinator over TLS, verified against this CA file (PEM), with
    ``tls_cert`` / ``tls_key`` as the client's own certificate if it asks for one
    (defaults: ``SPECDEC_CLIENT_TLS_CA``, ``_CERT``, ``_KEY``), so the command-line
    tools take them from the environment too. ``tls_server_name`` (default
    ``SPECDEC_CLIENT_TLS_SERVER_NAME``): the name the coordinator's certificate
    must carry, when it is not the address's host (through a port-forward)."""

    def __init__(self, address: str | Sequence[str] = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 max_message_bytes: int = 64 << 20, failover_s: float | None = None, token: str | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None):
        # One address, several, or several in one string: "c1:50051,c2:50051".
        parts = address.split(",") if isinstance(address, str) else list(address)
        self.addresses = [a.strip() for a in parts if a.strip()]
        if not self.addresses:
            raise ValueError("give at least one coordinator address")
        self.timeout = timeout  # default deadline of every call (None: none)
        # Going on through another coordinator needs another; alone, errors are raised at once.
        self.failover_s = failover_s if failover_s is not None else 30.0 if len(self.addresses) > 1 else 0.0
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # reconnect within a second or two to a coordinator that was not up yet
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        credentials = _tls_credentials(tls_ca, tls_cert, tls_key)
        name = tls_server_name if tls_server_name is not None else os.environ.get(f"{TLS_ENV}_SERVER_NAME", "")
        if name and credentials is None:
            raise ValueError("tls_server_name needs tls_ca (a name is checked only over TLS)")
        if credentials is not None:
            options += [("grpc.ssl_target_name_override", name)] if name else []
            self._channels = [grpc.secure_channel(a, credentials, options=options) for a in self.addresses]
        else:
            self._channels = [grpc.insecure_channel(a, options=options) for a in self.addresses]
        self._stubs = [pb_grpc.CoordinatorStub(c) for c in self._channels]
        self._current = 0  # the coordinator calls go to, until it fails
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        remote = [a for a in self.addresses if not _loopback(a)]
        if token and credentials is None and remote:
            log.warning("sending a bearer token without TLS to %s: anyone on the path can read it (give tls_ca, "
                        "or %s_CA)", ", ".join(remote), TLS_ENV)

    @property
    def address(self) -> str:
        return self.addresses[self._current]

    @property
    def channel(self) -> grpc.Channel:
        return self._channels[self._current]

    @property
    def _stub(self) -> pb_grpc.CoordinatorStub:
        return self._stubs[self._current]

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Iterable[int] | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        gamma_policy: str = "",
        stop: Iterable[str] | str = (),
        session_id: str = "",
        draft_top_k: int | None = None,
        timeout: float | None = None,
    ) -> Iterator[Delta | Stats]:
        """Stream a completion of ``prompt`` (text) or ``prompt_ids``: a
        :class:`Delta` per round as soon as it is accepted, then one
        :class:`Stats`. ``session_id`` continues a conversation (the prompt is
        appended to its history; only the new part is pre-filled). Under
        sampling the draft samples from, and sends, its top ``draft_top_k``
        tokens (None: the coordinator's ``--draft-top-k``; 0: all of them).
        Breaking out of the loop cancels the request."""
        # Plain ints, once (an iterator would be used up by the check); numpy and
        # torch integers too, and not by truth value (an array has none).
        prompt_ids = _token_ids(prompt_ids)
        _check_fields(max_new_tokens=max_new_tokens, top_k=top_k, seed=seed, draft_top_k=draft_top_k)
        try:
            job = GenerateJob(prompt=prompt or "", prompt_ids=tuple(prompt_ids), max_new_tokens=max_new_tokens,
                              sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                              gamma_policy=gamma_policy, stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
                              session_id=session_id, draft_top_k=draft_top_k)
        except ValueError as e:  # the sampling settings
            raise errors.InvalidRequest(f"sampling: {e}") from None
        if session_id:  # named, so that a broken stream can resume it
            job = dataclasses.replace(job, turn_id=uuid.uuid4().hex)
        yield from self._stream(job, timeout if timeout is not None else self.timeout)

    def _stream(self, job: GenerateJob, timeout: float | None) -> Iterator[Delta | Stats]:
        """One turn's events, through the next coordinator when one fails (see the module docstring)."""
        received, give_up_at = 0, None  # deltas received; when to stop failing over
        while True:
            call = self._stub.Generate(convert.generate_request(job), timeout=timeout, metadata=self._metadata)
            try:
                for message in call:
                    event = convert.event_from_proto(message)
                    yield event
                    if not isinstance(event, Delta):
                        return  # the stats: the turn is complete, nothing after them is worth a resume
                    received, give_up_at = received + 1, None  # progress: a later failure gets its own time
                return
            except grpc.RpcError as e:
                give_up_at = give_up_at or time.monotonic() + self.failover_s
                if not self._fail_over(e, job, received, give_up_at):
                    raise errors.from_rpc_error(e) from None
                if job.session_id:
                    job = dataclasses.replace(job, resume_after=received)
            finally:
                call.cancel()  # no-op when the stream is complete; frees the session otherwise

    def _fail_over(self, e: grpc.RpcError, job: GenerateJob, received: int, give_up_at: float) -> bool:
        """Whether to go on through the next coordinator (switched to, after a
        pause): when this one is gone (no answer of its own) or draining, or
        answered UNAVAILABLE with a retry-after hint (its session directory was
        down longer than it waits: the turn can be resumed once it is back), after
        that hint. Another UNAVAILABLE it answered itself (a model service or the
        directory down now) would be the same through any other."""
        unavailable = e.code() == grpc.StatusCode.UNAVAILABLE
        hint = errors.retry_after(e) if unavailable else None
        gone = errors.raised_by_server(e) in (None, errors.Draining.__name__)
        resumable = bool(job.session_id) or received == 0
        if not unavailable or not (gone or hint is not None) or not resumable or time.monotonic() >= give_up_at:
            return False
        log.warning("coordinator %s: %s; going on through %s after %d deltas", self.address, e.details(),
                    self.addresses[(self._current + 1) % len(self.addresses)], received)
        self._current = (self._current + 1) % len(self.addresses)
        pause = 0.2 if len(self.addresses) > 1 else 0.5
        time.sleep(pause if hint is None else min(hint, max(0.0, give_up_at - time.monotonic())))
        return True

    def complete(self, prompt: str | None = None, **kwargs) -> Completion:
        """:meth:`generate`, collected: the whole text, ids and stats."""
        text, ids, stats = [], [], None
        for event in self.generate(prompt, **kwargs):
            if isinstance(event, Delta):
                text.append(event.text)
                ids.extend(event.token_ids)
            else:
                stats = event
        return Completion("".join(text), ids, stats)

    def close_session(self, session_id: str, *, timeout: float | None = None) -> bool:
        """Forget a named session (NOT_FOUND -> ``SessionNotFound`` if unknown)."""
        try:
            return self._stub.CloseSession(
                pb.CloseSessionRequest(session_id=session_id),
                timeout=timeout if timeout is not None else self.timeout, metadata=self._metadata,
            ).existed
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the coordinator's health check reports SERVING."""
        import time

        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0,
                                    wait_for_ready=True).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise errors.Unavailable(f"coordinator at {self.address} not serving after {timeout:.0f} s")
            time.sleep(0.1)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_UINT32, _UINT64 = 2**32 - 1, 2**64 - 1
_FIELD_MAX = {"max_new_tokens": _UINT32, "top_k": _UINT32, "seed": _UINT64, "draft_top_k": _UINT32}


def _token_ids(prompt_ids) -> list[int]:
    """Token ids as plain ints in int32 (the wire type), or InvalidRequest naming the bad one."""
    if prompt_ids is None:
        return []
    try:
        if isinstance(prompt_ids, (str, bytes)):
            raise TypeError
        tokens = iter(prompt_ids)
    except TypeError:
        raise errors.InvalidRequest(f"prompt_ids must be a sequence of token ids, got {excerpt(prompt_ids)}") from None
    ids = []
    for i, token in enumerate(tokens):
        try:
            if isinstance(token, bool):
                raise TypeError
            token = operator.index(token)
        except TypeError:
            batch = i == 0 and hasattr(token, "__len__") and not isinstance(token, str)
            hint = " (a batch of one? pass ids[0])" if batch else ""
            raise errors.InvalidRequest(
                f"prompt_ids[{i}] = {excerpt(token)} is not a token id (an integer){hint}") from None
        if not -(2**31) <= token < 2**31:  # int32 on the wire; the coordinator checks the vocabulary
            raise errors.InvalidRequest(f"prompt_ids[{i}] = {token} is not a token id")
        ids.append(token)
    return ids


def _check_fields(**fields) -> None:
    """What protobuf would refuse with a bare "Value out of range", named."""
    for name, value in fields.items():
        if value is not None and not 0 <= value <= _FIELD_MAX[name]:
            raise errors.InvalidRequest(f"{name} must be in [0, {_FIELD_MAX[name]}], got {value}")
