"""specdec.models.batched runs every decoder family through its own modules,
batched, over the paged KV store: its logits equal the model's own forward
(transformers' eager attention over the whole sequence, no cache) through
everything the services do to a session -- a ragged pre-fill, single steps,
multi-token verification, rollbacks (across a sliding window's boundary too)
-- in each dtype. Models it cannot run are refused when they load, naming the
architecture and why."""

from __future__ import annotations

import pytest
import torch

from specdec.models.attention import BatchRow
from specdec.models.batched import BatchedModel, UnsupportedModel

from logit_check import DTYPES, TOLERANCE, Sessions, own_logits, reference, varlen_reference
from tiny_models import ARCHITECTURES, TEST_DEVICE, make_tiny_model


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_logits_equal_the_models_own_forward_through_a_sessions_life(arch, dtype):
    dtype = DTYPES[dtype]
    model = make_tiny_model(arch, dtype=dtype).to(TEST_DEVICE)
    batched = BatchedModel(model, max_tokens=2048, block_size=4, keep_behind=4)
    gen = torch.Generator().manual_seed(1)
    sessions = Sessions(batched, reference(arch, dtype), dtype,
                        [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (80, 60, 70)])
    sessions.run({0: 17, 1: 3, 2: 9})  # a ragged pre-fill: mixed lengths in one pass
    for _ in range(3):
        sessions.run({0: 1, 1: 1, 2: 1})  # drafting: one token each
    sessions.run({0: 5, 1: 1, 2: 3})  # verifying several beside decoding
    sessions.run({1: 14})  # one alone, past every window
    # Rollbacks: two rejected drafts (kept), and one deeper than the window's
    # margin (the cache is dropped and the tokens run again: still exact).
    assert sessions.roll_back(0, sessions.done[0] - 2) == 23
    windowed = any(layer.window for layer in batched.kv.layers)
    assert sessions.roll_back(1, 6) == (0 if windowed else 6)
    sessions.run({0: 4, 1: 20 - sessions.done[1], 2: 2})
    for _ in range(4):
        sessions.run({0: 2, 1: 1, 2: 5})  # across the window boundary again, ragged
    assert batched.kv.used_blocks() > 0
    for cache in sessions.caches:
        batched.kv.release(cache)
    assert batched.kv.used_blocks() == 0


def test_a_sliding_window_keeps_only_the_blocks_its_queries_see():
    """Mistral with a window of 8 and blocks of 4: a session of 60 positions
    holds the window and the rollback margin, not its whole past."""
    model = make_tiny_model("mistral").to(TEST_DEVICE)
    batched = BatchedModel(model, max_tokens=2048, block_size=4, keep_behind=4)
    cache = batched.new_cache()
    batched.forward_batch([BatchRow(list(range(60)), cache, 1)])
    # a query at 63 or later sees 56 on; 4 positions of margin: blocks from position 48 on
    assert cache.dropped == [12] and batched.kv.held_blocks(cache) == 3
    assert batched.kv.crop(cache, 57) == 57  # within the margin
    assert batched.kv.crop(cache, 50) == 0  # deeper: dropped, to be run again


def test_layers_of_different_windows_keep_their_own_block_tables():
    """Gemma 3: sliding and full layers in one model, two groups of blocks."""
    model = make_tiny_model("gemma3").to(TEST_DEVICE)
    batched = BatchedModel(model, max_tokens=2048, block_size=4, keep_behind=0)
    assert batched.kv.windows == [None, 8]
    assert [layer.window for layer in batched.kv.layers] == [8, 8, None]
    cache = batched.new_cache()
    batched.forward_batch([BatchRow(list(range(40)), cache, 1)])
    assert len(cache.tables[0]) == 10 and cache.dropped == [0, 8]


