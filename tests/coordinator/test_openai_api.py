"""The coordinator's OpenAI-compatible HTTP API, with the official ``openai``
SDK as its client: a coordinator in this process (its HTTP server on its own
event loop, beside gRPC) in front of real draft and target services with tiny
models, a byte tokenizer and a chat template.

The same request answers the same over HTTP, streamed or not, and over gRPC;
every error has its status and OpenAI's shape (a bug's too); the limits,
tokens and session owners are the gRPC port's own, and a refused client costs
no render; a client that goes away frees its session in the services; TLS works
with the SDK given the CA, and a TLS file the HTTP port cannot load stops the
whole start-up; metric labels stay bounded whatever a client sends."""

from __future__ import annotations

import json
import logging
import math
import pathlib
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from tls_certs import CA

from specdec.coordinator.openai_errors import http_error
from specdec.serving import errors
from specdec.serving.client import Client, Completion
from specdec.serving.config import CoordinatorConfig
from specdec.serving.server import free_port
from specdec.telemetry.metrics import CoordinatorMetrics
from specdec.telemetry.setup import ServiceTelemetry

from service_harness import LoopThread, start_service
from tiny_models import add_byte_tokenizer, add_chat_template, make_noisy_copy, make_tiny_llama

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
PROMPT = "def fib(n):"
GREEDY = dict(temperature=0, extra_body={"gamma_policy": "static:3"})
MAX_BODY = 256 << 10


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    target = make_tiny_llama(root / "target", vocab_size=260, layers=2, max_positions=512, seed=0, logit_scale=4.0)
    add_chat_template(add_byte_tokenizer(target), TEMPLATE)
    draft = add_byte_tokenizer(make_noisy_copy(target, root / "draft", noise=0.05, seed=1))
    plain = root / "tokenizer-without-template"  # the target's tokenizer, less its template
    plain.mkdir()
    add_byte_tokenizer(plain)
    (root / "other.jinja").write_text(OTHER_TEMPLATE)
    named = root / "tokenizer-with-named-templates"  # transformers reads these as a dict: {"default": ..., ...}
    named.mkdir()
    add_byte_tokenizer(named)
    config = json.loads((named / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": "TOOLS"}]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    return {"target": target, "draft": draft, "plain": plain, "other": root / "other.jinja", "named": named,
            "root": root}


@pytest.fixture(scope="module")
def stack(models):
    loop = LoopThread()
    services = {role: start_service(loop, role, models[role]) for role in ("draft", "target")}
    started = []

    def coordinator(telemetry=None, **settings):
        from specdec.coordinator.server import start_coordinator

        config = CoordinatorConfig(draft=f"127.0.0.1:{services['draft'].port}",
                                   target=f"127.0.0.1:{services['target'].port}", host="127.0.0.1", port=0,
                                   http_port=free_port(), **settings)
        running = loop.call(start_coordinator(config, telemetry))
        started.append(running)
        return running

    metrics = CoordinatorMetrics()
    main = coordinator(ServiceTelemetry("coordinator", metrics), auth_tokens=f"alice:{ALICE},bob:{BOB}",
                       max_message_bytes=MAX_BODY)
    try:
        yield {"loop": loop, "services": services, "main": main, "metrics": metrics, "coordinator": coordinator,
               "started": started}
    finally:
        for running in started:
            loop.call(running.stop())
        for service in services.values():
            loop.call(service.stop())
        loop.close()


def sdk(coordinator, key: str = ALICE, **kw) -> openai.OpenAI:
    """The official client, retrying nothing (a 429 or 503 is what a test looks for)."""
    scheme = "https" if kw.get("http_client") else "http"
    return openai.OpenAI(base_url=f"{scheme}://127.0.0.1:{coordinator.http_port}/v1", api_key=key, max_retries=0,
                         timeout=60, **kw)


def grpc_client(coordinator, token: str = ALICE) -> Client:
    return Client(f"127.0.0.1:{coordinator.port}", timeout=60, token=token)


def raw(coordinator, path: str, body: bytes | None = None, *, method: str | None = None, token: str | None = ALICE,
        headers: dict | None = None) -> tuple[int, dict, dict]:
    """A plain HTTP request: (status, headers, JSON body)."""
    request = urllib.request.Request(f"http://127.0.0.1:{coordinator.http_port}{path}", data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")


def api_of(coordinator):
    """The coordinator's OpenAIApi (the object its routes are methods of)."""
    fastapi_app = coordinator.http.app.app  # (under the guard)
    return next(route.endpoint.__self__ for route in fastapi_app.routes
                if getattr(route, "path", None) == "/v1/chat/completions")


class CountingTemplate:
    """A ChatTemplate's stand-in that counts its renders (and renders as the one it replaces)."""

    def __init__(self, chat):
        self.chat, self.renders = chat, 0

    def render(self, tokenizer, messages):
        self.renders += 1
        return self.chat.render(tokenizer, messages)


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def spec_metrics(stats) -> dict:
    """What ``metrics.speculative_decoding`` must say for these gRPC stats."""
    drafts = sum(1 for g in stats.gammas if g > 0)
    rounds = list(zip(stats.gammas, stats.accepted_per_round, strict=True))
    per_position = [sum(1 for g, a in rounds if g > i and a > i) for i in range(max(stats.gammas))]
    return {"num_drafts": drafts, "num_draft_tokens": stats.drafted_tokens,
            "num_accepted_tokens": stats.accepted_tokens, "num_accepted_tokens_per_pos": per_position,
            "mean_acceptance_length": pytest.approx(1 + stats.accepted_tokens / drafts),
            "draft_acceptance_rate": pytest.approx(stats.accepted_tokens / stats.drafted_tokens),
            "rounds": stats.rounds, "gammas": list(stats.gammas),
            "accepted_per_round": list(stats.accepted_per_round)}


# ------------------------------------------------------------------ answers


def test_models_and_health(stack):
    main = stack["main"]
    listed = sdk(main).models.list().data
    assert [m.id for m in listed] == ["target"] and listed[0].owned_by == "specdec"
    status, _, body = raw(main, "/health", token=None)  # open: a probe has no token
    assert (status, body) == (200, {"status": "SERVING"})


def test_a_completion_is_the_same_streamed_not_streamed_and_over_grpc(stack):
    main = stack["main"]
    client = sdk(main)
    whole = client.completions.create(model="target", prompt=PROMPT, max_tokens=40, **GREEDY)
    chunks = list(client.completions.create(model="target", prompt=PROMPT, max_tokens=40, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    with grpc_client(main) as c:
        events = list(c.generate(PROMPT, max_new_tokens=40, gamma_policy="static:3"))
    over_grpc = Completion("".join(e.text for e in events[:-1]), [], events[-1])
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.model == "target"
    choice = whole.choices[0]
    assert choice.text == over_grpc.text
    assert choice.finish_reason == "length" and choice.index == 0
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == \
        (len(PROMPT), 40, len(PROMPT) + 40) == (over_grpc.stats.prompt_tokens, over_grpc.stats.generated_tokens,
                                               len(PROMPT) + 40)
    spec = whole.model_extra["metrics"]["speculative_decoding"]
    assert spec == spec_metrics(over_grpc.stats)  # greedy, the same γ schedule: the same rounds

    *deltas, final, usage = chunks
    assert "".join(c.choices[0].text for c in deltas) == choice.text
    assert len(deltas) == len(events) - 1  # a chunk per delta (a round's, as it committed)
    assert all(c.choices[0].finish_reason is None for c in deltas) and final.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.completion_tokens == 40
    assert usage.model_extra["metrics"]["speculative_decoding"] == spec
    assert len({c.id for c in chunks}) == 1


def test_a_chat_renders_the_template_with_its_generation_prompt(stack):
    main = stack["main"]
    client = sdk(main)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    chat = client.chat.completions.create(model="target", messages=messages, max_completion_tokens=24, **GREEDY)
    rendered = "<system>Be brief.\n<user>hi\nthere\n<assistant>"
    plain = client.completions.create(model="target", prompt=rendered, max_tokens=24, **GREEDY)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == len(rendered)
    streamed = list(client.chat.completions.create(model="target", messages=messages, max_tokens=24, stream=True,
                                                   **GREEDY))
    assert streamed[0].object == "chat.completion.chunk" and streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == "length"
    rest = client.chat.completions.create(model="target", messages=messages, temperature=0,
                                          extra_body={"gamma_policy": "static:4"})  # no max_tokens: the context
    assert rest.usage.total_tokens == 512 and rest.choices[0].finish_reason == "length"


def test_sampling_defaults_to_temperature_1_with_a_seed_drawn_and_a_seed_repeats(stack):
    client = sdk(stack["main"])
    seeded = [client.completions.create(model="target", prompt=PROMPT, max_tokens=12, seed=7, top_p=0.9,
                                        extra_body={"gamma_policy": "static:2", "top_k": 50}).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    drawn = client.completions.create(model="target", prompt=PROMPT)  # OpenAI's defaults: 16 tokens, sampled
    assert drawn.usage.completion_tokens == 16 and drawn.choices[0].finish_reason == "length"


def test_stop_strings_and_named_sessions(stack):
    client = sdk(stack["main"])
    whole = client.completions.create(model="target", prompt=PROMPT, max_tokens=30, **GREEDY).choices[0].text
    stop = next(ch for ch in whole[2:] if ch.isascii() and ch.isprintable())  # (a random model's bytes)
    cut = client.completions.create(model="target", prompt=PROMPT, max_tokens=30, stop=[stop], **GREEDY)
    assert cut.choices[0].text == whole[:whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    session = {"session_id": "http-chat", "gamma_policy": "static:3"}
    client.completions.create(model="target", prompt="ab", max_tokens=4, temperature=0, extra_body=session)
    again = client.completions.create(model="target", prompt="cd", max_tokens=4, temperature=0, extra_body=session)
    assert again.usage.prompt_tokens == 2
    with grpc_client(stack["main"]) as c:  # the same session, over gRPC: the history both ports added to
        assert c.complete("ef", max_new_tokens=4, session_id="http-chat").stats.history_tokens == 2 + 4 + 2 + 4
        assert c.close_session("http-chat")


# ------------------------------------------------------------------ errors


UNSUPPORTED = [
    ("completions", "n", 2), ("completions", "best_of", 3), ("completions", "echo", True),
    ("completions", "logprobs", 1), ("completions", "suffix", "x"), ("completions", "presence_penalty", 0.5),
    ("completions", "frequency_penalty", -1.0), ("completions", "logit_bias", {"65": 10}),
    ("chat", "logprobs", True), ("chat", "top_logprobs", 2), ("chat", "n", 3),
    ("chat", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat", "tool_choice", "auto"), ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("chat", "response_format", {"type": "json_object"}),
    ("completions", "frobnicate", 1), ("chat", "reasoning_effort", "high"),  # unknown to specdec
]


@pytest.mark.parametrize(("endpoint", "param", "value"), UNSUPPORTED, ids=[f"{e}-{p}" for e, p, _ in UNSUPPORTED])
def test_an_unsupported_parameter_is_refused_naming_it(stack, endpoint, param, value):
    client = sdk(stack["main"])
    with pytest.raises(openai.BadRequestError) as exc:
        if endpoint == "chat":
            client.chat.completions.create(model="target", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2, extra_body={param: value})
        else:
            client.completions.create(model="target", prompt="x", max_tokens=2, extra_body={param: value})
    error = error_of(exc.value)
    assert exc.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and param in error["message"]


@pytest.mark.parametrize(("request_body", "param", "says"), [
    ({"prompt": ["one", "two"]}, "prompt", "one prompt per request"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens", "--max-new-tokens-cap"),
    ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "x", "stop": ["a"] * 65}, None, "too many stop strings"),
    ({"prompt": "x", "gamma_policy": "static:99"}, None, "gamma"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "only text parts"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "role 'tool' is not supported"),
    ({}, "prompt", "prompt is required"),
    # Malformed messages: each field's type checked where the messages are read (never a 500).
    ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": 5}]}, "messages[1].content",
     "must be a string or a list of text parts, not int"),
    ({"messages": [{"role": "user", "content": True}]}, "messages[0].content", "not bool"),
    ({"messages": [{"role": "user", "content": 1.5}]}, "messages[0].content", "not float"),
    ({"messages": [{"role": "user", "content": {"type": "text", "text": "x"}}]}, "messages[0].content", "not dict"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]", "only text parts"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role", "must be a string, not list"),
    ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role", "must be a string, not dict"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "messages[0].role is required"),
    ({"messages": [{"role": "u" * 500, "content": "x"}]}, "messages[0].role", "(500 characters)"),  # an excerpt
    ({"messages": [{"role": "user", "content": "x"}] * 4097}, "messages", "at most 4096"),
    ({"messages": []}, "messages", "messages is empty"),
])
def test_bad_input_is_400_naming_the_parameter(stack, request_body, param, says):
    path = "/v1/chat/completions" if "messages" in request_body else "/v1/completions"
    status, _, body = raw(stack["main"], path, json.dumps({"model": "target", **request_body}).encode())
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["param"] == param and says in body["error"]["message"], body


def test_a_body_that_is_not_json_is_400(stack):
    status, _, body = raw(stack["main"], "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]


@pytest.mark.parametrize("request_body", [b"", b"[]", b'"a prompt"', b"5", b"null"])
def test_a_body_that_is_not_a_json_object_is_400_saying_so(stack, request_body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, _, body = raw(stack["main"], path, request_body, method="POST")
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"].startswith("the request body must be a JSON object"), body
        assert "None" not in body["error"]["message"]


def test_a_long_model_name_comes_back_as_an_excerpt(stack):
    with pytest.raises(openai.NotFoundError) as exc:
        sdk(stack["main"]).completions.create(model="m" * 5000, prompt="x", max_tokens=2)
    message = error_of(exc.value)["message"]
    assert "(5000 characters)" in message and len(message) < 300


def test_unsupported_parameters_are_checked_once_a_request(stack, monkeypatch):
    from specdec.coordinator import openai_api, openai_protocol

    calls = []
    checked = openai_protocol.refuse_unsupported

    def counted(request):
        calls.append(type(request).__name__)
        return checked(request)

    monkeypatch.setattr(openai_protocol, "refuse_unsupported", counted)
    monkeypatch.setattr(openai_api, "refuse_unsupported", counted, raising=False)
    client = sdk(stack["main"])
    client.chat.completions.create(model="target", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    client.completions.create(model="target", prompt="x", max_tokens=2)
    assert calls == ["ChatRequest", "CompletionRequest"]


def test_an_unexpected_error_is_a_500_in_openais_shape_logged_once(stack, monkeypatch, caplog):
    """A bug (here: a renderer that raises TypeError) answers 500 server_error
    in OpenAI's shape, streamed or not; its traceback is logged once, at ERROR,
    with nothing of the request in it."""

    class Broken:
        def render(self, tokenizer, messages):
            raise TypeError("a bug in the renderer")

    monkeypatch.setattr(api_of(stack["main"]), "chat", Broken())
    caplog.set_level(logging.INFO)
    messages = [{"role": "user", "content": "a secret question"}]
    for stream in (False, True):
        caplog.clear()
        with pytest.raises(openai.InternalServerError) as exc:
            sdk(stack["main"]).chat.completions.create(model="target", messages=messages, max_tokens=2, stream=stream)
        error = error_of(exc.value)
        assert exc.value.status_code == 500 and error["type"] == "server_error" and "TypeError" in error["message"]
        time.sleep(0.2)  # (what the server logs after the response)
        errors_logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors_logged) == 1 and errors_logged[0].exc_info is not None, [r.getMessage() for r in
                                                                                   errors_logged]
        assert "a secret question" not in caplog.text


def test_tokens_are_checked_and_sessions_belong_to_their_client(stack):
    main = stack["main"]
    with pytest.raises(openai.AuthenticationError) as exc:
        sdk(main, key="not-a-token-of-this-coordinator").completions.create(model="target", prompt="x", max_tokens=2)
    assert exc.value.status_code == 401 and error_of(exc.value)["type"] == "authentication_error"
    status, _, body = raw(main, "/v1/models", token=None)
    assert status == 401 and "'Authorization: Bearer <token>'" in body["error"]["message"]
    assert "metadata" not in body["error"]["message"]  # (HTTP has headers: gRPC's words are not HTTP's)
    status, _, body = raw(main, "/v1/models", token=None, headers={"Authorization": "Basic dXNlcjpwYXNz"})
    assert status == 401 and body["error"]["message"] == "the Authorization header must be 'Bearer <token>'"

    sdk(main).completions.create(model="target", prompt="x", max_tokens=2, extra_body={"session_id": "alices"})
    with pytest.raises(openai.PermissionDeniedError) as exc:
        sdk(main, key=BOB).completions.create(model="target", prompt="x", max_tokens=2,
                                              extra_body={"session_id": "alices"})
    assert exc.value.status_code == 403 and "belongs to another client" in error_of(exc.value)["message"]
    with grpc_client(main, BOB) as bob, pytest.raises(errors.PermissionDenied):  # the gRPC port agrees
        bob.complete("x", max_new_tokens=2, session_id="alices")
    with grpc_client(main) as alice:
        assert alice.close_session("alices")


def test_unknown_models_routes_and_methods_are_404_and_405_in_openais_shape(stack):
    main = stack["main"]
    with pytest.raises(openai.NotFoundError) as exc:
        sdk(main).completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    error = error_of(exc.value)
    assert (error["param"], error["code"]) == ("model", "model_not_found") and "'target'" in error["message"]
    status, _, body = raw(main, "/v1/embeddings", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, _, body = raw(main, "/v1/completions", method="GET")
    assert status == 405 and set(body["error"]) == {"message", "type", "param", "code"}


def test_a_body_past_max_message_bytes_is_413_before_or_while_it_is_read(stack):
    main = stack["main"]
    big = json.dumps({"model": "target", "prompt": "x" * MAX_BODY}).encode()
    status, _, body = raw(main, "/v1/completions", big)
    assert status == 413 and body["error"]["code"] == "request_too_large" and "--max-message-bytes" in \
        body["error"]["message"]
    pieces = (big[i:i + 65536] for i in range(0, len(big), 65536))  # chunked: no Content-Length to go by
    status, _, body = raw(main, "/v1/completions", pieces)
    assert status == 413 and "--max-message-bytes" in body["error"]["message"]


def test_limits_are_shared_with_grpc_429_for_a_client_503_for_the_coordinator(stack):
    limited = stack["coordinator"](auth_tokens=f"alice:{ALICE},bob:{BOB}", client_rate=0.01, client_burst=1,
                                   max_stream_memory_mb=1)
    api = api_of(limited)
    api.chat = template = CountingTemplate(api.chat)
    with pytest.raises(openai.InternalServerError) as exc:  # 600 kB held twice: past the coordinator's 1 MiB
        sdk(limited).completions.create(model="target", prompt=[7] * 300_000, max_tokens=2)
    assert exc.value.status_code == 503 and exc.value.response.headers["retry-after"] == "1"
    assert error_of(exc.value)["type"] == "service_unavailable_error" and "--max-stream-memory" in \
        error_of(exc.value)["message"]
    with pytest.raises(openai.InternalServerError) as exc:  # a chat as large: refused before it is rendered
        sdk(limited).chat.completions.create(model="target", messages=[{"role": "user", "content": "y" * 600_000}])
    assert exc.value.status_code == 503 and "--max-stream-memory" in error_of(exc.value)["message"]
    assert template.renders == 0
    with grpc_client(limited) as alice:
        alice.complete("x", max_new_tokens=2)  # alice's one request of the burst, over gRPC
    with pytest.raises(openai.RateLimitError) as exc:
        sdk(limited).completions.create(model="target", prompt="x", max_tokens=2)
    assert exc.value.status_code == 429 and int(exc.value.response.headers["retry-after"]) >= 1
    assert error_of(exc.value)["code"] == "rate_limit_exceeded" and "--client-rate" in error_of(exc.value)["message"]
    with pytest.raises(openai.RateLimitError):  # past her rate: no render, and no model pair checked, for her chat
        sdk(limited).chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}])
    assert template.renders == 0
    bobs = sdk(limited, key=BOB).chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2)  # bob has his own: rendered once admitted
    assert template.renders == 1 and bobs.model == "target"


def test_one_address_is_one_client_on_both_ports():
    """Without a token a client is its address, spelled by one function for
    both ports: gRPC's peer and an HTTP client (an IPv4 client of a server on
    ``::`` is an IPv4-mapped address to HTTP, ``ipv4:`` to gRPC)."""
    from specdec.coordinator.streams import client_address

    assert client_address("ipv4:10.0.0.7:53412") == client_address(("10.0.0.7", 443)) == "ipv4:10.0.0.7"
    assert client_address(("::ffff:10.0.0.7", 443)) == client_address("ipv6:%5B::ffff:10.0.0.7%5D:53412") == \
        "ipv4:10.0.0.7"
    assert client_address("ipv6:%5B::1%5D:53412") == client_address(("::1", 8000)) == "ipv6:%5B::1%5D"
    assert client_address("ipv6:%5B2001:DB8:0::1%5D:1") == client_address(("2001:db8::1", 2)) == \
        "ipv6:%5B2001:db8::1%5D"
    assert client_address("unix:/run/specdec.sock") == "unix:/run/specdec.sock"
    assert client_address(None) == client_address("") == ""


@pytest.mark.parametrize(("exc", "status"), [
    (errors.ClientLimitExceeded("a client's streams", retry_after_s=2.5), 429),
    (errors.ResourceExhausted("the target's KV budget"), 503),
    (errors.Unavailable("the session directory is unreachable", retry_after_s=4.0), 503),
    (errors.Draining("shutting down"), 503),
    (errors.InvalidRequest("bad"), 400), (ValueError("bad"), 400), (errors.Unauthenticated("who"), 401),
    (errors.PermissionDenied("not yours"), 403), (errors.FailedPrecondition("busy"), 409),
    (TimeoutError(), 504), (RuntimeError("a bug"), 500),
])
def test_one_function_maps_errors_to_statuses(exc, status):
    error = http_error(exc)
    assert error.status == status
    if status in (429, 503):  # always with when to retry: the error's own time, rounded up, or 1 s
        assert error.headers() == {"Retry-After": str(math.ceil(getattr(exc, "retry_after_s", None) or 1))}
    else:
        assert error.headers() == {}


# ------------------------------------------------------------------ cancellation, TLS, chat templates


def test_a_client_gone_mid_stream_frees_its_session_in_the_services(stack):
    """A named session's turn: finished, the services would keep the session
    (for its next turn); cut short by the client, the turn ends it in both."""
    hosts = {role: service.host.sessions for role, service in stack["services"].items()}
    before = {role: len(sessions) for role, sessions in hosts.items()}
    stream = sdk(stack["main"]).completions.create(
        model="target", prompt=PROMPT, max_tokens=480, temperature=0, stream=True,
        extra_body={"session_id": "cut-short", "gamma_policy": "static:1"})
    chunks = iter(stream)
    assert [next(chunks).choices[0].finish_reason for _ in range(2)] == [None, None]
    stream.close()
    admission = stack["main"].servicer.streams.admission
    deadline = time.monotonic() + 20
    while {role: len(sessions) for role, sessions in hosts.items()} != before or admission.streams:
        assert time.monotonic() < deadline, "the cut turn's sessions were not freed"
        time.sleep(0.05)
    with grpc_client(stack["main"]) as alice:
        alice.close_session("cut-short")


def test_a_drain_ends_an_http_stream_with_its_reason_as_grpc_streams_end(stack):
    draining = stack["coordinator"]()
    stack["started"].remove(draining)  # stopped here
    stream = sdk(draining).completions.create(model="target", prompt=PROMPT, max_tokens=480, temperature=0,
                                              stream=True, extra_body={"gamma_policy": "static:1"})
    chunks = iter(stream)
    next(chunks)
    stopping = threading.Thread(target=lambda: stack["loop"].call(draining.stop(0.6)))
    stopping.start()
    try:
        with pytest.raises(openai.APIError, match="shutting down and its drain grace"):
            for _ in chunks:
                pass
    finally:
        stopping.join(30)


def test_tls_with_the_sdk_given_the_ca_and_a_chat_template_file(stack, models, tmp_path):
    ca = CA(tmp_path / "pki")
    cert, key = ca.issue("coordinator", dns=["localhost"], ips=["127.0.0.1"])
    secure = stack["coordinator"](tls_cert=cert, tls_key=key, tokenizer=str(models["plain"]),
                                  chat_template=str(models["other"]))
    trusted = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca.path))
    client = sdk(secure, http_client=trusted)
    chat = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, **GREEDY)
    plain = client.completions.create(model="target", prompt="[hi]>", max_tokens=8, **GREEDY)
    assert chat.choices[0].message.content == plain.choices[0].text  # the file's template, not the tokenizer's
    with pytest.raises(openai.APIConnectionError):  # a client that does not trust the CA
        sdk(secure, http_client=openai.DefaultHttpxClient()).models.list()


