"""The paged KV store: blocks from one pool, a table per session, rollback by
whole blocks, sliding windows that keep what their queries see, a budget that
is block-exact; and the runner's sequence operations on top of it."""

import gc

import pytest
import torch

from specdec.models.paged_kv import KVExhausted, LayerKV, PagedKV
from specdec.models.runner import ModelRunner

FULL = LayerKV(kv_heads=2, key_dim=4, value_dim=4)
WINDOWED = LayerKV(kv_heads=1, key_dim=8, value_dim=8, window=8)


def store(layers=(FULL,), max_tokens=64, block_size=4, keep_behind=0) -> PagedKV:
    return PagedKV(list(layers), max_tokens=max_tokens, block_size=block_size, device=torch.device("cpu"),
                   dtype=torch.float32, keep_behind=keep_behind)


def grow(kv: PagedKV, cache, n: int) -> None:
    """What a pass does: blocks for n more positions, then the length."""
    kv.reserve(cache, cache.length + n)
    cache.length += n
    kv.slide(cache)


def test_blocks_come_from_the_pool_and_go_back_whole():
    kv = store()
    a, b = kv.new_cache(), kv.new_cache()
    grow(kv, a, 5)
    grow(kv, b, 4)
    assert len(a.tables[0]) == 2 and len(b.tables[0]) == 1
    assert 0 not in a.tables[0] + b.tables[0]  # block 0 is scratch
    assert len(set(a.tables[0] + b.tables[0])) == 3 and kv.used_blocks() == 3
    assert kv.crop(a, 4) == 4  # the second block is freed; the first keeps its 4
    assert len(a.tables[0]) == 1 and kv.used_blocks() == 2
    assert kv.crop(a, 3) == 3 and len(a.tables[0]) == 1  # the last block is trimmed by the length alone
    with pytest.raises(ValueError, match="cannot crop a cache of 3 tokens to 5"):
        kv.crop(a, 5)
    kv.release(a)
    assert kv.used_blocks() == 1 and a.tables == [[]]


def test_the_budget_is_block_exact_and_a_refused_reservation_takes_nothing():
    kv = store(max_tokens=16)  # four blocks of four
    a, b = kv.new_cache(), kv.new_cache()
    grow(kv, a, 13)  # four blocks
    with pytest.raises(KVExhausted):
        kv.reserve(b, 1)
    assert b.tables == [[]] and kv.used_blocks() == 4
    kv.crop(a, 12)
    grow(kv, b, 4)  # the freed block serves another session
    assert kv.used_blocks() == 4


def test_a_growing_pool_keeps_what_it_holds():
    kv = store(max_tokens=4096, block_size=2)
    first = kv.pools[0].capacity
    cache = kv.new_cache()
    kv.reserve(cache, 2)
    slot = cache.tables[0][0] * 2
    kv.keys[0][slot] = 7.0
    grow(kv, cache, 2 * first)  # more blocks than the pool had
    assert kv.pools[0].capacity > first and kv.keys[0].shape[0] == kv.pools[0].capacity * 2
    assert torch.equal(kv.keys[0][slot], torch.full((2, 4), 7.0))


def test_a_dropped_cache_gives_its_blocks_back():
    kv = store()
    cache = kv.new_cache()
    grow(kv, cache, 10)
    assert kv.used_blocks() == 3
    del cache
    gc.collect()
    assert kv.used_blocks() == 0


def test_a_sliding_window_group_frees_what_no_query_sees_and_rollback_respects_it():
    kv = store(layers=(FULL, WINDOWED), keep_behind=2)
    assert kv.windows == [None, 8] and kv.group_of == [0, 1]
    cache = kv.new_cache()
    grow(kv, cache, 30)
    # the next query (30) sees 23..30; 2 of margin: 21 on; blocks before 20 freed
    assert cache.dropped == [0, 5] and cache.tables[1][:5] == [0] * 5
    assert kv.held_blocks(cache) == 8  # the full group's
    assert kv.crop(cache, 28) == 28  # within the margin: the window is still there
    assert kv.crop(cache, 26) == 0  # beyond it: everything goes, to be run again
    assert kv.used_blocks() == 0 and cache.length == 0
    grow(kv, cache, 6)  # and the session starts over
    assert cache.dropped == [0, 0]


def test_layers_of_one_group_may_differ_in_shape():
    kv = store(layers=(FULL, LayerKV(kv_heads=3, key_dim=6, value_dim=2)))
    assert kv.windows == [None] and [k.shape[1:] for k in kv.keys] == [(2, 4), (3, 6)]
    assert kv.values[1].shape[1:] == (3, 2)
    assert kv.bytes_per_token == (2 * 8 + 3 * 8) * 4


# ---------------------------------------------------------------------- the runner's sequences


@pytest.fixture(scope="module")
def runner(tiny_pair, device):
    return ModelRunner(tiny_pair[0], device)


def fresh_logits(runner, tokens, last):
    seq = runner.new_sequence()
    seq.tokens.extend(tokens)
    return runner.logits(seq, last)


