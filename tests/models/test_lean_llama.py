"""specdec.models.lean_llama runs a Llama draft as Hugging Face's forward does.

Its numerics cannot change the output (the target judges the draft by the q it
sampled from), but a draft that computed something else would lose acceptance;
so its logits are held to Hugging Face's, through the same cache operations the
decoder uses: prefill, one token at a time, several at once, rollback, growth."""

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.models import bundled, kv_cache
from specdec.models.lean_llama import LeanCache, LeanLlama, unsupported_reason
from specdec.models.runner import ModelRunner
from specdec.serving.config import DraftConfig, TargetConfig
from specdec.serving.model_host import ModelHost

from tiny_models import TEST_DEVICE


def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=600)
    config.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**config)).eval().to(TEST_DEVICE)


# Float rounding: float32 to the last few bits; bfloat16 keeps 8 bits of
# mantissa, so a logit may be off by a few of its units in the last place.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def run_both(hf, lean, hf_cache, lean_cache, ids, keep):
    ids = torch.tensor([ids], device=TEST_DEVICE)
    hf_logits = kv_cache.forward(hf, ids, hf_cache, keep)
    lean_logits = kv_cache.forward(lean, ids, lean_cache, keep)
    torch.testing.assert_close(lean_logits, hf_logits, **TOLERANCE[hf.dtype])
    assert kv_cache.cache_length(lean_cache) == kv_cache.cache_length(hf_cache)


