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
  become a stop string is held back until it is decided. Only that held-back
  tail and the new text are searched (:class:`_StopStrings`): the work per round
  does not grow with the text generated before it.

Also :func:`excerpt`: how an error message or log line shows a client's text.
"""

from __future__ import annotations

import bisect
from itertools import chain
from operator import itemgetter

# Tokens of already-known text decoded along with new ones, for context.
_CONTEXT_TOKENS = 5

# Characters of a client's value an error message or log line repeats.
EXCERPT_CHARS = 80


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """``value`` as an error message may repeat it: its repr (control
    characters escaped: no forged log lines), cut after ``limit`` characters.
    A client's megabyte comes back as a line, not as a megabyte of status
    details and log."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value)} characters)"
    shown = repr(value)
    return shown if len(shown) <= limit else f"{shown[:limit]}…"


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
        self._stop = _StopStrings(stop) if any(stop) else None
        self._ids: list[int] = list(context_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # self._ids[_prefix:_read] is already-released context
        self._read = len(self._ids)
        # Decided text not released yet: the tail held back for a stop string
        # that may be completing, then the text decided since.
        self._pending = ""
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
        return list(self._ids), self._prefix, self._read, self._pending, len(self._taken)

    def _restore(self, state: tuple) -> None:
        ids, self._prefix, self._read, self._pending, taken = state
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
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return ""  # nothing decided: what is held back stays so
        added = new_text[len(prefix_text):]
        self._pending += added
        self._prefix, self._read = (self._read, len(self._ids)) if not final else (len(self._ids),) * 2
        # Ids before the context are never decoded again: drop them, so that
        # saving the state (each round) copies a few ids, not the generation's.
        del self._ids[:self._prefix]
        self._prefix, self._read = 0, self._read - self._prefix
        return self._release(len(added), final)

    def finish(self) -> str:
        """End of generation: release whatever is left, incomplete characters
        included (as U+FFFD, as a full decode would show them)."""
        if self.stopped:
            return ""
        return self._advance(final=True)

    def _release(self, new: int, final: bool) -> str:
        """Release the pending text, of which the last ``new`` characters just
        came, up to a stop string or what may still become one."""
        held = 0
        if self._stop is not None:
            cut = self._stop.first_match(self._pending, new)
            if cut is not None:
                out, self._pending = self._pending[:cut], ""
                self.stopped = True
                return out
            held = 0 if final else self._stop.held_back(self._pending)
        end = len(self._pending) - held
        out, self._pending = self._pending[:end], self._pending[end:]
        return out


class _StopStrings:
    """A request's stop strings, matched against the text not released yet:
    the tail held back (shorter than the longest stop string) and the text
    that came since.

    A stop string completing there starts there (released text never ends
    with the beginning of one), so only that text is searched: the work per
    round depends on the stop strings and the new text, not on what came
    before."""

    def __init__(self, stop: list[str] | tuple[str, ...]):
        self._sorted = sorted(filter(None, stop))
        # The first character of each, and the first two: most places in a
        # text begin none, and are passed over without a search.
        self._firsts = frozenset(map(itemgetter(0), self._sorted))
        self._heads = self._firsts.union(map(itemgetter(slice(2)), self._sorted))
        self._ending: dict[str, list[str]] = {}  # last character -> the stop strings it ends
        for s in self._sorted:
            self._ending.setdefault(s[-1], []).append(s)
        self._shortest, self._longest = min(map(len, self._sorted)), max(map(len, self._sorted))

    def first_match(self, text: str, new: int) -> int | None:
        """Where the earliest stop string in ``text`` starts, or None. None was
        there before its last ``new`` characters came, so one must end among
        them: only the stop strings ending with one of those characters are
        looked for, and where one is found first is where it completes."""
        came = text[len(text) - new:]
        if len(text) < self._shortest or self._ending.keys().isdisjoint(came):  # most rounds
            return None
        ending = chain.from_iterable(self._ending.get(char, ()) for char in set(came))
        found = filter((-1).__lt__, map(text.find, ending))  # find: -1 where it is not there
        return min(found, default=None)

    def held_back(self, text: str) -> int:
        """The length of the longest tail of ``text`` that is a proper prefix of a
        stop string (it may still become one). It starts where last round's did
        or later, and ``text`` starts there: the places passed over before it
        are released, so each is passed over once in a turn."""
        start = max(0, len(text) - self._longest + 1)
        if self._firsts.isdisjoint(text[start:]):
            return 0
        for i in range(start, len(text)):
            if text[i] in self._firsts and text[i:i + 2] in self._heads and self._begins_one(text[i:]):
                return len(text) - i
        return 0

    def _begins_one(self, tail: str) -> bool:
        """Whether a stop string starts with ``tail``: the strings that do sort
        right after it."""
        k = bisect.bisect_left(self._sorted, tail)
        return k < len(self._sorted) and self._sorted[k].startswith(tail)
