"""Every setting of the three services, each declared once, as a field of the
service's config class below: name, type, default, bounds and help
(``description``). From the declarations come

* the command-line flags (:func:`add_flags`): ``--`` and the field name with
  dashes, or the ``"flag"`` in the field's ``json_schema_extra``;
* the environment variables (:func:`env_names`): ``SPECDEC_<ROLE>_<FIELD>``,
  then ``SPECDEC_<FIELD>``. Settings that must differ between services running
  side by side (``"role_only"``: ports, models, devices, addresses) are read
  only with the role's prefix;
* validation, with messages naming the flag or the variable (:meth:`BaseServiceConfig.load`);
* the flag tables of docs/settings.md (:func:`flag_table`): ``python -m specdec.serving.config --docs``
  rewrites them.

Precedence, highest first: command-line flag > environment variable > default.

    add_flags(parser, DraftConfig)            # every flag defaults to None: absent
    config = DraftConfig.load(vars(parser.parse_args()))
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import types
import typing
import urllib.parse
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from specdec.core.gamma import parse_gamma_policy, parse_gamma_spec
from specdec.core.interfaces import DEFAULT_DRAFT_TOP_K
from specdec.serving.auth import parse_tokens
from specdec.serving.tls import ServerTls, accepted_identities, check_settings

MiB = 1 << 20
ROLE_ONLY = {"role_only": True}
PORT_HELP = "port to listen on (0: any free port)"


class RoleEnvSource(EnvSettingsSource):
    """Each field from the first of its :func:`env_names` that is set (and not empty)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        for name in env_names(self.settings_cls, field_name):
            if name in self.env_vars:
                return self.env_vars[name], name, False
        return None, field_name, False


