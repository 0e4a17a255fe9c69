"""The session directory: what the coordinator remembers about each session.

A session's KV caches live in the draft and target services; the directory holds
everything needed to *rebuild* them (the token history) and to continue the
conversation (sampling parameters, how far each side is known to be in sync).
Because the history is here, a service that evicted a session costs a re-pre-fill,
never a different output.

The interface is three calls on a whole record, so that a shared store can
implement it with plain get/set/delete of one serialised value and any
coordinator replica can continue any session.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Protocol

log = logging.getLogger("specdec.coordinator")


@dataclasses.dataclass
class SessionRecord:
    """One session, as the coordinator knows it between requests."""

    session_id: str
    tokens: list[int] = dataclasses.field(default_factory=list)  # committed history
    draft_synced: int = 0  # prefix of ``tokens`` the draft service is known to hold
    target_synced: int = 0  # ... and the target service
    # Sampling parameters of the last request (seed included), as plain values so
    # the record serialises trivially.
    sampling: dict = dataclasses.field(default_factory=dict)
    gamma_policy: str = ""
    next_round_id: int = 1  # round ids stay unique across turns (0 means "no id" to the services)
    # The session's name in the draft and target services (set when the record
    # is created): the session id plus a random suffix, so that two coordinators
    # (or one restarted, its directory lost) given the same session id never
    # continue each other's KV state.
    service_session_id: str = ""
    updated_at: float = dataclasses.field(default_factory=time.time)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SessionRecord:
        return cls(**data)


class SessionDirectory(Protocol):
    def get(self, session_id: str) -> SessionRecord | None:
        """The stored record, or None for an unknown (or closed) session."""

    def put(self, record: SessionRecord) -> None:
        """Create or replace the record."""

    def delete(self, session_id: str) -> bool:
        """Forget the session; True if it existed."""


class InMemoryDirectory:
    """The default directory: a dict in this process (one coordinator, nothing to
    install). Records are copied in and out so callers never share mutable state
    with the store — the same semantics a networked store would have. At most
    ``max_records`` are kept; beyond that the least recently written is dropped
    (a client that never closes its sessions cannot grow the coordinator
    without bound)."""

    def __init__(self, max_records: int = 100_000) -> None:
        self.max_records = max_records
        self._records: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            data = self._records.get(session_id)
        return None if data is None else SessionRecord.from_dict(_copy(data))

    def put(self, record: SessionRecord) -> None:
        record.updated_at = time.time()
        with self._lock:
            self._records[record.session_id] = _copy(record.to_dict())
            self._records.move_to_end(record.session_id)
            while len(self._records) > self.max_records:
                dropped, _ = self._records.popitem(last=False)
                log.info("session directory full (%d): forgot least recently used session %r",
                         self.max_records, dropped)

    def delete(self, session_id: str) -> bool:
        with self._lock:
            return self._records.pop(session_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


def _copy(data: dict) -> dict:
    return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
