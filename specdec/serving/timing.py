"""What a service spent on one call (``ServerTiming`` on the wire).

The caller subtracts these from the time it observed to split a round into
server compute, host<->device copies, queueing behind other sessions, and the
rest: network and serialisation, the cross-device overhead.
"""

from __future__ import annotations

import dataclasses


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
