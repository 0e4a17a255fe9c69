"""Checking a batched model's logits against the model's own forward, for the
model tests: sessions run in pieces, each pass compared with transformers'
eager attention over the whole sequence; and a reference of the varlen kernel
that runs the CUDA plan on a CPU."""

from __future__ import annotations

import torch

from specdec.models.attention import BatchRow
from specdec.models.batched import BatchedModel

from tiny_models import TEST_DEVICE, make_tiny_model

# Float rounding of the same arithmetic in another order: float32 to the last
# bits; 16-bit floats keep 8 (bfloat16) or 11 (float16) bits of mantissa, so a
# logit may be off by a few units in its last place after a few layers.
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=4e-2, atol=4e-2),
             torch.float16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def reference(arch: str, dtype: torch.dtype):
    """The same weights, run by transformers' own eager attention."""
    model = make_tiny_model(arch, dtype=dtype).to(TEST_DEVICE)
    model.set_attn_implementation("eager")
    return model


def own_logits(model, tokens: list[int], last: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens], device=model.device)).logits[0, -last:].float()


class Sessions:
    """Sessions of one BatchedModel, each checked against the reference after every pass."""

    def __init__(self, batched: BatchedModel, ref, dtype: torch.dtype, tokens: list[list[int]]):
        self.batched, self.ref, self.tolerance = batched, ref, TOLERANCE[dtype]
        self.tokens = tokens  # every session's whole sequence, to be run in pieces
        self.caches = [batched.new_cache() for _ in tokens]
        self.done = [0 for _ in tokens]

    def run(self, counts: dict[int, int]) -> None:
        """One pass: session i runs its next counts[i] tokens; every row's logits checked."""
        rows = []
        for i, n in counts.items():
            rows.append(BatchRow(self.tokens[i][self.done[i]:self.done[i] + n], self.caches[i], n))
        outs = self.batched.forward_batch(rows)
        for (i, n), out in zip(counts.items(), outs, strict=True):
            self.done[i] += n
            assert self.caches[i].length == self.done[i]
            torch.testing.assert_close(out.float(), own_logits(self.ref, self.tokens[i][:self.done[i]], n),
                                       **self.tolerance)

    def roll_back(self, i: int, position: int) -> int:
        """Session i back to ``position``; returns what the cache kept (its tokens from there run again)."""
        kept = self.batched.kv.crop(self.caches[i], position)
        self.done[i] = kept
        return kept


def varlen_reference(q, keys, values, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa, seqused_k,
                     block_table):
    """What ``torch.nn.attention.varlen.varlen_attn`` computes over a paged pool
    (FlashAttention's convention: queries are each row's last positions), one
    row at a time: lets the varlen plan run on a CPU."""
    out = torch.zeros_like(q)
    bs = keys.shape[1]
    for row in range(len(cu_q) - 1):
        first, last, used = int(cu_q[row]), int(cu_q[row + 1]), int(seqused_k[row])
        if last == first:
            continue
        slots = [int(block_table[row, p // bs]) * bs + p % bs for p in range(used)]
        k = keys.reshape(-1, *keys.shape[2:])[slots].transpose(0, 1)  # [kv_heads, used, dim]
        v = values.reshape(-1, *values.shape[2:])[slots].transpose(0, 1)
        query_pos = torch.arange(used - (last - first), used)[:, None]
        key_pos = torch.arange(used)[None]
        seen = key_pos <= query_pos
        if window_size[0] >= 0:
            seen &= key_pos >= query_pos - window_size[0]
        out[first:last] = torch.nn.functional.scaled_dot_product_attention(
            q[first:last].transpose(0, 1), k, v, attn_mask=seen, scale=scale, enable_gqa=enable_gqa).transpose(0, 1)
    return out
