"""The model pair: what the coordinator must know of the draft and target it
drives (vocabulary, context, EOS ids, γ limit), asked of both services and
checked to work together.

Asked at the first request, and again after the connection to either service
dropped: what answers next may be another process (a restart), perhaps with
another model or other limits.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
from collections.abc import Callable

from coordinator.remote import ServiceClient
from specdec.core.vocabulary import check_same_vocabulary
from specdec.models.tokenizer import vocabulary_fingerprint
from specdec.serving import errors

log = logging.getLogger("specdec.coordinator")


@dataclasses.dataclass(frozen=True)
class PairInfo:
    """What the coordinator needs to know about the model pair."""

    vocab_size: int
    context: int  # the smaller of the two models' context windows
    eos_token_ids: frozenset[int]
    draft_name: str
    target_name: str
    gamma_max: int  # the largest γ a request may use: the coordinator's limit or the services', if lower


class PairRegistry:
    """The pair's facts, read once and again after either connection dropped.
    ``on_change()`` runs when a re-read finds the services serve something else."""

    def __init__(self, draft: ServiceClient, target: ServiceClient, gamma_max: int,
                 tokenizer_dir: pathlib.Path | None = None, on_change: Callable[[], None] = lambda: None):
        self.draft, self.target = draft, target
        self.gamma_max, self.tokenizer_dir, self.on_change = gamma_max, tokenizer_dir, on_change
        self._lock = threading.Lock()
        self._pair: PairInfo | None = None
        # Counts the drops, so that a read that started before one does not store what it read.
        self._epoch = 0
        self._last: PairInfo | None = None  # the last one read, to log a change
        draft.on_connection_lost(lambda: self.forget("draft"))
        target.on_connection_lost(lambda: self.forget("target"))

    @property
    def known(self) -> PairInfo | None:
        return self._pair

    def forget(self, role: str) -> None:
        with self._lock:
            self._epoch += 1
            known, self._pair = self._pair, None
        if known is not None:
            log.info("lost the connection to the %s service: the model pair is checked again at the next request",
                     role)

    def get(self, fresh: bool = False) -> PairInfo:
        """The pair, asked of both services if not known (or when ``fresh``);
        FailedPrecondition if they cannot work together."""
        with self._lock:
            pair, epoch = self._pair, self._epoch
        if pair is not None and not fresh:
            return pair
        pair = self._read()
        with self._lock:
            if self._epoch == epoch:
                self._pair = pair
            before, self._last = self._last, pair
        if pair != before:  # the first check, or the services came back different
            self._log(pair, before)
            if before is not None:
                self.on_change()
        return pair

    def check_unchanged(self, pair: PairInfo) -> None:
        """Before a service that lost a session mid-turn (as a restarted one has)
        gets its history again: one turn never mixes two models."""
        now = self.get(fresh=True)
        if now != pair:
            raise errors.Unavailable(
                f"the services changed during this turn (now draft {now.draft_name!r}, target "
                f"{now.target_name!r}, context {now.context}; the turn began with {pair.draft_name!r}, "
                f"{pair.target_name!r}, context {pair.context}): the turn is stopped, send it again")

    def _read(self) -> PairInfo:
        d, t = self.draft.model_info(), self.target.model_info()
        draft, target = self._where(d, self.draft), self._where(t, self.target)
        try:
            check_same_vocabulary(draft, d.vocab_size, d.vocab_fingerprint, target, t.vocab_size, t.vocab_fingerprint)
        except ValueError as e:
            raise errors.FailedPrecondition(str(e)) from None
        if self.tokenizer_dir is not None and (self.tokenizer_dir / "tokenizer.json").is_file():
            mine = vocabulary_fingerprint(self.tokenizer_dir, t.vocab_size)
            if mine != t.vocab_fingerprint:
                raise errors.FailedPrecondition(
                    f"tokenizer mismatch: the coordinator's tokenizer {self.tokenizer_dir} (fingerprint {mine}) "
                    f"is not the one of {target} (fingerprint {t.vocab_fingerprint}): give --tokenizer DIR")
        # A policy growing past a service's limit would fail mid-stream (older services report none).
        limits = [info.gamma_max for info in (d, t) if info.HasField("gamma_max")]
        return PairInfo(vocab_size=t.vocab_size, context=min(d.max_context, t.max_context),
                        eos_token_ids=frozenset(t.eos_token_ids), draft_name=d.model_name,
                        target_name=t.model_name, gamma_max=min([self.gamma_max, *limits]))

    @staticmethod
    def _where(info, client: ServiceClient) -> str:
        return f"{client.role} {info.model_name!r} at {client.address}"

    def _log(self, pair: PairInfo, before: PairInfo | None) -> None:
        log.log(logging.INFO if before is None else logging.WARNING,
                "model pair%s: draft %r at %s + target %r at %s (vocab %d, context %d, eos %s, gamma max %d)",
                "" if before is None else " changed", pair.draft_name, self.draft.address, pair.target_name,
                self.target.address, pair.vocab_size, pair.context, sorted(pair.eos_token_ids), pair.gamma_max)
        if pair.gamma_max < self.gamma_max:
            log.warning("gamma is capped at %d, the services' limit (--gamma-max %d here; raise theirs with "
                        "their --gamma-max)", pair.gamma_max, self.gamma_max)