@pytest.mark.parametrize("overrides", [
    {}, {"num_key_value_heads": 4}, {"tie_word_embeddings": True}, {"head_dim": 16},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 300}},
], ids=["gqa", "mha", "tied", "head-dim", "linear-rope", "yarn-rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_logits_match_hugging_face_through_the_decoders_cache_operations(overrides, dtype):
    """Pre-fill, drafting one token at a time, a multi-token verify, a rollback,
    and a re-pre-fill far past the cache's first capacity."""
    hf = tiny_llama(**overrides).to(dtype)
    lean = LeanLlama(hf)
    hf_cache, lean_cache = kv_cache.new_cache(hf), kv_cache.new_cache(lean)
    assert isinstance(lean_cache, LeanCache)
    tokens = torch.randint(0, 64, (520,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        run_both(hf, lean, hf_cache, lean_cache, tokens[:20], 20)  # prefill, every position
        for t in tokens[20:25]:  # drafting: one token at a time
            run_both(hf, lean, hf_cache, lean_cache, [t], 1)
        run_both(hf, lean, hf_cache, lean_cache, tokens[25:30], 5)  # verifying several at once
        for cache in (hf_cache, lean_cache):  # two rejected: roll back, then run other tokens
            kv_cache.crop_cache(cache, 28)
        run_both(hf, lean, hf_cache, lean_cache, [7, 9], 2)
        assert lean_cache.keys.shape[2] <= 30 + 256  # capacity: the first pass's, grown as needed
        # far past it: the cache grows, keeping what it held, up to the model's context
        run_both(hf, lean, hf_cache, lean_cache, tokens[30:500], 3)
        run_both(hf, lean, hf_cache, lean_cache, [11], 1)
    assert 501 <= lean_cache.keys.shape[2] <= 600


def test_the_bundled_draft_runs_lean_and_matches():
    hf = ModelRunner(bundled.draft_path(), TEST_DEVICE)
    lean = ModelRunner(bundled.draft_path(), TEST_DEVICE, lean=True)
    assert lean.lean and not hf.lean
    a, b = hf.new_sequence(), lean.new_sequence()
    for seq in (a, b):
        seq.tokens.extend(range(5, 45))
    torch.testing.assert_close(lean.logits(b, last=3), hf.logits(a, last=3), rtol=1e-5, atol=1e-5)
    assert lean.tokens_run == hf.tokens_run == 40
    lean.rollback(b, 30)
    hf.rollback(a, 30)
    for seq in (a, b):
        seq.tokens.append(17)
    torch.testing.assert_close(lean.logits(b), hf.logits(a), rtol=1e-5, atol=1e-5)
    assert b.cache_length == a.cache_length == 31


@pytest.mark.parametrize("overrides, reason", [
    ({"attention_bias": True}, "biases"),
    ({"mlp_bias": True}, "biases"),
    ({"hidden_act": "gelu"}, "activation"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "sequence length"),
])
def test_models_it_cannot_run_exactly_are_refused_with_the_reason(overrides, reason):
    model = tiny_llama(**overrides)
    assert reason in unsupported_reason(model)
    with pytest.raises(ValueError, match=reason):
        LeanLlama(model)


def test_quantized_or_adapted_weights_are_refused():
    model = tiny_llama()
    model.config.quantization_config = {"quant_method": "gptq"}
    assert unsupported_reason(model) == "quantized weights"

    class Adapted(torch.nn.Linear):  # e.g. a LoRA layer or a packed linear
        pass

    model = tiny_llama()
    model.model.layers[-1].mlp.up_proj.__class__ = Adapted  # any layer, not only the first
    assert "not plain nn.Linear" in unsupported_reason(model)


def test_a_runner_asked_for_lean_keeps_hugging_face_when_it_cannot(tmp_path, caplog):
    tiny_llama(attention_bias=True).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="specdec.models.runner"):
        runner = ModelRunner(tmp_path, lean=True)
    assert not runner.lean
    assert "attention or MLP biases" in caplog.text
    seq = runner.new_sequence()
    seq.tokens.extend([1, 2, 3])
    assert runner.logits(seq).shape == (1, 64)


@pytest.mark.parametrize("role", ["draft", "target"])
@pytest.mark.parametrize("lean", [True, False])
def test_both_services_run_lean_unless_told_not_to(role, lean, caplog):
    """The lean forward batches sessions; --no-lean-forward is Hugging Face's
    forward, one session per pass, said in the log."""
    import asyncio

    config = (DraftConfig if role == "draft" else TargetConfig)(port=0, lean_forward=lean)

    async def load():
        host = ModelHost(config)
        await host.load()
        host.close()
        return host.runner.lean, host.scheduler.max_sequences

    with caplog.at_level(logging.INFO):
        assert asyncio.run(load()) == (lean, config.max_batch if lean else 1)
    assert ("one session per forward pass" in caplog.text) is not lean


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_ragged_batched_pass_gives_each_row_the_logits_of_its_own_pass(dtype):
    """Rows of different context lengths (none cached, some, much), running
    different numbers of new tokens (1, several, a prefill), in one pass."""
    from specdec.models.lean_llama import BatchRow

    lean = LeanLlama(tiny_llama().to(dtype))
    gen = torch.Generator().manual_seed(2)
    contexts = [0, 3, 40, 17, 250]
    new = [12, 1, 5, 1, 3]
    alone, batched = [], []
    for context, n in zip(contexts, new, strict=True):
        tokens = torch.randint(0, 64, (context + n,), generator=gen).tolist()
        pair = (lean.new_cache(), lean.new_cache())
        for cache in pair:
            if context:
                lean.forward_batch([BatchRow(tokens[:context], cache, 1)])
        alone.append((tokens[context:], pair[0]))
        batched.append(BatchRow(tokens[context:], pair[1], n))
    expected = [lean.forward_batch([BatchRow(t, c, len(t))])[0] for t, c in alone]
    got = lean.forward_batch(batched)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for row, want, have, context in zip(batched, expected, got, contexts, strict=True):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, **tolerance)
        assert row.cache.length == context + len(row.tokens)
        torch.testing.assert_close(row.cache.keys[:, :, :row.cache.length],
                                   alone[batched.index(row)][1].keys[:, :, :row.cache.length], **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_passes_through_recorded_layers_give_the_eager_passes_logits(dtype):
    """specdec.models.cuda_graphs: each layer's work over fixed buffers padded to
    the next power of two (recorded as CUDA graphs on a CUDA device, called as
    they are elsewhere), attention between them; passes beyond the largest size
    run eagerly. Pre-fill, decoding, a ragged batch and a rollback, side by side."""
    from specdec.models.lean_llama import BatchRow

    eager = LeanLlama(tiny_llama().to(dtype))
    graphed = LeanLlama(tiny_llama().to(dtype), graph_tokens=8)
    assert graphed.graphs.for_tokens(3) is graphed.graphs.for_tokens(4) is not graphed.graphs.for_tokens(5)
    assert graphed.graphs.for_tokens(9) is None
    tolerance = TOLERANCE[dtype]
    gen = torch.Generator().manual_seed(3)
    caches = {lean: [lean.new_cache() for _ in range(3)] for lean in (eager, graphed)}

    def both(batch):  # [(session, tokens, logits to keep)]
        want, have = ([lean.forward_batch([BatchRow(t, caches[lean][s], k) for s, t, k in batch])
                       for lean in (eager, graphed)])
        for w, h in zip(want, have, strict=True):
            torch.testing.assert_close(h, w, **tolerance)

    def tokens(n):
        return torch.randint(0, 64, (n,), generator=gen).tolist()

    both([(0, tokens(12), 1)])  # a pre-fill beyond 8 tokens: eager
    both([(1, tokens(5), 5), (2, tokens(2), 1)])  # 7 tokens: padded to 8
    for _ in range(3):  # decoding three sessions at once, then one alone
        both([(0, tokens(1), 1), (1, tokens(1), 1), (2, tokens(1), 1)])
        both([(1, tokens(1), 1)])
    for lean in (eager, graphed):  # two drafts rejected
        caches[lean][0].length -= 2
    both([(0, tokens(3), 3), (2, tokens(4), 4)])  # a verification beside another
