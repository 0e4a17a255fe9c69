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
own recordings over its own fixed buffers, made the first time a pass of that
size comes; larger passes (pre-fills) launch as they are. The padding rows
compute garbage that nothing reads: every recorded operation works row by row.

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
        self.lean = lean
        self.max_tokens = max_tokens
        self.record = lean.embed.device.type == "cuda"
        self._sizes: dict[int, RecordedLayers] = {}
        # One memory pool for every recording: they replay one at a time, in
        # turn, on the model's one thread.
        self._pool = torch.cuda.graph_pool_handle() if self.record else None

    def for_tokens(self, tokens: int) -> RecordedLayers | None:
        """The recordings for a pass of ``tokens`` tokens, made on first use;
        None beyond ``max_tokens``."""
        if tokens > self.max_tokens:
            return None
        size = 1 << (tokens - 1).bit_length()
        if size not in self._sizes:
            self._sizes[size] = RecordedLayers(self.lean, size, self._recorder())
        return self._sizes[size]

    def _recorder(self) -> Callable[[Callable[[], None]], Callable[[], None]]:
        if not self.record:
            return lambda work: work
        return lambda work: _record(work, self._pool)


class RecordedLayers:
    """Fixed buffers for passes of up to ``size`` tokens, and each layer's work
    before and after attention recorded over them. The interface of
    :class:`specdec.models.lean_llama.EagerLayers`."""

    def __init__(self, lean, size: int, record: Callable[[Callable[[], None]], Callable[[], None]]):
        weight = lean.embed
        zeros = dict(dtype=weight.dtype, device=weight.device)
        self.size, self.n = size, 0
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


def _record(work: Callable[[], None], pool) -> Callable[[], None]:
    """``work`` recorded as a CUDA graph; returns its replay. Run once first on a
    side stream, as PyTorch's CUDA graph notes ask, so that lazy initialisation
    (cuBLAS workspaces, the allocator's first blocks) is not recorded."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        work()
    return graph.replay
