"""What adaptive γ learnt, carried from one request to the next.

Round costs (network, devices, the model pair) belong to the deployment, so a
new request need not learn them again: an adaptive policy starts from the
estimates the last finished adaptive request of the same *regime* ended with.
Acceptance depends on how tokens are chosen (greedy acceptance can be twice
that of sampling) and on the prompt, so it is kept per regime and only partly
carried over (:meth:`specdec.core.gamma.AdaptiveGamma.for_new_request`).
"""

from __future__ import annotations

import logging
import threading

from specdec.core.gamma import AdaptiveGamma, GammaPolicy

log = logging.getLogger("specdec.coordinator")

MAX_LEARNED_REGIMES = 64  # one per decoding regime; clients choose the settings freely


def regime(params, draft_top_k: int) -> tuple:
    """What acceptance depends on besides the pair: greedy, or the sampling
    settings (the seed aside) and the draft's top-k."""
    if params.temperature == 0:
        return ("greedy",)
    return ("sampling", params.temperature, params.top_k, params.top_p, draft_top_k)


class LearnedGamma:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_regime: dict[tuple, AdaptiveGamma] = {}  # least recent first
        # The first request runs the channels' and services' slow first calls:
        # its round costs (a verify slope of 4x the usual, γ = 0 "best") would
        # mislead the requests that start from them, which would then idle for
        # dozens of rounds. It teaches nothing.
        self._first_request = True

    def warm_start(self, policy: GammaPolicy, key: tuple) -> GammaPolicy:
        """``policy``, or for an adaptive one what the same regime learnt last."""
        with self._lock:
            learned = self._by_regime.get(key)
        if isinstance(policy, AdaptiveGamma) and learned is not None and learned.gamma_max == policy.gamma_max:
            return learned.for_new_request()
        return policy

    def finished(self, policy: GammaPolicy, key: tuple) -> None:
        """A request finished with ``policy``: remember it, unless it was the first."""
        with self._lock:
            first, self._first_request = self._first_request, False
        if not first:
            self.remember(policy, key)

    def remember(self, policy: GammaPolicy, key: tuple) -> None:
        if not isinstance(policy, AdaptiveGamma):
            return
        with self._lock:
            log.debug("adaptive γ after a request: %s", policy.describe())
            self._by_regime.pop(key, None)
            self._by_regime[key] = policy
            while len(self._by_regime) > MAX_LEARNED_REGIMES:
                self._by_regime.pop(next(iter(self._by_regime)))

    def forget(self) -> None:
        """The pair changed: what was learnt belongs to the old one."""
        with self._lock:
            self._by_regime.clear()
            self._first_request = True
