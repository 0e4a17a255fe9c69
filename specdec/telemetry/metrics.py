"""Prometheus metrics: what each service exports on ``/metrics``.

Every service object owns its own :class:`prometheus_client.CollectorRegistry`,
so several services in one process (tests, ``specdec serve`` variants) never
mix their numbers, and nothing registers in the library's global registry.

Speculative decoding counters mirror vLLM's ``spec_decode`` family with the
``specdec_`` prefix, so the familiar PromQL carries over::

    acceptance rate        = rate(specdec_spec_decode_num_accepted_tokens_total[5m])
                           / rate(specdec_spec_decode_num_draft_tokens_total[5m])
    mean acceptance length = 1 + rate(specdec_spec_decode_num_accepted_tokens_total[5m])
                               / rate(specdec_spec_decode_num_drafts_total[5m])
    acceptance at position i = rate(specdec_spec_decode_num_accepted_tokens_per_pos_total{position="i"}[5m])
                             / rate(specdec_spec_decode_num_drafts_total[5m])

Round phases (``specdec_round_phase_seconds{phase=...}``) are disjoint and add up
to the round: ``draft`` / ``target`` (server compute), ``queue`` (waiting behind
other sessions), ``copy`` (host<->device), ``network`` (network + serialisation
= what the coordinator observed minus what the servers report) and
``coordinator`` (the rest: the round loop itself).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROUND_PHASES = ("draft", "target", "queue", "copy", "network", "coordinator")

# HTTP methods as OpenTelemetry's HTTP conventions know them (RFC 9110's and
# PATCH); any other is "_OTHER": a client's method never makes a new series.
HTTP_METHODS = frozenset({"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"})


def http_method(method: str) -> str:
    """``method`` if it is a known HTTP method, else ``_OTHER`` (a bounded label)."""
    return method if method in HTTP_METHODS else "_OTHER"


class RpcMetrics:
    """Per-RPC metrics every gRPC service exports: latency and errors by code."""

    def __init__(self, service: str, registry: CollectorRegistry):
        self.service = service
        self.duration = Histogram(
            "specdec_rpc_server_duration_seconds", "Time to answer an RPC, by method (server side).",
            ["service", "method"], registry=registry, buckets=LATENCY_BUCKETS,
        )
        self.errors = Counter(
            "specdec_rpc_errors", "RPCs answered with an error, by gRPC status code.",
            ["service", "method", "code"], registry=registry,
        )

    def observe_rpc(self, method: str, seconds: float, code: str | None) -> None:
        self.duration.labels(self.service, method).observe(seconds)
        if code is not None and code != "OK":
            self.errors.labels(self.service, method, code).inc()


class CoordinatorMetrics(RpcMetrics):
    """The coordinator's view: every round it drives, split into phases."""

    def __init__(self, registry: CollectorRegistry | None = None, service: str = "coordinator"):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        super().__init__(service, self.registry)
        r = self.registry
        self.num_drafts = Counter("specdec_spec_decode_num_drafts", "Rounds that drafted (gamma > 0).", registry=r)
        self.num_draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.num_accepted_tokens = Counter(
            "specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", registry=r)
        self.num_accepted_per_pos = Counter(
            "specdec_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their 0-based position in the round's drafts.", ["position"], registry=r)
        self.accepted_length = Histogram(
            "specdec_accepted_length", "Drafts accepted per drafting round.", registry=r,
            buckets=tuple(range(0, 17)),
        )
        self.gamma = Gauge("specdec_gamma", "Gamma (tokens drafted) of the latest round.", registry=r)
        self.rounds = Counter("specdec_rounds", "Rounds run (gamma 0 included).", registry=r)
        self.draft_rounds = Counter(
            "specdec_draft_rounds", "Drafting rounds, by whether the draft service had prepared their drafts "
            "while the target verified the round before (ready=yes: no draft compute on the round's path).",
            ["ready"], registry=r)
        self.generated_tokens = Counter("specdec_generated_tokens", "Tokens committed to clients.", registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens received.", registry=r)
        self.requests = Counter("specdec_generate_requests", "Generate requests finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.round_duration = Histogram("specdec_round_duration_seconds", "Wall time of a round.",
                                        registry=r, buckets=LATENCY_BUCKETS)
        self.round_phase = Histogram(
            "specdec_round_phase_seconds",
            "Time of a round by phase (draft/target compute, queue, copy, network, coordinator).",
            ["phase"], registry=r, buckets=LATENCY_BUCKETS,
        )
        self.network = Histogram(
            "specdec_rpc_network_seconds",
            "Network + serialisation of one Propose/Verify: client-observed time minus server time.",
            ["side"], registry=r, buckets=LATENCY_BUCKETS,
        )
        self.bytes = Counter("specdec_rpc_bytes", "Serialized protobuf bytes of Propose/Verify, by side and direction.",
                             ["side", "direction"], registry=r)

        self.directory = Histogram(
            "specdec_directory_seconds", "Time of one session-directory operation (Redis: a round trip).",
            ["op"], registry=r, buckets=LATENCY_BUCKETS)
        self.directory_errors = Counter(
            "specdec_directory_errors", "Session-directory operations that failed (Redis unreachable).", ["op"],
            registry=r)
        self.lease_conflicts = Counter(
            "specdec_lease_conflicts", "Requests refused because another coordinator held the session.", registry=r)
        self.turns_resumed = Counter(
            "specdec_turns_resumed", "Turns resumed after their stream broke (resume_after).", registry=r)
        self.pins = Counter(
            "specdec_replica_pins", "Sessions pinned to a replica, by role and cause (new: a session's first; "
            "gone, unhealthy: its replica left or is out at a turn's start; failed: moved mid-turn).",
            ["role", "cause"], registry=r)
        self.failovers = Counter(
            "specdec_failovers", "Turns moved to another replica mid-turn, by role.", ["role"], registry=r)
        self.prefills = Counter(
            "specdec_re_prefills", "Sessions re-pre-filled from their history, by role and cause (evicted: the "
            "replica lost it; moved: another replica took it over; turn cut short: its last turn did not finish).",
            ["role", "cause"], registry=r)

        self.http_requests = Counter(
            "specdec_http_requests", "HTTP API requests answered, by route, method and status code.",
            ["route", "method", "status"], registry=r)
        self.http_duration = Histogram(
            "specdec_http_server_duration_seconds", "Time to answer an HTTP API request (a streamed one: to its "
            "last chunk), by route and status code.", ["route", "status"], registry=r, buckets=LATENCY_BUCKETS)

    def watch_replicas(self, snapshot: Callable[[], Mapping[str, Iterable]]) -> None:
        """Report ``snapshot()`` ({role: [ReplicaStatus]}) at each scrape:
        turns in flight and health of every replica."""
        self.registry.register(_ReplicaCollector(snapshot))

    def observe_round(self, *, gamma: int, accepted: int, wall_s: float,
                      phases: Mapping[str, float]) -> None:
        self.rounds.inc()
        self.gamma.set(gamma)
        self.round_duration.observe(wall_s)
        for phase, seconds in phases.items():
            self.round_phase.labels(phase).observe(seconds)
        if gamma > 0:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(gamma)
            self.num_accepted_tokens.inc(accepted)
            self.accepted_length.observe(accepted)
            for position in range(gamma):  # every drafted position has a series, 0 until accepted
                counter = self.num_accepted_per_pos.labels(str(position))
                if position < accepted:
                    counter.inc()

    def observe_http(self, route: str, method: str, status: int, seconds: float) -> None:
        """An HTTP API request answered (``route``: one of the API's, or
        "unmatched"; ``method``: as the client sent it, counted as
        :func:`http_method` has it)."""
        self.http_requests.labels(route, http_method(method), str(status)).inc()
        self.http_duration.labels(route, str(status)).observe(seconds)

    def observe_call(self, side: str, network_s: float, bytes_out: int, bytes_in: int) -> None:
        self.network.labels(side).observe(network_s)
        self.bytes.labels(side, "out").inc(bytes_out)
        self.bytes.labels(side, "in").inc(bytes_in)

    def observe_streamed(self, tokens: int) -> None:
        """Tokens streamed to a client (a round's tokens past a stop string are not)."""
        self.generated_tokens.inc(tokens)

    def observe_request(self, *, prompt_tokens: int, finish_reason: str) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.requests.labels(finish_reason).inc()


class ServiceMetrics(RpcMetrics):
    """A draft or target service: its model work and its session store.

    ``sessions`` returns the store's :class:`specdec.serving.sessions.StoreStats` (or None
    while the model loads); it is read at scrape time, so the store needs no
    hooks."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None,
                 sessions: Callable[[], object | None] | None = None):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        super().__init__(service, self.registry)
        r = self.registry
        self.server_seconds = Counter(
            "specdec_server_seconds", "Seconds the model service spent, by part (queue, compute, copy).",
            ["service", "part"], registry=r)
        self.computed_tokens = Counter("specdec_server_computed_tokens", "Tokens run through the model.",
                                       ["service"], registry=r)
        self.proposed_tokens = Counter("specdec_draft_proposed_tokens", "Draft tokens streamed by Propose.",
                                       ["service"], registry=r)
        self.verified_tokens = Counter("specdec_target_verified_draft_tokens", "Draft tokens judged by Verify.",
                                       ["service"], registry=r)
        self.target_accepted_tokens = Counter("specdec_target_accepted_tokens", "Draft tokens Verify accepted.",
                                              ["service"], registry=r)
        self.draft_ahead_tokens = Counter(
            "specdec_draft_ahead_tokens", "Drafts made ahead while the target verified: for the outcome that "
            "every draft is accepted, after the guess at the target's token (outcome=made), for a rejection "
            "corrected with the draft's runner-up (outcome=branched), and those a later Propose answered without "
            "running the model (outcome=reused).",
            ["service", "outcome"], registry=r)
        self.pass_sequences = Histogram(
            "specdec_batch_sequences", "Sessions in each forward pass.", ["service"], registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.pass_tokens = Histogram(
            "specdec_batch_tokens", "New tokens in each forward pass.", ["service"], registry=r,
            buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
        self.pass_seconds = Histogram(
            "specdec_batch_pass_seconds", "Time of each forward pass (with the steps around it).",
            ["service"], registry=r, buckets=LATENCY_BUCKETS)
        self.queue_wait = Histogram(
            "specdec_queue_wait_seconds", "Time a call waited for its first forward pass.", ["service"],
            registry=r, buckets=LATENCY_BUCKETS)
        self.sessions_watched = False
        if sessions is not None:
            self.watch_sessions(sessions)

    def watch_sessions(self, sessions: Callable[[], object | None]) -> None:
        """Export the session store's gauges, read from ``sessions()`` at scrape time."""
        if not self.sessions_watched:
            self.registry.register(_SessionCollector(self.service, sessions))
            self.sessions_watched = True

    def observe_timing(self, timing) -> None:
        """A ServerTiming (protobuf or dataclass) the service reported."""
        s = self.service
        self.server_seconds.labels(s, "queue").inc(timing.queue_s)
        self.server_seconds.labels(s, "compute").inc(timing.compute_s)
        self.server_seconds.labels(s, "copy").inc(timing.copy_s)
        self.computed_tokens.labels(s).inc(timing.computed_tokens)

    def observe_pass(self, stats) -> None:
        """A forward pass (:class:`specdec.serving.scheduler.PassStats`)."""
        self.pass_sequences.labels(self.service).observe(stats.sequences)
        self.pass_tokens.labels(self.service).observe(stats.tokens)
        self.pass_seconds.labels(self.service).observe(stats.seconds)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.labels(self.service).observe(seconds)

    def observe_proposed(self, tokens: int) -> None:
        self.proposed_tokens.labels(self.service).inc(tokens)

    def observe_draft_ahead(self, made: int = 0, reused: int = 0, branched: int = 0) -> None:
        self.draft_ahead_tokens.labels(self.service, "made").inc(made)
        self.draft_ahead_tokens.labels(self.service, "reused").inc(reused)
        self.draft_ahead_tokens.labels(self.service, "branched").inc(branched)

    def observe_verified(self, drafts: int, accepted: int) -> None:
        self.verified_tokens.labels(self.service).inc(drafts)
        self.target_accepted_tokens.labels(self.service).inc(accepted)


class _SessionCollector:
    """Session-store gauges and counters, read from the store when scraped."""

    def __init__(self, service: str, stats: Callable[[], object | None]):
        self.service, self.stats = service, stats

    def describe(self) -> Iterable:
        return self.families(None)

    def collect(self) -> Iterable:
        try:
            stats = self.stats()
        except Exception:  # a scrape must never take the service down
            log.exception("reading session stats for /metrics failed")
            stats = None
        return self.families(stats)

    def families(self, stats) -> list:
        def value(name):
            return float(getattr(stats, name)) if stats is not None else 0.0

        families = [
            (GaugeMetricFamily, "specdec_active_sessions", "Sessions held.", "active_sessions"),
            (GaugeMetricFamily, "specdec_cached_kv_tokens", "Tokens held in KV caches over all sessions.",
             "cached_tokens"),
            (GaugeMetricFamily, "specdec_kv_budget_tokens", "The KV budget: tokens all sessions may hold.",
             "budget_tokens"),
            (CounterMetricFamily, "specdec_kv_budget_refusals",
             "Calls refused RESOURCE_EXHAUSTED because the sessions in use hold the KV budget.", "refusals"),
            (CounterMetricFamily, "specdec_session_evictions", "Sessions evicted by the session or token cap.",
             "evictions"),
            (CounterMetricFamily, "specdec_session_expirations", "Sessions dropped after the idle TTL.",
             "expirations"),
        ]
        out = []
        for cls, name, doc, field in families:
            family = cls(name, doc, labels=["service"])
            family.add_metric([self.service], value(field))
            out.append(family)
        return out


class MetricsServer:
    """``/metrics`` over HTTP on a daemon thread (prometheus_client's WSGI server)."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0"):
        from prometheus_client import start_http_server

        try:
            self.httpd, self.thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port}: {e}") from None
        self.port = self.httpd.server_port
        self.host = host
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _ReplicaCollector:
    """Per replica, read from the pools when scraped: ``specdec_replica_turns``
    (turns in flight through this coordinator) and ``specdec_replica_healthy``."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Iterable]]):
        self.snapshot = snapshot

    def describe(self):
        return []  # not known before the first scrape: the pools may still be resolving

    def collect(self):
        turns = GaugeMetricFamily("specdec_replica_turns", "Turns in flight on a replica through this coordinator.",
                                  labels=["role", "address"])
        healthy = GaugeMetricFamily("specdec_replica_healthy", "1 if the replica takes new sessions, else 0.",
                                    labels=["role", "address"])
        for role, replicas in self.snapshot().items():
            for replica in replicas:
                turns.add_metric([role, replica.address], replica.load)
                healthy.add_metric([role, replica.address], 1.0 if replica.healthy else 0.0)
        yield turns
        yield healthy
