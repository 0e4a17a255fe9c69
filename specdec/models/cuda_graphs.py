"""CUDA graphs of whole decode-sized passes, attention included.

Why: on a GPU at decoding batch sizes a forward pass is mostly kernel
launches, not arithmetic: each layer is a dozen small kernels launched from
Python (the reason vLLM, SGLang and TensorRT-LLM capture CUDA graphs). A graph
records the kernels of a pass once and replays them with one launch.

A recording fixes every address and shape, so a pass of T tokens is padded to
the next size of 1, 2, 4 ... ``max_tokens`` and run over that size's fixed
buffers: token ids, positions, and a ``varlen`` attention plan with room for T
rows (a pass of T tokens has at most T), each with a block table as wide as
the model's context. The paged store's pool never moves on a CUDA device, and
FlashAttention's paged kernel reads keys and values through the tables, so
the same recording serves any sessions of any lengths. Padding tokens write
their keys to the scratch block and belong to no row; padding rows hold no
positions; nothing reads what they compute. Larger passes (pre-fills), and
passes with rows that carry their own masks, run eagerly.

Each size is recorded when the model loads. Off CUDA the same buffers run with
plain calls in place of replays, which is how the tests check everything but
the recording itself on a CPU (with a reference of the varlen kernel).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from specdec.models.attention import GroupPlan, PassPlan

log = logging.getLogger(__name__)


class PassGraphs:
    """Recordings of ``run(ids, positions, keep, plan)`` for each padded pass size."""

    def __init__(self, run: Callable, kv, layer_of: dict[int, int], max_tokens: int, max_context: int):
        device = kv.device
        recorder = Recorder(device) if device.type == "cuda" else (lambda work: work)
        sizes = [1 << i for i in range(max(1, max_tokens).bit_length())]
        self.max_tokens = sizes[-1]
        self._sizes = {size: RecordedPass(run, kv, layer_of, size, max_context, recorder) for size in sizes}

    def for_tokens(self, tokens: int) -> RecordedPass | None:
        """The recording for a pass of ``tokens`` tokens; None beyond ``max_tokens``."""
        return self._sizes.get(1 << (tokens - 1).bit_length())


class RecordedPass:
    """The fixed buffers of passes of up to ``size`` tokens, and the pass recorded over them."""

    def __init__(self, run: Callable, kv, layer_of: dict[int, int], size: int, max_context: int,
                 record: Callable[[Callable[[], None]], Callable[[], None]]):
        device, i32 = kv.device, torch.int32
        width = -(-max_context // kv.block_size)
        self.ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.keep = torch.arange(size, device=device)  # every token's logits; the rows' are picked after
        groups = [GroupPlan(write=torch.zeros(size, dtype=torch.long, device=device), window=window,
                            block_table=torch.zeros(size, width, dtype=i32, device=device),
                            seq_used=torch.zeros(size, dtype=i32, device=device),
                            cu_k=torch.zeros(size + 1, dtype=i32, device=device), max_k=max_context)
                  for window in kv.windows]
        self.plan = PassPlan(kv=kv, kernel="varlen", layer_of=layer_of, groups=groups, rows=size,
                             positions_end=max_context, cu_q=torch.zeros(size + 1, dtype=i32, device=device),
                             max_q=size)
        self.logits: torch.Tensor | None = None

        def work() -> None:
            self.logits = run(self.ids, self.positions, self.keep, self.plan)

        self._replay = record(work)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, plan: PassPlan) -> torch.Tensor:
        """Logits [T, V] of every token of a pass whose inputs are ``ids`` and
        ``positions`` [T] and whose (varlen) plan is ``plan``."""
        n, rows, static = ids.shape[0], plan.rows, self.plan
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        static.cu_q[:rows + 1].copy_(plan.cu_q)
        static.cu_q[rows + 1:].fill_(n)  # padding rows hold no queries
        for mine, theirs in zip(static.groups, plan.groups, strict=True):
            mine.write[:n].copy_(theirs.write)
            mine.write[n:].zero_()  # padding tokens: the scratch block
            width = theirs.block_table.shape[1]
            mine.block_table[:rows, :width].copy_(theirs.block_table)
            mine.seq_used[:rows].copy_(theirs.seq_used)
            mine.seq_used[rows:].zero_()  # padding rows hold no positions
            torch.cumsum(mine.seq_used, 0, dtype=torch.int32, out=mine.cu_k[1:])
        self._replay()
        return self.logits[:n]


class Recorder:
    """Records work as CUDA graphs on one device; each recording returns its replay."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)
        # One memory pool for every recording: they replay one at a time, in
        # turn, on the model's one thread.
        with torch.cuda.device(device):
            self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, work: Callable[[], None]) -> Callable[[], None]:
        """Run ``work`` once first on a side stream, as PyTorch's CUDA graph notes
        ask, so that lazy initialisation (cuBLAS workspaces, the allocator's
        first blocks) is not recorded; then record it on that stream, on the
        model's device whichever device is current, only this thread's calls
        checked (another model's thread may go on meanwhile)."""
        with torch.cuda.device(self.device):
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                work()
            torch.cuda.current_stream().wait_stream(self.side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.side, capture_error_mode="thread_local"):
                work()
        return graph.replay