def test_rollback_then_extend_matches_fresh_recompute(runner):
    seq = runner.new_sequence()
    seq.tokens.extend([3, 1, 4, 1, 5])
    runner.logits(seq)
    seq.tokens.extend([9, 2, 6])  # speculative tokens, then rejected
    runner.logits(seq, 3)
    runner.rollback(seq, 6)
    assert seq.tokens == [3, 1, 4, 1, 5, 9] and seq.cache_length == 6
    seq.tokens.extend([8, 7])
    got = runner.logits(seq, 3)
    want = fresh_logits(runner, [3, 1, 4, 1, 5, 9, 8, 7], 3)
    assert torch.allclose(got, want, atol=1e-5)


def test_asking_again_recomputes_from_the_cache(runner):
    seq = runner.new_sequence()
    seq.tokens.extend([2, 7, 1, 8])
    first = runner.logits(seq, 2)
    again = runner.logits(seq, 2)  # nothing pending: rewinds and recomputes
    assert torch.allclose(first, again, atol=1e-5)
    assert seq.cache_length == 4


def test_incremental_matches_one_pass(runner):
    seq = runner.new_sequence()
    rows = []
    for tok in [5, 6, 7, 8]:
        seq.tokens.append(tok)
        rows.append(runner.logits(seq)[0])
    assert torch.allclose(torch.stack(rows), fresh_logits(runner, [5, 6, 7, 8], 4), atol=1e-5)


def test_rollback_past_the_end_is_an_error(runner):
    seq = runner.new_sequence()
    seq.tokens.extend([1, 2])
    with pytest.raises(ValueError, match="only 2 tokens"):
        runner.rollback(seq, 3)


def test_a_fork_shares_whole_blocks_copies_the_last_and_a_rollback_into_a_shared_block_copies_it():
    kv = store(layers=(FULL, WINDOWED), keep_behind=2)
    a = kv.new_cache()
    grow(kv, a, 10)
    for tensors in (kv.keys, kv.values):
        for t in tensors:
            t.copy_(torch.randn_like(t))
    used = kv.used_blocks()
    fork = kv.fork(a, 7)  # block 0 whole (shared), block 1 partly filled (copied)
    assert fork.length == 7 and fork.tables[0][0] == a.tables[0][0] and fork.tables[0][1] != a.tables[0][1]
    assert kv.used_blocks() == used + 1
    for layer, group in enumerate(kv.group_of):
        assert torch.equal(kv.keys[layer][kv._slots(a.tables[group][:2])][:7],
                           kv.keys[layer][kv._slots(fork.tables[group][:2])][:7])
    grow(kv, fork, 5)  # the branch grows on its own blocks; the source is untouched
    assert a.length == 10
    before = kv.keys[0][kv._slots(fork.tables[0][:1])].clone()
    assert kv.crop(a, 3) == 3 and a.tables[0][0] != fork.tables[0][0]  # into the shared block: a copy of its own
    assert torch.equal(kv.keys[0][kv._slots(a.tables[0][:1])][:3], before[:3])
    kv.release(a)
    kv.release(fork)
    assert kv.used_blocks() == 0  # shared or not, every block goes back once
    assert kv.fork(kv.new_cache(), 5).length == 0
    tight = store(max_tokens=8)
    src = tight.new_cache()
    grow(tight, src, 6)
    with pytest.raises(KVExhausted):
        tight.fork(src, 6)  # the partly filled block needs one more, and none is left
    assert tight.fork(src, 4).length == 4  # whole blocks only: shared, nothing taken


def test_a_forked_sequence_goes_on_as_the_same_tokens_run_fresh(runner):
    seq = runner.new_sequence()
    seq.tokens.extend([3, 1, 4, 1, 5, 9, 2])
    runner.logits(seq)
    branch = runner.fork(seq, 5)
    assert branch.tokens == [3, 1, 4, 1, 5] and branch.cache_length == 5 and seq.cache_length == 7
    branch.tokens.extend([8, 8])
    got = runner.logits(branch, 2)
    assert torch.allclose(got, fresh_logits(runner, [3, 1, 4, 1, 5, 8, 8], 2), atol=1e-5)
    assert torch.allclose(runner.logits(seq), fresh_logits(runner, [3, 1, 4, 1, 5, 9, 2], 1), atol=1e-5)


def test_blocks_are_copied_outside_inference_mode_after_a_pass_grew_the_pool():
    """A forward pass (inference mode) that grows the pool makes its tensors
    inference tensors; a fork or a rollback into a shared block, made by the
    steps outside inference mode, must still copy blocks there."""
    kv = store(max_tokens=4096, block_size=2)
    a = kv.new_cache()
    with torch.inference_mode():  # as a pass reserving its positions
        grow(kv, a, 2 * kv.pools[0].capacity + 1)  # past the pool's first capacity: its tensors remade
        assert kv.keys[0].is_inference()
    fork = kv.fork(a, 5)  # the partly filled block copied
    assert kv.crop(a, 3) == 3  # into the shared block: copied first
    assert torch.equal(kv.keys[0][kv._slots(a.tables[0][:2])][:3], kv.keys[0][kv._slots(fork.tables[0][:2])][:3])
