"""The coordinator: drives speculative rounds between a draft service and a
target service and streams completions to clients.

* :mod:`specdec.coordinator.engine` — the pipeline of one Generate: the pieces below,
  wired, inside a span;
* :mod:`specdec.coordinator.requests` — a client's request in core types, and its checks;
* :mod:`specdec.coordinator.pair` — what the two services serve, checked to work together;
* :mod:`specdec.coordinator.leases` — one request per session at a time;
* :mod:`specdec.coordinator.learned_gamma` — what adaptive γ learnt, for the next request;
* :mod:`specdec.coordinator.turn` — one turn on one session: rounds, commit or roll back, stats;
* :mod:`specdec.coordinator.remote` — gRPC clients of the two services shaped as the
  round loop's Proposer / Verifier (deadlines, round ids, re-pre-fill on eviction);
* :mod:`specdec.coordinator.directory` — the session directory (in memory), and each
  client's count of named sessions (``--client-max-sessions``);
* :mod:`specdec.coordinator.streams` — a client's stream of one turn, for every protocol:
  admission and per-client limits, the turn's own context, cancellation, drain;
* :mod:`specdec.coordinator.service` / :mod:`specdec.coordinator.server` — the gRPC servicer and
  the ``specdec coordinator`` process;
* the OpenAI-compatible HTTP API (``--http-port``): :mod:`specdec.coordinator.openai_api` (the
  routes), :mod:`specdec.coordinator.openai_protocol` (requests and responses),
  :mod:`specdec.coordinator.openai_errors` (statuses), :mod:`specdec.coordinator.chat` (chat
  templates), :mod:`specdec.coordinator.http_guard` (span, metrics, size, token per request) and
  :mod:`specdec.coordinator.http_server` (uvicorn on the coordinator's loop).
"""
