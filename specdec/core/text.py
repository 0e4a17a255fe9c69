"""From committed token ids to streamed text: incremental detokenisation and stop
strings.

Two things make this more than ``tokenizer.decode(new_ids)``:

* A character may span several tokens (byte-level BPE splits multi-byte UTF-8), so
  a prefix of the ids can decode to a trailing U+FFFD. Text is released only once
  it is complete; the ids are decoded with a few tokens of left context so
  tokenizers that treat a sequence's first token specially (leading spaces) give
  the same text as decoding everything at once. This is the offsets scheme of
  Hugging Face TGI, O(1) per token.
* Stop strings are matched on text, which may straddle tokens and rounds. Output is
  cut *before* the stop string, so any tail of the released text that could still
  become a stop string is held back until it is decided.
"""

from __future__ import annotations

# Tokens of already-known text decoded along with new ones, for context.
_CONTEXT_TOKENS = 5


def decode_continuation(tokenizer, context_ids: list[int], ids: list[int]) -> str:
    """The text ``ids`` add after ``context_ids``, all at once: what a
    :class:`TextStream` given the same context releases for them, token by token."""
    context = list(context_ids[-_CONTEXT_TOKENS:])
    before = tokenizer.decode(context, skip_special_tokens=True)
    return tokenizer.decode(context + list(ids), skip_special_tokens=True)[len(before):]


class TextStream:
    """Feed generated token ids one at a time; get back the text they complete.

    It is also the round loop's stop condition (:meth:`stop_after`): fed each
    round's committed tokens, it collects the text they release for
    :meth:`take`."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), context_ids: list[int] = ()):
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._ids: list[int] = list(context_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # self._ids[_prefix:_read] is already-released context
        self._read = len(self._ids)
        self._text = ""  # decided text of the generation so far
        self._sent = 0  # characters of _text already released
        self._taken: list[str] = []  # released by stop_after, not yet taken
        self.stopped = False

    def stop_after(self, tokens: list[int]) -> int | None:
        """Push ``tokens`` in order; how many to keep if a stop string completes
        among them (the token completing it included), else None.

        A round's tokens are decoded together (two decodes a round, not two a
        token). Where that does not settle them all -- a stop string completes
        among them (which token completed it?), or they end inside a character
        -- they are pushed again one by one, from before them, exactly as
        without the shortcut."""
        if len(tokens) > 1 and not self.stopped:
            before = self._state()
            self._taken.append(self._push_all(tokens))
            if not self.stopped and self._read == len(self._ids):
                return None
            self._restore(before)
        for i, token in enumerate(tokens):
            self._taken.append(self.push(token))
            if self.stopped:
                return i + 1
        return None

    def _state(self) -> tuple:
        return list(self._ids), self._prefix, self._read, self._text, self._sent, len(self._taken)

    def _restore(self, state: tuple) -> None:
        ids, self._prefix, self._read, self._text, self._sent, taken = state
        self._ids = ids
        del self._taken[taken:]
        self.stopped = False

    def _push_all(self, tokens: list[int]) -> str:
        """:meth:`push` for several tokens at once."""
        self._ids.extend(tokens)
        return self._advance(final=False)

    def take(self) -> str:
        """The text :meth:`stop_after` released since the last take."""
        out = "".join(self._taken)
        self._taken.clear()
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add one token; return the text now safe to release ("" if none). After a
        stop string is found, :attr:`stopped` is True and further pushes are
        ignored."""
        if self.stopped:
            return ""
        self._ids.append(token)
        return self._advance(final=False)

    def _advance(self, final: bool) -> str:
        """Decide the text the ids not yet read complete; release what is safe."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if final or (len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd")):
            self._text += new_text[len(prefix_text):]
            self._prefix, self._read = (self._read, len(self._ids)) if not final else (len(self._ids),) * 2
        return self._release(final=final)

    def finish(self) -> str:
        """End of generation: release whatever is left, incomplete characters
        included (as U+FFFD, as a full decode would show them)."""
        if self.stopped:
            return ""
        return self._advance(final=True)

    def _release(self, final: bool) -> str:
        if self._stop:
            # A stop string can only newly appear in text not yet released (plus
            # the held-back tail before it, which is never released).
            start = max(0, self._sent - max(map(len, self._stop)))
            hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits)
                out = self._text[self._sent:cut]
                self._sent = cut
                self.stopped = True
                return out
        end = len(self._text) if final else len(self._text) - self._held_back()
        out = self._text[self._sent:end]
        self._sent = max(self._sent, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop
        string (it may still turn into one)."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:n]):
                    best = n
                    break
        return best
