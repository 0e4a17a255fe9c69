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


def _searched_whole(data: bytes, stop: list[str]) -> tuple[int | None, list[str]]:
    """The reference, one byte token at a time: search all the text decided so
    far for every stop string; else release all of it but its longest tail
    that begins a stop string. (tokens kept, the text released after each)"""
    released = []
    for k in range(1, len(data) + 1):
        text = data[:k].decode("utf-8", errors="ignore")  # an unfinished character is not decided yet
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:
            return k, released + [text[:min(hits)]]
        held = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        released.append(text[:len(text) - held])
    return None, released


@pytest.mark.parametrize("seed", range(4))
def test_stop_strings_are_found_as_searching_all_the_text_would(tokenizer, seed):
    """Overlapping stop strings (the earliest start wins among those complete),
    ones sharing prefixes or repeating a character, strings split across
    tokens and multi-byte characters."""
    import random

    rng = random.Random(seed)
    alphabet = "aab é日\n"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        start = rng.randrange(len(text))
        stop.append(text[start:start + rng.randint(1, 6)])  # one that may well match
        stream = TextStream(tokenizer, stop)
        released, kept = "", None
        seen = []
        for k, token in enumerate(text.encode(), 1):
            released += stream.push(token)
            seen.append(released)
            if stream.stopped:
                kept = k
                break
        assert (kept, seen) == _searched_whole(text.encode(), stop), (text, stop)


def test_the_text_kept_to_search_stays_short_however_long_the_generation(tokenizer):
    """Matching looks only at the text not released yet: the held-back tail
    (shorter than the longest stop string) and the round's new text, so a
    round costs the same after 20,000 characters as after 20, even with the
    most stop strings a request may carry, each held back nearly whole."""
    stop = [("ab" * 128)[i:i + 255] + "!" for i in range(64)]  # "abab…!" never completes
    stream = TextStream(tokenizer, stop)
    longest_kept, out = 0, []
    for i in range(0, 20_000, 5):
        assert stream.stop_after(list(b"ababa" if i % 2 == 0 else b"babab")) is None
        out.append(stream.take())
        longest_kept = max(longest_kept, len(stream._pending), len(stream._ids))
    out.append(stream.finish())
    assert longest_kept < 255 + 5
    assert "".join(out) == "ab" * 10_000
