"""Token ids to text as they are generated: whole UTF-8 characters only, stop
strings held back until decided, and the same text as a decode all at once."""

from __future__ import annotations

import pytest

from specdec.core.text import TextStream, decode_continuation
from specdec.models.tokenizer import load_tokenizer

from tiny_models import add_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(add_byte_tokenizer(tmp_path_factory.mktemp("bytes")))


def test_stop_string_held_back_until_decided(tokenizer):
    stream = TextStream(tokenizer, stop=["abc"])
    assert [stream.push(t) for t in b"xxab"] == ["x", "x", "", ""]  # "ab" may start "abc"
    assert stream.push(ord("d")) == "abd"
    assert stream.push(ord("a")) == "" and stream.push(ord("b")) == ""
    assert stream.push(ord("c")) == "" and stream.stopped


def test_text_waits_for_whole_utf8_characters(tokenizer):
    text = "é✓日本 ok"
    stream = TextStream(tokenizer)
    out = [stream.push(b) for b in text.encode()] + [stream.finish()]
    assert "".join(out) == text
    assert all("\ufffd" not in piece for piece in out)
    cut = TextStream(tokenizer)
    assert "".join([cut.push(b) for b in "日".encode()[:2]]) == ""
    assert cut.finish() == "\ufffd"  # an unfinished character at the very end shows as a full decode would


def test_stop_after_keeps_the_tokens_up_to_the_one_completing_the_stop_string(tokenizer):
    stream = TextStream(tokenizer, stop=["\n\n"])
    assert stream.stop_after(list(b"def f")) is None
    assert stream.stop_after(list(b"():\n\nx = 1")) == 5  # "():\n\n": the second newline completes it
    assert stream.take() + stream.finish() == "def f():"  # the text ends before the stop string


def test_a_decode_all_at_once_gives_what_the_stream_releases(tokenizer):
    context = list("é✓ prompt ".encode())
    ids = list("日本 ok é".encode())[1:]  # starts inside a character: it decodes to U+FFFD either way
    stream = TextStream(tokenizer, context_ids=context)
    streamed = "".join(stream.push(t) for t in ids) + stream.finish()
    assert decode_continuation(tokenizer, context, ids) == streamed


@pytest.mark.parametrize("seed", range(6))
def test_a_round_of_tokens_at_once_keeps_and_releases_what_one_at_a_time_does(tokenizer, seed):
    """stop_after decodes a round's tokens together: the tokens kept and the text
    released, round by round, are those of pushing them one at a time, across
    characters split between rounds and stop strings straddling them."""
    import random

    rng = random.Random(seed)
    ids = list("déjà vu ✓日本 ok\n\nabc end日本".encode())
    rounds, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        rounds.append(ids[i:i + n])
        i += n

    def feed(stream, one_at_a_time: bool):
        seen = []
        for chunk in rounds:
            if one_at_a_time:
                kept = None
                for j, token in enumerate(chunk):
                    if stream.stop_after([token]) is not None:
                        kept = j + 1
                        break
            else:
                kept = stream.stop_after(chunk)
            seen.append((kept, stream.take()))
            if kept is not None:
                break
        return seen, stream.finish()

    for stop in ([], ["\n\n"], ["c en", "日本 o"], ["never"]):
        assert feed(TextStream(tokenizer, stop), False) == feed(TextStream(tokenizer, stop), True), stop
