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
* :mod:`specdec.coordinator.service` / :mod:`specdec.coordinator.server` — the gRPC servicer and
  the ``specdec coordinator`` process.
"""
