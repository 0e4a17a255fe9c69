"""One Generate call in plain types, the same on both ends: the request
(:class:`GenerateJob`), and the events streamed back — a :class:`Delta` per
round, then :class:`GenerationStats`. The client builds and reads them, the
coordinator reads and fills them; :mod:`specdec.serving.convert` carries them
across the wire. Nothing here imports torch, so a client stays light."""

from __future__ import annotations

import dataclasses

from specdec.core.interfaces import SamplingParams


@dataclasses.dataclass(frozen=True)
class GenerateJob:
    """A client's request."""

    prompt: str = ""  # text; needs a tokenizer on the coordinator
    prompt_ids: tuple[int, ...] = ()  # or token ids: exactly one of the two
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    gamma_policy: str = ""  # "" = the coordinator's default
    stop: tuple[str, ...] = ()
    session_id: str = ""  # "" = one-shot
    draft_top_k: int | None = None  # None: the coordinator's default; 0: dense q
    turn_id: str = ""  # names the turn, so that it can be resumed
    # Resume turn ``turn_id`` after the first N of its deltas (the ones the
    # client received); None: a new turn.
    resume_after: int | None = None


@dataclasses.dataclass(frozen=True)
class Delta:
    """Tokens committed by one round, and the text they complete (text waits for
    whole characters, and for a possible stop string to be decided)."""

    token_ids: list[int]
    text: str


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    session_id: str
    finish_reason: str  # "eos" | "length" | "stop"
    prompt_tokens: int
    generated_tokens: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    gammas: list[int]
    accepted_per_round: list[int]
    elapsed_s: float
    tokens_per_second: float
    target_prefill_tokens: int  # history tokens the target (re-)ran for this request
    draft_prefill_tokens: int
    draft_compute_s: float = 0.0
    target_compute_s: float = 0.0
    queue_s: float = 0.0
    copy_s: float = 0.0
    draft_network_s: float = 0.0  # network + serialisation: waited on the call − server time
    target_network_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    history_tokens: int = 0  # the session's tokens before this turn (0: a new session)
    prepared_rounds: int = 0  # drafting rounds whose drafts were ready before they were asked for

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_gamma(self) -> float:
        return sum(self.gammas) / len(self.gammas) if self.gammas else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per round: accepted drafts plus the target's own token."""
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def network_s(self) -> float:
        return self.draft_network_s + self.target_network_s

    def time_split(self) -> dict[str, float]:
        """Where the turn's wall time went, in seconds: the target's compute, the
        draft's compute the rounds waited for (drafts made ahead while the target
        verified cost nothing here), the network with serialisation, the
        services' queues and copies, and the rest: the coordinator's own work."""
        split = {"target compute": self.target_compute_s, "draft compute (waited for)": self.draft_compute_s,
                 "network + serialisation": self.network_s, "service queues + copies": self.queue_s + self.copy_s}
        split["coordinator + client"] = max(0.0, self.elapsed_s - sum(split.values()))
        return split

    @property
    def bytes_per_round(self) -> float:
        return (self.bytes_sent + self.bytes_received) / self.rounds if self.rounds else 0.0


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What a draft or target service says it serves (its GetModelInfo), as the
    coordinator checks a pair with."""

    model_name: str
    vocab_size: int
    vocab_fingerprint: str
    max_context: int
    eos_token_ids: frozenset[int]
    gamma_max: int | None = None  # the most drafts a round may carry there (None: not reported)
    architecture: str = ""
    has_tokenizer: bool = False
