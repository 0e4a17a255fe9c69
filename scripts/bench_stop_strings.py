"""What stop strings cost the coordinator's text handling, side by side: a
turn's 64 generated tokens turned into text as the round loop does it
(``TextStream.stop_after`` per round, then ``take``), with no stop strings and
with the most a request may carry (``MAX_STOP_STRINGS`` of ``MAX_STOP_CHARS``
characters), in process, on the bundled target's tokenizer.

Besides none: a chat client's few stop strings, and three sets at the limits:
unrelated strings (random characters), strings of the generated text's own
words (most places in the text begin one: each is checked), and the worst
case found for the matcher, strings that begin as the generated text does
from 63 different offsets and end with a space, and one of a single
character that never comes (a long tail is held back after every round, and
every round with a space searches for them all).

Then whole requests: the bundled pair's in-process decoder generating the same
tokens (greedy, adaptive γ) with no stop strings and with the worst case,
the text handled as the coordinator handles it.

    python scripts/bench_stop_strings.py [--tokens 64] [--repeats 300] [--requests 15] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import time

from specdec.coordinator.requests import MAX_STOP_CHARS, MAX_STOP_STRINGS
from specdec.core.text import TextStream
from specdec.models import bundled
from specdec.models.tokenizer import load_tokenizer

PROMPT = "Speculative decoding, explained for an engineer who has an afternoon:"
TEXT = (" a small draft model guesses the next few tokens, and the large target model checks all of"
        " them in one forward pass. Every guess the target agrees with is kept; at the first"
        " disagreement the target's own token is used instead, so the output is exactly what the"
        " target alone would have written, only sooner. How much sooner depends on how often the"
        " draft is right, and on what a round costs: two models, a network hop, and the text.")


CHAT = ["\n\nUser:", "<|im_end|>", "</s>", "\n\n\n"]


def unrelated(rng: random.Random) -> list[str]:
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz.,;!?") for _ in range(MAX_STOP_CHARS))
            for _ in range(MAX_STOP_STRINGS)]


def same_words(rng: random.Random) -> list[str]:
    words = TEXT.split()
    return [" ".join(rng.choice(words) for _ in range(MAX_STOP_CHARS))[:MAX_STOP_CHARS - 1] + "\x1f"
            for _ in range(MAX_STOP_STRINGS)]


def worst_case(generated: str) -> list[str]:
    """Each begins as the generated text does from its own offset and ends
    where it never does: every round ends inside several of them. The short
    one: no stop string is too long to be searched for."""
    text = generated * (MAX_STOP_CHARS // max(1, len(generated)) + 2)
    return [text[i:i + MAX_STOP_CHARS - 2] + "\x1f " for i in range(MAX_STOP_STRINGS - 1)] + ["\x1f"]


def one_turn(tokenizer, context: list[int], ids: list[int], stop: list[str], per_round: int) -> float:
    """Seconds to turn ``ids`` into streamed text, ``per_round`` tokens a round."""
    started = time.perf_counter()
    stream = TextStream(tokenizer, stop, context_ids=context)
    for i in range(0, len(ids), per_round):
        if stream.stop_after(ids[i:i + per_round]) is not None:
            raise AssertionError("a stop string matched: the benchmark's text must not end")
        stream.take()
    stream.finish()
    return time.perf_counter() - started


def whole_requests(tokens: int, repeats: int) -> None:
    """The in-process decoder's request, with no stop strings and with the worst case, side by side."""
    from specdec import SpeculativeDecoder
    from specdec.core.gamma import parse_gamma_policy

    decoder = SpeculativeDecoder(target=bundled.target_path(), draft=bundled.draft_path())
    prompt = decoder.target.tokenizer.encode(PROMPT, add_special_tokens=False) if decoder.target.tokenizer else [1]
    generated = decoder.generate(prompt, max_new_tokens=tokens, gamma=parse_gamma_policy("adaptive", 8)).text or ""
    sets = {"none": [], "worst case at the limits": worst_case(generated)}
    times = {name: [] for name in sets}
    for _ in range(repeats):
        for name, stop in sets.items():
            started = time.perf_counter()
            out = decoder.generate(prompt, max_new_tokens=tokens, gamma=parse_gamma_policy("adaptive", 8), stop=stop)
            times[name].append(time.perf_counter() - started)
            assert out.finish_reason != "stop", "a stop string matched: the benchmark's text must not end"
    base = statistics.median(times["none"])
    print(f"whole requests of {tokens} tokens (in-process decoder, bundled pair), median of {repeats} each")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:<36} {median * 1e3:>8.1f} ms {median / base:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--requests", type=int, default=15, help="whole requests of each kind (0: none)")
    parser.add_argument("--tokenizer", type=pathlib.Path, default=bundled.target_path())
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    context = tokenizer.encode(PROMPT, add_special_tokens=False)
    ids = tokenizer.encode(TEXT * (args.tokens // 16 + 1), add_special_tokens=False)[:args.tokens]
    generated = tokenizer.decode(ids)
    most = f"{MAX_STOP_STRINGS} of <= {MAX_STOP_CHARS} chars"
    sets = {"none": [], f"{len(CHAT)} of a chat template": CHAT, f"{most}, unrelated": unrelated(random.Random(0)),
            f"{most}, the text's words": same_words(random.Random(0)), f"{most}, worst case": worst_case(generated)}
    print(f"{len(ids)} tokens ({len(generated)} characters), median of {args.repeats} turns each")
    print(f"{'tokens a round':>14}  {'stop strings':<36} {'µs a turn':>10} {'× none':>7}")
    for per_round in (1, 5):
        times = {name: [] for name in sets}
        for _ in range(args.repeats):  # interleaved: the machine's load drifts over all sets alike
            for name, stop in sets.items():
                times[name].append(one_turn(tokenizer, context, ids, stop, per_round))
        base = statistics.median(times["none"])
        for name, samples in times.items():
            median = statistics.median(samples)
            print(f"{per_round:>14}  {name:<36} {median * 1e6:>10.0f} {median / base:>7.2f}")
    if args.requests:
        whole_requests(args.tokens, args.requests)


if __name__ == "__main__":
    main()
