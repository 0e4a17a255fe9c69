"""The model pair: what the coordinator must know of the draft and target it
drives (vocabulary, context, EOS ids, γ limit), asked of both services and
checked to work together.

Each replica is asked at its first turn, and again after its connection
dropped: what answers next may be another process (a restart), perhaps with
another model or other limits.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
import weakref
from collections.abc import Callable

from specdec.coordinator.remote import ServiceClient
from specdec.core.vocabulary import shared_vocabulary
from specdec.models.tokenizer import vocabulary_fingerprint
from specdec.serving import errors
from specdec.serving.generation import ModelFacts

log = logging.getLogger("specdec.coordinator")


@dataclasses.dataclass(frozen=True)
class PairInfo:
    """What the coordinator needs to know about the model pair."""

    vocab_size: int  # the target's: what a request's ids and q are checked against
    context: int  # the smaller of the two models' context windows
    eos_token_ids: frozenset[int]
    draft_name: str
    target_name: str
    gamma_max: int  # the largest γ a request may use: the coordinator's limit or the services', if lower
    vocab_fingerprint: str = ""  # the vocabulary both serve
    draft_vocab_size: int = 0  # the draft's rows (padding may make it differ from the target's)


class PairRegistry:
    """The pair's facts for any draft and target replica, from each replica's
    ModelInfo: read once, and again after its connection dropped. A replica
    serving another model than the rest of its role is named in a warning;
    one turn never mixes two (:meth:`check_unchanged`). ``on_change()`` runs
    when the pair read last differs from the one before (another model)."""

    def __init__(self, gamma_max: int, tokenizer_dir: pathlib.Path | None = None,
                 on_change: Callable[[], None] = lambda: None):
        self.gamma_max, self.tokenizer_dir, self.on_change = gamma_max, tokenizer_dir, on_change
        self._lock = threading.Lock()
        # By client (a replica's address may come back as another pod, with a new client):
        # its ModelInfo while connected, and its drops (a read from before one is not kept).
        self._infos: weakref.WeakKeyDictionary[ServiceClient, ModelFacts] = weakref.WeakKeyDictionary()
        self._epochs: weakref.WeakKeyDictionary[ServiceClient, int] = weakref.WeakKeyDictionary()
        self._watched: weakref.WeakSet[ServiceClient] = weakref.WeakSet()
        self._last: PairInfo | None = None  # the last pair read, to log a change
        self._last_from: tuple = ()
        self._fingerprints: dict[int, str] = {}  # the tokenizer's, by vocabulary size

    @property
    def known(self) -> PairInfo | None:
        """The pair read last, while both its replicas' facts are still held."""
        with self._lock:
            held = bool(self._last_from) and all(c in self._infos for c in self._last_from)
            return self._last if held else None

    def forget(self, client: ServiceClient) -> None:
        with self._lock:
            self._epochs[client] = self._epochs.get(client, 0) + 1
            known = self._infos.pop(client, None)
        if known is not None:
            log.info("lost the connection to the %s service at %s: its model is checked again before its next "
                     "turn", client.role, client.address)

    async def get(self, draft: ServiceClient, target: ServiceClient, fresh: bool = False) -> PairInfo:
        """The pair these two replicas serve, asked of them if not known (or when
        ``fresh``); FailedPrecondition if they cannot work together."""
        d, t = await self.info(draft, fresh), await self.info(target, fresh)
        pair = self._pair(d, t, draft, target)
        with self._lock:
            before, self._last, self._last_from = self._last, pair, (draft, target)
        if pair != before:  # the first check, or the services came back different
            self._log(pair, before, draft, target)
            if before is not None:
                self.on_change()
        return pair

    async def differs(self, pair: PairInfo, client: ServiceClient, fresh: bool = False) -> str:
        """How the replica behind ``client`` differs from what ``pair`` says of
        its role ("": it does not). Only that replica is asked."""
        info = await self.info(client, fresh)
        name = pair.draft_name if client.role == "draft" else pair.target_name
        rows = pair.draft_vocab_size if client.role == "draft" else pair.vocab_size
        if info.model_name != name:
            return f"serves {info.model_name!r}, the turn began with {name!r}"
        if info.vocab_size != rows or info.vocab_fingerprint != pair.vocab_fingerprint:
            return f"has another vocabulary (size {info.vocab_size}, fingerprint {info.vocab_fingerprint})"
        if info.max_context < pair.context:
            return f"holds a context of {info.max_context}, the turn needs {pair.context}"
        if client.role == "target" and info.eos_token_ids != pair.eos_token_ids:
            return f"ends on EOS ids {sorted(info.eos_token_ids)}, the turn began with {sorted(pair.eos_token_ids)}"
        if info.gamma_max is not None and info.gamma_max < pair.gamma_max:
            return f"takes at most {info.gamma_max} tokens a round (--gamma-max), the turn may ask {pair.gamma_max}"
        return ""

    async def check_unchanged(self, pair: PairInfo, client: ServiceClient) -> None:
        """Before a replica that lost a session mid-turn (as a restarted one has)
        gets its history again: one turn never mixes two models."""
        why = await self.differs(pair, client, fresh=True)
        if why:
            raise errors.Unavailable(f"the {client.role} service at {client.address} changed during this turn: "
                                     f"it {why}; the turn is stopped, send it again")

    async def info(self, client: ServiceClient, fresh: bool = False) -> ModelFacts:
        """The replica's ModelInfo: held, or asked (and held until its connection drops)."""
        with self._lock:
            info, epoch = self._infos.get(client), self._epochs.get(client, 0)
            watch = client not in self._watched
            self._watched.add(client)
        if watch:
            client.on_connection_lost(lambda: self.forget(client))
        if info is not None and not fresh:
            return info
        info = await client.model_info()
        with self._lock:
            if self._epochs.get(client, 0) == epoch:
                self._infos[client] = info
            others = {c.address: i.model_name for c, i in self._infos.items()
                      if c.role == client.role and i.model_name != info.model_name}
        if others:
            log.warning("%s replica %s serves model %r, others another: %s; a turn runs on one model only",
                        client.role, client.address, info.model_name, others)
        return info

    def _pair(self, d: ModelFacts, t: ModelFacts, draft_client: ServiceClient,
              target_client: ServiceClient) -> PairInfo:
        draft, target = self._where(d, draft_client), self._where(t, target_client)
        try:
            shared_vocabulary(draft, d.vocab_size, d.vocab_fingerprint, target, t.vocab_size, t.vocab_fingerprint)
        except ValueError as e:
            raise errors.FailedPrecondition(str(e)) from None
        if self.tokenizer_dir is not None and (self.tokenizer_dir / "tokenizer.json").is_file():
            mine = self._fingerprint(t.vocab_size)
            if mine != t.vocab_fingerprint:
                raise errors.FailedPrecondition(
                    f"tokenizer mismatch: the coordinator's tokenizer {self.tokenizer_dir} (fingerprint {mine}) "
                    f"is not the one of {target} (fingerprint {t.vocab_fingerprint}): give --tokenizer DIR")
        # A policy growing past a service's limit would fail mid-stream (older services report none).
        limits = [info.gamma_max for info in (d, t) if info.gamma_max is not None]
        return PairInfo(vocab_size=t.vocab_size, context=min(d.max_context, t.max_context),
                        eos_token_ids=t.eos_token_ids, draft_name=d.model_name,
                        target_name=t.model_name, gamma_max=min([self.gamma_max, *limits]),
                        vocab_fingerprint=t.vocab_fingerprint, draft_vocab_size=d.vocab_size)

    def _fingerprint(self, vocab_size: int) -> str:
        if vocab_size not in self._fingerprints:
            self._fingerprints[vocab_size] = vocabulary_fingerprint(self.tokenizer_dir, vocab_size)
        return self._fingerprints[vocab_size]

    @staticmethod
    def _where(info, client: ServiceClient) -> str:
        return f"{client.role} {info.model_name!r} at {client.address}"

    def _log(self, pair: PairInfo, before: PairInfo | None, draft: ServiceClient, target: ServiceClient) -> None:
        log.log(logging.INFO if before is None else logging.WARNING,
                "model pair%s: draft %r at %s + target %r at %s (vocab %d, context %d, eos %s, gamma max %d)",
                "" if before is None else " changed", pair.draft_name, draft.address, pair.target_name,
                target.address, pair.vocab_size, pair.context, sorted(pair.eos_token_ids), pair.gamma_max)
        if pair.gamma_max < self.gamma_max:
            log.warning("gamma is capped at %d, the services' limit (--gamma-max %d here; raise theirs with "
                        "their --gamma-max)", pair.gamma_max, self.gamma_max)

