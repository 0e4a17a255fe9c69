"""One batched forward pass for any decoder-only model transformers runs
through its attention interface.

The model's own modules run as transformers wrote them; specdec supplies what
batching needs: the new tokens of every row packed into one sequence with
explicit positions, its paged KV store (:mod:`specdec.models.paged_kv`) and
its attention function (:mod:`specdec.models.attention`), which writes each
row's keys and values and attends for all rows at once.

When a model loads, :func:`check_model` refuses what cannot run this way,
naming the architecture and the reason (encoder-decoder models, attention that
does not go through the interface, layers that keep a state other than keys
and values, ...), and a short self-check compares the batched pass with the
model's own eager forward, so a model that would compute something else is
refused at start-up rather than answering wrongly.

Llama-architecture models may instead run through :mod:`specdec.models.lean_llama`:
the same store, plan and attention function, with less Python per layer.
"""

from __future__ import annotations

import logging
import re

import torch

from specdec.models import attention
from specdec.models.attention import BatchRow, PassPlan, Probe, plan_pass
from specdec.models.paged_kv import PagedCache, PagedKV, bytes_per_token

log = logging.getLogger(__name__)

# Rotary scalings whose angles depend on the length of the sequence being run,
# not only on each token's position: rows batched together would change each
# other's angles, so such models run one sequence per pass.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Module classes that keep a recurrent state rather than keys and values.
RECURRENT = re.compile(r"Mamba|SSM|DeltaNet|LinearAttention|Recurrent|Rwkv|RWKV|xLSTM")


class UnsupportedModel(ValueError):
    """A model specdec cannot run, with the architecture and the reason."""


def architecture(model_or_config) -> str:
    """E.g. ``Qwen2ForCausalLM (model_type 'qwen2')``."""
    config = getattr(model_or_config, "config", model_or_config)
    names = getattr(config, "architectures", None) or [type(model_or_config).__name__]
    return f"{names[0]} (model_type {config.model_type!r})"


def check_config(config) -> None:
    """UnsupportedModel for what a configuration alone shows (before loading weights)."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{architecture(config)} cannot be served: it is an encoder-decoder model; specdec "
                               "runs decoder-only models")


def check_model(model) -> None:
    """UnsupportedModel if ``model`` cannot run through the batched forward, for
    reasons its configuration or class show."""
    check_config(model.config)
    config = model.config
    why = None
    recurrent = sorted({type(m).__name__ for m in model.modules() if RECURRENT.search(type(m).__name__)})
    if recurrent:
        why = (f"it has state-space or recurrent layers ({', '.join(recurrent[:3])}), whose state is not attention "
               "keys and values")
    elif not getattr(type(model), "_supports_attention_backend", False) or not model._can_set_attn_implementation():
        why = "its attention does not go through transformers' AttentionInterface"
    elif any(kind not in ("full_attention", "sliding_attention") for kind in getattr(config, "layer_types", None)
             or ()):
        kinds = sorted(set(config.layer_types) - {"full_attention", "sliding_attention"})
        why = f"it has layers of kind {', '.join(kinds)}, whose state is not attention keys and values"
    if why:
        raise UnsupportedModel(f"{architecture(model)} cannot be served: {why}")


def rope_types(config) -> set[str]:
    """The rotary embedding types a config uses (one, or one per layer type)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if all(isinstance(v, dict) for v in rope.values()) and rope:
        return {params.get("rope_type", "default") for params in rope.values()}
    return {rope.get("rope_type", "default")}