def test_a_row_may_carry_its_own_mask_over_its_new_tokens():
    """Token trees: two branches after a shared prefix, each token seeing its
    own branch, in one row; each branch's logits are those of the branch run
    alone. A causal tree is causal order."""
    model = make_tiny_model("qwen3").to(TEST_DEVICE)
    batched = BatchedModel(model, max_tokens=2048, block_size=4)
    ref = reference("qwen3", torch.float32)
    prefix = [5, 9, 14, 3, 7, 21]
    cache = batched.new_cache()
    batched.forward_batch([BatchRow(prefix, cache, 1)])
    # new tokens: a (pos 6), b (pos 7, after a) | c (pos 6), d (pos 7, after c)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    out = batched.forward_batch([BatchRow([30, 31, 40, 41], cache, 4, tree=tree, positions=[6, 7, 6, 7])])[0]
    torch.testing.assert_close(out[:2], own_logits(ref, prefix + [30, 31], 2), **TOLERANCE[torch.float32])
    torch.testing.assert_close(out[2:], own_logits(ref, prefix + [40, 41], 2), **TOLERANCE[torch.float32])
    batched.kv.crop(cache, len(prefix))
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    out = batched.forward_batch([BatchRow([30, 31, 32], cache, 3, tree=causal, positions=[6, 7, 8])])[0]
    torch.testing.assert_close(out, own_logits(ref, prefix + [30, 31, 32], 3), **TOLERANCE[torch.float32])


# FlashAttention's paged kernel on a GPU (bfloat16, blocks of 256); elsewhere a
# reference of it (any dtype and block) runs the same plan.
ON_CUDA = TEST_DEVICE.startswith("cuda")
VARLEN_DTYPE, VARLEN_BLOCK = (torch.bfloat16, 256) if ON_CUDA else (torch.float32, 4)


@pytest.fixture
def varlen(monkeypatch):
    """The varlen kernel as this device runs it (see above)."""
    from specdec.models import attention

    if not ON_CUDA:
        monkeypatch.setattr(attention, "VARLEN", varlen_reference)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral"])
def test_the_varlen_plan_gives_the_same_logits(arch, varlen):
    """The CUDA kernel's plan: block tables, cumulative query counts, the
    positions each row holds, sliding windows as the kernel's window."""
    model = make_tiny_model(arch, dtype=VARLEN_DTYPE).to(TEST_DEVICE)
    batched = BatchedModel(model, max_tokens=4096, block_size=VARLEN_BLOCK, keep_behind=4, kernel="varlen")
    assert batched.kernel == "varlen"
    gen = torch.Generator().manual_seed(2)
    sessions = Sessions(batched, reference(arch, VARLEN_DTYPE), VARLEN_DTYPE,
                        [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (40, 40)])
    sessions.run({0: 11, 1: 2})
    for _ in range(3):
        sessions.run({0: 1, 1: 4})
    sessions.roll_back(1, sessions.done[1] - 3)
    sessions.run({0: 3, 1: 5})


@pytest.mark.parametrize("lean", [False, True], ids=["own-modules", "lean"])
def test_recorded_passes_give_the_eager_passes_logits(lean, varlen):
    """specdec.models.cuda_graphs: whole passes over fixed buffers padded to the
    next power of two (recorded as CUDA graphs on a CUDA device, called as they
    are elsewhere); larger passes run eagerly. Pre-fill, decoding, a ragged
    batch and a rollback, side by side with the eager model."""
    from specdec.models.lean_llama import LeanLlama

    models = [BatchedModel(make_tiny_model("llama", dtype=VARLEN_DTYPE).to(TEST_DEVICE), max_tokens=4096,
                           block_size=VARLEN_BLOCK, kernel="varlen") for _ in range(2)]
    if lean:
        for m in models:
            m.lean = LeanLlama(m.model)
    eager, graphed = models
    graphed.record_graphs(8)
    assert graphed.graphs.for_tokens(3) is graphed.graphs.for_tokens(4) is not graphed.graphs.for_tokens(5)
    assert graphed.graphs.for_tokens(9) is None
    gen = torch.Generator().manual_seed(3)
    caches = {m: [m.new_cache() for _ in range(3)] for m in models}

    def both(batch):  # [(session, tokens, logits to keep)]
        want, have = (m.forward_batch([BatchRow(t, caches[m][s], k) for s, t, k in batch]) for m in models)
        for w, h in zip(want, have, strict=True):
            torch.testing.assert_close(h, w, **TOLERANCE[VARLEN_DTYPE])

    def tokens(n):
        return torch.randint(0, 96, (n,), generator=gen).tolist()

    both([(0, tokens(12), 1)])  # a pre-fill beyond 8 tokens: eager
    both([(1, tokens(5), 5), (2, tokens(2), 1)])  # 7 tokens: padded to 8
    for _ in range(3):  # decoding three sessions at once, then one alone
        both([(0, tokens(1), 1), (1, tokens(1), 1), (2, tokens(1), 1)])
        both([(1, tokens(1), 1)])
    for m in models:  # two drafts rejected
        m.kv.crop(caches[m][0], caches[m][0].length - 2)
    both([(0, tokens(3), 3), (2, tokens(4), 4)])  # a verification beside another


