"""A lean forward pass for Llama-architecture models: the target and the draft.

Why: at the batch sizes of decoding (one to a few tokens per session) a forward
pass through Hugging Face's modules spends much of its time not on arithmetic
but on Python: module calls, config lookups, mask construction and output
dataclasses, paid every layer of every pass. This module runs the same weights
with a handful of tensor operations per layer and a KV cache of its own
(tensors grown as needed; rolling back is lowering a length), over a ragged
batch of sessions in one pass.

Its logits equal Hugging Face's to float rounding, in float32 and bfloat16
(tests/models/test_lean_llama.py). For the draft that is only about acceptance:
the target judges each draft by the q it was sampled from, so any q gives the
target's output. For the target it is the output itself: greedy decoding is
Hugging Face's, but where two tokens tie to the last bit.

The weights are shared with the loaded model, not copied. Each layer's q, k and
v projections become one matrix, and gate and up another, each stored [in, out]
so that one product computes them; the model's own modules are left holding
views of those matrices, so Hugging Face's forward still runs on the same
memory.

Models this cannot run exactly as Hugging Face would (other architectures,
quantized or adapted weights, biases, other activations, rotary scalings that
depend on the sequence length) are reported by ``unsupported_reason`` and keep
Hugging Face's forward.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

# Rotary embeddings whose cos/sin depend only on the position (not on the
# sequence length), so a table computed once holds for every call.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model) -> str | None:
    """None if ``model`` can run through ``LeanLlama``; else why not."""
    config = model.config
    if config.model_type != "llama":
        return f"model type {config.model_type!r} is not 'llama'"
    if getattr(config, "quantization_config", None):
        return "quantized weights"
    linears = [model.lm_head] + [m for layer in model.model.layers for m in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    if any(type(m) is not torch.nn.Linear for m in linears):
        return "projections that are not plain nn.Linear (quantized or adapted weights)"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "attention or MLP biases"
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r} is not 'silu'"
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp != 1"
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} depends on the sequence length"
    return None


@dataclasses.dataclass
class LeanCache:
    """Keys and values of one sequence: [layers, kv_heads, capacity, head_dim]
    each, of which the first ``length`` positions are held. Rolling back is
    lowering ``length``. Capacity starts at the first pass's length and grows
    by half (at least 256 positions) when a pass needs more, up to the model's
    context: a session holds at most ~1.5× its tokens' worth, plus 256."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0

    def reserve(self, needed: int, limit: int) -> None:
        """Room for ``needed`` positions; grown to at most ``limit`` (or ``needed``)."""
        capacity = self.keys.shape[2]
        if needed <= capacity:
            return
        capacity = max(needed, min(capacity + max(256, capacity // 2), limit))
        grown_k = self.keys.new_empty(*self.keys.shape[:2], capacity, self.keys.shape[3])
        grown_v = torch.empty_like(grown_k)
        grown_k[:, :, : self.length] = self.keys[:, :, : self.length]
        grown_v[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = grown_k, grown_v


@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's weights as the lean forward multiplies them: every
    projection [in, out] (``x @ w``), with q, k and v side by side, and gate and up."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [hidden, (heads + 2 kv_heads) * head_dim]
    o: torch.Tensor  # [heads * head_dim, hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [hidden, 2 * intermediate]
    down: torch.Tensor  # [intermediate, hidden]
    eps: float


def _layer_weights(layer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=_side_by_side(attn.q_proj, attn.k_proj, attn.v_proj),
        o=_side_by_side(attn.o_proj),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=_side_by_side(mlp.gate_proj, mlp.up_proj),
        down=_side_by_side(mlp.down_proj),
        eps=layer.input_layernorm.variance_epsilon,
    )


def _side_by_side(*linears: torch.nn.Linear) -> torch.Tensor:
    """The linears' weights as one [in, Σ out] matrix, so that ``x @ w`` computes
    all their outputs in one product. Each linear is left holding a view of it
    (its [out, in] weight, transposed), so the model runs as before and no
    weight is held twice. [in, out] is also the faster layout for a few rows
    through MKL's float32 products on CPUs where it falls back to generic code."""
    fused = torch.cat([linear.weight.detach() for linear in linears]).t().contiguous()
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight = torch.nn.Parameter(fused[:, start:end].t(), requires_grad=False)
        start = end
    return fused


class LeanLlama:
    """The forward pass of a loaded ``LlamaForCausalLM`` with plain tensor ops.
    Shares the model's weights (nothing is copied; see the module docstring)."""

    def __init__(self, model, graph_tokens: int = 0):
        """``graph_tokens`` > 0: passes of up to that many tokens run their
        per-layer work through :class:`specdec.models.cuda_graphs.LayerGraphs`
        (recorded as CUDA graphs on a CUDA device)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"cannot run this model with the lean forward: {reason}")
        config = model.config
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.max_positions = config.max_position_embeddings
        with torch.no_grad():
            self.layers = [_layer_weights(layer) for layer in model.model.layers]
        self.embed = model.model.embed_tokens.weight.detach()  # [vocab, hidden]
        self.lm_head = model.lm_head.weight.detach()  # [vocab, hidden], the embedding itself when tied
        norm = model.model.norm
        self.final_norm, self.final_eps = norm.weight.detach(), norm.variance_epsilon
        self._cos = self._sin = None  # [positions, head_dim] rotary tables, grown on demand
        self.graphs = None
        if graph_tokens > 0:
            from specdec.models.cuda_graphs import LayerGraphs

            self.graphs = LayerGraphs(self, graph_tokens)

    def new_cache(self) -> LeanCache:
        shape = (len(self.layers), self.kv_heads, 0, self.head_dim)  # allocated by the first pass
        keys = torch.empty(shape, dtype=self.embed.dtype, device=self.embed.device)
        return LeanCache(keys=keys, values=torch.empty_like(keys))

    def _rotary(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [≥ end, head_dim] (see :func:`_rope`), from the model's
        own rotary module."""
        if self._cos is None or self._cos.shape[0] < end:
            current = 0 if self._cos is None else self._cos.shape[0]
            size = max(end, min(self.max_positions, max(256, 2 * current)))
            positions = torch.arange(size, device=self.embed.device)[None]
            cos, sin = self.model.model.rotary_emb(self.embed[:1][None], positions)
            half = self.head_dim // 2
            self._cos, self._sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return self._cos, self._sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: LeanCache, logits_to_keep: int) -> torch.Tensor:
        """Run ``input_ids`` [1, n] after the cached positions, appending their keys
        and values to ``cache``; return logits [logits_to_keep, V] for the last
        positions (what ``kv_cache.forward`` returns for Hugging Face's pass)."""
        return self.forward_batch([BatchRow(input_ids[0].tolist(), cache, logits_to_keep)])[0]

    @torch.inference_mode()
    def forward_batch(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        """One pass over a ragged batch: each row's new tokens after its own cached
        positions, appended to its own cache. Returns each row's logits
        [logits_to_keep, V] for its last positions.

        Every token of every row goes through the projections and the MLP together
        ([T, hidden] with T the batch's new tokens: where a batch saves time, since
        the weights are read once); attention runs row by row, against the row's
        own cache where it lies. A batch of one row is the unbatched pass."""
        spans = []  # (first flat index, start position, new tokens) per row
        flat: list[int] = []
        for row in rows:
            start = row.cache.length
            row.cache.reserve(start + len(row.tokens), self.max_positions)
            spans.append((len(flat), start, len(row.tokens)))
            flat += row.tokens
        total = len(flat)
        cos, sin = self._rotary(max(start + n for _, start, n in spans))
        # one angle per token, broadcast over heads: [T, 1, head_dim]
        cos = _rows(cos, [(start, n) for _, start, n in spans])[:, None]
        sin = _rows(sin, [(start, n) for _, start, n in spans])[:, None]
        x = F.embedding(torch.tensor(flat, device=self.embed.device), self.embed)  # [T, hidden]
        layers = (self.graphs and self.graphs.for_tokens(total)) or EagerLayers(self)
        layers.start(x, cos, sin)
        for i in range(len(self.layers)):
            qk, v = layers.before_attention(i)
            q, k = qk[:, :self.heads], qk[:, self.heads:]
            out = [self._attend(i, row.cache, q, k, v, span) for row, span in zip(rows, spans, strict=True)]
            layers.after_attention(i, out[0] if len(out) == 1 else torch.cat(out))
        for row, (_, start, n) in zip(rows, spans, strict=True):
            row.cache.length = start + n
        x = layers.x
        kept = _rows(x, [(first + n - row.logits_to_keep, row.logits_to_keep)
                         for row, (first, _, n) in zip(rows, spans, strict=True)])
        logits = F.linear(_rms_norm(kept, self.final_norm, self.final_eps), self.lm_head)
        return list(logits.split([row.logits_to_keep for row in rows]))

    def before_attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's work before attention, for the residual stream ``x`` [T, hidden]:
        queries and keys, rotated [T, heads + kv_heads, head_dim], and values
        [T, kv_heads, head_dim]."""
        w, heads, kv = self.layers[layer], self.heads, self.kv_heads
        qkv = (_rms_norm(x, w.input_norm, w.eps) @ w.qkv).view(x.shape[0], heads + 2 * kv, self.head_dim)
        return _rope(qkv[:, :heads + kv], cos, sin), qkv[:, heads + kv:]  # q and k rotated together

    def after_attention(self, layer: int, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """A layer's work after attention ([T, heads * head_dim]): the residual stream it leaves."""
        w = self.layers[layer]
        x = torch.addmm(x, attention, w.o)  # x + attention @ o
        gate, up = (_rms_norm(x, w.post_norm, w.eps) @ w.gate_up).chunk(2, dim=-1)
        return torch.addmm(x, F.silu(gate) * up, w.down)  # x + mlp

    def _attend(self, layer: int, cache: LeanCache, q, k, v, span: tuple[int, int, int]) -> torch.Tensor:
        """One row's attention in one layer: its new keys and values [n, kv_heads,
        head_dim] written into its cache, its queries against every position up to
        each; returns [n, heads * head_dim]."""
        first, start, n = span
        end = start + n
        cache.keys[layer, :, start:end] = k[first:first + n].transpose(0, 1)
        cache.values[layer, :, start:end] = v[first:first + n].transpose(0, 1)
        # A new token at position start+i sees every cached position and the new
        # ones up to itself: causal when nothing is cached, an offset mask when
        # something is, none for one token alone.
        mask = None
        if n > 1 and start:
            mask = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        keys, values = cache.keys[layer, :, :end], cache.values[layer, :, :end]
        # With a mask, SDPA's fused CUDA kernels take grouped K/V only repeated
        # out (as Hugging Face does); without one they take them as they are.
        groups = self.heads // self.kv_heads if mask is not None else 1
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
        out = F.scaled_dot_product_attention(
            q[first:first + n].transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
            is_causal=n > 1 and not start, enable_gqa=keys.shape[0] != self.heads,
        )[0]  # [heads, n, head_dim]
        return out.transpose(0, 1).reshape(n, -1)


class EagerLayers:
    """A pass's per-layer work around attention, each operation launched as it
    comes (:class:`specdec.models.cuda_graphs.LayerGraphs` replays recordings of
    the same work instead). ``x`` is the residual stream [T, hidden]."""

    def __init__(self, lean: LeanLlama):
        self.lean = lean

    def start(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.x, self.cos, self.sin = x, cos, sin

    def before_attention(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lean.before_attention(layer, self.x, self.cos, self.sin)

    def after_attention(self, layer: int, attention: torch.Tensor) -> None:
        self.x = self.lean.after_attention(layer, self.x, attention)


@dataclasses.dataclass
class BatchRow:
    """One sequence's part of a batched pass: the ``tokens`` to run after what
    ``cache`` holds, and how many of the last positions' logits to return."""

    tokens: list[int]
    cache: LeanCache
    logits_to_keep: int


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalised in float32, scaled in the input's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def _rows(x: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The rows [start, start + n) of ``x`` for each (start, n), in order: a view
    when there is one range (a pass of one session), else a copy."""
    if len(ranges) == 1:
        start, n = ranges[0]
        return x[start:start + n]
    return torch.cat([x[start:start + n] for start, n in ranges])


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [..., head_dim] by position (``cos``, ``signed_sin`` broadcast to it):
    each half-pair (a, b) of a head's dimensions turns by the position's angle,
    (a cos - b sin, b cos + a sin). Rolling the halves gives (b, a), and the sine's
    first half carries the minus sign: three operations instead of six."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