class BatchedModel:
    """A transformers causal LM run over ragged batches of sequences, each
    with its :class:`PagedCache` in one :class:`PagedKV`.

    ``max_tokens``: the KV budget per group, in positions (on CUDA, no more than
    ``memory_fraction`` of the device's free memory holds); ``block_size``:
    positions per block; ``keep_behind``: how far a sequence may roll back
    without losing a sliding window; ``kernel``: ``padded`` or ``varlen``
    (default: varlen where it can serve, :func:`attention.choose_kernel`)."""

    def __init__(self, model, *, max_tokens: int, block_size: int, keep_behind: int = 64,
                 kernel: str | None = None, memory_fraction: float = 0.8, self_check: bool = True):
        check_model(model)
        attention.register()
        self.model = model
        self.device = model.device
        model.set_attn_implementation(attention.NAME)
        probe = self._probe()
        self.layer_of = probe.layer_of
        self.kernel = attention.choose_kernel(self.device, model.dtype, block_size, probe.softcapped, kernel)
        if kernel is None and self.kernel == "padded" and self.device.type == "cuda":
            log.info("%s: the padded attention kernel serves it, not FlashAttention's paged one: %s",
                     architecture(model), attention.varlen_unfit(self.device, model.dtype, block_size,
                                                                 probe.softcapped))
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            max_tokens = max(1, min(max_tokens, int(free * memory_fraction) // bytes_per_token(probe.layers,
                                                                                                  model.dtype)))
        self.kv = PagedKV(probe.layers, max_tokens=max_tokens, block_size=block_size, device=self.device,
                          dtype=model.dtype, keep_behind=keep_behind)
        self.batched = not (rope_types(model.config) & set(LENGTH_DEPENDENT_ROPE))
        self.lean = None  # a specdec.models.lean_llama.LeanLlama running the model's layers instead
        self.graphs = None  # specdec.models.cuda_graphs.PassGraphs, once recorded
        if self_check:
            try:
                self._self_check()
            except Exception as e:  # FlashAttention's paged kernel is not in every torch build
                if self.kernel != "varlen" or kernel is not None:
                    raise
                log.warning("%s: the varlen attention kernel failed its check (%s: %s); the padded kernel serves "
                            "it", architecture(model), type(e).__name__, e)
                self.kernel = "padded"
                self._self_check()

    def _probe(self) -> Probe:
        """What each attention layer stores, from one short forward pass."""
        probe = Probe()
        ids = torch.tensor([[1, 2]], device=self.device)
        try:
            with torch.inference_mode():
                self.model(input_ids=ids, position_ids=torch.arange(2, device=self.device)[None], use_cache=False,
                           specdec_pass=probe)
        except Exception as e:
            raise UnsupportedModel(f"{architecture(self.model)} cannot be served: its forward pass through "
                                   f"specdec's attention failed: {type(e).__name__}: {e}") from None
        config = self.model.config
        layers = getattr(config, "num_hidden_layers", None)
        if not probe.layers:
            raise UnsupportedModel(f"{architecture(self.model)} cannot be served: none of its layers called the "
                                   "attention interface")
        if layers is not None and len(probe.layers) != layers:
            raise UnsupportedModel(f"{architecture(self.model)} cannot be served: {len(probe.layers)} of its "
                                   f"{layers} layers attend through the interface; the others keep a state specdec "
                                   "does not store")
        return probe

    def _self_check(self) -> None:
        """The batched pass against the model's own eager forward: two sequences
        of different lengths run in pieces, ragged (pre-fills of 5 and 3, a step
        of one beside a step of three, then after a rollback three beside one);
        UnsupportedModel if they differ beyond float rounding."""
        vocab = max(2, self.model.config.vocab_size)
        seqs = [[(7 * i + 3) % vocab for i in range(8)], [(5 * i + 1) % vocab for i in range(7)]]
        caches = [self.new_cache(), self.new_cache()]
        with torch.inference_mode():
            self.forward_batch([BatchRow(seqs[0][:5], caches[0], 5), BatchRow(seqs[1][:3], caches[1], 3)])
            self.forward_batch([BatchRow(seqs[0][5:6], caches[0], 1), BatchRow(seqs[1][3:6], caches[1], 3)])
            self.kv.crop(caches[0], 5)
            got = self.forward_batch([BatchRow(seqs[0][5:8], caches[0], 3), BatchRow(seqs[1][6:7], caches[1], 1)])
            self.model.set_attn_implementation("eager")
            try:
                want = [self.model(input_ids=torch.tensor([seq], device=self.device), use_cache=False).logits[0, -n:]
                        for seq, n in zip(seqs, (3, 1), strict=True)]
            finally:
                self.model.set_attn_implementation(attention.NAME)
        for cache in caches:
            self.kv.release(cache)
        got_all, want_all = torch.cat(got).float(), torch.cat(want).float()
        if not close_logits(got_all, want_all, self.model.dtype):
            diff = (got_all - want_all).abs().max().item()
            raise UnsupportedModel(f"{architecture(self.model)} cannot be served: its logits through specdec's "
                                   f"batched attention differ from its own forward's (max |difference| {diff:.3g}); "
                                   "it does something the attention function does not")

    def new_cache(self) -> PagedCache:
        return self.kv.new_cache()

    def record_graphs(self, max_tokens: int) -> None:
        """Record decode-sized passes of up to ``max_tokens`` tokens
        (:mod:`specdec.models.cuda_graphs`); needs the varlen kernel. A model
        whose pass cannot be recorded runs eagerly, with a warning."""
        from specdec.models.cuda_graphs import PassGraphs

        if self.kernel != "varlen":
            log.info("%s: no CUDA graphs (the %s attention kernel reads keys and values through copies of "
                     "varying size)", architecture(self.model), self.kernel)
            return
        context = getattr(self.model.config, "max_position_embeddings", None) or 2048
        try:
            self.graphs = PassGraphs(self.run, self.kv, self.layer_of, max_tokens, context)
        except Exception as e:
            log.warning("%s runs without CUDA graphs: recording a pass failed: %s: %s", architecture(self.model),
                        type(e).__name__, e)
            self.graphs = None

    @torch.inference_mode()
    def forward_batch(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        """One pass over ``rows``: each row's new tokens after its cached
        positions, their keys and values added to its cache. Returns each row's
        logits [logits_to_keep, V] for its last positions."""
        for row in rows:
            self.kv.reserve(row.cache, row.cache.length + len(row.tokens))
        plan = plan_pass(self.kv, rows, self.kernel, self.layer_of)
        ids, positions, keep = pass_inputs(rows, self.device)
        recorded = self.graphs.for_tokens(ids.shape[0]) if self.graphs and plan.kernel == "varlen" else None
        if recorded is not None:
            logits = recorded.run(ids, positions, plan).index_select(0, keep)
        else:
            logits = self.run(ids, positions, keep, plan)
        for row in rows:
            row.cache.length += len(row.tokens)
            self.kv.slide(row.cache)
        return list(logits.split([row.logits_to_keep for row in rows]))

    def run(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, plan: PassPlan) -> torch.Tensor:
        """Logits [K, V] at the packed tokens ``keep`` of the pass ``ids`` [T] at ``positions`` [T]."""
        if self.lean is not None:
            return self.lean.run(ids, positions, keep, plan)
        out = self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=keep,
                         specdec_pass=plan)
        return out.logits[0]


def pass_inputs(rows: list[BatchRow], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed token ids [T], their positions [T], and the indices of the
    tokens whose logits the rows keep [K]."""
    ids, positions, keep = [], [], []
    for row in rows:
        start = row.cache.length
        ids += row.tokens
        positions += row.positions or range(start, start + len(row.tokens))
        keep += range(len(ids) - row.logits_to_keep, len(ids))
    as_tensor = torch.tensor([ids, positions, keep + [0] * (len(ids) - len(keep))], device=device)
    return as_tensor[0], as_tensor[1], as_tensor[2, :len(keep)]


# How far a batched pass's logits may be from the model's own forward's: float
# rounding of the same arithmetic in another order (relative to the logits' scale).
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 6e-2}


def close_logits(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    scale = max(1.0, want.abs().max().item())
    return bool((got - want).abs().max() <= CHECK_TOLERANCE.get(dtype, 6e-2) * scale)
