"""Stop strings in the in-process decoder: the same finish condition of the
shared round loop as the coordinator's, so the same semantics: output ends
before the stop string, the ids include the token that completed it, and no γ
changes where it ends."""

from __future__ import annotations

import pytest

from specdec import SpeculativeDecoder
from specdec.core.text import TextStream

from tiny_models import add_byte_tokenizer, make_noisy_copy, make_tiny_llama


@pytest.fixture(scope="module")
def byte_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytes")
    target = add_byte_tokenizer(make_tiny_llama(root / "target", vocab_size=256, layers=1, seed=3, logit_scale=8))
    draft = add_byte_tokenizer(make_noisy_copy(target, root / "draft", noise=0.05, seed=4))
    return SpeculativeDecoder(target, draft)


def _stop_inside(decoder, prompt, n=48):
    """A reference completion, and a two-character string first found well inside its text."""
    ref = decoder.generate(prompt, max_new_tokens=n, gamma=0)
    text = ref.text
    for k in range(4, len(text) - 2):
        stop = text[k:k + 2]
        if text.index(stop) == k and "\ufffd" not in stop:
            return ref, stop
    raise AssertionError(f"no usable stop string in {text!r}: change the seed")


@pytest.mark.parametrize("gamma", [0, 1, 3])
def test_output_ends_before_the_stop_string(byte_pair, gamma):
    prompt = list(b"def f(")
    ref, stop = _stop_inside(byte_pair, prompt)
    out = byte_pair.generate(prompt, max_new_tokens=48, gamma=gamma, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == ref.text[:ref.text.index(stop)]
    # The ids run through the token completing the stop string, not beyond: a
    # prefix of the reference that just completes it.
    assert out.token_ids == ref.token_ids[:len(out.token_ids)]
    stream = TextStream(byte_pair.tokenizer, [stop], context_ids=prompt)
    assert stream.stop_after(ref.token_ids) == len(out.token_ids)


def test_a_stop_string_that_never_appears_changes_nothing(byte_pair):
    prompt = list(b"x = ")
    ref = byte_pair.generate(prompt, max_new_tokens=24, gamma=2)
    out = byte_pair.generate(prompt, max_new_tokens=24, gamma=2, stop=["\x00never\x00"])
    assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)


def test_bad_stop_strings_are_refused(byte_pair, tiny_pair):
    with pytest.raises(ValueError, match="must not be empty"):
        byte_pair.generate([1, 2], stop=[""])
    no_tokenizer = SpeculativeDecoder(tiny_pair[0], tiny_pair[1])
    with pytest.raises(ValueError, match="no tokenizer"):
        no_tokenizer.generate([1, 2], stop=["x"])
