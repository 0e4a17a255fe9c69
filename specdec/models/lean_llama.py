"""A lean forward pass for Llama-architecture models: the target and the draft.

Why: at the batch sizes of decoding (one to a few tokens per session) a forward
pass through Hugging Face's modules spends much of its time not on arithmetic
but on Python: module calls, config lookups, mask construction and output
dataclasses, paid every layer of every pass. This module runs the same weights
with a handful of tensor operations per layer, over the same ragged batches,
paged KV store and attention function as every other model
(:mod:`specdec.models.batched`, :mod:`specdec.models.attention`): only the
work around attention is its own.

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
depend on the sequence length) are reported by ``unsupported_reason`` and run
through their own modules.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from specdec.models.attention import PassPlan, attend

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
    """The layers of a loaded ``LlamaForCausalLM`` with plain tensor ops, for
    :meth:`specdec.models.batched.BatchedModel.run`. Shares the model's weights
    (nothing is copied; see the module docstring)."""

    def __init__(self, model):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"cannot run this model with the lean forward: {reason}")
        config = model.config
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.max_positions = config.max_position_embeddings
        with torch.no_grad():
            self.layers = [_layer_weights(layer) for layer in model.model.layers]
        self.embed = model.model.embed_tokens.weight.detach()  # [vocab, hidden]
        self.lm_head = model.lm_head.weight.detach()  # [vocab, hidden], the embedding itself when tied
        norm = model.model.norm
        self.final_norm, self.final_eps = norm.weight.detach(), norm.variance_epsilon
        self._cos = self._sin = None  # [positions, head_dim] rotary tables, grown on demand

    def run(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, plan: PassPlan) -> torch.Tensor:
        """Logits [K, V] at the tokens ``keep`` of a pass of ``ids`` [T] at
        ``positions`` [T], attending through ``plan``. Every token goes through
        the products together ([T, hidden]: where a batch saves time, since the
        weights are read once)."""
        cos, sin = self._rotary(plan.positions_end)
        cos, sin = cos[positions][:, None], sin[positions][:, None]  # [T, 1, head_dim]: one angle per token
        x = F.embedding(ids, self.embed)  # [T, hidden]
        for i in range(len(self.layers)):
            qk, v = self.before_attention(i, x, cos, sin)
            out = attend(plan, i, qk[:, :self.heads], qk[:, self.heads:], v, self.scale)
            x = self.after_attention(i, x, out.reshape(x.shape[0], -1))
        x = x.index_select(0, keep) if keep.shape[0] != x.shape[0] else x
        return F.linear(_rms_norm(x, self.final_norm, self.final_eps), self.lm_head)

    def _rotary(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [>= end, head_dim] (see :func:`_rope`), from the model's
        own rotary module."""
        if self._cos is None or self._cos.shape[0] < end:
            current = 0 if self._cos is None else self._cos.shape[0]
            size = max(end, min(self.max_positions, max(256, 2 * current)))
            positions = torch.arange(size, device=self.embed.device)[None]
            cos, sin = self.model.model.rotary_emb(self.embed[:1][None], positions)
            half = self.head_dim // 2
            self._cos, self._sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return self._cos, self._sin

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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalised in float32, scaled in the input's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [..., head_dim] by position (``cos``, ``signed_sin`` broadcast to it):
    each half-pair (a, b) of a head's dimensions turns by the position's angle,
    (a cos - b sin, b cos + a sin). Rolling the halves gives (b, a), and the sine's
    first half carries the minus sign: three operations instead of six."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
