"""The coordinator: drives speculative rounds between a draft service and a
target service and streams completions to clients.

* :mod:`coordinator.engine` — the pipeline of one Generate: the pieces below,
  wired, inside a span;
* :mod:`coordinator.requests` — a client's request in core types, and its checks;
* :mod:`coordinator.pair` — what the two services serve, checked to work together;
* :mod:`coordinator.leases` — one request per session at a time;
* :mod:`coordinator.learned_gamma` — what adaptive γ learnt, for the next request;
* :mod:`coordinator.turn` — one turn on one session: rounds, commit or roll back, stats;
* :mod:`coordinator.remote` — gRPC clients of the two services shaped as the
  round loop's Proposer / Verifier (deadlines, round ids, re-pre-fill on eviction);
* :mod:`coordinator.directory` — the session directory (in memory);
* :mod:`coordinator.service` / :mod:`coordinator.server` — the gRPC servicer and
  the ``specdec coordinator`` process.
"""
