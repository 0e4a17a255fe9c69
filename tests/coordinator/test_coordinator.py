"""The coordinator's engine against scripted fake draft/target services (real gRPC
on loopback, no models): EOS, stop strings, eviction and re-pre-fill, cancellation,
the vocabulary check; plus its pure parts (γ policies, directory).

The fake "language": the target's next token is a pure function of the position,
spelling TEXT over and over; the draft agrees except at every 4th position, so
rounds see both acceptances and rejections.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import grpc
import pytest

from specdec.coordinator.directory import InMemoryDirectory, SessionRecord
from specdec.coordinator.engine import Coordinator
from specdec.coordinator.learned_gamma import regime
from specdec.coordinator.requests import parse_gamma_policy
from specdec.core.gamma import AdaptiveGamma, HeuristicGamma, StaticGamma
from specdec.core.vocabulary import size_fingerprint
from specdec.models.tokenizer import load_tokenizer
from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import errors
from specdec.serving.config import CoordinatorConfig
from specdec.serving.generation import Delta, GenerateJob
from specdec.serving.generation import GenerationStats as Stats

from service_harness import LoopThread, SyncEngine, _OnLoop
from tiny_models import add_byte_tokenizer

TEXT = b"hello world, speculative decoding! "
VOCAB = 260
EOS = 259


def target_next(seq: list[int], eos_at: int | None) -> int:
    if eos_at is not None and len(seq) >= eos_at:
        return EOS
    return TEXT[len(seq) % len(TEXT)]


class FakeService:
    """Session bookkeeping shared by the fake draft and target: a token list per
    session, position checks, NOT_FOUND for unknown sessions past position 0."""

    def __init__(self, vocab=VOCAB, fingerprint="fp", eos_at=None):
        self.sessions: dict[str, list[int]] = {}
        self.calls: list[tuple[str, int, int]] = []  # (session, position, len(new_tokens))
        self.ended: list[str] = []
        self.vocab, self.fingerprint, self.eos_at = vocab, fingerprint, eos_at
        self.lose_everything = False
        self.unavailable_once = False
        self.unavailable_always = False  # a service that stays down
        self.unavailable_calls = 0  # a restart: the next calls find nobody
        self.full = False  # at its KV budget: RESOURCE_EXHAUSTED
        self.hang_s = 0.0  # a hung service: every call (EndSession too) takes this long
        self.name = ""  # the model's name in ModelInfo (default: the class's)
        self.stopping = False  # a service shutting down: grpc cancels its calls
        self.round_ids: list[int] = []
        self.gamma_max: int | None = None  # reported in ModelInfo when set

    def _seq(self, request, context) -> list[int]:
        time.sleep(self.hang_s)
        self.calls.append((request.session_id, request.position, len(request.new_tokens)))
        self.round_ids.append(request.round_id)
        if self.unavailable_once or self.unavailable_always or self.unavailable_calls:
            self.unavailable_once = False
            self.unavailable_calls = max(0, self.unavailable_calls - 1)
            context.abort(grpc.StatusCode.UNAVAILABLE, "blip")
        if self.stopping:
            context.abort(grpc.StatusCode.CANCELLED, "Cancelling all calls")
        if self.full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the KV budget is full")
        if self.lose_everything:
            context.abort(grpc.StatusCode.NOT_FOUND, f"session {request.session_id!r} lost again")
        seq = self.sessions.get(request.session_id)
        if seq is None:
            if request.position:
                context.abort(grpc.StatusCode.NOT_FOUND, f"session {request.session_id!r} is not held")
            seq = self.sessions[request.session_id] = []
        if request.position > len(seq):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "position beyond held tokens")
        del seq[request.position:]
        seq.extend(request.new_tokens)
        return seq

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_name=self.name or type(self).__name__, vocab_size=self.vocab,
                            vocab_fingerprint=self.fingerprint,
                            max_context=512, eos_token_ids=[EOS], active_sessions=len(self.sessions),
                            gamma_max=self.gamma_max)

    def EndSession(self, request, context):
        time.sleep(self.hang_s)
        self.ended.append(request.session_id)
        return pb.EndSessionResponse(existed=self.sessions.pop(request.session_id, None) is not None)


class FakeDraft(FakeService, pb_grpc.DraftServiceServicer):
    def Propose(self, request, context):
        self.target_vocab_sizes = getattr(self, "target_vocab_sizes", []) + [request.target_vocab_size]
        seq = self._seq(request, context)
        for i in range(request.gamma):
            tok = target_next(seq, self.eos_at)
            if len(seq) % 4 == 0:
                tok = ord("#")  # disagree now and then
            seq.append(tok)
            last = i == request.gamma - 1
            yield pb.DraftToken(token=tok, timing=pb.ServerTiming(computed_tokens=1) if last else None)

    def ProposeAll(self, request, context):
        drafts = list(self.Propose(request, context))
        return pb.Proposal(drafts=[pb.DraftToken(token=d.token) for d in drafts],
                           timing=pb.ServerTiming(computed_tokens=1))


class FakeTarget(FakeService, pb_grpc.TargetServiceServicer):
    def Verify(self, request, context):
        seq = self._seq(request, context)
        n = 0
        for d in request.draft_tokens:
            if d != target_next(seq, self.eos_at):
                break
            seq.append(d)
            n += 1
        nxt = target_next(seq, self.eos_at)
        seq.append(nxt)
        return pb.VerifyResponse(accepted=n, next_token=nxt)


def named(session_id: str, keys) -> bool:
    """Whether a fake service saw the coordinator's session ``session_id``
    among ``keys``: the services know it as the id plus a random suffix."""
    return any(key.startswith(session_id + "~") for key in keys)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(add_byte_tokenizer(tmp_path_factory.mktemp("bytes")))


@contextlib.contextmanager
def fake_services(draft=None, target=None):
    """A fake draft and target on loopback (new ones unless given): their addresses."""
    servers, addresses = [], []
    for servicer, add in ((draft or FakeDraft(), pb_grpc.add_DraftServiceServicer_to_server),
                          (target or FakeTarget(), pb_grpc.add_TargetServiceServicer_to_server)):
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        add(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    try:
        yield addresses
    finally:
        for server in servers:
            server.stop(None)


@pytest.fixture
def fakes():
    """(draft, target, make_engine): fake services on loopback; make_engine builds
    a Coordinator engine talking to them."""
    draft, target = FakeDraft(), FakeTarget()
    engines = []
    loop = LoopThread()
    with fake_services(draft, target) as addresses:

        def make_engine(tokenizer=None, **config):
            cfg = CoordinatorConfig(**{"draft": addresses[0], "target": addresses[1], "info_timeout_s": 5,
                                       "call_timeout_s": 5, **config})
            engine = SyncEngine(loop, lambda: Coordinator(cfg, tokenizer=tokenizer))
            engines.append(engine)
            return engine

        yield draft, target, make_engine
        for e in engines:
            e.close()
        loop.close()


def run(engine, **job) -> tuple[list[int], str, Stats]:
    ids, text, stats = [], [], None
    for event in engine.generate(GenerateJob(**job)):
        if isinstance(event, Delta):
            ids += event.token_ids
            text.append(event.text)
        else:
            stats = event
    return ids, "".join(text), stats


def expected_tokens(start: int, n: int) -> list[int]:
    return [TEXT[i % len(TEXT)] for i in range(start, start + n)]


# ------------------------------------------------------------------ rounds


def test_streams_the_target_text_and_frees_one_shot_sessions(fakes, tokenizer):
    draft, target, make = fakes
    engine = make(tokenizer)
    ids, text, stats = run(engine, prompt="hel", max_new_tokens=20, gamma_policy="static:4")
    assert ids == expected_tokens(3, 20)
    assert text == bytes(ids).decode()
    assert stats.finish_reason == "length" and stats.generated_tokens == 20
    assert stats.accepted_tokens < stats.drafted_tokens  # the draft disagreed sometimes
    assert stats.rounds < 20 and stats.session_id == ""
    assert draft.sessions == {} and target.sessions == {}  # one-shot: ended in both services


def test_gamma_is_capped_at_the_services_limit(fakes):
    """A coordinator allowing more γ than a service accepts would fail a request
    mid-stream once a growing policy passed the service's limit: the smaller
    limit, from ModelInfo, applies to every policy."""
    _, target, make = fakes
    target.gamma_max = 2
    engine = make(gamma_max=16)
    _, _, stats = run(engine, prompt_ids=(104, 101, 108), max_new_tokens=30, gamma_policy="heuristic")
    assert stats.generated_tokens == 30 and 0 < max(stats.gammas) <= 2
    _, _, stats = run(engine, prompt_ids=(104, 101, 108), max_new_tokens=30, gamma_policy="adaptive")
    assert max(stats.gammas) <= 2
    with pytest.raises(errors.InvalidRequest, match=r"gamma must be in \[0, 2\], got 3"):
        run(engine, prompt_ids=(104, 101, 108), max_new_tokens=4, gamma_policy="static:3")


def test_eos_from_model_info_ends_generation(fakes):
    draft, target, make = fakes
    draft.eos_at = target.eos_at = 12
    ids, _, stats = run(make(), prompt_ids=(104, 101, 108), max_new_tokens=50)
    assert ids == expected_tokens(3, 9) + [EOS]
    assert stats.finish_reason == "eos"


def test_stop_string_across_rounds_and_the_session_continues_after_it(fakes, tokenizer):
    draft, target, make = fakes
    engine = make(tokenizer)
    ids, text, stats = run(engine, prompt="hel", max_new_tokens=60, stop=("decoding",), session_id="s",
                           gamma_policy="static:3")
    full = TEXT.decode()
    assert stats.finish_reason == "stop"
    assert text == full[3:full.index("decoding")]
    # ids run through the token that completed the stop string, not beyond
    assert bytes(ids).decode().endswith("decoding") and len(ids) == full.index("decoding") + len("decoding") - 3
    record = engine.directory.get("s")
    assert record.tokens == list(b"hel") + ids
    ids2, _, _ = run(engine, prompt_ids=(33,), max_new_tokens=5, session_id="s")
    assert ids2 == expected_tokens(len(record.tokens) + 1, 5)


def test_the_most_stop_strings_a_request_may_carry_work_as_one(fakes, tokenizer):
    """At the bounds (MAX_STOP_STRINGS of MAX_STOP_CHARS characters, most of
    them held back for rounds as the text begins them): cut where the one
    that completes first begins."""
    from specdec.coordinator.requests import MAX_STOP_CHARS, MAX_STOP_STRINGS

    _, _, make = fakes
    full = (TEXT * 10).decode()
    never = [full[3 + i:3 + i + MAX_STOP_CHARS - 1] + "#" for i in range(MAX_STOP_STRINGS - 1)]
    ids, text, stats = run(make(tokenizer), prompt="hel", max_new_tokens=300, gamma_policy="static:3",
                           stop=(*never, "decoding! hello"))
    assert stats.finish_reason == "stop"
    assert text == full[3:full.index("decoding! hello")]


def test_evicted_sessions_are_re_pre_filled_from_the_history(fakes):
    draft, target, make = fakes
    engine = make()
    ids1, _, s1 = run(engine, prompt_ids=(104, 101, 108), max_new_tokens=10, session_id="e", gamma_policy="static:3")
    target.sessions.clear()  # the target evicts the session ...
    draft.sessions.clear()  # ... and so does the draft
    target.calls.clear(), draft.calls.clear()
    ids2, _, s2 = run(engine, prompt_ids=(33, 33), max_new_tokens=10, session_id="e", gamma_policy="static:3")
    history = 3 + 10 + 2
    # the answer is exactly what an uninterrupted session gives
    assert ids2 == expected_tokens(history, 10)
    # first a NOT_FOUND at the synced position, then position 0 with the whole history
    assert target.calls[0][1] > 0 and target.calls[1][1:] == (0, history)
    assert draft.calls[1][1] == 0 and draft.calls[1][2] >= history - 2
    assert named("e", target.sessions)


def test_a_session_lost_twice_in_one_round_is_an_error_not_a_loop(fakes):
    draft, target, make = fakes
    engine = make()
    run(engine, prompt_ids=(104, 101), max_new_tokens=4, session_id="twice", gamma_policy="static:0")
    target.lose_everything = True  # NOT_FOUND at any position, every time
    with pytest.raises(errors.SessionNotFound, match="target service"):
        run(engine, prompt_ids=(33,), max_new_tokens=4, session_id="twice", gamma_policy="static:0")
    assert [c[1] for c in target.calls[-2:]] == [6, 0]  # one retry from position 0, then the error


def test_an_unavailable_blip_is_repeated_with_the_same_round_id(fakes):
    """The target's call is repeated as it was; the draft's is not (a draft
    failure costs speculation only): the round goes on without drafts, and
    the draft is out of the pool until a health check takes it back."""
    draft, target, make = fakes
    engine = make()
    steps = engine.generate(GenerateJob(prompt_ids=(104, 101, 108), max_new_tokens=12, gamma_policy="static:3"))
    next(steps)
    target.unavailable_once = draft.unavailable_once = True
    events = list(steps)
    ids = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
    assert ids == expected_tokens(3, 12)[-len(ids):]
    blip = next(i for i in range(1, len(target.round_ids)) if target.round_ids[i] == target.round_ids[i - 1])
    assert target.calls[blip] == target.calls[blip - 1]  # the very same call again
    assert len(set(draft.round_ids)) == len(draft.round_ids), "a failed Propose is not repeated"
    assert 0 in events[-1].gammas[1:], "the round of the blip verifies no drafts"
    (status,) = engine.pools["draft"].snapshot()
    assert not status.healthy and "Propose failed (UNAVAILABLE)" in status.reason
    assert engine.pools["draft"].check_now()[0].healthy  # (the fakes have no health service: fine)


def test_a_service_back_within_seconds_is_waited_for_and_one_that_stays_down_fails(fakes):
    """A restart (about a second without the service) costs a pause, not the
    request; a service down for good fails it with UNAVAILABLE after a few
    seconds of repeats, naming the service."""
    draft, target, make = fakes
    engine = make()
    steps = engine.generate(GenerateJob(prompt_ids=(104, 101, 108), max_new_tokens=12, gamma_policy="static:3"))
    next(steps)
    target.unavailable_calls = 5  # ~1 s of repeats
    ids = [t for e in steps if isinstance(e, Delta) for t in e.token_ids]
    assert ids == expected_tokens(3, 12)[-len(ids):] and target.unavailable_calls == 0
    target.unavailable_always = True
    started = time.monotonic()
    with pytest.raises(errors.Unavailable, match="target service at .* did not answer Verify"):
        run(engine, prompt_ids=(104,), max_new_tokens=4, gamma_policy="static:0")
    assert 2.5 < time.monotonic() - started < 10


def test_a_hung_service_fails_the_request_after_the_call_deadline_not_more(fakes):
    """The call runs out its deadline; ending the session on that same hung
    service must not hold the error back by the info timeout too."""
    _, target, make = fakes
    engine = make(call_timeout_s=0.5, info_timeout_s=10)
    engine.pair()
    target.hang_s = 4.0
    started = time.monotonic()
    with pytest.raises(errors.Unavailable, match="did not answer Verify .DEADLINE_EXCEEDED"):
        run(engine, prompt_ids=(104,), max_new_tokens=4, gamma_policy="static:0")
    assert time.monotonic() - started < 3  # 0.5 s deadline + 1 s for EndSession (4 s before)
    target.hang_s = 0.0


def test_cancelling_ends_the_session_in_both_services(fakes):
    draft, target, make = fakes
    engine = make()
    steps = engine.generate(GenerateJob(prompt_ids=(104,), max_new_tokens=200, session_id="c",
                                        gamma_policy="static:2"))
    next(steps), next(steps)
    assert named("c", draft.sessions) and named("c", target.sessions)
    steps.close()  # the client left before the second round's delta was sent
    assert named("c", draft.ended) and named("c", target.ended)
    # The session has no history yet; its unfinished first turn is kept, resumable.
    record = engine.directory.get("c")
    assert record.tokens == [] and not record.turn.finished and len(record.turn.deltas) == 2


def test_a_turn_that_does_not_finish_leaves_the_history_as_before_it(fakes):
    """What the client received of a cancelled or failed turn cannot be known
    (gRPC buffers a stream), so the turn is all or nothing: its prompt and
    output are dropped from the session's history, and resending the turn
    gives what it would have given."""
    draft, target, make = fakes
    engine = make()
    turn1, _, _ = run(engine, prompt_ids=(104,), max_new_tokens=5, session_id="t", gamma_policy="static:2")
    before = engine.directory.get("t").tokens
    assert before == [104] + turn1
    steps = engine.generate(GenerateJob(prompt_ids=(33, 34), max_new_tokens=200, session_id="t",
                                        gamma_policy="static:2"))
    next(steps), next(steps)
    steps.close()  # cancelled mid-turn
    record = engine.directory.get("t")
    assert record.tokens == before and record.draft_synced == record.target_synced == 0
    target.unavailable_always = True  # a turn that fails: the same
    with pytest.raises(errors.Unavailable):
        run(engine, prompt_ids=(33, 34), max_new_tokens=5, session_id="t")
    target.unavailable_always = False
    assert engine.directory.get("t").tokens == before
    ids, _, _ = run(engine, prompt_ids=(33, 34), max_new_tokens=3, session_id="t")
    assert ids == expected_tokens(len(before) + 2, 3)  # as if turn 2 had been sent once


def test_a_service_cancelling_calls_is_reported_as_maybe_stopping(fakes):
    _, target, make = fakes
    target.stopping = True
    with pytest.raises(errors.Unavailable, match=r"target service at .* cancelled Verify \(is it shutting down"):
        run(make(), prompt_ids=(33, 34), max_new_tokens=5)


def test_a_request_waits_for_a_cancelled_one_on_its_session_to_end(fakes):
    """'Stop, then send the next message': the cancelled request is still
    ending in its thread when the next one comes; the next one waits for it
    instead of being refused. A request still running is refused at once."""
    import threading

    _, _, make = fakes
    engine = make()
    run(engine, prompt_ids=(104,), max_new_tokens=2, session_id="chat")
    gone = engine.gone()
    first = engine.generate(GenerateJob(prompt_ids=(105,), max_new_tokens=50, session_id="chat"), gone)
    next(first)
    with pytest.raises(errors.FailedPrecondition, match="already generating"):
        run(engine, prompt_ids=(1,), max_new_tokens=2, session_id="chat")  # still running: at once
    gone.set()  # what the servicer does when the client goes
    threading.Timer(0.3, first.close).start()  # its cleanup, a moment later
    started = time.monotonic()
    ids, _, _ = run(engine, prompt_ids=(1,), max_new_tokens=2, session_id="chat")
    assert len(ids) == 2 and time.monotonic() - started >= 0.25


def test_a_cancelled_request_runs_no_more_rounds_and_marks_no_other(fakes):
    """A step of a request whose client has gone (queued behind others) ends
    at once without a round; a request cancelled before it got its session
    does nothing and leaves the request that holds it as it is."""
    draft, target, make = fakes
    engine = make()
    gone = engine.gone()
    a = engine.generate(GenerateJob(prompt_ids=(104,), max_new_tokens=50, session_id="s",
                                    gamma_policy="static:2"), gone)
    next(a)
    b_gone = engine.gone()
    b_gone.set()
    assert list(engine.generate(GenerateJob(prompt_ids=(1,), max_new_tokens=2, session_id="s"), b_gone)) == []
    started = time.monotonic()
    with pytest.raises(errors.FailedPrecondition):  # A still runs: refused at once, not after a wait
        run(engine, prompt_ids=(1,), max_new_tokens=2, session_id="s")
    assert time.monotonic() - started < 1
    calls = len(target.calls)
    gone.set()
    assert list(a) == []  # the next step: no round, no delta, no stats
    assert len(target.calls) == calls and named("s", target.ended)


def test_two_coordinators_with_one_session_id_keep_their_own_histories(fakes):
    """Session ids are the clients' names; two coordinators in front of the same
    services (a blue/green rollout, or a restart that lost the directory) may
    both see "x". Each continues its own history, never the other's KV state."""
    draft, target, make = fakes
    a, b = make(), make()
    run(a, prompt_ids=(104, 101, 108), max_new_tokens=6, session_id="x", gamma_policy="static:3")
    run(b, prompt_ids=(33,), max_new_tokens=4, session_id="x", gamma_policy="static:3")
    ids, _, _ = run(a, prompt_ids=(33, 33), max_new_tokens=8, session_id="x", gamma_policy="static:3")
    assert ids == expected_tokens(3 + 6 + 2, 8)  # A's history, not B's
    assert len([k for k in target.sessions if named("x", [k])]) == 2


