"""Every family users bring, through the three services: a target and a draft
of the same architecture (tiny, random), a draft service, a target service and
a coordinator on loopback, 8 greedy sessions at once through the Python
client. Each session's output is Hugging Face's own greedy decoding of the
target, token for token; the target batches them (the mean sessions per
forward pass, from the service's own metric, is above 1.5); sessions longer
than the sliding windows cross them. And a pair of one tokenizer padded to
different vocabulary sizes, served by text by a coordinator given no
tokenizer: it takes the target's."""

from __future__ import annotations

import concurrent.futures
import random

import pytest
import torch

import specdec
from specdec.serving.config import CoordinatorConfig
from specdec.telemetry.metrics import ServiceMetrics
from specdec.telemetry.setup import ServiceTelemetry

from service_harness import LoopThread
from tiny_models import ARCHITECTURES, TEST_DEVICE, add_byte_tokenizer, make_noisy_copy, save_tiny_model

SESSIONS = 8
NEW_TOKENS = 28


@pytest.fixture(scope="module")
def loop():
    loop = LoopThread()
    yield loop
    loop.close()


class Stack:
    """Draft and target services and a coordinator, in this process."""

    def __init__(self, loop: LoopThread, target, draft, **coordinator):
        from specdec.coordinator.server import start_coordinator
        from specdec.draft_service.servicer import DRAFT
        from specdec.serving.config import CONFIG_CLASSES
        from specdec.serving.model_host import start_model_service
        from specdec.target_service.servicer import TARGET

        self.loop = loop
        self.metrics = ServiceMetrics("target")
        self.services = []
        for role, model, service_role in (("draft", draft, DRAFT), ("target", target, TARGET)):
            config = CONFIG_CLASSES[role](model=str(model), host="127.0.0.1", port=0, device=TEST_DEVICE,
                                          max_batch=SESSIONS)
            telemetry = ServiceTelemetry(role, self.metrics) if role == "target" else None
            service, _ = loop.call(start_model_service(config, service_role, telemetry=telemetry))
            self.services.append(service)
        config = CoordinatorConfig(host="127.0.0.1", port=0, draft=f"127.0.0.1:{self.services[0].port}",
                                   target=f"127.0.0.1:{self.services[1].port}", **coordinator)
        self.coordinator = loop.call(start_coordinator(config))
        self.client = specdec.Client(f"127.0.0.1:{self.coordinator.port}", timeout=120)

    def sessions_per_target_pass(self) -> float:
        registry = self.metrics.registry
        total = registry.get_sample_value("specdec_batch_sequences_sum", {"service": "target"})
        passes = registry.get_sample_value("specdec_batch_sequences_count", {"service": "target"})
        return total / passes

    def close(self) -> None:
        self.client.close()
        self.loop.call(self.coordinator.server.stop())
        self.loop.call(self.coordinator.engine.close())
        for service in self.services:
            self.loop.call(service.stop())


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    """Hugging Face's own greedy decoding of the target (its eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_concurrent_greedy_sessions_equal_hugging_face_and_are_batched(arch, loop, tmp_path):
    target = save_tiny_model(tmp_path / "target", arch, seed=1, logit_scale=4.0)
    draft = make_noisy_copy(target, tmp_path / "draft", noise=0.05, seed=2)
    rng = random.Random(arch)
    prompts = [[rng.randrange(96) for _ in range(rng.randrange(3, 20))] for _ in range(SESSIONS)]
    stack = Stack(loop, target, draft)
    try:
        def session(i: int) -> list[int]:
            return stack.client.complete(prompt_ids=prompts[i], max_new_tokens=NEW_TOKENS, temperature=0.0,
                                         gamma_policy=("static:3", "static:1", "adaptive", "static:0")[i % 4]
                                         ).token_ids

        with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
            outputs = list(pool.map(session, range(SESSIONS)))
        for i, out in enumerate(outputs):
            assert out == hf_greedy(target, prompts[i], NEW_TOKENS), f"{arch} session {i}"
        assert stack.sessions_per_target_pass() > 1.5
    finally:
        stack.close()


def test_a_padded_pair_is_served_by_text_with_the_targets_own_tokenizer(loop, tmp_path):
    """Qwen2 of one byte-level tokenizer (256 tokens): a target of 320 rows and
    a draft of 384. The coordinator has no --tokenizer: it fetches the
    target's, encodes the prompt and decodes the deltas with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    big = save_tiny_model(tmp_path / "big", "qwen2", vocab_size=384, seed=3, logit_scale=4.0)
    target_model = AutoModelForCausalLM.from_pretrained(big, dtype=torch.float32)
    target_model.resize_token_embeddings(320, mean_resizing=False)
    target_model.save_pretrained(tmp_path / "target")
    target = add_byte_tokenizer(tmp_path / "target")
    draft = add_byte_tokenizer(make_noisy_copy(big, tmp_path / "draft", noise=0.05, seed=4))
    stack = Stack(loop, target, draft)
    try:
        out = stack.client.complete("def fibonacci(n):", max_new_tokens=20, temperature=0.0,
                                    gamma_policy="static:3")
        tokenizer = AutoTokenizer.from_pretrained(target)
        prompt = tokenizer.encode("def fibonacci(n):", add_special_tokens=False)
        assert out.token_ids == hf_greedy(target, prompt, 20)
        assert out.text == tokenizer.decode(out.token_ids)
        assert out.stats.drafted_tokens > 0
    finally:
        stack.close()