def test_mutual_tls_closes_a_connection_whose_certificate_names_another_identity(stack, tmp_path):
    ca = CA(tmp_path / "pki")
    cert, key = ca.issue("coordinator", dns=["localhost"], ips=["127.0.0.1"])
    secure = stack["coordinator"](tls_cert=cert, tls_key=key, tls_ca=ca.path,
                                  tls_peer_identity="spiffe://specdec.test/gateway")

    def presenting(identity: str) -> openai.OpenAI:
        context = ssl.create_default_context(cafile=ca.path)
        context.load_cert_chain(*ca.issue(identity.rsplit("/", 1)[-1], uris=[identity]))
        return sdk(secure, http_client=openai.DefaultHttpxClient(verify=context))

    assert presenting("spiffe://specdec.test/gateway").models.list().data[0].id == "target"
    with pytest.raises(openai.APIConnectionError):
        presenting("spiffe://specdec.test/intruder").models.list()


def test_a_tokenizer_without_a_chat_template_says_how_to_give_one(stack, models):
    bare = stack["coordinator"](tokenizer=str(models["plain"]), served_model_name="tiny-pair")
    assert [m.id for m in sdk(bare).models.list().data] == ["tiny-pair"]  # --served-model-name
    with pytest.raises(openai.NotFoundError):
        sdk(bare).completions.create(model="target", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        sdk(bare).chat.completions.create(model="tiny-pair", messages=[{"role": "user", "content": "hi"}])
    assert "--chat-template" in error_of(exc.value)["message"] and error_of(exc.value)["param"] == "messages"


def test_named_chat_templates_render_with_the_default_and_other_failures_are_the_servers(stack, models):
    """A tokenizer with named templates (transformers: a dict) renders with its
    ``default``; only a template's own refusal is the request's 400."""
    from specdec.coordinator.chat import ChatTemplate

    named = stack["coordinator"](tokenizer=str(models["named"]))
    client = sdk(named)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="target", messages=messages, max_tokens=8, **GREEDY)
    plain = client.completions.create(model="target", prompt="<user>hi\n<assistant>", max_tokens=8, **GREEDY)
    assert chat.choices[0].message.content == plain.choices[0].text

    class Tokenizer:  # a renderer failing for its own reasons
        chat_template = TEMPLATE

        def __init__(self, failure):
            self.failure = failure

        def apply_chat_template(self, *args, **kwargs):
            raise self.failure

    with pytest.raises(RuntimeError):  # not the request's fault: no 400 blaming it
        ChatTemplate().render(Tokenizer(RuntimeError("the renderer broke")), messages)
    with pytest.raises(errors.InvalidRequest, match="could not render these messages: roles must alternate"):
        import jinja2

        ChatTemplate().render(Tokenizer(jinja2.TemplateError("roles must alternate")), messages)
    nameless = Tokenizer(None)
    nameless.chat_template = {"tool_use": TEMPLATE}
    with pytest.raises(errors.InvalidRequest, match="no chat template named 'default'.*--chat-template"):
        ChatTemplate().render(nameless, messages)