class BaseServiceConfig(BaseSettings):
    """What every service has. A subclass names its ``role`` and adds its own settings."""

    model_config = SettingsConfigDict(case_sensitive=True, env_ignore_empty=True)
    role: ClassVar[str]

    host: str = Field("0.0.0.0", description="address to listen on")
    max_message_bytes: int = Field(64 * MiB, gt=0, description="gRPC message size limit: larger requests are "
                                   "refused before they are read (a Verify with dense q carries vocabulary × γ "
                                   "× 4 bytes)")
    drain_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM, seconds the generations in flight may take to finish",
        json_schema_extra={"flag": "--drain-grace", "metavar": "SECONDS"})
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="logging level")
    trace_file: str | None = Field(
        None, description="append every span as a JSON line to PATH (read by `specdec trace-report`); "
        "OTLP export is configured by the standard OTEL_* variables", json_schema_extra={"metavar": "PATH"})
    metrics_port: int = Field(
        0, ge=0, le=65535, description="serve Prometheus metrics on http://HOST:PORT/metrics (0: off)",
        json_schema_extra={"metavar": "PORT", **ROLE_ONLY})
    health_port: int = Field(
        0, ge=0, le=65535, description="also answer gRPC health checks, and only those, in plaintext on this "
        "port: for probes that cannot speak TLS, such as the kubelet's (0: off)",
        json_schema_extra={"metavar": "PORT", **ROLE_ONLY})
    reflection: bool = Field(True, description="serve gRPC server reflection (grpcurl can list and call the "
                             "services); --no-reflection hides the schema")
    tls_cert: str = Field("", description="serve TLS with this certificate (PEM; with --tls-key); re-read when "
                          "the file changes", json_schema_extra={"metavar": "FILE"})
    tls_key: str = Field("", description="the private key of --tls-cert (PEM)", json_schema_extra={"metavar": "FILE"})
    tls_ca: str = Field("", description="mutual TLS: clients must present a certificate signed by this CA (PEM)",
                        json_schema_extra={"metavar": "FILE"})
    tls_peer_identity: str = Field(
        "", description="with --tls-ca: accept only clients whose certificate names one of these identities "
        "(comma-separated), each matched against the certificate's subject alternative names of its type only: "
        "a URI against URI SANs (e.g. spiffe://cluster/ns/specdec/sa/coordinator), a DNS name against DNS SANs. "
        "A uri: or dns: prefix gives the type; without one, an identity with a scheme (spiffe://, https://) is a "
        "URI, any other a DNS name", json_schema_extra={"metavar": "IDS"})

    @field_validator("tls_peer_identity")
    @classmethod
    def _typed_identities(cls, value: str) -> str:
        accepted_identities(value)
        return value

    @model_validator(mode="after")
    def _tls_complete(self):
        check_settings({"--tls-cert": self.tls_cert, "--tls-key": self.tls_key, "--tls-ca": self.tls_ca,
                     "--tls-peer-identity": self.tls_peer_identity},
                    {"--tls-cert": ("--tls-key",), "--tls-key": ("--tls-cert",), "--tls-ca": ("--tls-cert",),
                     "--tls-peer-identity": ("--tls-ca",)}, names=("--tls-peer-identity",))
        return self

    @model_validator(mode="after")
    def _ports_distinct(self):
        ports = {"--port": getattr(self, "port", 0), "--metrics-port": self.metrics_port,
                 "--health-port": self.health_port}
        if self.health_port and list(ports.values()).count(self.health_port) > 1:
            clash = " and ".join(flag for flag, port in ports.items() if port == self.health_port)
            raise ValueError(f"{clash} are both {self.health_port}: the health port must be a port of its own")
        return self

    @property
    def server_tls(self) -> ServerTls | None:
        return ServerTls(self.tls_cert, self.tls_key, self.tls_ca) if self.tls_cert else None

    @property
    def peer_identities(self) -> frozenset[str] | None:
        """The identities accepted, each as ``uri:URI`` or ``dns:NAME`` (None: any)."""
        return accepted_identities(self.tls_peer_identity) or None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return init_settings, RoleEnvSource(settings_cls)  # no .env file, no secrets directory

    @classmethod
    def load(cls, flags: Mapping[str, Any] | None = None):
        """From ``flags`` (field name -> value; None, or a name that is no setting
        of this service, is ignored), then the environment, then the defaults. A
        ValueError names the flag or the variable that is wrong."""
        given = {name: value for name, value in (flags or {}).items() if name in cls.model_fields and value is not None}
        try:
            return cls(**given)
        except ValidationError as e:
            raise ValueError("; ".join(_explain(cls, error, given) for error in e.errors())) from None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class ServiceConfig(BaseServiceConfig):
    """A model service: the draft (:class:`DraftConfig`) or the target (:class:`TargetConfig`)."""

    model: str | None = Field(
        None, description="model directory (default: the bundled model of this role)",
        json_schema_extra={"metavar": "DIR", **ROLE_ONLY})
    device: str = Field("cpu", description="torch device, e.g. cpu, cuda:0", json_schema_extra=ROLE_ONLY)
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="model dtype")
    max_sessions: int = Field(256, gt=0, description="sessions held before LRU eviction")
    max_cached_tokens: int = Field(
        1_000_000, gt=0, description="KV budget: tokens held over all sessions, counted in whole KV blocks. Idle "
        "sessions are evicted, least recently used first, to stay within it; a call that would exceed it with "
        "every session in use is refused RESOURCE_EXHAUSTED. On a CUDA device, no more than --kv-memory-fraction "
        "of the memory left free after loading the model holds")
    kv_memory_fraction: float = Field(
        0.8, gt=0, le=1, description="on a CUDA device, the share of the memory free after loading the model "
        "that the KV pool takes (allocated at start-up); the budget is the smaller of this and "
        "--max-cached-tokens", json_schema_extra={"metavar": "FRACTION"})
    kv_block_size: int = Field(
        0, ge=0, description="positions per KV block (0: 256 on CUDA, as FlashAttention's paged kernel wants, "
        "16 elsewhere)", json_schema_extra={"metavar": "N"})
    attention_kernel: Literal["auto", "padded", "varlen"] = Field(
        "auto", description="attention over the paged KV: varlen (FlashAttention's paged kernel, CUDA only), "
        "padded (keys gathered per pass, any device) or auto (varlen on CUDA)")
    max_batch: int = Field(
        32, gt=0, description="sessions per forward pass (continuous batching; 1: one session at a time, "
        "as without batching)", json_schema_extra={"metavar": "N"})
    max_batch_tokens: int = Field(
        2048, gt=0, description="new tokens per forward pass (a single longer pre-fill runs alone)",
        json_schema_extra={"metavar": "N"})
    session_ttl_s: float = Field(
        600.0, gt=0, description="seconds an idle session is kept",
        json_schema_extra={"flag": "--session-ttl", "metavar": "SECONDS"})
    gamma_max: int = Field(64, ge=0, description="largest gamma / number of drafts accepted per call")
    cuda_graphs: bool = Field(
        True, description="on a CUDA device, replay CUDA graphs of whole decoding-sized passes (up to 256 "
        "tokens), attention included, recorded at load (one launch instead of a dozen per layer); off: every "
        "kernel launched as it comes")

    def model_path(self) -> str:
        """The model directory to serve: ``model`` or the bundled one."""
        if self.model:
            return self.model
        from specdec.models import bundled

        return str(bundled.draft_path() if self.role == "draft" else bundled.target_path())


