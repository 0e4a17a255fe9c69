"""What a service spent on one call (``ServerTiming`` on the wire).

The caller subtracts these from the time it observed to split a round into
server compute, host<->device copies, queueing behind other sessions, and the
rest: network and serialisation, the cross-device overhead.

The service adds up :class:`ServerTiming` while it works; its caller reads the
reply's account as a :class:`CallTiming` (the passes averaged, as sent).
"""

from __future__ import annotations

import dataclasses

from specdec.core.interfaces import PassLoad


@dataclasses.dataclass
class ServerTiming:
    queue_s: float = 0.0  # waiting for the model executor (another session's pass)
    compute_s: float = 0.0  # forward passes, sampling, verification (copies excluded)
    copy_s: float = 0.0  # host <-> device copies of inputs and outputs
    computed_tokens: int = 0  # tokens run through the model in this call
    passes: int = 0  # forward passes this call was in
    pass_sequences: int = 0  # sessions in those passes, summed
    pass_tokens: int = 0  # new tokens in those passes, summed
    pass_seconds: float = 0.0  # their time, summed

    def per_pass(self, total: float) -> float:
        """``total`` over the passes this call was in (0: none)."""
        return total / self.passes if self.passes else 0.0

    def reported(self) -> CallTiming:
        """This call's account as the caller receives it."""
        return CallTiming(self.queue_s, self.compute_s, self.copy_s, self.computed_tokens,
                          self.per_pass(self.pass_sequences), self.per_pass(self.pass_tokens),
                          self.per_pass(self.pass_seconds))


@dataclasses.dataclass(frozen=True)
class CallTiming:
    """A service's account of one call, as its caller reads it off the reply."""

    queue_s: float = 0.0
    compute_s: float = 0.0
    copy_s: float = 0.0
    computed_tokens: int = 0
    batch_sequences: float = 0.0  # sessions per forward pass the call was in, on average (0: not reported)
    batch_tokens: float = 0.0  # new tokens per such pass, on average
    pass_s: float = 0.0  # seconds of one such pass, on average

    def pass_load(self) -> PassLoad | None:
        """The passes the call ran in, when the service reported them."""
        return PassLoad(self.batch_sequences, self.batch_tokens, self.pass_s) if self.batch_sequences else None
