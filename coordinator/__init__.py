"""The coordinator: drives speculative rounds between a draft service and a target
service and streams completions to clients (DESIGN §1–§2).

* :mod:`coordinator.engine` — validation, sessions, the core round loop with
  remote proposer/verifier, text deltas and stop strings;
* :mod:`coordinator.remote` — gRPC clients of the two services shaped as the
  round loop's Proposer / Verifier (deadlines, round ids, re-pre-fill on eviction);
* :mod:`coordinator.directory` — the session directory (in memory; Redis later);
* :mod:`specdec.core.text` — incremental detokenisation and stop strings;
* :mod:`coordinator.service` / :mod:`coordinator.server` — the gRPC servicer and
  the ``specdec coordinator`` process.
"""