class DraftConfig(ServiceConfig):
    role: ClassVar[str] = "draft"

    # A Propose request is the session's new tokens: kilobytes, even for a long context.
    max_message_bytes: int = Field(4 * MiB, gt=0, description="gRPC message size limit: larger requests are "
                                   "refused before they are read")

    port: int = Field(50052, ge=0, le=65535, description=PORT_HELP, json_schema_extra=ROLE_ONLY)
    draft_ahead: bool = Field(
        True, description="while the target verifies, draft the next round as if all drafts are accepted "
        "(reused when they are; the output never changes)")
    lean_forward: bool = Field(
        True, description="run a plain Llama draft's layers with specdec's lean tensor ops instead of its own "
        "modules (same weights, store and attention, less Python per token; the output's distribution never "
        "changes, though one seed's sampled tokens follow q to the last bit)")


class TargetConfig(ServiceConfig):
    role: ClassVar[str] = "target"

    port: int = Field(50053, ge=0, le=65535, description=PORT_HELP, json_schema_extra=ROLE_ONLY)
    lean_forward: bool = Field(
        True, description="run a plain Llama target's layers with specdec's lean tensor ops instead of its own "
        "modules (same weights, store and attention, less Python per token; logits equal to float rounding, so "
        "a greedy near-tie can break the other way)")


