"""The paged KV store: every session's keys and values, for every attention
layer of one model, in fixed-size blocks drawn from one pool.

Terms:

* **slot**: one token's key and value in one layer, a row of that layer's pool
  tensors ``keys[layer]`` / ``values[layer]`` [slots, kv_heads, dim].
* **block**: ``block_size`` consecutive slots. Block 0 is scratch: padding
  tokens write there and nothing reads it.
* **group**: the layers that see the same window of the past (every layer of a
  plain model; a full-attention group and a sliding-window group for Gemma 2/3,
  Phi-3, Mistral with a window). A group has its own pool of blocks and each
  session its own **table** in it: ``table[i]`` holds positions
  ``[i * block_size, (i + 1) * block_size)`` for every layer of the group.
  Layers of one group may differ in shape; each has its own tensors.

A session's :class:`PagedCache` is its tables and the positions they hold.
Rolling back frees the blocks past the new end (the last one is trimmed by the
length alone). A fork (a draft's branch) shares the whole blocks of the prefix
it starts from; a shared block is freed when its last holder lets it go. In a
sliding-window group, a query at position p sees positions
(p - window, p], so blocks wholly older than that are freed after each pass,
but for ``keep_behind`` positions kept so that a rollback of that many tokens
still finds the window it needs; a rollback deeper than that drops the cache
(its tokens are run again: slower, never wrong).

Budget: the store holds at most ``max_tokens`` positions per group, in whole
blocks. On a CUDA device the pool is allocated at once (its addresses must not
move under recorded CUDA graphs); elsewhere it starts small and doubles as
sessions need it, up to the budget, so a large budget costs nothing until used.
Blocks are taken on the model's thread and may be freed from any thread.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref

import torch

SCRATCH = 0  # the block padding writes to
FIRST_BLOCKS = 64  # a growable pool's first size, in blocks


class KVExhausted(MemoryError):
    """The pool has no free block left (its budget is spent): answered
    RESOURCE_EXHAUSTED by the services."""


@dataclasses.dataclass(frozen=True)
class LayerKV:
    """What one attention layer stores per token, and what it sees."""

    kv_heads: int
    key_dim: int
    value_dim: int
    window: int | None = None  # a query sees this many positions, itself included; None: every earlier one


@dataclasses.dataclass
class PagedCache:
    """One session's keys and values in a :class:`PagedKV`: positions ``[0, length)``
    in every layer. ``tables[g]`` lists the blocks of group g in order; the first
    ``dropped[g]`` of them were released (older than the group's window) and read
    as SCRATCH."""

    tables: list[list[int]]
    dropped: list[int]
    length: int = 0

    def first_held(self, group: int, block_size: int) -> int:
        """The first position group ``group`` still holds."""
        return self.dropped[group] * block_size


class BlockPool:
    """The blocks of one group: a free list over ``capacity`` blocks (block 0,
    scratch, never handed out), grown up to ``max_blocks`` when ``grow``."""

    def __init__(self, max_blocks: int, grow: bool):
        self.max_blocks = max_blocks
        self.capacity = min(max_blocks, FIRST_BLOCKS) if grow else max_blocks
        self._free = list(range(self.capacity - 1, SCRATCH, -1))  # popped from the end: low blocks first
        self._shared: dict[int, int] = {}  # block -> caches holding it, where more than one does
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self.capacity - 1 - len(self._free)

    def take(self, n: int) -> list[int] | None:
        """``n`` free blocks; None when the pool must grow first (it can), and
        KVExhausted when the budget cannot hold them."""
        with self._lock:
            if len(self._free) >= n:
                taken = self._free[len(self._free) - n:]
                del self._free[len(self._free) - n:]
                return taken[::-1]
            if self.used + n > self.max_blocks - 1:
                raise KVExhausted(f"all {self.max_blocks - 1} blocks of the KV budget are in use")
            return None

    def grown(self, need: int) -> int:
        """The capacity to grow to so that ``need`` blocks are free (``take`` said it can)."""
        with self._lock:
            missing = need - len(self._free)
            return min(self.max_blocks, max(2 * self.capacity, self.capacity + missing))

    def extend(self, capacity: int) -> None:
        with self._lock:
            self._free[:0] = range(capacity - 1, self.capacity - 1, -1)
            self.capacity = capacity

    def give_back(self, blocks: list[int]) -> None:
        """Each block's owner lets it go: free once no other cache shares it."""
        with self._lock:
            for b in blocks:
                if b == SCRATCH:
                    continue
                owners = self._shared.pop(b, 1)
                if owners > 2:
                    self._shared[b] = owners - 1
                elif owners == 1:
                    self._free.append(b)

    def share(self, blocks: list[int]) -> None:
        """One more cache holds each of ``blocks`` (a fork)."""
        with self._lock:
            for b in blocks:
                if b != SCRATCH:
                    self._shared[b] = self._shared.get(b, 1) + 1

    def is_shared(self, block: int) -> bool:
        with self._lock:
            return block in self._shared


class PagedKV:
    """Keys and values of every session of one model (see the module docstring).

    ``layers`` describes each attention layer in the order the model calls them;
    ``max_tokens`` is the budget, per group, in positions."""

    def __init__(self, layers: list[LayerKV], *, max_tokens: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, keep_behind: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.layers, self.block_size, self.keep_behind = layers, block_size, keep_behind
        self.device, self.dtype = torch.device(device), dtype
        self.windows: list[int | None] = sorted({layer.window for layer in layers}, key=lambda w: (w is not None, w))
        self.group_of = [self.windows.index(layer.window) for layer in layers]  # layer -> group
        max_blocks = math.ceil(max_tokens / block_size) + 1  # + scratch
        grow = self.device.type != "cuda"
        self.pools = [BlockPool(max_blocks, grow) for _ in self.windows]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for layer, group in zip(layers, self.group_of, strict=True):
            slots = self.pools[group].capacity * block_size
            self.keys.append(torch.zeros(slots, layer.kv_heads, layer.key_dim, dtype=dtype, device=self.device))
            self.values.append(torch.zeros(slots, layer.kv_heads, layer.value_dim, dtype=dtype, device=self.device))

    @property
    def max_tokens(self) -> int:
        """Positions the budget holds per group, in whole blocks."""
        return (self.pools[0].max_blocks - 1) * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """Device memory one position of one session takes, over every layer."""
        return bytes_per_token(self.layers, self.dtype)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def new_cache(self) -> PagedCache:
        cache = PagedCache(tables=[[] for _ in self.windows], dropped=[0 for _ in self.windows])
        weakref.finalize(cache, _give_back, self.pools, cache.tables, cache.dropped)
        return cache

    # ------------------------------------------------------------------ growing

    def reserve(self, cache: PagedCache, end: int) -> None:
        """Blocks for positions up to ``end`` in every group (KVExhausted when the
        budget is spent: then nothing is taken)."""
        need = self.blocks_for(end)
        taken: list[tuple[int, list[int]]] = []
        try:  # all groups or none
            for group in range(len(self.pools)):
                missing = need - len(cache.tables[group])
                if missing > 0:
                    taken.append((group, self._take(group, missing)))
        except BaseException:
            for group, blocks in taken:
                self.pools[group].give_back(blocks)
            raise
        for group, blocks in taken:
            cache.tables[group].extend(blocks)

    def _take(self, group: int, n: int) -> list[int]:
        """``n`` free blocks of ``group``, growing its pool if it must (KVExhausted beyond the budget)."""
        pool = self.pools[group]
        blocks = pool.take(n)
        if blocks is None:
            self._grow(group, pool.grown(n))
            blocks = pool.take(n)
        return blocks

    def _grow(self, group: int, capacity: int) -> None:
        """A growable pool's tensors, enlarged to ``capacity`` blocks (contents kept)."""
        slots = capacity * self.block_size
        for i, g in enumerate(self.group_of):
            if g == group:
                for tensors in (self.keys, self.values):
                    old = tensors[i]
                    tensors[i] = torch.zeros(slots, *old.shape[1:], dtype=old.dtype, device=old.device)
                    tensors[i][:old.shape[0]] = old
        self.pools[group].extend(capacity)

    def fork(self, cache: PagedCache, length: int) -> PagedCache:
        """A new cache holding ``cache``'s positions ``[0, length)`` (fewer if
        ``cache`` holds fewer; none where a sliding window would need positions
        already released): a branch that goes on from there. Whole blocks are
        shared by the two (neither writes them again: a rollback into one copies
        it first); a partly filled last block is copied. KVExhausted when the
        budget cannot hold that copy."""
        length = min(length, cache.length)
        for group, window in enumerate(self.windows):
            if window is not None and cache.first_held(group, self.block_size) > max(0, length - window + 1):
                length = 0
        fork = self.new_cache()
        whole = length // self.block_size
        for group, table in enumerate(cache.tables):
            first = min(cache.dropped[group], whole)
            self.pools[group].share(table[first:whole])
            fork.tables[group][:] = [SCRATCH] * first + table[first:whole]
            fork.dropped[group] = first
        fork.length = whole * self.block_size
        if length > fork.length:  # the last block, partly filled: a copy of its own
            self.reserve(fork, length)
            for group, table in enumerate(cache.tables):
                self._copy_block(group, table[whole], fork.tables[group][whole])
            fork.length = length
        return fork

    @torch.inference_mode()  # a pool a pass grew holds inference tensors: written only in inference mode
    def _copy_block(self, group: int, src: int, dst: int) -> None:
        """Block ``src``'s keys and values into block ``dst``, in every layer of ``group``."""
        a, b = src * self.block_size, dst * self.block_size
        for i, g in enumerate(self.group_of):
            if g == group:
                self.keys[i][b:b + self.block_size] = self.keys[i][a:a + self.block_size]
                self.values[i][b:b + self.block_size] = self.values[i][a:a + self.block_size]

    def _unshare_last(self, cache: PagedCache) -> None:
        """Before a cache ends inside a block it shares (a rollback): a copy of
        that block of its own, since its next pass writes there."""
        if cache.length % self.block_size == 0:
            return
        last = cache.length // self.block_size
        for group, table in enumerate(cache.tables):
            if last < len(table) and self.pools[group].is_shared(table[last]):
                (own,) = self._take(group, 1)
                self._copy_block(group, table[last], own)
                self.pools[group].give_back([table[last]])
                table[last] = own

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        """The slots of ``blocks``, in order."""
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return (ids[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).flatten()

    # ------------------------------------------------------------------ shrinking

    def crop(self, cache: PagedCache, length: int) -> int:
        """Keep at most positions ``[0, length)``; returns how many are kept:
        ``length``, or 0 when a sliding window would need positions already
        released (the cache is then emptied, to be run again)."""
        if length < 0 or length > cache.length:
            raise ValueError(f"cannot crop a cache of {cache.length} tokens to {length}")
        for group, window in enumerate(self.windows):
            if window is not None and cache.first_held(group, self.block_size) > max(0, length - window + 1):
                length = 0
        keep = self.blocks_for(length)
        for group, table in enumerate(cache.tables):
            self.pools[group].give_back(table[max(keep, cache.dropped[group]):])
            del table[keep:]
            cache.dropped[group] = min(cache.dropped[group], keep)
        cache.length = length
        self._unshare_last(cache)
        return length

    def slide(self, cache: PagedCache) -> None:
        """Release the blocks of sliding-window groups that no query from
        ``cache.length - keep_behind`` on can see (after a pass)."""
        for group, window in enumerate(self.windows):
            if window is None:
                continue
            oldest_seen = cache.length - self.keep_behind - window + 1
            drop = max(0, oldest_seen) // self.block_size  # blocks wholly before it
            table = cache.tables[group]
            if drop > cache.dropped[group]:
                self.pools[group].give_back(table[cache.dropped[group]:drop])
                table[cache.dropped[group]:drop] = [SCRATCH] * (drop - cache.dropped[group])
                cache.dropped[group] = drop

    def release(self, cache: PagedCache) -> None:
        """Give every block of ``cache`` back (its session ended). A cache that is
        garbage collected gives its blocks back too (:meth:`new_cache`)."""
        _give_back(self.pools, cache.tables, cache.dropped)
        cache.length = 0

    # ------------------------------------------------------------------ accounting

    def held_blocks(self, cache: PagedCache) -> int:
        """Blocks ``cache`` holds in its largest group."""
        return max(len(table) - dropped for table, dropped in zip(cache.tables, cache.dropped, strict=True))

    def used_blocks(self) -> int:
        """Blocks in use, in the fullest group."""
        return max(pool.used for pool in self.pools)


def bytes_per_token(layers: list[LayerKV], dtype: torch.dtype) -> int:
    """Memory one position takes in every layer's keys and values."""
    return sum(layer.kv_heads * (layer.key_dim + layer.value_dim) for layer in layers) * dtype.itemsize


def _give_back(pools: list[BlockPool], tables: list[list[int]], dropped: list[int]) -> None:
    """Every block of a cache's ``tables`` back to ``pools``; the tables emptied."""
    for group, table in enumerate(tables):
        pools[group].give_back(table[dropped[group]:])
        table.clear()
        dropped[group] = 0
