"""``specdec demo`` end to end: it starts the three services as processes (on
free loopback ports), streams a completion, measures target-only decoding through
the same services, prints the summary and stops everything."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import time

import pytest

from specdec.cli import main

from tiny_models import add_byte_tokenizer, add_chat_template, make_noisy_copy, make_tiny_llama

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-models")
    target = add_byte_tokenizer(make_tiny_llama(root / "target", vocab_size=260, layers=2, max_positions=256,
                                                seed=3, logit_scale=4.0))
    add_chat_template(target, TEMPLATE)  # for the HTTP API's chat completions
    draft = add_byte_tokenizer(make_noisy_copy(target, root / "draft", noise=0.05, seed=4))
    return target, draft


def test_demo_streams_a_completion_and_reports_the_speedup(pair, capfd):
    from specdec.serving.server import free_port

    target, draft = pair
    http_port = free_port()
    assert main(["demo", "--target-model", str(target), "--draft-model", str(draft),
                 "--max-new-tokens", "32", "--prompt", "def main():\n", "--http-port", str(http_port)]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("def main():\n") and len(out) > len("def main():\n")
    for line in ("serving: coordinator 127.0.0.1:", f"OpenAI-compatible HTTP API http://127.0.0.1:{http_port}/v1",
                 "acceptance ", "gamma         adaptive: mean",
                 "speculative ", "target only ", "speedup ", "same output as target-only decoding: yes"):
        assert line in err, err


def test_demo_without_models_says_what_to_do(tmp_path, capsys):
    assert main(["demo", "--target-model", str(tmp_path), "--draft-model", str(tmp_path)]) == 2
    assert "is not a model directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--http-port", "50051"], "--http-port 50051: the HTTP API needs a port of its own"),
    (["--http-port", "70000"], "--http-port 70000: give a port in [1, 65535], or 0 for no HTTP API"),
    (["--http-port", "9466", "--metrics-port", "9464"], "/metrics ports [9464, 9465, 9466] overlap"),
])
def test_serve_checks_its_ports_first(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_serve_defaults_to_port_8000_other_stacks_to_no_http_api(monkeypatch):
    """Its services take free ports and stop when it ends: 8000, which
    ``specdec serve`` may hold, stays alone."""
    from specdec.cli import build_parser, serve

    started = []
    monkeypatch.setattr(serve.subprocess, "Popen", lambda argv, **kw: started.append(argv))
    assert build_parser(only="demo").parse_args(["demo"]).http_port == 0
    assert build_parser(only="serve").parse_args(["serve"]).http_port == 8000
    ports = {"coordinator": 1, "draft": 2, "target": 3}
    for given, flag in ((None, "0"), (8123, "8123")):
        serve.Stack(target="t", draft="d", ports=ports, devices={"draft": "cpu", "target": "cpu"},
                    **({"http_port": given} if given else {}))
        argv = started[-1]
        assert argv[argv.index("--http-port") + 1] == flag, argv


def three_free_ports() -> int:
    """PORT such that PORT, PORT+1 and PORT+2 were free a moment ago."""
    import socket

    from specdec.serving.server import free_port

    for _ in range(100):
        base = free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("0.0.0.0", base + 1))
                b.bind(("0.0.0.0", base + 2))
                return base
        except OSError:
            continue
    raise RuntimeError("no three consecutive free ports")


def test_serve_runs_three_services_and_stops_them_on_sigterm(pair, tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from specdec.serving import errors
    from specdec.serving.client import Client
    from specdec.serving.server import free_port

    target, draft = pair
    ports = [free_port() for _ in range(4)]  # coordinator, draft, target, HTTP API
    metrics = three_free_ports()
    trace_file = tmp_path / "spans.jsonl"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--target-model", str(target), "--draft-model", str(draft),
         "--coordinator-port", str(ports[0]), "--draft-port", str(ports[1]), "--target-port", str(ports[2]),
         "--http-port", str(ports[3]), "--metrics-port", str(metrics), "--trace-file", str(trace_file)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        # Wait for serve's own banner (it prints it once all three health checks
        # pass); a SIGTERM before then is "stop before started", a different path.
        deadline = time.monotonic() + 180
        while "specdec serve: coordinator on" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, "serve exited early"
            assert time.monotonic() < deadline, "serve did not print its banner"
            time.sleep(0.1)
        with Client(f"127.0.0.1:{ports[0]}", timeout=30) as client:
            client.wait_ready(timeout=120)
            out = client.complete(prompt_ids=[100, 101], max_new_tokens=8)
            assert out.stats.generated_tokens == 8
        # --metrics-port PORT: coordinator on PORT, draft PORT+1, target PORT+2.
        for offset, sample in ((0, "specdec_generated_tokens_total 8.0"),
                               (1, 'specdec_rpc_server_duration_seconds_count{method="ProposeAll",service="draft"}'),
                               (2, 'specdec_rpc_server_duration_seconds_count{method="Verify",service="target"}')):
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics + offset}/metrics", timeout=10) as r:
                assert sample in r.read().decode()
        assert_curl_streams_chunks_as_rounds_commit(f"http://127.0.0.1:{ports[3]}/v1")
        # A service that dies is started again; the others go on.
        children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
        (target_pid,) = [int(p) for p in children if b"target-service" in open(f"/proc/{p}/cmdline", "rb").read()]
        os.kill(target_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        with Client(f"127.0.0.1:{ports[0]}", timeout=30) as client:
            while True:
                try:
                    assert client.complete(prompt_ids=[100, 101], max_new_tokens=8).token_ids == out.token_ids
                    break
                except errors.Unavailable:
                    assert time.monotonic() < deadline, "the target was not started again"
                    time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    except BaseException:
        print("serve log:\n" + (tmp_path / "serve.log").read_text())  # shown by pytest on failure
        raise
    finally:
        if proc.poll() is None:  # a failure: SIGTERM first, so serve stops its services (own sessions) too
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = (tmp_path / "serve.log").read_text()
    assert (f"specdec serve: coordinator on 127.0.0.1:{ports[0]} (gRPC), OpenAI-compatible HTTP API on "
            f"http://127.0.0.1:{ports[3]}/v1; draft ") in text
    services = {json.loads(line)["service"] for line in trace_file.read_text().splitlines()}
    assert services == {"specdec-coordinator", "specdec-draft", "specdec-target"}  # flushed at exit
    assert text.count("exited cleanly") == 3  # coordinator, draft and target all drained
    assert "the target service exited with status -9; starting it again in 1 s" in text
    assert "starting the target service again (restart 1)" in text
    assert text.count("objects alive after start-up frozen") == 4  # (the target twice) full collections skip them
    assert text.index("coordinator exited cleanly") < text.index("draft service exited cleanly")


def curl_stream(url: str, body: dict) -> tuple[float, list[tuple[float, dict | str]]]:
    """``curl -N`` (no buffering) POSTing ``body``: when it started, and each
    server-sent event's data (JSON, or ``[DONE]``) with when its line came out.
    Without curl on this machine, http.client reads the lines as they come."""
    started, events = time.monotonic(), []
    for line in _post_lines(url, json.dumps(body)):
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            events.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
    return started, events


def _post_lines(url: str, body: str):
    curl = shutil.which("curl")
    if curl is None:
        import http.client
        import urllib.parse

        where = urllib.parse.urlsplit(url)
        connection = http.client.HTTPConnection(where.netloc, timeout=30)
        connection.request("POST", where.path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200, response.read()
        yield from response  # line by line, each as soon as it is complete
        return
    proc = subprocess.Popen([curl, "-sS", "-N", "--fail-with-body", url, "-H", "Content-Type: application/json",
                             "-d", body], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield from proc.stdout  # each line as curl writes it
    assert proc.wait(30) == 0, proc.stderr.read().decode()


def assert_curl_streams_chunks_as_rounds_commit(base_url: str) -> None:
    """A streamed chat completion through ``curl -N``: a chunk per round as it
    commits, so the first arrives long before the stream ends (a buffered
    response would bring them all at once, at the end)."""
    body = {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 96, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "gamma_policy": "static:1"}
    started, events = curl_stream(f"{base_url}/chat/completions", body)
    times, data = [t for t, _ in events], [d for _, d in events]
    assert data[-1] == "[DONE]" and data[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = data[-2]
    assert usage["usage"]["completion_tokens"] == 96 and data[-3]["choices"][0]["finish_reason"] == "length"
    rounds = usage["metrics"]["speculative_decoding"]["rounds"]
    content = [d for d in data[:-2] if d["choices"] and d["choices"][0]["delta"].get("content")]
    assert rounds >= 48 and len(content) >= rounds // 2, (rounds, len(content))  # (a round may end mid-character)
    first, end = times[0], times[-1]
    assert end - first > 0.3 * (end - started), f"chunks at {[round(t - started, 3) for t in times]}"
    apart = sum(1 for a, b in itertools.pairwise(times) if b - a > 0.0005)  # each round takes a few ms
    assert apart >= len(content) // 3, f"the chunks came in a few bursts: {[round(t - started, 4) for t in times]}"


@pytest.mark.parametrize("argv, message", [
    (["--local", "--device", "cuda:7", "x"], "device cuda:7: "),
    (["--local", "--device", "tpu9", "x"], "device 'tpu9' is not a torch device"),
    (["--local", "--device", "fpga", "x"], "device fpga: fpga is not available here"),
    (["--local", "--device", "ipu", "x"], "device ipu: ipu is not available here"),
    (["--coordinator", "127.0.0.1:1", "--gamma", "0", "x"], "--gamma: only with --local"),
    (["--coordinator", "127.0.0.1:1", "--draft", "d", "--device", "cpu", "x"], "--draft, --device: only with --local"),
    (["--local", "--gamma-policy", "heuristic", "--session", "s", "x"],
     "--session, --gamma-policy: only with --coordinator"),
    (["--local", "--prompt-ids", "1,2", "x"], "give a PROMPT or --prompt-ids, not both"),
    (["--coordinator", "127.0.0.1:1", "--max-new-tokens", "0", "x"], "--max-new-tokens must be >= 1, got 0"),
    (["--local", "--prompt-ids", "1,,2"], "--prompt-ids must be comma-separated integers, got '1,,2'"),
    (["--coordinator", "127.0.0.1:1", "--seed", "-5", "x"], "--seed must be >= 0, got -5"),
    (["--coordinator", "127.0.0.1:1", "--prompt-ids", "99999999999"], "--prompt-ids: 99999999999 is not a token id"),
])
def test_generate_flags_say_what_is_wrong(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    assert f"specdec generate: error: {message}" in capsys.readouterr().err


def test_client_names_a_field_out_of_range_before_calling():
    from specdec.serving import errors
    from specdec.serving.client import Client

    with Client("127.0.0.1:1") as client:  # nothing listens: the checks come first
        for kwargs, words in ((dict(top_k=-1), "top_k must be in [0, 4294967295], got -1"),
                              (dict(seed=2**64), "seed must be in [0, 18446744073709551615]"),
                              (dict(prompt_ids=[1, 2**31]), "prompt_ids[1] = 2147483648 is not a token id")):
            kwargs.setdefault("prompt_ids", [1])
            with pytest.raises(errors.InvalidRequest, match=words.replace("[", r"\[").replace("]", r"\]")):
                next(client.generate(**kwargs))
    request = {}

    class Call(list):  # an empty stream
        def cancel(self):
            pass

    class Stub:  # what reaches the wire
        def Generate(self, req, timeout=None, metadata=()):
            request["ids"] = list(req.prompt_ids)
            return Call()

    with Client("127.0.0.1:1") as client:
        client._stubs[0] = Stub()
        list(client.generate(prompt_ids=iter([5, 6, 7])))  # an iterator is read once
    assert request["ids"] == [5, 6, 7]


def test_an_unknown_flag_shows_the_sub_command_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--bogus", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: specdec generate") and "unrecognized arguments: --bogus" in err


def test_help_and_light_commands_start_without_torch():
    """`specdec --help`, `specdec netem`, every service's flags, the Python
    client and `specdec generate --coordinator` load neither torch nor
    transformers (seconds of start-up and ~190 MB on a small machine):
    `import specdec` is lazy, the CLI imports only the command it runs, and
    serving.convert imports torch-bearing types where they are used."""
    probe = (
        "import sys, contextlib, io, socket\n"
        "import specdec\n"
        "from specdec.cli import main\n"
        "for argv in (['--help'], ['netem', '--help'], ['coordinator', '--help'], ['draft-service', '--help'],\n"
        "             ['target-service', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
        "specdec.Client\n"
        "with socket.socket() as s:  # a port nothing listens on: the call fails UNAVAILABLE\n"
        "    s.bind(('127.0.0.1', 0))\n"
        "    port = s.getsockname()[1]\n"
        "with contextlib.redirect_stderr(io.StringIO()):\n"
        "    assert main(['generate', '--coordinator', f'127.0.0.1:{port}', 'x']) == 1\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "[]"]
    # The lazy names still resolve to the real objects.
    import specdec
    from specdec.models.decoder import SpeculativeDecoder

    assert specdec.SpeculativeDecoder is SpeculativeDecoder and "SpeculativeDecoder" in dir(specdec)


def test_a_model_service_refuses_a_model_it_cannot_serve_at_start_up(tmp_path):
    """A state-space model: the service exits 1 at start-up, its log naming
    the architecture and why, before any request could get an INTERNAL."""
    from transformers import MambaConfig, MambaForCausalLM

    MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=1)
                     ).save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "target-service", "--model", str(tmp_path),
                          "--host", "127.0.0.1", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "MambaForCausalLM (model_type 'mamba') cannot be served: it has state-space" in out.stderr
