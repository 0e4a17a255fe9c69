"""``specdec trace-report FILE... [--png OUT]``: where each round's time went.

Reads trace files written with ``--trace-file`` (JSON lines, one span each; the
three services may share one file or write their own — pass them all) and prints

* one row per Generate (its session, tokens, rounds, acceptance, tokens/s and the
  share of round time spent crossing devices), and
* the round time of all of them split by phase,

and with ``--png`` draws a stacked bar per round — draft compute, target compute,
queue, device copies, network + serialisation, coordinator — with γ and the
accepted count marked: the picture that answers "is the network eating my
speedup?".

Everything comes from the coordinator's round spans (``specdec.round``), which
carry the servers' own timings; spans of other services only add context.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from collections.abc import Iterable

from specdec.telemetry.observer import (
    GEN_AI_CONVERSATION,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_REQUEST_MODEL,
)
from specdec.telemetry.trace_file import read_spans

ROUND_SPAN = "specdec.round"

# (label, colour, function of a round span's attributes -> seconds), bottom to top.
PHASES = [
    ("draft compute", "#4c72b0", lambda a: a.get("specdec.draft.compute_s", 0.0)),
    ("target compute", "#dd8452", lambda a: a.get("specdec.target.compute_s", 0.0)),
    ("queue", "#8c8c8c", lambda a: a.get("specdec.draft.queue_s", 0.0) + a.get("specdec.target.queue_s", 0.0)),
    ("device copies", "#937860", lambda a: a.get("specdec.draft.copy_s", 0.0) + a.get("specdec.target.copy_s", 0.0)),
    ("network + serialisation", "#c44e52",
     lambda a: a.get("specdec.draft.network_s", 0.0) + a.get("specdec.target.network_s", 0.0)),
    ("coordinator", "#55a868", lambda a: a.get("specdec.coordinator_s", 0.0)),
]
CROSSING = ("device copies", "network + serialisation")  # what crossing devices costs


@dataclasses.dataclass
class Round:
    index: int
    gamma: int
    accepted: int
    tokens: int
    seconds: float
    phases: dict[str, float]
    bytes_out: int
    bytes_in: int


@dataclasses.dataclass
class Generation:
    """One Generate (or, without a generation span, one trace's rounds)."""

    trace_id: str
    session: str
    model: str
    start_ns: int
    duration_s: float
    input_tokens: int | None
    output_tokens: int | None
    rounds: list[Round]

    @property
    def drafted(self) -> int:
        return sum(r.gamma for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else sum(r.tokens for r in self.rounds)

    @property
    def round_s(self) -> float:
        return sum(r.seconds for r in self.rounds)

    def phase_total(self, name: str) -> float:
        return sum(r.phases[name] for r in self.rounds)


def _round(span: dict) -> Round:
    a = span["attributes"]
    phases = {name: float(fn(a)) for name, _, fn in PHASES}
    wall = a.get("specdec.round_s", (span["end_ns"] - span["start_ns"]) / 1e9)
    return Round(
        index=int(a.get("specdec.round", 0)), gamma=int(a.get("specdec.gamma", 0)),
        accepted=int(a.get("specdec.accepted", 0)), tokens=int(a.get("specdec.tokens", 0)),
        # The phases split the wall time (the coordinator's share is the remainder),
        # so they add up to it; max() keeps shares <= 100% whatever a file holds.
        seconds=max(wall, sum(phases.values())), phases=phases,
        bytes_out=int(a.get("specdec.bytes_out", 0)), bytes_in=int(a.get("specdec.bytes_in", 0)),
    )


def generations(spans: Iterable[dict]) -> list[Generation]:
    """Group round spans under their generation span (by parent), in time order."""
    spans = list(spans)
    gen_spans = {s["span_id"]: s for s in spans if GEN_AI_OPERATION in s.get("attributes", {})}
    by_parent: dict[str, list[dict]] = {}
    for s in spans:
        if s["name"] == ROUND_SPAN:
            key = s["parent_span_id"] if s["parent_span_id"] in gen_spans else f"trace:{s['trace_id']}"
            by_parent.setdefault(key, []).append(s)
    out = []
    for key, rounds in by_parent.items():
        rounds.sort(key=lambda s: s["start_ns"])
        gen = gen_spans.get(key)
        if gen is not None:
            a = gen["attributes"]
            out.append(Generation(
                trace_id=gen["trace_id"], session=str(a.get(GEN_AI_CONVERSATION, "")),
                model=str(a.get(GEN_AI_REQUEST_MODEL, "")), start_ns=gen["start_ns"],
                duration_s=(gen["end_ns"] - gen["start_ns"]) / 1e9, input_tokens=a.get(GEN_AI_INPUT_TOKENS),
                output_tokens=a.get(GEN_AI_OUTPUT_TOKENS), rounds=[_round(s) for s in rounds],
            ))
        else:
            start, end = rounds[0]["start_ns"], max(s["end_ns"] for s in rounds)
            out.append(Generation(
                trace_id=rounds[0]["trace_id"], session="-", model="-", start_ns=start, duration_s=(end - start) / 1e9,
                input_tokens=None, output_tokens=None, rounds=[_round(s) for s in rounds],
            ))
    out.sort(key=lambda g: g.start_ns)
    return out


# ---------------------------------------------------------------- tables


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _short(text: str, width: int = 24) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def session_table(gens: list[Generation]) -> str:
    header = ["session", "trace", "model", "in", "out", "rounds", "mean γ", "accept", "seconds", "tok/s",
              "crossing"]
    rows = []
    for g in gens:
        crossing = sum(g.phase_total(p) for p in CROSSING)
        rows.append([
            _short(g.session or "-"), g.trace_id[:8], g.model,
            "-" if g.input_tokens is None else g.input_tokens, g.tokens,
            len(g.rounds), f"{g.drafted / len(g.rounds):.2f}" if g.rounds else "-",
            _share(g.accepted, g.drafted), f"{g.duration_s:.3f}",
            f"{g.tokens / g.duration_s:.1f}" if g.duration_s > 0 else "-", _share(crossing, g.round_s),
        ])
    return _table(header, rows)


def phase_table(gens: list[Generation]) -> str:
    rounds = [r for g in gens for r in g.rounds]
    total = sum(r.seconds for r in rounds)
    header = ["phase", "seconds", "ms/round", "share"]
    rows = []
    for name, _, _ in PHASES:
        s = sum(r.phases[name] for r in rounds)
        rows.append([name, f"{s:.4f}", f"{1e3 * s / len(rounds):.3f}" if rounds else "-", _share(s, total)])
    rows.append(["round (wall)", f"{total:.4f}", f"{1e3 * total / len(rounds):.3f}" if rounds else "-",
                 _share(total, total)])
    return _table(header, rows)


def report(gens: list[Generation]) -> str:
    rounds = sum(len(g.rounds) for g in gens)
    b_out = sum(r.bytes_out for g in gens for r in g.rounds)
    b_in = sum(r.bytes_in for g in gens for r in g.rounds)
    per_round = f", {b_out / rounds:.0f} B out / {b_in / rounds:.0f} B in per round" if rounds else ""
    return "\n".join([
        f"{len(gens)} generation(s), {rounds} round(s){per_round}",
        "",
        "per session (one row per Generate; 'crossing' = device copies + network share of round time)",
        session_table(gens),
        "",
        "per phase (all rounds)",
        phase_table(gens),
    ])


# ---------------------------------------------------------------- the picture


def plot(gens: list[Generation], out: pathlib.Path, max_rounds: int = 400) -> int:
    """Stacked bars per round (ms), γ and accepted on a second axis; returns the
    number of rounds drawn (the first ``max_rounds``)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--png needs matplotlib: pip install 'specdec[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 -- matplotlib.ticker.MaxNLocator below

    rounds, boundaries = [], []
    for g in gens:
        if rounds:
            boundaries.append(len(rounds) - 0.5)
        rounds.extend(g.rounds)
    rounds = rounds[:max_rounds]
    xs = list(range(len(rounds)))
    fig, ax = plt.subplots(figsize=(min(6 + 0.12 * len(rounds), 26), 5), dpi=100)
    bottom = [0.0] * len(rounds)
    for name, colour, _ in PHASES:
        heights = [1e3 * r.phases[name] for r in rounds]
        ax.bar(xs, heights, bottom=bottom, color=colour, label=name, width=0.85)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for b in boundaries:
        if b < len(rounds):
            ax.axvline(b, color="black", linewidth=0.6, linestyle=":")
    ax.set_xlabel("round (generations in time order, dotted lines between them)")
    ax.set_ylabel("round time (ms)")
    ax2 = ax.twinx()
    ax2.plot(xs, [r.gamma for r in rounds], "v", markerfacecolor="none", markeredgecolor="black", label="γ drafted")
    ax2.plot(xs, [r.accepted for r in rounds], "o", color="black", markersize=3.5, label="accepted")
    ax2.set_ylabel("tokens")
    ax2.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2.set_ylim(0, max([r.gamma for r in rounds] + [1]) * 1.15 + 0.5)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(handles[::-1] + h2, labels[::-1] + l2, loc="upper left", bbox_to_anchor=(1.07, 1.0), fontsize=8)
    crossing = sum(r.phases[p] for r in rounds for p in CROSSING)
    ax.set_title(f"specdec rounds: {len(rounds)} drawn; crossing devices = "
                 f"{_share(crossing, sum(r.seconds for r in rounds))} of round time")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return len(rounds)


# ---------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="trace file(s) written with --trace-file")
    p.add_argument("--png", metavar="OUT", default=None, help="write the per-round stacked bar chart here")
    p.add_argument("--max-rounds", type=int, default=400, help="rounds drawn in the chart (default 400)")


def run(args: argparse.Namespace) -> int:
    for f in args.files:
        if not pathlib.Path(f).is_file():
            raise ValueError(f"{f}: no such trace file")
    gens = generations(read_spans(args.files))
    if not gens:
        print(f"no round spans ({ROUND_SPAN}) in {', '.join(args.files)}: was the coordinator started with "
              "--trace-file (or SPECDEC_TRACE_FILE)?", file=sys.stderr)
        return 1
    print(report(gens))
    if args.png:
        drawn = plot(gens, pathlib.Path(args.png), args.max_rounds)
        print(f"\nwrote {args.png} ({drawn} rounds)")
    return 0