def test_one_request_per_session_at_a_time(fakes):
    _, _, make = fakes
    engine = make()
    run(engine, prompt_ids=(104,), max_new_tokens=2, session_id="busy")
    first = engine.generate(GenerateJob(prompt_ids=(105,), max_new_tokens=50, session_id="busy"))
    next(first)
    with pytest.raises(errors.FailedPrecondition, match="already generating"):
        run(engine, prompt_ids=(1,), max_new_tokens=2, session_id="busy")
    with pytest.raises(errors.FailedPrecondition, match="generating"):
        engine.close_session("busy")
    first.close()
    assert engine.close_session("busy") is True
    with pytest.raises(errors.SessionNotFound, match="'busy' is unknown"):
        engine.close_session("busy")


@pytest.mark.parametrize("field,value,words", [
    ("vocab", 300, "vocabulary mismatch: draft 'FakeDraft' at 127.0.0.1:"),
    ("fingerprint", "other", "tokenizer mismatch: draft 'FakeDraft' at 127.0.0.1:"),
])
def test_draft_and_target_must_share_the_vocabulary(fakes, field, value, words):
    """Models without tokenizers are known by their vocabulary's size alone:
    sizes must agree. With tokenizers, the tokenizers must."""
    draft, target, make = fakes
    for service in (draft, target):
        service.fingerprint = size_fingerprint(service.vocab)
    setattr(draft, field, value)
    if field == "vocab":
        draft.fingerprint = size_fingerprint(value)
    with pytest.raises(errors.FailedPrecondition) as exc:
        run(make(), prompt_ids=(1, 2), max_new_tokens=2)
    assert words in str(exc.value) and "target 'FakeTarget' at 127.0.0.1:" in str(exc.value)


