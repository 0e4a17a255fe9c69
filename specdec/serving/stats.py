"""What one Generate request did and cost: the final event of a stream, the same
dataclass on the coordinator (which fills it) and in the client (which reads it);
specdec.serving.convert carries it across."""

from __future__ import annotations

import dataclasses


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

    @property
    def bytes_per_round(self) -> float:
        return (self.bytes_sent + self.bytes_received) / self.rounds if self.rounds else 0.0
