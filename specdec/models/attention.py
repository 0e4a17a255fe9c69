"""The attention function specdec registers with transformers, and the
per-pass plan it reads.

A model runs with ``attn_implementation="specdec_paged"``: its own modules
compute queries, keys and values as transformers wrote them (norms, rotary
variants, biases, q/k norms) and hand them to :func:`paged_attention` through
transformers' public ``AttentionInterface``. That function writes each row's
new keys and values into the row's blocks of the paged store
(:mod:`specdec.models.paged_kv`) and computes the attention of every row of the
pass in one kernel call per layer. Everything it needs to know about the pass
(which slots each token writes, which slots each row reads, the masks) is a
:class:`PassPlan`, built once per pass and passed to the model's forward as the
keyword ``specdec_pass``, which transformers forwards to the attention function
(the way its own continuous batching passes its per-pass metadata).

Terms, for a pass of B rows (sessions) and T new tokens in all:

* row b has ``n_b`` new tokens at positions ``start_b .. end_b - 1``, after the
  ``start_b`` positions it holds;
* a query at position p sees positions ``<= p`` (causal) and, in a layer with a
  sliding window W, ``> p - W``; a row may instead give its own [n_b, n_b]
  mask over its new tokens (a token tree), with their positions;
* Q = max n_b, L = the most positions a row reads in a group.

Kernels (chosen when the model loads, :func:`choose_kernel`):

* ``padded`` (any device): each row's keys and values gathered from their
  blocks into [B, kv_heads, L, dim], queries padded to [B, heads, Q, dim], one
  ``scaled_dot_product_attention`` call with a boolean mask [B, 1, Q, L] (or
  one masked matmul-softmax-matmul where the layer soft-caps its scores). A
  single row whose blocks lie in order copies them as one slice instead of
  gathering them (a copy either way: the kernel's rounding depends on where
  its inputs lie in memory, and a pass must not depend on where its blocks do).
* ``varlen`` (CUDA): ``torch.nn.attention.varlen.varlen_attn`` over the packed
  queries, reading keys and values straight from the pool through the block
  tables (FlashAttention's paged kernel). No copies; shapes fixed by the pool,
  so a decode-sized pass can be recorded as a CUDA graph. Rows with their own
  masks, and soft-capping layers, take the padded kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdec.models.paged_kv import LayerKV, PagedCache, PagedKV

NAME = "specdec_paged"  # the attn_implementation models run with
KERNELS = ("padded", "varlen")


@dataclasses.dataclass
class BatchRow:
    """One sequence's part of a pass: ``tokens`` to run after what ``cache``
    holds, and how many of the last positions' logits to return. ``tree``
    [n, n] (bool), with ``positions``, replaces causal order among the new
    tokens: token i sees new token j where ``tree[i, j]`` (a token tree). The
    cache then holds every tree token's keys and values, in the order given:
    the caller crops it to the path it keeps and runs that path again."""

    tokens: list[int]
    cache: PagedCache
    logits_to_keep: int
    tree: torch.Tensor | None = None
    positions: list[int] | None = None


@dataclasses.dataclass
class GroupPlan:
    """Where one group's layers write and read in a pass."""

    write: torch.Tensor  # [T] slot each new token's key and value go to
    window: int | None
    # padded kernel
    read: torch.Tensor | None = None  # [B, L] slot of each position a row reads (padding: scratch)
    read_slice: tuple[int, int] | None = None  # one row reading slots [first, first + L) as one slice
    mask: torch.Tensor | None = None  # [B, 1, Q, L]; None: every query sees every key it reads
    # varlen kernel
    block_table: torch.Tensor | None = None  # [B, blocks] int32
    seq_used: torch.Tensor | None = None  # [B] int32: positions held after the pass
    cu_k: torch.Tensor | None = None  # [B + 1] int32
    max_k: int = 0


@dataclasses.dataclass
class PassPlan:
    """Everything the attention function needs for one pass (see the module docstring)."""

    kv: PagedKV
    kernel: str
    layer_of: dict[int, int]  # id(attention module) -> layer, for the model's own modules
    groups: list[GroupPlan]
    rows: int
    positions_end: int  # 1 + the largest position in the pass
    # padded kernel: queries [T, heads, dim] -> [B, Q, heads, dim]
    q_per_row: int = 0  # Q
    uniform: bool = True  # every row has Q new tokens: a view, no gather
    q_index: torch.Tensor | None = None  # [B * Q] token of each padded query (padding: the row's last)
    out_index: torch.Tensor | None = None  # [T] padded query of each token
    # varlen kernel
    cu_q: torch.Tensor | None = None  # [B + 1] int32
    max_q: int = 0

    def attend_module(self, module, q, k, v, scale, window, softcap):
        return attend(self, self.layer_of[id(module)], q, k, v, scale, softcap)