class CoordinatorConfig(BaseServiceConfig):
    """The coordinator: where the draft and target services are, and the limits
    it enforces on client requests."""

    role: ClassVar[str] = "coordinator"

    # A Generate request is a prompt that fits the context: rarely a megabyte.
    max_message_bytes: int = Field(4 * MiB, gt=0, description="gRPC message size limit: larger requests are "
                                   "refused before they are read")

    draft: str = Field("localhost:50052", description="draft service replicas: HOST:PORT, a comma-separated "
                       "list, or dns:///NAME:PORT (every address NAME resolves to, looked up again every 10 s)",
                       json_schema_extra={"metavar": "ADDRESSES", **ROLE_ONLY})
    target: str = Field("localhost:50053", description="target service replicas, as --draft",
                        json_schema_extra={"metavar": "ADDRESSES", **ROLE_ONLY})
    port: int = Field(50051, ge=0, le=65535, description=PORT_HELP, json_schema_extra=ROLE_ONLY)
    http_port: int = Field(
        8000, ge=0, le=65535, description="also serve the OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health) on this port, on --host, with the same tokens, limits and "
        "TLS as the gRPC port (0: off)", json_schema_extra={"metavar": "PORT", **ROLE_ONLY})
    served_model_name: str = Field(
        "", description="the model name the HTTP API serves: what requests' 'model' must say and /v1/models "
        "lists (default: the target service's model name)", json_schema_extra={"metavar": "NAME", **ROLE_ONLY})
    chat_template: str = Field(
        "", description="a Jinja chat template file for /v1/chat/completions, in place of the tokenizer's own "
        "(needed for a tokenizer that has none)", json_schema_extra={"metavar": "FILE", **ROLE_ONLY})
    tokenizer: str | None = Field(
        None, description="tokenizer directory for text prompts, text deltas and stop strings (default: the "
        "target service's own, fetched from it); 'none', or a target without one: only prompt_ids work",
        json_schema_extra={"metavar": "DIR", **ROLE_ONLY})
    max_new_tokens_cap: int = Field(4096, gt=0, description="largest max_new_tokens a request may ask for")
    max_sessions: int = Field(
        100_000, gt=0, description="named sessions remembered (least recently used forgotten beyond)")
    default_gamma_policy: str = Field(
        "adaptive", description="gamma policy for requests that name none: static:N, heuristic (+2 if all "
        "drafts were accepted, -1 otherwise) or adaptive (maximises expected tokens/s from measured acceptance "
        "and round costs)", json_schema_extra={"flag": "--gamma-policy"})
    gamma_max: int = Field(
        16, ge=0, description="largest gamma a policy may use (the services' --gamma-max where theirs is lower)")
    default_draft_top_k: int = Field(
        DEFAULT_DRAFT_TOP_K, ge=0, description="under sampling, the draft samples from its top-k and sends "
        "only that support (exact, far fewer bytes); for requests that set no draft_top_k; 0 = dense q",
        json_schema_extra={"flag": "--draft-top-k"})
    plain_tokens: int = Field(
        4, ge=1, le=64, description="tokens a round without drafts (gamma 0: plain target decoding) asks of the "
        "target in one call, after a request's first token: one call and round trip for several tokens, which "
        "stream together (at most the services' --gamma-max + 1)")
    call_timeout_s: float = Field(
        60.0, gt=0, description="deadline of each Propose/Verify call",
        json_schema_extra={"flag": "--call-timeout", "metavar": "SECONDS"})
    info_timeout_s: float = Field(
        10.0, gt=0, description="deadline of GetModelInfo/EndSession calls",
        json_schema_extra={"flag": "--info-timeout", "metavar": "SECONDS"})
    max_streams: int = Field(4096, gt=0, description="Generate streams this coordinator serves at once (each "
                             "holds no thread: a few kB and its session's history); more are refused with "
                             "RESOURCE_EXHAUSTED and a retry-after hint", json_schema_extra={"metavar": "N"})
    kv_wait_s: float = Field(
        30.0, ge=0, description="how long a turn waits for KV room when every target replica is at its KV budget "
        "or session cap (the call is sent again as other turns end); then RESOURCE_EXHAUSTED with a retry-after "
        "hint; 0: refuse at once", json_schema_extra={"flag": "--kv-wait", "metavar": "SECONDS"})
    kv_wait_turns: int = Field(
        1024, ge=0, description="turns that may wait for KV room at once (--kv-wait); more are refused "
        "RESOURCE_EXHAUSTED at once", json_schema_extra={"metavar": "N"})
    max_stream_memory_mb: int = Field(
        2048, ge=0, description="memory this coordinator's streams may hold, in MiB: each is charged twice its "
        "request's size and 96 kB; a request past it is refused RESOURCE_EXHAUSTED with a retry-after hint; "
        "0: no bound", json_schema_extra={"flag": "--max-stream-memory", "metavar": "MIB"})
    redis: str = Field(
        "", description="keep the session directory in Redis (redis://HOST:PORT/DB, rediss:// for TLS, "
        "unix://PATH), shared by every coordinator given the same URL; empty: in this process's memory",
        json_schema_extra={"metavar": "URL"})
    redis_ttl_s: float = Field(
        86400.0, gt=0, description="a session idle this long is forgotten, by the session directory in memory "
        "as in Redis (--redis): each turn restarts the clock, and its slot under --client-max-sessions frees",
        json_schema_extra={"flag": "--redis-ttl", "metavar": "SECONDS"})
    client_max_streams: int = Field(
        0, ge=0, description="streams one client may have open at once (its token's name, or its address "
        "without --auth-tokens); more are refused RESOURCE_EXHAUSTED with retry-after; 0: no limit",
        json_schema_extra={"metavar": "N", **ROLE_ONLY})
    client_max_sessions: int = Field(
        1000, ge=0, description="named sessions one client may hold at once (its token's name, or its address "
        "without --auth-tokens), across every coordinator sharing --redis; a Generate starting one more is refused "
        "RESOURCE_EXHAUSTED until the client closes one (CloseSession) or one idles out (--redis-ttl); continuing "
        "a session never is. 1000: far more than one user's conversations, while a hundred clients at the cap "
        "still fit the in-memory --max-sessions; raise it for a gateway serving many users under one token, or "
        "many users behind one address; 0: no limit",
        json_schema_extra={"metavar": "N", **ROLE_ONLY})
    client_rate: float = Field(
        0.0, ge=0, description="requests per second one client may start on average; beyond, RESOURCE_EXHAUSTED "
        "with retry-after; 0: no limit", json_schema_extra={"metavar": "PER_SECOND", **ROLE_ONLY})
    client_burst: float = Field(
        0.0, ge=0, description="requests one client may start at once under --client-rate (default: the rate, "
        "at least 1)", json_schema_extra={"metavar": "N", **ROLE_ONLY})
    auth_tokens: str = Field(
        "", description="clients that may call, as NAME:TOKEN,NAME:TOKEN (set it in the environment, not on the "
        "command line); each client's named sessions are its own. Empty, with no --auth-tokens-file: no "
        "authentication", repr=False, json_schema_extra={"metavar": "NAME:TOKEN,...", **ROLE_ONLY})
    auth_tokens_file: str = Field(
        "", description="clients that may call, one 'NAME TOKEN' a line (# comments), with --auth-tokens",
        json_schema_extra={"metavar": "FILE", **ROLE_ONLY})
    upstream_ca: str = Field(
        "", description="reach the draft and target services over TLS, verified against this CA (PEM)",
        json_schema_extra={"metavar": "FILE", **ROLE_ONLY})
    upstream_cert: str = Field("", description="mutual TLS to the model services: the coordinator's certificate "
                               "(with --upstream-key)", json_schema_extra={"metavar": "FILE", **ROLE_ONLY})
    upstream_key: str = Field("", description="the private key of --upstream-cert",
                              json_schema_extra={"metavar": "FILE", **ROLE_ONLY})
    upstream_server_name: str = Field(
        "", description="with --upstream-ca: the name the model services' certificates must carry, when it is "
        "not the host of their address (for dns:///NAME:PORT, NAME)",
        json_schema_extra={"metavar": "NAME", **ROLE_ONLY})
    lease_s: float = Field(
        5.0, gt=0, description="with --redis: how long a session stays leased to a coordinator that stopped "
        "renewing it (died); a resumed turn waits up to this long to take the session over",
        json_schema_extra={"flag": "--lease", "metavar": "SECONDS"})
    directory_outage_s: float = Field(
        30.0, ge=0, description="with --redis: how long, beyond --lease, a turn in flight rides out a session "
        "directory that cannot be written (Redis restarting, stalled or full): its stream pauses while the "
        "writes are retried, then goes on; past it, UNAVAILABLE with a retry-after hint (the turn resumable on "
        "any coordinator sharing the directory)",
        json_schema_extra={"flag": "--directory-outage", "metavar": "SECONDS"})

    @field_validator("draft", "target")
    @classmethod
    def _grpc_addresses(cls, value: str) -> str:
        # Each entry HOST:PORT, [IPv6]:PORT, or a gRPC target with a scheme (unix:PATH, dns:///NAME:PORT);
        # the coordinator's replica pool says more precisely what is wrong with one.
        entries = [entry.strip() for entry in value.split(",")]
        for entry in entries:
            if not (re.fullmatch(r"\S+:\d{1,5}", entry) or re.fullmatch(r"[a-z][a-z0-9+.-]*:\S+", entry)):
                where = f" ({entry!r} is not)" if len(entries) > 1 else ""
                raise ValueError(f"must be HOST:PORT, a comma-separated list of them, or a gRPC target such as "
                                 f"unix:PATH or dns:///NAME:PORT{where}")
        return value

    @model_validator(mode="after")
    def _upstream_tls_complete(self):
        check_settings({"--upstream-ca": self.upstream_ca, "--upstream-cert": self.upstream_cert,
                     "--upstream-key": self.upstream_key, "--upstream-server-name": self.upstream_server_name},
                    {"--upstream-cert": ("--upstream-key", "--upstream-ca"), "--upstream-key": ("--upstream-cert",),
                     "--upstream-server-name": ("--upstream-ca",)}, names=("--upstream-server-name",))
        return self

    @model_validator(mode="after")
    def _http_port_of_its_own(self):
        others = {"--port": self.port, "--metrics-port": self.metrics_port, "--health-port": self.health_port}
        clash = [flag for flag, port in others.items() if self.http_port and port == self.http_port]
        if clash:
            raise ValueError(f"--http-port and {' and '.join(clash)} are both {self.http_port}: the HTTP API "
                             "needs a port of its own")
        return self

    @field_validator("chat_template")
    @classmethod
    def _chat_template_file(cls, value: str) -> str:
        if value and not pathlib.Path(value).is_file():
            raise ValueError("must be an existing file")
        return value

    @model_validator(mode="after")
    def _tokens_parse(self):
        parse_tokens(self.auth_tokens, self.auth_tokens_file)  # a bad file fails at start-up, naming no token
        return self

    @field_validator("redis")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return value

    @field_validator("default_gamma_policy")
    @classmethod
    def _known_gamma_policy(cls, value: str) -> str:
        try:
            parse_gamma_spec(value)  # the range is checked against --gamma-max below
        except ValueError:
            raise ValueError("must be static:N, heuristic or adaptive") from None
        return value

    @model_validator(mode="after")
    def _gamma_policy_within_gamma_max(self):
        try:
            parse_gamma_policy(self.default_gamma_policy, self.gamma_max)
        except ValueError:
            raise ValueError(f"--gamma-policy {self.default_gamma_policy} asks for more than "
                             f"--gamma-max {self.gamma_max}") from None
        return self


