"""A lean forward pass for Llama-architecture drafts.

Why: a draft proposes one token per forward pass, and for a small draft most of
that pass is not arithmetic but Python: Hugging Face's module calls, config
lookups, mask construction and output dataclasses. On the bundled 1-layer draft
that overhead is about half of each ~1 ms step, and every round pays it γ times.
This module runs the same weights with plain tensor operations and a KV cache
of its own (tensors grown as needed; rolling back is lowering a length).

Why it is safe: the draft's numerics never change what is generated. The target
accepts or rejects each draft token against the probabilities the draft actually
sampled it from (see specdec.core.verification), so any draft distribution q gives
exactly the target's output. The target always runs through Hugging Face's own
forward. Logits match Hugging Face's to float rounding (tests/models/test_lean_llama.py);
that only keeps the acceptance rate the same.

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


class LeanLlama:
    """The forward pass of a loaded ``LlamaForCausalLM`` with plain tensor ops.
    Shares the model's weights (nothing is copied)."""

    def __init__(self, model):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"cannot run this model with the lean forward: {reason}")
        config = model.config
        self.model = model
        self.layers = list(model.model.layers)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.max_positions = config.max_position_embeddings
        self._cos = self._sin = None  # [positions, head_dim] rotary tables, grown on demand

    def new_cache(self) -> LeanCache:
        weight = self.model.model.embed_tokens.weight
        shape = (len(self.layers), self.kv_heads, 0, self.head_dim)  # allocated by the first pass
        keys = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        return LeanCache(keys=keys, values=torch.empty_like(keys))

    def _rotary(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [end - start, head_dim] from the model's own rotary module."""
        if self._cos is None or self._cos.shape[0] < end:
            current = 0 if self._cos is None else self._cos.shape[0]
            size = max(end, min(self.max_positions, max(256, 2 * current)))
            weight = self.model.model.embed_tokens.weight
            positions = torch.arange(size, device=weight.device)[None]
            cos, sin = self.model.model.rotary_emb(weight[:1][None], positions)
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[start:end], self._sin[start:end]

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
        device = self.model.model.embed_tokens.weight.device
        spans = []  # (first flat index, start position, new tokens) per row
        flat: list[int] = []
        for row in rows:
            start = row.cache.length
            row.cache.reserve(start + len(row.tokens), self.max_positions)
            spans.append((len(flat), start, len(row.tokens)))
            flat += row.tokens
        total = len(flat)
        positions = torch.cat([torch.arange(start, start + n) for _, start, n in spans]).to(device)
        end = max(start + n for _, start, n in spans)
        cos, sin = self._rotary(0, end)
        cos, sin = cos[positions][:, None], sin[positions][:, None]  # [T, 1, head_dim]: one angle per token

        x = F.embedding(torch.tensor(flat, device=device), self.model.model.embed_tokens.weight)  # [T, hidden]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm)
            q = _rope(F.linear(h, attn.q_proj.weight).view(total, self.heads, self.head_dim), cos, sin)
            k = _rope(F.linear(h, attn.k_proj.weight).view(total, self.kv_heads, self.head_dim), cos, sin)
            v = F.linear(h, attn.v_proj.weight).view(total, self.kv_heads, self.head_dim)
            out = torch.cat([self._attend(i, row.cache, q, k, v, span) for row, span in zip(rows, spans, strict=True)])
            x = x + F.linear(out, attn.o_proj.weight)
            h = _rms_norm(x, layer.post_attention_layernorm)
            mlp = layer.mlp
            x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                             mlp.down_proj.weight)
        for row, (_, start, n) in zip(rows, spans, strict=True):
            row.cache.length = start + n
        kept = torch.cat([torch.arange(first + n - row.logits_to_keep, first + n)
                          for row, (first, _, n) in zip(rows, spans, strict=True)]).to(device)
        logits = F.linear(_rms_norm(x[kept], self.model.model.norm), self.model.lm_head.weight)
        return list(logits.split([row.logits_to_keep for row in rows]))

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


@dataclasses.dataclass
class BatchRow:
    """One sequence's part of a batched pass: the ``tokens`` to run after what
    ``cache`` holds, and how many of the last positions' logits to return."""

    tokens: list[int]
    cache: LeanCache
    logits_to_keep: int


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """LlamaRMSNorm: normalised in float32, scaled in the input's dtype."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [..., head_dim] by position (``cos``, ``sin`` broadcast to it): each half-pair (a, b) of a head's
    dimensions turns by the position's angle, (a cos - b sin, b cos + a sin)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
