"""specdec.models.lean_llama runs a plain Llama's layers as its own modules do.

Its logits are held to transformers' own forward through what the services do
to a session (a ragged pre-fill, one token at a time, several at once,
rollbacks), over the same paged store and attention function as every model."""

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.draft_service.servicer import DRAFT
from specdec.models import bundled
from specdec.models.batched import BatchedModel
from specdec.models.lean_llama import LeanLlama, unsupported_reason
from specdec.models.runner import ModelRunner
from specdec.serving.config import DraftConfig, TargetConfig
from specdec.serving.model_host import ModelHost
from specdec.target_service.servicer import TARGET

from logit_check import Sessions
from tiny_models import TEST_DEVICE


def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=600)
    config.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**config)).eval().to(TEST_DEVICE)


@pytest.mark.parametrize("overrides", [
    {}, {"num_key_value_heads": 4}, {"tie_word_embeddings": True}, {"head_dim": 16},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 300}},
], ids=["gqa", "mha", "tied", "head-dim", "linear-rope", "yarn-rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lean_logits_equal_the_models_own_forward(overrides, dtype):
    batched = BatchedModel(tiny_llama(**overrides).to(dtype), max_tokens=4096, block_size=4)
    batched.lean = LeanLlama(batched.model)
    ref = tiny_llama(**overrides).to(dtype)
    ref.set_attn_implementation("eager")
    gen = torch.Generator().manual_seed(1)
    sessions = Sessions(batched, ref, dtype, [torch.randint(0, 64, (n,), generator=gen).tolist()
                                              for n in (330, 40)])
    sessions.run({0: 20, 1: 3})  # pre-fill, every position
    for _ in range(5):  # drafting: one token at a time
        sessions.run({0: 1, 1: 1})
    sessions.run({0: 5, 1: 2})  # verifying several at once
    sessions.roll_back(0, sessions.done[0] - 2)  # two rejected
    sessions.run({0: 2})
    sessions.run({0: 300, 1: 1})  # far past the first blocks, beside a decoding row


def test_the_bundled_draft_runs_lean_and_matches_its_own_modules():
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


def test_a_runner_asked_for_lean_runs_the_models_own_modules_when_it_cannot(tmp_path, caplog):
    tiny_llama(attention_bias=True).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="specdec.models.runner"):
        runner = ModelRunner(tmp_path, lean=True)
    assert not runner.lean and runner.batched
    assert "attention or MLP biases" in caplog.text
    seq = runner.new_sequence()
    seq.tokens.extend([1, 2, 3])
    assert runner.logits(seq).shape == (1, 64)


@pytest.mark.parametrize("role", ["draft", "target"])
@pytest.mark.parametrize("lean", [True, False])
def test_both_services_run_lean_unless_told_not_to_and_batch_either_way(role, lean):
    import asyncio

    config = (DraftConfig if role == "draft" else TargetConfig)(port=0, lean_forward=lean)
    service_role = DRAFT if role == "draft" else TARGET

    async def load():
        host = ModelHost(config, service_role.session_kind(config))
        await host.load()
        host.close()
        return host.worker.runner.lean, host.worker.scheduler.max_sequences

    assert asyncio.run(load()) == (lean, config.max_batch)