CONFIG_CLASSES: dict[str, type[BaseServiceConfig]] = {
    "coordinator": CoordinatorConfig, "draft": DraftConfig, "target": TargetConfig}
DEFAULT_PORTS = {role: cls.model_fields["port"].default for role, cls in CONFIG_CLASSES.items()}


# ---------------------------------------------------------------- derived from the declarations


def _extra(cls: type[BaseServiceConfig], name: str) -> dict:
    return cls.model_fields[name].json_schema_extra or {}


def settings(cls: type[BaseServiceConfig]) -> list[tuple[str, FieldInfo]]:
    """``cls``'s settings in the order ``--help`` and docs/settings.md list them: the
    service's own first, then those every service has."""
    return sorted(cls.model_fields.items(), key=lambda item: item[0] in BaseServiceConfig.model_fields)


def flag_name(cls: type[BaseServiceConfig], name: str) -> str:
    return _extra(cls, name).get("flag") or "--" + name.replace("_", "-")


def env_names(cls: type[BaseServiceConfig], name: str) -> list[str]:
    """The environment variables setting field ``name``, most specific first."""
    prefixes = [f"SPECDEC_{cls.role.upper()}_"] + ([] if _extra(cls, name).get("role_only") else ["SPECDEC_"])
    return [prefix + name.upper() for prefix in prefixes]