def test_a_draft_padded_to_other_rows_of_the_same_tokenizer_is_told_the_targets(fakes):
    """Same tokenizer, vocabularies padded to different sizes: the pair is
    served, and each Propose names the target's rows, so the draft proposes
    only ids the target holds."""
    draft, target, make = fakes
    draft.vocab = target.vocab + 64
    ids, _, _ = run(make(), prompt_ids=(1, 2), max_new_tokens=6, gamma_policy="static:3")
    assert len(ids) == 6 and draft.target_vocab_sizes and set(draft.target_vocab_sizes) == {target.vocab}


def _serve(servicer, add, port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    add(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


@pytest.fixture
def restartable():
    """(draft, engine, restart_target): fake services and an engine in front of
    them; ``restart_target(fake)`` stops the target, waits until the engine has
    seen its connection drop, and serves ``fake`` on the same port."""
    draft = FakeDraft()
    draft_server, draft_port = _serve(draft, pb_grpc.add_DraftServiceServicer_to_server)
    servers = [draft_server, *_serve(FakeTarget(), pb_grpc.add_TargetServiceServicer_to_server)]
    target_port = servers.pop()
    loop = LoopThread()
    engine = SyncEngine(loop, lambda: Coordinator(CoordinatorConfig(
        draft=f"127.0.0.1:{draft_port}", target=f"127.0.0.1:{target_port}", info_timeout_s=5, call_timeout_s=5)))

    def restart_target(fake: FakeTarget) -> None:
        servers.pop().stop(None)
        deadline = time.monotonic() + 10
        while engine.pairs.known is not None:  # the channel's connectivity watch forgets the pair
            assert time.monotonic() < deadline, "the engine did not notice the connection drop"
            time.sleep(0.05)
        servers.append(_serve(fake, pb_grpc.add_TargetServiceServicer_to_server, target_port)[0])

    yield draft, engine, restart_target
    engine.close()
    loop.close()
    for server in servers:
        server.stop(None)


def test_a_service_back_with_another_model_is_checked_again(restartable):
    """The pair's facts (EOS, context, γ limit, vocabulary) are asked for again
    after a connection drops: a target restarted with another model must not be
    served with the old one's EOS or limits."""
    draft, engine, restart_target = restartable
    ids, _, stats = run(engine, prompt_ids=(104, 101, 108), max_new_tokens=20, gamma_policy="static:3")
    assert stats.finish_reason == "length" and len(ids) == 20
    restarted = FakeTarget(eos_at=12)
    restarted.gamma_max = 2
    restart_target(restarted)
    with pytest.raises(errors.InvalidRequest, match=r"gamma must be in \[0, 2\], got 3"):
        run(engine, prompt_ids=(104, 101, 108), max_new_tokens=20, gamma_policy="static:3")
    draft.eos_at = 12
    ids, _, stats = run(engine, prompt_ids=(104, 101, 108), max_new_tokens=20, gamma_policy="static:2")
    assert ids == expected_tokens(3, 9) + [EOS] and stats.finish_reason == "eos"


def test_a_turn_never_mixes_two_models(restartable):
    """The target is replaced by another model in the middle of a turn: the new
    process holds no session, and before re-pre-filling it the coordinator sees
    that the pair changed and stops the turn (the output would mix two models)."""
    _, engine, restart_target = restartable
    steps = engine.generate(GenerateJob(prompt_ids=(104, 101, 108), max_new_tokens=200, gamma_policy="static:2"))
    next(steps)
    other = FakeTarget()
    other.name = "another-target"
    restart_target(other)
    with pytest.raises(errors.Unavailable, match="the target service at [0-9.:]+ changed during this turn: it "
                                                 "serves 'another-target', the turn began with 'FakeTarget'"):
        list(steps)
    assert other.calls and all(position > 0 for _, position, _ in other.calls)  # no re-pre-fill was sent


def test_the_drain_grace_ends_open_turns_but_not_a_finished_one():
    """As SIGTERM's grace runs out, a turn still generating ends with a reason
    (UNAVAILABLE, its token count); a turn whose stats are out is complete and
    stored, and gets no error after them."""
    import asyncio

    from specdec.coordinator.service import CoordinatorServicer

    class PeerOnly:  # the grpc context, as far as the servicer reads it
        def peer(self):
            return "ipv4:127.0.0.1:50000"

    class SlowEngine:
        async def generate(self, job):
            yield Delta([1], "a")
            await asyncio.sleep(0.3)  # the grace runs out meanwhile
            yield Delta([2], "b") if job.max_new_tokens > 2 else Stats(
                "", "length", 1, 1, 1, 0, 0, [0], [0], 0.3, 3.3, 1, 0)

    async def turn(max_new_tokens: int) -> list:
        servicer = CoordinatorServicer(SlowEngine())
        got = []
        try:
            async for message in servicer.Generate(pb.GenerateRequest(prompt_ids=[1], max_new_tokens=max_new_tokens),
                                                   PeerOnly()):
                got.append(message.WhichOneof("kind"))
                if len(got) == 1:
                    await servicer.shutting_down(0.4)  # streams end from 0.2 s on
        except errors.Draining as e:
            got.append(str(e))
        return got

    assert asyncio.run(turn(2)) == ["delta", "stats"]
    cut = asyncio.run(turn(8))
    assert cut[:2] == ["delta", "delta"] and "drain grace (0.4 s) ran out after 2 generated tokens" in cut[2]


def test_unreachable_service_is_unavailable_naming_it():
    cfg = CoordinatorConfig(draft="127.0.0.1:1", target="127.0.0.1:2", info_timeout_s=0.5)
    loop = LoopThread()
    engine = SyncEngine(loop, lambda: Coordinator(cfg))
    try:
        with pytest.raises(errors.Unavailable, match=r"draft (service at |replica: )127\.0\.0\.1:1"):
            run(engine, prompt_ids=(1,), max_new_tokens=2)
    finally:
        engine.close()
        loop.close()


def test_text_prompts_need_a_tokenizer(fakes):
    _, _, make = fakes
    with pytest.raises(errors.InvalidRequest, match="no tokenizer"):
        run(make(), prompt="hello", max_new_tokens=2)
    with pytest.raises(errors.InvalidRequest, match="no tokenizer"):
        run(make(), prompt_ids=(1,), stop=("x",), max_new_tokens=2)


def test_a_text_prompt_that_cannot_fit_is_refused_before_tokenizing(fakes, tokenizer):
    """Tokenizing megabytes of text takes seconds of the coordinator's CPU: a
    prompt with more characters than the context's tokens could spell is
    refused first."""
    _, _, make = fakes
    engine = make(tokenizer)
    longest = max(map(len, tokenizer.get_vocab()))
    encode = tokenizer.encode
    tokenizer.encode = None  # would fail if called
    try:
        with pytest.raises(errors.InvalidRequest, match=rf"prompt of {512 * longest + 1} characters cannot fit "
                                                        rf"the model context of 512 tokens"):
            run(engine, prompt="a" * (512 * longest + 1), max_new_tokens=2)
    finally:
        tokenizer.encode = encode
    with pytest.raises(errors.InvalidRequest, match="does not fit the model context of 512"):
        run(engine, prompt="é" * 300, max_new_tokens=2)  # within the bound, but 600 byte tokens


# ------------------------------------------------------------------ pure parts


def test_gamma_policies():
    assert parse_gamma_policy("static:0", 16) == StaticGamma(0)
    assert parse_gamma_policy(" Static:7 ", 16) == StaticGamma(7)
    assert isinstance(parse_gamma_policy("heuristic", 16), HeuristicGamma)
    assert isinstance(parse_gamma_policy("adaptive", 16), AdaptiveGamma)
    assert parse_gamma_policy("heuristic", 3).gamma_max == 3
    for bad, words in (("static:17", "gamma must be in [0, 16]"), ("static:-1", "gamma must be in"),
                       ("static:", "integer"), ("greedy", "not understood")):
        with pytest.raises(errors.InvalidRequest, match=words.replace("[", r"\[")):
            parse_gamma_policy(bad, 16)


def test_directory_stores_copies():
    d = _OnLoop(LoopThread(), InMemoryDirectory())
    record = SessionRecord("a", tokens=[1, 2], draft_synced=1)
    d.put(record)
    record.tokens.append(3)
    got = d.get("a")
    assert got.tokens == [1, 2] and got.draft_synced == 1
    got.tokens.append(9)
    assert d.get("a").tokens == [1, 2]
    assert d.delete("a") is True and d.get("a") is None and d.delete("a") is False
    small = _OnLoop(LoopThread(), InMemoryDirectory(max_records=2))
    for sid in ("x", "y", "x", "z"):  # x rewritten after y: y is the least recent
        small.put(SessionRecord(sid))
    assert small.get("y") is None and small.get("x") is not None and len(small) == 2


def test_coordinator_flags_fall_back_to_the_environment(capsys, monkeypatch):
    import argparse

    from specdec.coordinator.server import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for name, value in {"SPECDEC_COORDINATOR_DRAFT": "d:1", "SPECDEC_GAMMA_MAX": "8",
                        "SPECDEC_COORDINATOR_PORT": "7"}.items():
        monkeypatch.setenv(name, value)
    args = parser.parse_args(["--target", "t:2", "--max-new-tokens-cap", "99"])
    cfg = CoordinatorConfig.load(vars(args))
    assert (cfg.draft, cfg.target, cfg.gamma_max, cfg.port, cfg.max_new_tokens_cap) == ("d:1", "t:2", 8, 7, 99)
    monkeypatch.delenv("SPECDEC_COORDINATOR_PORT")
    assert CoordinatorConfig.load(vars(parser.parse_args([]))).port == 50051
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "SPECDEC_COORDINATOR_DRAFT" in capsys.readouterr().out


def test_adaptive_requests_start_from_what_their_regime_learnt():
    """Greedy acceptance says little about sampling's: a request starts from the
    estimates of the last request decoding the same way (the seed aside)."""
    import dataclasses

    from specdec.core.interfaces import RoundResult, SamplingParams

    loop = LoopThread()
    engine = SyncEngine(loop, lambda: Coordinator(CoordinatorConfig(draft="127.0.0.1:1", target="127.0.0.1:2")))
    try:
        greedy = GenerateJob(prompt_ids=(1,), gamma_policy="adaptive")
        sampled = GenerateJob(prompt_ids=(1,), sampling=SamplingParams(temperature=0.8, seed=1))
        learned = parse_gamma_policy("adaptive", engine.config.gamma_max)

        def key(job):
            return regime(job.sampling, job.draft_top_k)

        for _ in range(20):
            learned.observe(RoundResult([1, 2, 3, 4, 5], 4, 4, 0.01, 0.01, None, 0.004))
        engine.learned.remember(learned, key(greedy))

        def fresh():
            return parse_gamma_policy("adaptive", engine.config.gamma_max)

        def learned_from(policy, teacher):  # its round costs, and acceptance leaning the teacher's way
            return (policy.cost() == teacher.cost()
                    and fresh().alphas()[0] < policy.alphas()[0] <= teacher.alphas()[0])

        started = engine.learned.warm_start(fresh(), key(greedy))
        assert started is not learned and learned_from(started, learned)
        assert engine.learned.warm_start(fresh(), key(sampled)).cost() is None  # nothing learnt for sampling yet
        engine.learned.remember(learned, key(sampled))
        other_seed = dataclasses.replace(sampled, sampling=SamplingParams(temperature=0.8, seed=2))
        assert learned_from(engine.learned.warm_start(fresh(), key(other_seed)), learned)
        hotter = dataclasses.replace(sampled, sampling=SamplingParams(temperature=1.0, seed=1))
        assert engine.learned.warm_start(fresh(), key(hotter)).cost() is None
    finally:
        engine.close()
        loop.close()


def test_the_first_request_teaches_the_next_ones_nothing(fakes):
    """Its rounds ran the slow first calls; from the second request on, an
    adaptive request leaves what it learnt to the next one of its regime."""
    _, _, make_engine = fakes
    engine = make_engine()
    run(engine, prompt_ids=[1, 2, 3], max_new_tokens=12, gamma_policy="adaptive")

    def warm_start():
        return engine.learned.warm_start(parse_gamma_policy("adaptive", engine.config.gamma_max), ("greedy",))

    assert warm_start().cost() is None
    run(engine, prompt_ids=[1, 2, 3], max_new_tokens=12, gamma_policy="adaptive")
    assert warm_start().cost() is not None


def test_a_tokenizer_directory_without_a_tokenizer_is_refused_at_startup(tmp_path):
    from specdec.coordinator.tokenizer_source import TokenizerSource

    with pytest.raises(ValueError, match="no tokenizer.json or tokenizer_config.json"):
        TokenizerSource.for_config(CoordinatorConfig(tokenizer=str(tmp_path)))
    with pytest.raises(ValueError, match="not a directory"):
        TokenizerSource.for_config(CoordinatorConfig(tokenizer=str(tmp_path / "nope")))
    assert TokenizerSource.for_config(CoordinatorConfig()).from_target
    assert not TokenizerSource.for_config(CoordinatorConfig(tokenizer="none")).from_target


# ------------------------------------------------------------------ resuming a turn


def take(steps, n: int) -> list[Delta]:
    """The first ``n`` deltas of a stream, then the stream dropped (the client's connection broke)."""
    got = [next(steps) for _ in range(n)]
    steps.close()
    return got


def test_a_cut_turn_resumes_after_the_last_delta_received_each_token_once(fakes, tokenizer):
    draft, target, make = fakes
    engine = make(tokenizer)
    job = dict(prompt="hel", max_new_tokens=30, session_id="r", gamma_policy="static:2", stop=("ld,",),
               turn_id="t1")
    got = take(engine.generate(GenerateJob(**job)), 3)
    # The client received 2 of the 3 deltas (the third was lost in the broken stream).
    ids, text, stats = run(engine, **job, resume_after=2)
    streamed = [t for d in got[:2] for t in d.token_ids] + ids
    assert streamed == expected_tokens(3, len(streamed))
    assert "".join(d.text for d in got[:2]) + text == "lo wor"  # cut before the stop string
    assert stats.finish_reason == "stop" and stats.generated_tokens == len(streamed)
    assert stats.prompt_tokens == 3 and stats.history_tokens == 0
    # The session goes on from the resumed turn, as if it had not been cut.
    assert engine.directory.get("r").tokens == list(b"hel") + streamed
    more, _, _ = run(engine, prompt_ids=(33,), max_new_tokens=3, session_id="r")
    assert more == expected_tokens(3 + len(streamed) + 1, 3)


def test_resuming_a_finished_turn_replays_what_the_client_missed(fakes):
    _, _, make = fakes
    engine = make()
    run(engine, prompt_ids=(104,), max_new_tokens=3, session_id="f")
    job = dict(prompt_ids=(105,), max_new_tokens=9, session_id="f", gamma_policy="static:2", turn_id="t2")
    events = list(engine.generate(GenerateJob(**job)))
    deltas, stats = events[:-1], events[-1]
    ids, _, again = run(engine, **job, resume_after=1)
    assert ids == [t for d in deltas[1:] for t in d.token_ids]
    assert again.finish_reason == stats.finish_reason and again.generated_tokens == 9 and again.rounds == 0
    assert again.history_tokens == stats.history_tokens == 4
    ids, _, _ = run(engine, **job, resume_after=len(deltas))
    assert ids == []
    assert len(engine.directory.get("f").tokens) == 4 + 1 + 9  # nothing generated twice


def test_a_new_turn_drops_an_unfinished_one(fakes):
    _, _, make = fakes
    engine = make()
    turn1, _, _ = run(engine, prompt_ids=(104,), max_new_tokens=4, session_id="d")
    job = dict(prompt_ids=(33,), max_new_tokens=50, session_id="d", gamma_policy="static:2", turn_id="cut")
    take(engine.generate(GenerateJob(**job)), 2)
    ids, _, stats = run(engine, prompt_ids=(34,), max_new_tokens=3, session_id="d")
    assert stats.history_tokens == 5 and ids == expected_tokens(6, 3)
    with pytest.raises(errors.FailedPrecondition, match="not in the session directory"):
        run(engine, **job, resume_after=1)  # another turn followed it


def test_a_turn_never_recorded_starts_afresh_when_nothing_was_streamed(fakes):
    _, _, make = fakes
    engine = make()
    ids, _, stats = run(engine, prompt_ids=(104,), max_new_tokens=4, session_id="n", turn_id="a",
                        resume_after=0)
    assert ids == expected_tokens(1, 4) and stats.history_tokens == 0
    with pytest.raises(errors.InvalidRequest, match="has streamed only"):
        run(engine, prompt_ids=(104,), max_new_tokens=4, session_id="n", turn_id="a", resume_after=9)


@pytest.mark.parametrize("job", [dict(resume_after=0), dict(resume_after=0, session_id="x"),
                                 dict(resume_after=0, turn_id="x")])
def test_resume_requests_name_the_session_and_the_turn(fakes, job):
    _, _, make = fakes
    with pytest.raises(errors.InvalidRequest, match="needs the session_id and turn_id"):
        run(make(), prompt_ids=(1,), max_new_tokens=2, **job)


def test_a_turn_cut_after_its_last_delta_ends_without_repeating_it(fakes, tokenizer):
    """The coordinator died between streaming a turn's held-back tail (text of
    a possible stop string, released at the end) and recording the end."""
    _, _, make = fakes
    engine = make(tokenizer)
    job = dict(prompt="hel", max_new_tokens=8, session_id="tail", stop=("world!",), turn_id="t",
               gamma_policy="static:2")
    events = list(engine.generate(GenerateJob(**job)))
    deltas = events[:-1]
    assert deltas[-1].token_ids == [] and deltas[-1].text.endswith("world")  # the tail
    record = engine.directory.get("tail")
    record.turn.finish_reason, record.tokens = "", []  # as the dead coordinator left it
    engine.directory.put(record)
    ids, text, stats = run(engine, **job, resume_after=len(deltas))
    assert ids == [] and text == "" and stats.finish_reason == "length" and stats.generated_tokens == 8
    assert engine.directory.get("tail").tokens == list(b"hel") + expected_tokens(3, 8)


def test_a_target_at_its_kv_budget_hands_the_turn_to_another_and_all_full_is_resource_exhausted(fakes):
    draft, target, make = fakes
    other = FakeTarget()
    server, port = _serve(other, pb_grpc.add_TargetServiceServicer_to_server)
    try:
        engine = make(target=f"{make().config.target},127.0.0.1:{port}")
        target.full = True
        for _ in range(2):  # whichever the pool picks first
            ids, _, _ = run(engine, prompt_ids=(104, 101, 108), max_new_tokens=10, gamma_policy="static:2")
            assert ids == expected_tokens(3, 10)
        assert other.calls and not target.sessions
        other.full = True
        with pytest.raises(errors.ResourceExhausted, match="no other target replica took it") as exc:
            run(engine, prompt_ids=(104, 101, 108), max_new_tokens=10, gamma_policy="static:2")
        assert exc.value.retry_after_s == 1.0
    finally:
        server.stop(None)


def test_a_draft_at_its_kv_budget_hands_the_session_to_another_and_the_first_is_told_to_end_it(fakes):
    """Not a round without drafts: another draft with room takes the session
    (re-pre-filled), and the full one is told to free what it held of it."""
    draft, target, make = fakes
    other = FakeDraft()
    server, port = _serve(other, pb_grpc.add_DraftServiceServicer_to_server)
    try:
        engine = make(draft=f"{make().config.draft},127.0.0.1:{port}")
        run(engine, prompt_ids=(104, 101, 108), max_new_tokens=4, session_id="kv", gamma_policy="static:2")
        full, spare = (draft, other) if named("kv", draft.sessions) else (other, draft)
        full.full = True
        ids, _, stats = run(engine, prompt_ids=(33,), max_new_tokens=10, session_id="kv", gamma_policy="static:2")
        assert ids == expected_tokens(3 + 4 + 1, 10)
        assert stats.gammas[:4] == [2, 2, 2, 2] and named("kv", spare.sessions)  # drafted, on the other draft
        deadline = time.monotonic() + 5
        while not named("kv", full.ended):  # told in the background
            assert time.monotonic() < deadline, "the full draft was not told to end the session"
            time.sleep(0.02)
    finally:
        server.stop(None)


def test_a_target_that_takes_fewer_drafts_than_the_turn_may_ask_cannot_take_it_over(fakes):
    """A replacement target with a lower --gamma-max would refuse the turn's
    rounds mid-stream: the pair check keeps it out, and the turn fails over
    to none (UNAVAILABLE naming why), never to a target that refuses it."""
    from specdec.serving.server import free_port

    draft, target, make = fakes
    other = FakeTarget()
    other.gamma_max = 1
    port = free_port()
    engine = make(target=f"{make().config.target},127.0.0.1:{port}")  # nothing answers there yet
    steps = engine.generate(GenerateJob(prompt_ids=(104, 101, 108), max_new_tokens=50, gamma_policy="static:3"))
    next(steps)
    server, _ = _serve(other, pb_grpc.add_TargetServiceServicer_to_server, port)  # a replacement comes up
    try:
        engine.pools["target"].check_now()
        target.unavailable_always = True
        with pytest.raises(errors.Unavailable, match="did not answer Verify"):
            list(steps)
        assert not other.calls  # never sent a round it would refuse
    finally:
        server.stop(None)


def test_a_named_session_records_what_adaptive_gamma_saw_for_its_next_turn(fakes):
    _, _, make = fakes
    engine = make()
    run(engine, prompt_ids=(104, 101, 108), max_new_tokens=40, session_id="g", gamma_policy="adaptive")
    state = engine.directory.get("g").gamma_state
    assert state["regime"] == ["greedy"] and sum(state["tried"]) > 0 and len(state["tried"]) == 16
    run(engine, prompt_ids=(33,), max_new_tokens=8, session_id="g", gamma_policy="static:2")
    assert engine.directory.get("g").gamma_state == state  # a static turn leaves it as it was
