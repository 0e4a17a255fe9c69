"""CUDA graphs of the lean forward's per-layer work.

Why: on a GPU at decoding batch sizes a forward pass of a small or mid-sized
model is mostly kernel launches, not arithmetic: each layer is a dozen small
kernels, each launched from Python (the reason vLLM and TensorRT-LLM capture
CUDA graphs). A CUDA graph records a sequence of kernels once and replays it
with one launch.

What is recorded: for each layer, its work before attention (norm, the q/k/v
product, rotary embedding) and its work after (output product, residual, norm,
MLP, residual). Attention itself stays outside: each session's KV cache lies
in memory of its own and grows, which a recording (fixed addresses, fixed
shapes) cannot follow. A recording also fixes the number of tokens, so passes
are padded up to the next size of 1, 2, 4, ... ``max_tokens``, each size with its
own recordings over its own fixed buffers, all made when the model loads;
larger passes (pre-fills) launch as they are. The padding rows compute zeros
that nothing reads: every recorded operation works row by row.

Off CUDA, :class:`LayerGraphs` runs the same fixed buffers with plain calls in
place of replays, which is how the tests check everything but the recording
itself on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LayerGraphs:
    """Per-size recordings of a ``LeanLlama``'s per-layer work (see the module docstring)."""

    def __init__(self, lean, max_tokens: int):
        device = lean.embed.device
        if device.type == "cuda":
            recorder = Recorder(device)
        else:
            def recorder(work):
                return work
        sizes = [1 << i for i in range(max(1, max_tokens).bit_length())]
        self.max_tokens = sizes[-1]
        self._sizes = {size: RecordedLayers(lean, size, recorder) for size in sizes}

    def for_tokens(self, tokens: int) -> RecordedLayers | None:
        """The recordings for a pass of ``tokens`` tokens; None beyond ``max_tokens``."""
        return self._sizes.get(1 << (tokens - 1).bit_length())


class RecordedLayers:
    """Fixed buffers for passes of up to ``size`` tokens, and each layer's work
    before and after attention recorded over them. The interface of
    :class:`specdec.models.lean_llama.EagerLayers`."""

    def __init__(self, lean, size: int, record: Callable[[Callable[[], None]], Callable[[], None]]):
        weight = lean.embed
        zeros = dict(dtype=weight.dtype, device=weight.device)
        self.n = 0
        self._x = torch.zeros(size, weight.shape[1], **zeros)  # the residual stream
        self._cos = torch.zeros(size, 1, lean.head_dim, **zeros)
        self._sin = torch.zeros_like(self._cos)
        self._qk = torch.zeros(size, lean.heads + lean.kv_heads, lean.head_dim, **zeros)
        self._v = torch.zeros(size, lean.kv_heads, lean.head_dim, **zeros)
        self._attention = torch.zeros(size, lean.heads * lean.head_dim, **zeros)

        def before(layer: int) -> Callable[[], None]:
            def work() -> None:
                qk, v = lean.before_attention(layer, self._x, self._cos, self._sin)
                self._qk.copy_(qk)
                self._v.copy_(v)
            return work

        def after(layer: int) -> Callable[[], None]:
            def work() -> None:
                self._x.copy_(lean.after_attention(layer, self._x, self._attention))
            return work

        layers = range(len(lean.layers))
        self._before = [record(before(i)) for i in layers]
        self._after = [record(after(i)) for i in layers]

    def start(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        n = self.n = x.shape[0]
        self._x[:n].copy_(x)
        self._x[n:].zero_()  # the last pass's rows: kept finite
        self._cos[:n].copy_(cos)
        self._sin[:n].copy_(sin)

    def before_attention(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._before[layer]()
        return self._qk[:self.n], self._v[:self.n]

    def after_attention(self, layer: int, attention: torch.Tensor) -> None:
        self._attention[:self.n].copy_(attention)
        self._after[layer]()

    @property
    def x(self) -> torch.Tensor:
        return self._x[:self.n]


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
