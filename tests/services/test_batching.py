"""Many sessions at once through real services (gRPC on loopback), their
forward passes batched: every session's greedy output is still its own
target-only output, whatever shares its passes; a sampled batch follows the
target's distribution; one bad request fails alone; the KV budget refuses
rather than grows."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import random
import threading
import time

import grpc
import pytest
import torch

from specdec import SpeculativeDecoder
from specdec.coordinator.engine import Coordinator
from specdec.core.interfaces import SamplingParams
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import convert as pc
from specdec.serving.config import CoordinatorConfig
from specdec.serving.generation import Delta, GenerateJob

from service_harness import LoopThread, SyncEngine, channel, start_service
from tiny_models import make_noisy_copy, make_tiny_llama

SESSIONS = 16
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batching-models")
    target = make_tiny_llama(root / "target", vocab_size=96, layers=2, max_positions=512, seed=3, logit_scale=4.0)
    return target, make_noisy_copy(target, root / "draft", noise=0.05, seed=4)


@pytest.fixture(scope="module")
def stack(pair):
    """Batching draft and target services (the target holds 10 sessions at most,
    so idle ones are evicted and re-pre-filled) and a coordinator engine."""
    target, draft = pair
    loop = LoopThread()
    services = [start_service(loop, "draft", draft, max_batch=SESSIONS),
                start_service(loop, "target", target, max_batch=SESSIONS, max_sessions=10)]
    passes = []
    for service in services:  # record how many sessions each pass held
        scheduler = service.host.worker.scheduler
        scheduler.on_pass = lambda stats, role=service.host.config.role: passes.append((role, stats.sequences))
    engine = SyncEngine(loop, lambda: Coordinator(CoordinatorConfig(
        draft=f"127.0.0.1:{services[0].port}", target=f"127.0.0.1:{services[1].port}", max_streams=SESSIONS * 2)))
    yield engine, services, passes
    engine.close()
    for service in services:
        loop.call(service.stop())
    loop.close()


def generate(engine, **job) -> list[int]:
    return [t for e in engine.generate(GenerateJob(**job)) if isinstance(e, Delta) for t in e.token_ids]


def test_concurrent_sessions_each_get_their_own_target_only_output(pair, stack):
    """16 sessions at once: different prompt lengths and output lengths, γ
    policies, some with a second turn (after which their target session may
    have been evicted), one cancelled midway."""
    engine, _, passes = stack
    reference = SpeculativeDecoder(target=pair[0])
    rng = random.Random(5)
    prompts = [[rng.randrange(96) for _ in range(rng.randrange(3, 60))] for _ in range(SESSIONS)]
    lengths = [rng.randrange(8, 40) for _ in range(SESSIONS)]
    start = threading.Barrier(SESSIONS)

    def session(i: int):
        policy = ("adaptive", "static:4", "static:0", "heuristic")[i % 4]
        start.wait()
        if i == 0:  # cancelled after its first tokens: the others must not notice
            events = engine.generate(GenerateJob(prompt_ids=tuple(prompts[0]), max_new_tokens=200,
                                                 session_id="s0", gamma_policy="static:4"))
            next(events)
            events.close()
            return None
        out = generate(engine, prompt_ids=tuple(prompts[i]), max_new_tokens=lengths[i], session_id=f"s{i}",
                       gamma_policy=policy)
        if i % 3 == 0:  # a second turn on the same session
            turn2 = [7, 8, 9]
            history = prompts[i] + out + turn2
            out2 = generate(engine, prompt_ids=tuple(turn2), max_new_tokens=12, session_id=f"s{i}",
                            gamma_policy=policy)
            return (out, history, out2)
        return (out, None, None)

    with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
        results = list(pool.map(session, range(SESSIONS)))
    for i, result in enumerate(results[1:], start=1):
        out, history, out2 = result
        assert out == reference.generate(prompts[i], max_new_tokens=lengths[i]).token_ids, f"session {i}"
        if history is not None:
            assert out2 == reference.generate(history, max_new_tokens=12).token_ids, f"session {i}, turn 2"
    assert max(n for role, n in passes if role == "target") > 1, "no target pass was ever batched"
    assert max(n for role, n in passes if role == "draft") > 1, "no draft pass was ever batched"


def test_a_bad_request_in_a_batch_fails_alone(pair, stack):
    """One session's Verify names a position past its end while others are
    verified alongside it: it gets its own clear status, they complete."""
    engine, services, _ = stack
    target = services[1]

    def good(i):
        return generate(engine, prompt_ids=(1, 2, 3, i), max_new_tokens=16, gamma_policy="static:2")

    with channel(target) as ch, concurrent.futures.ThreadPoolExecutor(4) as pool:
        stub = pb_grpc.TargetServiceStub(ch)
        futures = [pool.submit(good, i) for i in range(3)]
        with pytest.raises(grpc.RpcError) as e:
            stub.Verify(pc.verify_request("bad-row", 1, 7, [1, 2], [], GREEDY), timeout=20)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND  # an unknown session asked at position 7
        assert all(len(f.result(60)) == 16 for f in futures)


def test_the_kv_budget_refuses_with_resource_exhausted(pair):
    """Sessions in the middle of calls may not be evicted: beyond the budget a
    new one is refused, saying so, and the budget is never exceeded."""
    loop = LoopThread()
    target = start_service(loop, "target", pair[0], max_cached_tokens=100)
    try:
        with channel(target) as ch:
            stub = pb_grpc.TargetServiceStub(ch)
            holder = target.host.sessions
            release = threading.Event()

            async def hold_session():  # a call in flight on a 90-token session
                async with holder.open("busy", 0, reserve=90):
                    while not release.is_set():
                        await asyncio.sleep(0.01)

            held = asyncio.run_coroutine_threadsafe(hold_session(), loop.loop)
            with pytest.raises(grpc.RpcError) as e:
                stub.Verify(pc.verify_request("new", 1, 0, list(range(30)), [], GREEDY), timeout=20)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "budget of 100 tokens" in e.value.details()
            assert holder.cached_tokens <= 100 and "new" not in holder
            release.set()
            held.result(10)
            stub.Verify(pc.verify_request("new", 1, 0, list(range(30)), [], GREEDY), timeout=20)  # room now
    finally:
        loop.call(target.stop())
        loop.close()


def test_a_turn_waits_for_kv_room_then_gives_the_target_output(pair):
    """Every target at its KV budget: the coordinator's turn waits (--kv-wait)
    until a call in flight ends, then generates what the target alone would;
    with no wait allowed it is refused RESOURCE_EXHAUSTED at once."""
    from specdec.serving import errors

    target_dir, draft_dir = pair
    loop = LoopThread()
    services = [start_service(loop, "draft", draft_dir), start_service(loop, "target", target_dir,
                                                                          max_cached_tokens=100)]
    engines = {wait: SyncEngine(loop, lambda wait=wait: Coordinator(CoordinatorConfig(
        draft=f"127.0.0.1:{services[0].port}", target=f"127.0.0.1:{services[1].port}", kv_wait_s=wait)))
        for wait in (0.0, 30.0)}
    prompt = list(range(1, 31))
    expected = SpeculativeDecoder(target=target_dir).generate(prompt, max_new_tokens=12, gamma=0)
    release = threading.Event()

    async def hold_session():  # a call in flight on a 90-token session
        async with services[1].host.sessions.open("busy", 0, reserve=90):
            while not release.is_set():
                await asyncio.sleep(0.01)

    try:
        held = asyncio.run_coroutine_threadsafe(hold_session(), loop.loop)
        with pytest.raises(errors.ResourceExhausted, match="budget of 100 tokens"):
            generate(engines[0.0], prompt_ids=prompt, max_new_tokens=12)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(generate, engines[30.0], prompt_ids=prompt, max_new_tokens=12)
            deadline = time.monotonic() + 30
            while engines[30.0].kv_waits.waiting == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engines[30.0].kv_waits.waiting == 1 and not waiting.done()  # waiting for room
            release.set()
            assert waiting.result(60) == expected.token_ids
        held.result(10)
    finally:
        release.set()
        for engine in engines.values():
            engine.close()
        for service in services:
            loop.call(service.stop())
        loop.close()


@pytest.mark.parametrize("draft_top_k", [0, 4], ids=["dense-q", "sparse-q"])
def test_sampled_tokens_verified_in_batches_follow_the_target_distribution(tmp_path, draft_top_k):
    """4,000 sessions' first token, each drafted alone and verified in batched
    target passes (up to 64 sessions per pass): chi-square against the target's
    exact next-token distribution."""
    from scipy import stats

    from specdec.core.sampling import process_logits
    from specdec.models.local import DraftRule, draft_steps, new_draft_sequence, run_alone, verify_steps
    from specdec.models.runner import KVSettings, ModelRunner
    from specdec.serving.scheduler import PassScheduler
    from specdec.serving.timing import ServerTiming

    vocab, prompt, samples = 16, [3, 1, 4], 4000
    target_dir = make_tiny_llama(tmp_path / "t", vocab_size=vocab, layers=1, seed=3, logit_scale=3)
    target = ModelRunner(target_dir, lean=True, kv=KVSettings(tokens=samples * 16))  # every session at once
    draft = ModelRunner(make_noisy_copy(target_dir, tmp_path / "d", noise=0.6, seed=4), lean=True)
    params = SamplingParams(temperature=1.0)
    seq = target.new_sequence()
    seq.tokens.extend(prompt)
    p = process_logits(target.logits(seq)[0], params)
    scheduler = PassScheduler(target, max_sequences=64, max_tokens=4096)
    passes = []
    scheduler.on_pass = lambda s: passes.append(s.sequences)
    rounds = []  # (sampling, drafts), all drafted first so that the verifications queue up together
    for seed in range(samples):
        sampling = dataclasses.replace(params, seed=seed)
        dseq = new_draft_sequence(draft)
        rounds.append((sampling, list(run_alone(draft, draft_steps(draft, dseq, 0, prompt, 2, sampling,
                                                                   DraftRule(draft_top_k))))))
    futures, firsts = [], []
    try:
        for sampling, drafts in rounds:
            tseq = target.new_sequence()
            futures.append(scheduler.submit(verify_steps(target, tseq, 0, prompt, drafts, sampling), ServerTiming()))
            firsts.append(drafts[0].token)
        counts = torch.zeros(vocab)
        for future, first in zip(futures, firsts, strict=True):
            verdict = future.result(60)
            counts[first if verdict.accepted else verdict.next_token] += 1
    finally:
        scheduler.close()
    assert max(passes) > 1  # verified in batches
    assert counts[p == 0].sum() == 0
    expected = p * samples
    big = expected >= 5
    scaled = expected[big] * counts[big].sum() / expected[big].sum()
    pvalue = stats.chisquare(counts[big].numpy(), scaled.numpy()).pvalue
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}"