def test_a_busy_http_port_fails_start_up_with_one_line(stack, models):
    from specdec.coordinator.server import start_coordinator

    port = stack["main"].http_port
    config = CoordinatorConfig(draft="127.0.0.1:1", target="127.0.0.1:2", host="127.0.0.1", port=0, http_port=port,
                               tokenizer=str(models["plain"]))
    with pytest.raises(OSError, match=rf"cannot serve the HTTP API on 127.0.0.1:{port} \(--http-port\): the port is "
                                      "in use"):
        stack["loop"].call(start_coordinator(config))


# ------------------------------------------------------------------ observability


def test_requests_are_counted_by_route_and_status_and_traced_with_the_turn_under_them(stack, provider):
    main = stack["main"]
    sdk(main).completions.create(model="target", prompt=PROMPT, max_tokens=4, temperature=0,
                                 extra_body={"session_id": "traced-session"})
    with pytest.raises(openai.NotFoundError):
        sdk(main).completions.create(model="nope", prompt="x", max_tokens=2)
    registry = stack["metrics"].registry
    count = registry.get_sample_value("specdec_http_requests_total",
                                      {"route": "/v1/completions", "method": "POST", "status": "200"})
    assert count and count >= 1
    assert registry.get_sample_value("specdec_http_requests_total",
                                     {"route": "/v1/completions", "method": "POST", "status": "404"}) >= 1
    assert registry.get_sample_value("specdec_http_server_duration_seconds_count",
                                     {"route": "/v1/completions", "status": "200"}) >= 1
    spans = provider.memory.get_finished_spans()
    server = [s for s in spans if s.name == "POST /v1/completions"]
    assert len(server) == 2 and {s.attributes["http.response.status_code"] for s in server} == {200, 404}
    ok = next(s for s in server if s.attributes["http.response.status_code"] == 200)
    under = [s for s in spans if s.parent is not None and s.parent.span_id == ok.context.span_id]
    assert under and all(s.context.trace_id == ok.context.trace_id for s in under)
    shown = json.dumps([dict(s.attributes) for s in server])
    assert PROMPT not in shown and "traced-session" not in shown
    with grpc_client(main) as alice:
        alice.close_session("traced-session")


