"""``specdec generate``: one completion, in-process (``--local``) or from a
running coordinator (``--coordinator HOST:PORT``)."""

from __future__ import annotations

import argparse
import json
import sys

from specdec.core.interfaces import DEFAULT_DRAFT_TOP_K


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """Sampling flags shared by every command that generates."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for reproducible sampling: the same tokens again under the same gamma schedule "
                        "(static:N or heuristic; adaptive gamma follows timings)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (needs a model with a tokenizer)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids, e.g. 1,2,3")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="run both models in this process")
    where.add_argument("--coordinator", metavar="HOST:PORT[,HOST:PORT...]",
                       help="ask a running coordinator (several, comma-separated: the next when one fails)")
    p.add_argument("--target", default=None, help="target model directory (--local; default: bundled)")
    p.add_argument("--draft", default=None,
                   help="draft model directory (--local; default: bundled, 'none' = target only)")
    p.add_argument("--gamma", type=int, default=None,
                   help="drafted tokens per round (--local; default 4, 0 = target only)")
    p.add_argument("--device", default=None, help="device for the models (--local; default cpu), e.g. cuda:0")
    p.add_argument("--lean-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="(--local) run plain Llama models' layers through specdec's lean tensor ops, as the "
                        "services do (default); --no-lean-forward: through their own modules")
    p.add_argument("--session", default="", metavar="ID",
                   help="(--coordinator) continue the named session: the prompt is appended to its history")
    p.add_argument("--gamma-policy", default="", metavar="POLICY",
                   help="(--coordinator) static:N | heuristic | adaptive (default: the coordinator's)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string, may repeat; output ends before it")
    p.add_argument("--draft-top-k", type=int, default=None, metavar="K",
                   help="under sampling the draft samples from its top K tokens and sends only those (exact); "
                        f"0 = its whole distribution. Default: {DEFAULT_DRAFT_TOP_K} with --local, the "
                        "coordinator's --draft-top-k with --coordinator")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_sampling_arguments(p)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]  # an empty item ("1,,2") is an error too
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    bad = next((t for t in ids if not 0 <= t < 2**31), None)
    if bad is not None:
        raise ValueError(f"--prompt-ids: {bad} is not a token id")
    return ids


LOCAL_ONLY = ("target", "draft", "gamma", "device", "lean_forward")  # a coordinator's services have their own
REMOTE_ONLY = ("session", "gamma_policy")


def run(args: argparse.Namespace) -> int:
    if args.prompt is None and args.prompt_ids is None:
        raise ValueError("give a PROMPT or --prompt-ids")
    if args.prompt is not None and args.prompt_ids is not None:
        raise ValueError("give a PROMPT or --prompt-ids, not both")
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--top-k", args.top_k, 0),
                             ("--seed", args.seed, 0), ("--draft-top-k", args.draft_top_k, 0),
                             ("--gamma", args.gamma, 0)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    unused = ([name for name in LOCAL_ONLY if getattr(args, name) is not None] if args.coordinator
              else [name for name in REMOTE_ONLY if getattr(args, name)])
    if unused:
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        raise ValueError(f"{flags}: only with {'--local' if args.coordinator else '--coordinator'}")
    if args.coordinator:
        return _run_remote(args)
    return _run_local(args)


def _run_local(args: argparse.Namespace) -> int:
    from specdec import SamplingParams, SpeculativeDecoder

    target, draft = args.target, args.draft
    if target is None or draft is None:
        from specdec.models import bundled

        target = target or bundled.target_path()
        draft = draft or bundled.draft_path()
    if str(draft).lower() == "none":
        draft = None
    prompt_ids = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None  # before loading
    dec = SpeculativeDecoder(target=target, draft=draft, device=args.device or "cpu",
                             lean=args.lean_forward is not False)
    if prompt_ids is None:
        if dec.tokenizer is None:
            raise ValueError(f"{target} has no tokenizer: pass --prompt-ids")
        prompt_ids = dec.tokenizer.encode(args.prompt, add_special_tokens=False)
    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    top_k = {} if args.draft_top_k is None else {"draft_top_k": args.draft_top_k}
    gamma = 4 if args.gamma is None else args.gamma
    out = dec.generate(prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling, gamma=gamma,
                       stop=args.stop, **top_k)
    if args.json:
        record = {
            "token_ids": out.token_ids,
            "rounds": out.rounds,
            "accepted": out.accepted,
            "gammas": out.gammas,
            "target_forwards": out.target_forwards,
            "elapsed_s": out.elapsed_s,
            "finish_reason": out.finish_reason,
            "acceptance_rate": out.acceptance_rate,
            "tokens_per_second": len(out.token_ids) / out.elapsed_s if out.elapsed_s else 0.0,
        }
        if out.text is not None:
            record["text"] = out.text
        print(json.dumps(record))
    else:
        print(out.text if out.text is not None else ",".join(map(str, out.token_ids)))
        print(
            f"[{len(out.token_ids)} tokens in {out.elapsed_s:.2f}s, {out.rounds} rounds, "
            f"acceptance {out.acceptance_rate:.2f}]",
            file=sys.stderr,
        )
    return 0


def _run_remote(args: argparse.Namespace) -> int:
    """Stream from a coordinator: text is printed as each round commits (ids when
    the coordinator has no tokenizer); with --json one object at the end."""
    from specdec.serving import errors
    from specdec.serving.client import Client, Delta

    request = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, gamma_policy=args.gamma_policy, stop=args.stop,
        session_id=args.session, draft_top_k=args.draft_top_k,
    )
    if args.prompt_ids is not None:
        request["prompt_ids"] = parse_prompt_ids(args.prompt_ids)
    else:
        request["prompt"] = args.prompt
    text, ids, stats = [], [], None
    with Client(args.coordinator) as client:
        try:
            for event in client.generate(**request):
                if isinstance(event, Delta):
                    text.append(event.text)
                    ids.extend(event.token_ids)
                    if not args.json and event.text:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                else:
                    stats = event
        except errors.SpecdecError as e:
            if not args.json:
                print(file=sys.stdout)
            print(f"specdec generate: {e.code.name}: {e}", file=sys.stderr)
            return 1
    if args.json:
        import dataclasses

        print(json.dumps({"text": "".join(text), "token_ids": ids, **dataclasses.asdict(stats),
                          "acceptance_rate": stats.acceptance_rate}))
    else:
        if ids and not any(text):  # the coordinator has no tokenizer: show the ids
            sys.stdout.write(",".join(map(str, ids)))
        print()
        print(
            f"[{stats.generated_tokens} tokens in {stats.elapsed_s:.2f}s ({stats.tokens_per_second:.1f} tok/s), "
            f"{stats.rounds} rounds, acceptance {stats.acceptance_rate:.2f}, finish {stats.finish_reason}"
            + (f"; session {args.session!r}: {stats.history_tokens} tokens of history before this turn"
               if args.session else "") + "]",
            file=sys.stderr,
        )
    return 0