# ====================================================================== planning


def plan_pass(kv: PagedKV, rows: list[BatchRow], kernel: str, layer_of: dict[int, int]) -> PassPlan:
    """The plan of a pass over ``rows``, whose caches already hold blocks for
    their new tokens (:meth:`PagedKV.reserve`). Built with a few tensor
    operations over all rows, not per token."""
    if kernel == "varlen" and any(row.tree is not None for row in rows):
        kernel = "padded"
    device, bs = kv.device, kv.block_size
    shape = RowShape.of(rows, device)
    width = max(len(row.cache.tables[0]) for row in rows)
    # the blocks of every group [groups, B, width] (padding: scratch)
    tables = torch.tensor([[row.cache.tables[g] + [0] * (width - len(row.cache.tables[g])) for row in rows]
                           for g in range(len(kv.windows))], device=device)
    total = sum(shape.counts)
    # each new token's row and the position (slot order) it fills: [T]
    token_row = torch.repeat_interleave(torch.arange(len(rows), device=device), shape.counts_t, output_size=total)
    token_pos = torch.arange(total, device=device) - shape.first_token[token_row] + shape.starts_t[token_row]
    groups = [GroupPlan(write=tables[g][token_row, token_pos // bs] * bs + token_pos % bs, window=window)
              for g, window in enumerate(kv.windows)]
    end = max(max(row.positions) + 1 if row.positions else e for row, e in zip(rows, shape.ends, strict=True))
    plan = PassPlan(kv=kv, kernel=kernel, layer_of=layer_of, groups=groups, rows=len(rows), positions_end=end,
                    q_per_row=max(shape.counts))
    if kernel == "varlen":
        plan.cu_q = torch.cat([shape.first_token, shape.first_token.new_tensor([total])]).to(torch.int32)
        plan.max_q = max(shape.counts)
        for g, group in enumerate(groups):
            group.block_table = tables[g].to(torch.int32)
            group.seq_used = shape.ends_t.to(torch.int32)
            group.cu_k = torch.cat([shape.ends_t.new_zeros(1), torch.cumsum(shape.ends_t, 0)]).to(torch.int32)
            group.max_k = max(shape.ends)
    else:
        _plan_padded(plan, rows, shape, tables)
    return plan


@dataclasses.dataclass
class RowShape:
    """Where each row of a pass starts (the positions it holds), how many new
    tokens it runs and where it ends: lists, and [B] tensors on the device."""

    starts: list[int]
    counts: list[int]
    ends: list[int]
    starts_t: torch.Tensor
    counts_t: torch.Tensor
    ends_t: torch.Tensor
    first_token: torch.Tensor  # index of each row's first new token in the packed pass

    @classmethod
    def of(cls, rows: list[BatchRow], device: torch.device) -> RowShape:
        starts = [row.cache.length for row in rows]
        counts = [len(row.tokens) for row in rows]
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        starts_t, counts_t, ends_t = torch.tensor([starts, counts, ends], device=device)
        return cls(starts, counts, ends, starts_t, counts_t, ends_t, torch.cumsum(counts_t, 0) - counts_t)


def _plan_padded(plan: PassPlan, rows: list[BatchRow], shape: RowShape, tables: torch.Tensor) -> None:
    """What the padded kernel reads: per group, each row's slots [B, L], or one
    row's in place; the queries' padding; the masks."""
    starts, counts, ends = shape.starts, shape.counts, shape.ends
    device, bs, q = plan.kv.device, plan.kv.block_size, plan.q_per_row
    plan.uniform = all(n == q for n in counts)
    step = torch.arange(q, device=device)[None]  # [1, Q]
    # [B, Q]: a padding query is its row's last token again, so no softmax row is empty
    last = torch.minimum(step, shape.counts_t[:, None] - 1)
    if not plan.uniform:
        plan.q_index = (shape.first_token[:, None] + last).flatten()
        plan.out_index = torch.cat([torch.arange(n, device=device) + b * q for b, n in enumerate(counts)])
    query_pos = shape.starts_t[:, None] + last
    trees = [r for r, row in enumerate(rows) if row.tree is not None]
    for r in trees:
        query_pos[r, :counts[r]] = torch.tensor(rows[r].positions, device=device)
        query_pos[r, counts[r]:] = query_pos[r, counts[r] - 1]
    for g, group in enumerate(plan.groups):
        firsts = [row.cache.first_held(g, bs) for row in rows]  # the oldest position a row still holds
        if group.window is not None:  # and the oldest any of its new queries sees
            firsts = [max(f, s - group.window + 1) // bs * bs for f, s in zip(firsts, starts, strict=True)]
        length = max(e - f for f, e in zip(firsts, ends, strict=True))
        key_pos = torch.tensor(firsts, device=device)[:, None] + torch.arange(length, device=device)[None]  # [B, L]
        held = key_pos < shape.ends_t[:, None]
        blocks = rows[0].cache.tables[g][firsts[0] // bs:-(-ends[0] // bs)]
        if len(rows) == 1 and blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            group.read_slice = (blocks[0] * bs, length)  # in order in the pool: one slice
        else:
            slots = tables[g].gather(1, (key_pos // bs).clamp(max=tables.shape[2] - 1)) * bs + key_pos % bs
            group.read = torch.where(held, slots, slots[:, :1])  # padding reads the row's own first slot, masked
        all_seen = (q == 1 and all(e - f == length for f, e in zip(firsts, ends, strict=True)) and not trees
                    and (group.window is None or length <= group.window))
        if not all_seen:
            group.mask = _mask(rows, trees, starts, firsts, key_pos, held, query_pos, group.window)


def _mask(rows: list[BatchRow], trees: list[int], starts: list[int], firsts: list[int], key_pos: torch.Tensor,
          held: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, 1, Q, L]: which key each (padded) query sees: held, not after it,
    within the window; among a tree row's new tokens, its own mask."""
    seen = (key_pos[:, None, :] <= query_pos[:, :, None]) & held[:, None, :]
    if window is not None:
        seen &= key_pos[:, None, :] > query_pos[:, :, None] - window
    for r in trees:
        row = rows[r]
        n, new = len(row.tokens), starts[r] - firsts[r]
        tree = row.tree.to(device=seen.device, dtype=torch.bool)
        if window is not None:
            pos = query_pos[r, :n]
            tree = tree & (pos[None, :] > pos[:, None] - window)
        seen[r, :n, new:new + n] = tree
        seen[r, n:] = seen[r, n - 1]
    return seen[:, None]


# ====================================================================== attending


def attend(plan: PassPlan, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
           softcap: float | None = None) -> torch.Tensor:
    """Layer ``layer`` of the pass: the new keys and values k, v [T, kv_heads, dim]
    written to their slots, then the attention of the queries q [T, heads, dim];
    returns [T, heads, value dim]."""
    kv = plan.kv
    group = plan.groups[kv.group_of[layer]]
    keys, values = kv.keys[layer], kv.values[layer]
    keys.index_copy_(0, group.write, k.to(keys.dtype))
    values.index_copy_(0, group.write, v.to(values.dtype))
    if plan.kernel == "varlen":  # never for soft-capping layers (choose_kernel)
        return _varlen(plan, group, kv.layers[layer], q, keys, values, scale)
    return _padded(plan, group, q, keys, values, scale, softcap)


def _padded(plan: PassPlan, group: GroupPlan, q, keys, values, scale, softcap) -> torch.Tensor:
    b, n = plan.rows, plan.q_per_row
    heads, dim = q.shape[1], q.shape[2]
    queries = q.reshape(b, n, heads, dim) if plan.uniform else q.index_select(0, plan.q_index).view(b, n, heads, dim)
    if group.read_slice is not None:
        first, length = group.read_slice
        k_rows, v_rows = keys[first:first + length][None].clone(), values[first:first + length][None].clone()
    else:
        read = group.read.view(-1)
        length = group.read.shape[1]
        k_rows = keys.index_select(0, read).view(b, length, *keys.shape[1:])
        v_rows = values.index_select(0, read).view(b, length, *values.shape[1:])
    # [B, Q|L, heads, dim] -> [B, heads, Q|L, dim]
    queries, k_rows, v_rows = queries.transpose(1, 2), k_rows.transpose(1, 2), v_rows.transpose(1, 2)
    if softcap:
        out = _softcapped(queries, k_rows, v_rows, group.mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(queries, k_rows, v_rows, attn_mask=group.mask, scale=scale,
                                             enable_gqa=k_rows.shape[1] != heads)
    out = out.transpose(1, 2)  # [B, Q, heads, value dim]
    if plan.uniform:
        return out.reshape(b * n, heads, -1)
    return out.reshape(b * n, heads, -1).index_select(0, plan.out_index)


def _softcapped(q, k, v, mask, scale, softcap) -> torch.Tensor:
    """Attention whose scores are soft-capped (Gemma 2): cap * tanh(s / cap)
    before the mask and a float32 softmax, as transformers' eager attention
    computes it. q [B, H, Q, D], k/v [B, KVH, L, D]."""
    b, heads, n, _ = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads  # query heads h*group .. h*group + group - 1 share kv head h
    scores = q.reshape(b, kv_heads, group * n, -1) @ k.transpose(-1, -2)  # [B, KVH, G*Q, L]
    scores = torch.tanh(scores * ((scale or q.shape[-1] ** -0.5) / softcap)) * softcap
    if mask is not None:
        scores = scores.view(b, kv_heads, group, n, length).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores.view(b, kv_heads, group * n, length), dim=-1, dtype=torch.float32).to(v.dtype)
    return (probs @ v).view(b, heads, n, -1)


def _varlen(plan: PassPlan, group: GroupPlan, layer: LayerKV, q, keys, values, scale) -> torch.Tensor:
    bs = plan.kv.block_size
    window = (-1, 0) if group.window is None else (group.window - 1, 0)  # (left, right): causal, windowed
    return (VARLEN or _varlen_attn())(
        q, keys.view(-1, bs, *keys.shape[1:]), values.view(-1, bs, *values.shape[1:]), plan.cu_q, group.cu_k,
        plan.max_q, group.max_k, scale=scale, window_size=window, enable_gqa=q.shape[1] != layer.kv_heads,
        seqused_k=group.seq_used, block_table=group.block_table)


def _varlen_attn() -> Callable:
    from torch.nn.attention.varlen import varlen_attn  # imported on first use: CUDA builds only need it

    return varlen_attn


VARLEN: Callable | None = None  # tests put a reference implementation here to run the varlen plan on a CPU


# ====================================================================== the registered function


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                    softcap=None, specdec_pass=None, **kwargs):
    """The function registered as ``specdec_paged``, with transformers' attention
    signature: query [1, heads, T, dim], key/value [1, kv_heads, T, dim] (the
    pass's tokens packed in one sequence); returns ([1, T, heads, dim], None)."""
    if specdec_pass is None:
        raise RuntimeError(f"attn_implementation {NAME!r} runs only inside specdec's batched forward")
    for name in ("position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attention with {name} is not supported")
    if attention_mask is not None:
        raise NotImplementedError("the model built its own attention mask")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("bidirectional (non-causal) attention")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, dim]
    out = specdec_pass.attend_module(module, q, k, v, scaling, sliding_window, softcap)
    return out[None], None


def register() -> None:
    """Make ``attn_implementation=NAME`` available to every model (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention)


# ====================================================================== probing a model


class Probe:
    """Stands in for a plan during one forward pass of a model at load: records
    what each attention layer stores (in call order) and computes plain causal
    attention so that the pass completes."""

    def __init__(self):
        self.layers: list[LayerKV] = []
        self.layer_of: dict[int, int] = {}
        self.softcapped = False

    def attend_module(self, module, q, k, v, scale, window, softcap):
        if id(module) in self.layer_of:
            raise NotImplementedError("an attention module runs twice in one forward pass (shared layers)")
        self.layer_of[id(module)] = len(self.layers)
        self.layers.append(LayerKV(kv_heads=k.shape[1], key_dim=k.shape[2], value_dim=v.shape[2],
                                   window=int(window) if window else None))
        self.softcapped |= bool(softcap)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out[0].transpose(0, 1)


def varlen_unfit(device: torch.device, dtype: torch.dtype, block_size: int, softcapped: bool) -> str:
    """Why FlashAttention's paged kernel cannot serve a model ("": it can)."""
    if device.type != "cuda" and VARLEN is None:
        return f"it runs on CUDA devices only, not {device.type}"
    if softcapped:
        return "the model soft-caps its attention scores, which the kernel does not"
    if device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
        return f"it takes bfloat16 or float16, not {str(dtype).removeprefix('torch.')}"
    if device.type == "cuda" and block_size % 256:
        return f"its blocks are multiples of 256 positions, not {block_size}"
    return ""


def choose_kernel(device: torch.device, dtype: torch.dtype, block_size: int, softcapped: bool,
                  requested: str | None = None) -> str:
    """``requested``, or ``varlen`` where it can serve (:func:`varlen_unfit`),
    else ``padded``. ValueError for a requested kernel that cannot serve."""
    why = varlen_unfit(device, dtype, block_size, softcapped)
    if requested is None:
        return "padded" if why else "varlen"
    if requested not in KERNELS:
        raise ValueError(f"attention kernel must be one of {KERNELS}, got {requested!r}")
    if requested == "varlen" and why:
        raise ValueError(f"the varlen attention kernel cannot serve this model: {why}")
    return requested