# ---------------------------------------------------------------------- refusals


def test_an_encoder_decoder_model_is_refused_naming_it(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    from specdec.models.runner import ModelRunner

    T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
                               ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match=r"T5ForConditionalGeneration .*encoder-decoder"):
        ModelRunner(tmp_path)


def test_a_state_space_model_is_refused_naming_it(tmp_path):
    from transformers import MambaConfig, MambaForCausalLM

    from specdec.models.runner import ModelRunner

    MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=1)
                     ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match=r"MambaForCausalLM \(model_type 'mamba'\) cannot be served: it has "
                       "state-space"):
        ModelRunner(tmp_path)


def test_a_model_whose_batched_logits_differ_is_refused_at_load(monkeypatch):
    """The self-check at load: an attention function that computes something
    else (here: keys scaled) is caught before any request."""
    from specdec.models import attention

    real = attention.attend

    def wrong(plan, layer, q, k, v, scale, softcap=None):
        return real(plan, layer, q, k * 1.5, v, scale, softcap)

    monkeypatch.setattr(attention, "attend", wrong)
    with pytest.raises(UnsupportedModel, match="logits through specdec's batched attention differ"):
        BatchedModel(make_tiny_model("qwen2").to(TEST_DEVICE), max_tokens=256, block_size=4)


def test_a_kernel_that_cannot_serve_is_refused_or_not_chosen():
    """varlen needs CUDA, bfloat16 or float16, blocks of 256, no soft-capping:
    asked for where it cannot serve, a clear ValueError; by default, padded."""
    from specdec.models.attention import choose_kernel

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_kernel(cuda, torch.bfloat16, 256, False) == "varlen"
    assert choose_kernel(cuda, torch.float32, 256, False) == "padded"
    assert choose_kernel(cuda, torch.bfloat16, 16, False) == "padded"
    assert choose_kernel(cuda, torch.bfloat16, 256, True) == "padded"
    assert choose_kernel(cpu, torch.bfloat16, 256, False) == "padded"
    for args, why in (((cpu, torch.bfloat16, 256, False), "CUDA devices only"),
                      ((cuda, torch.float32, 256, False), "bfloat16 or float16, not float32"),
                      ((cuda, torch.float16, 16, False), "multiples of 256 positions, not 16"),
                      ((cuda, torch.bfloat16, 256, True), "soft-caps")):
        with pytest.raises(ValueError, match=why):
            choose_kernel(*args, requested="varlen")
    with pytest.raises(ValueError, match="one of"):
        choose_kernel(cpu, torch.float32, 16, False, requested="flash")


def test_a_default_varlen_kernel_that_fails_its_check_falls_back_to_padded(monkeypatch, caplog):
    """Where FlashAttention's paged kernel cannot run (here: a CPU, as a torch
    build without it would), the model is served by the padded kernel."""
    from specdec.models import attention

    monkeypatch.setattr(attention, "choose_kernel", lambda *args: "varlen")
    batched = BatchedModel(make_tiny_model("llama").to(TEST_DEVICE), max_tokens=256, block_size=4)
    assert batched.kernel == "padded" and "the varlen attention kernel failed its check" in caplog.text
