"""`specdec train-models`' building blocks: the fixed split, the deterministic data
order, on-policy batches, the distillation loss and bit-exact resuming."""

from __future__ import annotations

import json
import platform
import re

import pytest
import torch

from specdec.models import bundled
from specdec.tools import train_models as tm

TINY = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=32)


def tiny_model(seed: int):
    return tm.make_model(TINY, eos_id=0, seed=seed)


def test_held_out_split_is_the_documented_one():
    """The split rule applied to this interpreter's stdlib gives exactly the file
    list shipped next to the weights (HELD_OUT.md), and is about 1 in 20. Only on
    the Python version that trained them: another stdlib has other files."""
    trained_on = json.loads((bundled.target_path() / "training.json").read_text())["python"]
    if platform.python_version() != trained_on:
        pytest.skip(f"the weights were trained on Python {trained_on}'s stdlib")
    train, held = tm.split_files()
    documented = re.findall(r"^- `(.+)`$", (bundled.models_dir() / "HELD_OUT.md").read_text(), re.M)
    assert held == documented
    assert not set(train) & set(held)
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.08


def test_held_out_rule_depends_on_the_path_only():
    # Files of HELD_OUT.md and files trained on, fixed by sha256 of the path alone.
    assert all(tm.is_held_out(f) for f in ("_sitebuiltins.py", "asyncio/events.py", "chunk.py"))
    assert not any(tm.is_held_out(f) for f in ("os.py", "json/decoder.py", "asyncio/tasks.py"))
    flags = [tm.is_held_out(f"pkg/module_{i}.py") for i in range(2000)]
    assert 60 < sum(flags) < 140  # ~5 %


def test_window_batches_are_a_pure_function_of_seed_and_step():
    tokens = torch.arange(10_000, dtype=torch.int32)
    a, b = tm.WindowSampler(tokens, 4, seed=7, seq_len=32), tm.WindowSampler(tokens, 4, seed=7, seq_len=32)
    later = a.batch(300)  # crosses into another epoch first
    assert torch.equal(b.batch(300), later)
    assert torch.equal(a.batch(3), b.batch(3))
    assert not torch.equal(a.batch(3), tm.WindowSampler(tokens, 4, seed=8, seq_len=32).batch(3))
    # One epoch visits every non-overlapping window once.
    starts = [int(row[0]) for step in range(a.n_windows // 4) for row in a.batch(step)]
    assert len(set(starts)) == len(starts) and all(s % 32 == 0 for s in starts)
    assert a.batch(0).shape == (4, 33)


def test_on_policy_batches_are_the_teachers_greedy_continuations():
    teacher = tiny_model(seed=1).eval()
    tokens = torch.randint(1, tm.VOCAB_SIZE, (5000,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    sampler = tm.GreedyContinuationSampler(teacher, tokens, batch_size=3, seed=5, prefix_len=10, new_tokens=6)
    batch = sampler.batch(2)
    assert batch.shape == (3, 16) and sampler.seq_len == 15
    assert torch.equal(batch[:, :10], sampler.prefixes.batch(2))
    with torch.no_grad():
        for row in batch:
            ids = row[:10].tolist()
            for _ in range(6):
                logits = teacher(input_ids=torch.tensor([ids])).logits[0, -1]
                logits[0] = float("-inf")  # EOS is suppressed so rows keep one length
                ids.append(int(logits.argmax()))
            assert ids == row.tolist()
    assert torch.equal(sampler.batch(2), batch)


def test_distill_loss_is_zero_for_the_teacher_itself_and_counts_from_start():
    teacher, draft = tiny_model(seed=1).eval(), tiny_model(seed=2)
    batch = torch.randint(1, tm.VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0))
    assert tm.distill_loss(teacher, teacher, batch).item() == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        p = torch.log_softmax(teacher(input_ids=batch[:, :-1]).logits, -1)
        q = torch.log_softmax(draft(input_ids=batch[:, :-1]).logits, -1)
    per_position = (p.exp() * (p - q)).sum(-1)
    assert tm.distill_loss(draft, teacher, batch, start=7).item() == pytest.approx(
        per_position[:, 7:].mean().item(), rel=1e-5)
    assert tm.distill_loss(draft, teacher, batch).item() == pytest.approx(per_position.mean().item(), rel=1e-5)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    spec = tm.PhaseSpec("x", budget_s=1, max_steps=100, lr=1.0, batch_size=1, seed=0)
    assert tm.lr_at(0.0, spec) < tm.lr_at(0.02, spec) < tm.lr_at(0.03, spec) == pytest.approx(1.0)
    assert tm.lr_at(0.5, spec) < 1.0
    assert tm.lr_at(1.0, spec) == pytest.approx(0.1)


def test_an_interrupted_phase_resumes_bit_for_bit(tmp_path):
    """Checkpoint, crash, rerun: the weights equal those of an uninterrupted run."""
    tokens = torch.randint(1, tm.VOCAB_SIZE, (4000,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    spec = tm.PhaseSpec("t", budget_s=1e9, max_steps=4, lr=1e-2, batch_size=2, seed=3)

    straight = tiny_model(seed=0)
    tm.train_phase(straight, tm.lm_loss, tm.WindowSampler(tokens, 2, 3, seq_len=16), spec, tmp_path / "a.ckpt")

    calls = []

    def crash_on_third_step(model, batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return tm.lm_loss(model, batch)

    first = tiny_model(seed=0)
    with pytest.raises(KeyboardInterrupt):
        tm.train_phase(first, crash_on_third_step, tm.WindowSampler(tokens, 2, 3, seq_len=16), spec,
                       tmp_path / "b.ckpt", checkpoint_every_s=0.0)
    resumed = tiny_model(seed=99)  # different init: everything must come from the checkpoint
    summary = tm.train_phase(resumed, tm.lm_loss, tm.WindowSampler(tokens, 2, 3, seq_len=16), spec, tmp_path / "b.ckpt")
    assert summary["steps"] == 4
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