def test_a_tls_file_the_http_port_cannot_load_stops_the_grpc_server_too(stack, models, tmp_path, monkeypatch):
    """uvicorn loads the TLS files as the HTTP server starts, after the gRPC
    server started: a CA bundle with a corrupt entry (which gRPC skips, and
    Python's ssl refuses) fails start-up, with the gRPC server stopped, both
    ports free and the engine closed."""
    from specdec.coordinator.engine import Coordinator
    from specdec.coordinator.server import start_coordinator

    ca = CA(tmp_path / "pki")
    cert, key = ca.issue("coordinator", dns=["localhost"], ips=["127.0.0.1"])
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(pathlib.Path(ca.path).read_bytes() + b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n"
                       b"-----END CERTIFICATE-----\n")
    closed = []
    close = Coordinator.close

    async def closing(engine):
        closed.append(engine)
        await close(engine)

    monkeypatch.setattr(Coordinator, "close", closing)
    grpc_port, http_port = free_port(), free_port()
    config = CoordinatorConfig(draft=f"127.0.0.1:{stack['services']['draft'].port}",
                               target=f"127.0.0.1:{stack['services']['target'].port}", host="127.0.0.1",
                               port=grpc_port, http_port=http_port, tls_cert=cert, tls_key=key, tls_ca=str(bundle))
    with pytest.raises(OSError, match=rf"cannot serve the HTTP API on 127.0.0.1:{http_port} with --tls-cert"):
        stack["loop"].call(start_coordinator(config))
    assert len(closed) == 1
    for port in (grpc_port, http_port):  # nothing listens on either
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_metric_labels_and_span_names_stay_bounded_whatever_the_client_sends(stack, provider):
    """A method of the client's own (h11 takes any token), even refused 401,
    is ``_OTHER``; a path not one of the API's routes is ``unmatched``."""
    main = stack["main"]
    for method in ("BREW", "X-JUNK-1", "X-JUNK-2"):
        status, _, _ = raw(main, "/v1/models", method=method, token=None)
        assert status == 401
    status, _, _ = raw(main, "/v1/no-such-route-12345", method="GET")
    assert status == 404
    registry = stack["metrics"].registry

    def counted(labels: dict, at_least: int) -> bool:  # (counted as the response ends: just after the client has it)
        deadline = time.monotonic() + 10
        while (registry.get_sample_value("specdec_http_requests_total", labels) or 0) < at_least:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    assert counted({"route": "/v1/models", "method": "_OTHER", "status": "401"}, 3)
    assert counted({"route": "unmatched", "method": "GET", "status": "404"}, 1)
    labels = [sample.labels for family in registry.collect() if family.name.startswith("specdec_http")
              for sample in family.samples]
    assert {label.get("method") for label in labels} <= {None, "GET", "POST", "HEAD", "OPTIONS", "_OTHER"}
    assert {label.get("route") for label in labels} <= {None, "/v1/completions", "/v1/chat/completions",
                                                        "/v1/models", "/health", "unmatched"}
    spans = [s for s in provider.memory.get_finished_spans() if s.kind.name == "SERVER"]
    assert {s.name for s in spans} == {"HTTP /v1/models", "GET unmatched"}
    assert {s.attributes["http.request.method"] for s in spans} == {"_OTHER", "GET"}