def shown_default(field: FieldInfo) -> str:
    """The default as --help and docs/settings.md show it ("" when the description says)."""
    value = field.default
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # seconds: 30, not 30.0
    return str(value)


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None``, else the annotation itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return annotation


def add_flags(parser: argparse.ArgumentParser, cls: type[BaseServiceConfig]) -> None:
    """One flag per setting of ``cls``, defaulting to None so that an absent flag
    falls through to the environment, then to the declared default."""
    for name, field in settings(cls):
        flag, default = flag_name(cls, name), shown_default(field)
        help_text = f"{field.description} [env {' or '.join(env_names(cls, name))}"
        help_text = (help_text + (f"; default {default}]" if default else "]")).replace("%", "%%")
        kind = _without_none(field.annotation)
        options: dict[str, Any] = {"dest": name, "default": None, "help": help_text}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            options["choices"] = typing.get_args(kind)
        else:
            options["type"] = kind
            options["metavar"] = _extra(cls, name).get("metavar") or flag[2:].replace("-", "_").upper()
        parser.add_argument(flag, **options)


def command_line(cls: type[BaseServiceConfig], **values: Any) -> list[str]:
    """The flags giving ``cls``'s settings these ``values`` (None: left out)."""
    argv: list[str] = []
    for name, value in values.items():
        flag = flag_name(cls, name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _explain(cls: type[BaseServiceConfig], error: Mapping[str, Any], flags: Mapping[str, Any]) -> str:
    """One pydantic error as a sentence naming the flag, or the variable it came from."""
    if not error["loc"]:  # a check across settings: its message names them
        return error["msg"].removeprefix("Value error, ")
    name = error["loc"][0]
    ctx = error.get("ctx", {})
    bounds = [f"must be {sign} {ctx[key]:g}" for key, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
              if key in ctx]
    if bounds:
        problem = bounds[0]
    elif error["type"].endswith("_parsing") or error["type"] == "int_from_float":
        problem = f"is not a valid {error['type'].split('_')[0]}"  # int_parsing -> int
    else:
        problem = error["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    flag = flag_name(cls, name)
    env = next((env for env in env_names(cls, name) if os.environ.get(env)), None)
    if name in flags or env is None:
        return f"{flag} {problem}, got {_shown(error['input'])!r}"
    return f"environment variable {env}={_shown(os.environ[env])!r} {problem} (it sets {flag})"


def _shown(value: Any) -> Any:
    """A value as an error message may repeat it: a URL without its password."""
    return redacted_url(value) if isinstance(value, str) else value


def redacted_url(url: str) -> str:
    """``url`` without the password of its user part (other strings as they are)."""
    parts = urllib.parse.urlsplit(url)
    if not parts.netloc or "@" not in parts.netloc:
        return url
    user, _, host = parts.netloc.rpartition("@")
    name, has_password, _ = user.partition(":")
    if not has_password:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{name}:***@{host}" if name else f"***@{host}"))


def flag_table(cls: type[BaseServiceConfig]) -> str:
    """``cls``'s settings as a Markdown table: flag, environment variables, default, help."""
    rows = [f"| {cls.role} flag | environment | default | |", "|---|---|---|---|"]
    for name, field in settings(cls):
        metavar = _extra(cls, name).get("metavar")
        flag = f"`{flag_name(cls, name)}{' ' + metavar if metavar else ''}`"
        if field.annotation is bool:
            flag += f" / `--no-{flag_name(cls, name)[2:]}`"
        env = ", ".join(f"`{env}`" for env in env_names(cls, name))
        description = field.description.replace("|", r"\|")  # a | would end the cell
        rows.append(f"| {flag} | {env} | {shown_default(field)} | {description} |")
    return "\n".join(rows)


SETTINGS_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "settings.md"
DOCS_COMMAND = "python -m specdec.serving.config --docs"


def with_flag_tables(text: str) -> str:
    """``text`` with the table of NAME's settings between each
    ``<!-- BEGIN flags NAME -->`` and ``<!-- END flags NAME -->`` (NAME: a role)."""
    def table(block: re.Match) -> str:
        return f"{block[1]}\n{flag_table(CONFIG_CLASSES[block[2]])}\n{block[3]}"

    return re.sub(r"(<!-- BEGIN flags (\S+) -->).*?(<!-- END flags \2 -->)", table, text, flags=re.S)


if __name__ == "__main__":
    if sys.argv[1:] != ["--docs"]:
        sys.exit(f"usage: {DOCS_COMMAND}  (rewrites the flag tables in {SETTINGS_DOC})")
    SETTINGS_DOC.write_text(with_flag_tables(SETTINGS_DOC.read_text(encoding="utf-8")), encoding="utf-8")
