"""The services' settings, each declared once in specdec/serving/config.py: the
flags, environment variables, validation messages and docs/settings.md's tables derived
from the declarations, and ``specdec serve`` starting its services from them."""

from __future__ import annotations

import argparse
import os

import pytest

from specdec.cli import main
from specdec.serving.config import (
    CONFIG_CLASSES,
    DOCS_COMMAND,
    SETTINGS_DOC,
    CoordinatorConfig,
    DraftConfig,
    TargetConfig,
    add_flags,
    command_line,
    flag_name,
    with_flag_tables,
)


@pytest.fixture(autouse=True)
def no_specdec_environment(monkeypatch):
    """Only the variables a test sets."""
    for name in list(os.environ):
        if name.startswith("SPECDEC_"):
            monkeypatch.delenv(name)


def parse(cls, argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    return vars(parser.parse_args(argv))


def test_flag_then_role_variable_then_generic_variable_then_default(monkeypatch):
    for name, value in {"SPECDEC_DRAFT_PORT": "6000", "SPECDEC_MAX_SESSIONS": "7", "SPECDEC_TARGET_MAX_SESSIONS": "9",
                        "SPECDEC_PORT": "1234",  # a generic port would clash between services: ignored
                        "SPECDEC_TRACE_FILE": "spans.jsonl", "SPECDEC_METRICS_PORT": "9000",  # role-only: ignored
                        "SPECDEC_DRAFT_DRAFT_AHEAD": "off", "SPECDEC_COORDINATOR_CALL_TIMEOUT_S": "5"}.items():
        monkeypatch.setenv(name, value)
    draft = DraftConfig.load()
    assert (draft.port, draft.max_sessions, draft.trace_file, draft.metrics_port, draft.draft_ahead) == \
        (6000, 7, "spans.jsonl", 0, False)
    target = TargetConfig.load()
    assert (target.role, target.port, target.max_sessions, target.address) == ("target", 50053, 9, "0.0.0.0:50053")
    assert CoordinatorConfig.load().call_timeout_s == 5.0
    flagged = DraftConfig.load(parse(DraftConfig, ["--port", "7000", "--draft-ahead", "--session-ttl", "3"]))
    assert (flagged.port, flagged.max_sessions, flagged.draft_ahead, flagged.session_ttl_s) == (7000, 7, True, 3.0)
    monkeypatch.setenv("SPECDEC_DRAFT_METRICS_PORT", "9464")
    monkeypatch.setenv("SPECDEC_MAX_CACHED_TOKENS", "")  # empty: not set
    draft = DraftConfig.load()
    assert (draft.metrics_port, draft.max_cached_tokens) == (9464, 1_000_000)


def test_a_flag_overrides_a_bad_variable(monkeypatch):
    monkeypatch.setenv("SPECDEC_MAX_SESSIONS", "abc")
    assert TargetConfig.load({"max_sessions": 5}).max_sessions == 5


@pytest.mark.parametrize("cls, flags, env, message", [
    (TargetConfig, {}, {"SPECDEC_TARGET_MAX_SESSIONS": "abc"},
     "environment variable SPECDEC_TARGET_MAX_SESSIONS='abc' is not a valid int (it sets --max-sessions)"),
    (TargetConfig, {}, {"SPECDEC_MAX_SESSIONS": "0"},
     "environment variable SPECDEC_MAX_SESSIONS='0' must be > 0 (it sets --max-sessions)"),
    (DraftConfig, {}, {"SPECDEC_DRAFT_DRAFT_AHEAD": "maybe"},
     "environment variable SPECDEC_DRAFT_DRAFT_AHEAD='maybe' is not a valid bool (it sets --draft-ahead)"),
    (DraftConfig, {}, {"SPECDEC_DRAFT_METRICS_PORT": "x"},
     "environment variable SPECDEC_DRAFT_METRICS_PORT='x' is not a valid int (it sets --metrics-port)"),
    (DraftConfig, {"max_sessions": 0}, {}, "--max-sessions must be > 0, got 0"),
    (CoordinatorConfig, {"call_timeout_s": 0.0}, {}, "--call-timeout must be > 0, got 0.0"),
    (CoordinatorConfig, {"port": 70000}, {}, "--port must be <= 65535, got 70000"),
    (TargetConfig, {"dtype": "int8"}, {}, "--dtype must be 'float32', 'bfloat16' or 'float16', got 'int8'"),
    (CoordinatorConfig, {"draft": "localhost"}, {},
     "--draft must be HOST:PORT, a comma-separated list of them, or a gRPC target such as unix:PATH or "
     "dns:///NAME:PORT, got 'localhost'"),
    (CoordinatorConfig, {"target": "t1:50053,t2"}, {},
     "--target must be HOST:PORT, a comma-separated list of them, or a gRPC target such as unix:PATH or "
     "dns:///NAME:PORT ('t2' is not), got 't1:50053,t2'"),
    (CoordinatorConfig, {}, {"SPECDEC_DEFAULT_GAMMA_POLICY": "fast"},
     "environment variable SPECDEC_DEFAULT_GAMMA_POLICY='fast' must be static:N, heuristic or adaptive "
     "(it sets --gamma-policy)"),
    (CoordinatorConfig, {"default_gamma_policy": "static:9", "gamma_max": 8}, {},
     "--gamma-policy static:9 asks for more than --gamma-max 8"),
    (TargetConfig, {"health_port": 9464, "metrics_port": 9464}, {},
     "--metrics-port and --health-port are both 9464: the health port must be a port of its own"),
])
def test_a_bad_value_is_a_value_error_naming_the_flag_or_variable(monkeypatch, cls, flags, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        cls.load(flags)
    assert str(e.value) == message


def test_the_command_line_says_what_is_wrong_and_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_TARGET_MAX_SESSIONS", "0")
    assert main(["target-service"]) == 2
    assert capsys.readouterr().err == ("specdec target-service: error: environment variable "
                                       "SPECDEC_TARGET_MAX_SESSIONS='0' must be > 0 (it sets --max-sessions)\n")


@pytest.mark.parametrize("command, cls", [("draft-service", DraftConfig), ("target-service", TargetConfig),
                                          ("coordinator", CoordinatorConfig)])
def test_help_lists_every_setting_with_its_variables_and_default(command, cls, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in cls.model_fields:
        assert flag_name(cls, name) in text
    assert "--max-sessions MAX_SESSIONS" in text and "SPECDEC_MAX_SESSIONS" in text
    if cls is CoordinatorConfig:
        assert "[env SPECDEC_COORDINATOR_DRAFT; default localhost:50052]" in text
        assert "[env SPECDEC_COORDINATOR_CALL_TIMEOUT_S or SPECDEC_CALL_TIMEOUT_S; default 60]" in text
    else:
        role = cls.role.upper()
        assert f"[env SPECDEC_{role}_MAX_SESSIONS or SPECDEC_MAX_SESSIONS; default 256]" in text
        assert f"[env SPECDEC_{role}_METRICS_PORT; default 0]" in text
        assert f"[env SPECDEC_{role}_TRACE_FILE or SPECDEC_TRACE_FILE]" in text
        assert ("--no-draft-ahead" in text) == (cls is DraftConfig)
        if cls is not CoordinatorConfig:
            assert "--no-lean-forward" in text and "--max-batch N" in text and "--max-batch-tokens N" in text


def test_command_line_gives_the_values_back():
    values = dict(model="m", device="cuda:1", port=0, draft_ahead=False, session_ttl_s=5.0, trace_file=None)
    argv = command_line(DraftConfig, **values)
    assert "--trace-file" not in argv and "--no-draft-ahead" in argv
    config = DraftConfig.load(parse(DraftConfig, argv))
    assert {name: getattr(config, name) for name in values} == values


def test_the_settings_page_flag_tables_match_the_declarations():
    text = SETTINGS_DOC.read_text(encoding="utf-8")
    for role in CONFIG_CLASSES:
        assert f"<!-- BEGIN flags {role} -->" in text and f"<!-- END flags {role} -->" in text
    assert with_flag_tables(text) == text, \
        f"docs/settings.md's flag tables differ from specdec/serving/config.py: run `{DOCS_COMMAND}`"


def test_serve_without_a_tokenizer_serves_prompt_ids(tiny_pair, monkeypatch):
    """Models that ship no tokenizer: the coordinator ``specdec serve`` would
    start asks the target for its tokenizer, finds none, and takes prompt_ids."""
    import subprocess

    from specdec.cli import serve
    from specdec.coordinator.server import add_arguments, start_coordinator
    from specdec.serving import errors
    from specdec.serving.client import Client

    from service_harness import LoopThread, start_service

    target, draft, _ = tiny_pair
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kw: started.append(argv))
    loop = LoopThread()
    services = {role: start_service(loop, role, model) for role, model in (("draft", draft), ("target", target))}
    coordinator = None
    try:
        ports = {"coordinator": 0, **{role: service.port for role, service in services.items()}}
        serve.Stack(target=target, draft=draft, ports=ports, devices={"draft": "cpu", "target": "cpu"})
        argv = started[-1][started[-1].index("coordinator") + 1:]
        assert "--tokenizer" not in argv  # the target's own, fetched from it
        assert argv[argv.index("--http-port") + 1] == "0"  # no HTTP API unless asked (serve asks for 8000)
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        coordinator = loop.call(start_coordinator(CoordinatorConfig.load(vars(parser.parse_args(argv)))))
        assert coordinator.http is None
        with Client(f"127.0.0.1:{coordinator.port}", timeout=30) as client:
            out = client.complete(prompt_ids=[1, 2, 3], max_new_tokens=8)
            assert out.stats.generated_tokens == 8 and len(out.token_ids) == 8
            with pytest.raises(errors.InvalidRequest, match="no tokenizer"):
                client.complete("some text", max_new_tokens=8)
    finally:
        if coordinator is not None:
            loop.call(coordinator.stop())
        for service in services.values():
            loop.call(service.stop())
        loop.close()
