"""Typed configuration with environment overrides.

Precedence, highest first: command-line flag > environment variable > default.
Every field ``foo_bar`` of a config is read from ``<PREFIX>FOO_BAR`` for each of
the config's prefixes in turn (most specific first), e.g. a draft service's
``max_sessions`` from ``SPECDEC_DRAFT_MAX_SESSIONS``, then
``SPECDEC_MAX_SESSIONS``. Fields that must differ between services running side
by side (port, model, device) are only read with the role's prefix.

    cfg = load_config(ServiceConfig, role_prefixes("draft"), overrides={"port": 0}, role="draft")
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Mapping, TypeVar

from specdec.core.interfaces import DEFAULT_DRAFT_TOP_K

T = TypeVar("T")

ENV_PREFIX = "SPECDEC_"





def role_prefixes(role: str) -> tuple[str, ...]:
    """``("SPECDEC_DRAFT_", "SPECDEC_")`` for role "draft"."""
    return (f"{ENV_PREFIX}{role.upper()}_", ENV_PREFIX)


def env_names(cls: type, field: str, prefixes: tuple[str, ...]) -> list[str]:
    """The environment variables consulted for ``field``, most specific first."""
    f = {f.name: f for f in dataclasses.fields(cls)}[field]
    if f.metadata.get("role_only"):
        prefixes = prefixes[:1]
    return [p + field.upper() for p in prefixes]


def load_config(
    cls: type[T],
    prefixes: tuple[str, ...],
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    **fixed: Any,
) -> T:
    """Build ``cls`` from defaults, then the environment, then ``overrides``
    (entries that are None are ignored, so argparse flags defaulting to None
    fall through). ``fixed`` values are set as given (e.g. ``role``)."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = dict(fixed)
    for f in dataclasses.fields(cls):
        if f.name in fixed or not f.init:
            continue
        for name in env_names(cls, f.name, prefixes):
            raw = environ.get(name)
            if raw is not None and raw != "":
                values[f.name] = _parse(raw, hints[f.name], name)
                break
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    return cls(**values)


def _parse(raw: str, hint: Any, name: str) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if args else hint  # Optional[X] -> X
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind in (int, float, str):
            return kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {kind.__name__}") from None
    raise TypeError(f"cannot read {name} into a field of type {hint}")


def _role_only(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={"role_only": True})


# ============================================================================
# Model services (draft and target) -- owned by the services side.
# ============================================================================

DEFAULT_PORTS = {"coordinator": 50051, "draft": 50052, "target": 50053}
MiB = 1 << 20


def check_limits(config, *, positive: tuple[str, ...], non_negative: tuple[str, ...]) -> None:
    """ValueError naming the first field out of range."""
    for name in positive:
        if getattr(config, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(config, name)}")
    for name in non_negative:
        if getattr(config, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(config, name)}")


@dataclasses.dataclass
class ServiceConfig:
    """One model service: the draft (role "draft") or the target (role "target")."""

    role: str = "target"
    model: str | None = _role_only(None)  # model directory; None = the bundled model of the role
    device: str = _role_only("cpu")
    dtype: str = "float32"
    host: str = "0.0.0.0"
    port: int | None = _role_only(None)  # None = DEFAULT_PORTS[role]; 0 = any free port
    max_sessions: int = 256  # LRU-evicted beyond this
    max_cached_tokens: int = 1_000_000  # summed over sessions; LRU-evicted beyond this
    session_ttl_s: float = 600.0  # idle sessions are dropped after this
    max_message_bytes: int = 64 * MiB  # gRPC send/receive limit
    gamma_max: int = 64  # Propose gamma / Verify drafts above this are rejected
    drain_grace_s: float = 30.0  # on SIGTERM: how long the generations in flight may take to finish
    log_level: str = "INFO"
    draft_ahead: bool = True  # draft service: draft the next round while the target verifies
    lean_forward: bool = True  # draft service: a Llama draft runs through specdec.models.lean_llama

    def __post_init__(self) -> None:
        if self.role not in ("draft", "target"):
            raise ValueError(f"role must be 'draft' or 'target', got {self.role!r}")
        if self.port is None:
            self.port = DEFAULT_PORTS[self.role]
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        check_limits(self, positive=("max_sessions", "max_cached_tokens", "max_message_bytes", "session_ttl_s"),
                     non_negative=("gamma_max", "drain_grace_s"))

    @classmethod
    def load(cls, role: str, overrides: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> "ServiceConfig":
        return load_config(cls, role_prefixes(role), overrides, environ, role=role)

    def model_path(self) -> str:
        """The model directory to serve: ``model`` or the bundled one."""
        if self.model:
            return self.model
        from specdec.models import bundled

        return str(bundled.draft_path() if self.role == "draft" else bundled.target_path())

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


# ============================================================================
# Coordinator -- owned by the coordinator side (helper-3); add CoordinatorConfig below.
# ============================================================================


@dataclasses.dataclass
class CoordinatorConfig:
    """The coordinator: where the draft and target services are, and the limits
    it enforces on client requests. Environment: ``SPECDEC_COORDINATOR_<FIELD>``,
    then ``SPECDEC_<FIELD>`` (``draft``, ``target``, ``port`` and ``tokenizer``
    only with the role prefix)."""

    draft: str = _role_only("localhost:50052")  # draft service HOST:PORT
    target: str = _role_only("localhost:50053")  # target service HOST:PORT
    host: str = "0.0.0.0"
    port: int | None = _role_only(None)  # None = 50051; 0 = any free port
    tokenizer: str | None = _role_only(None)  # tokenizer directory; None = the bundled target's, if present
    max_new_tokens_cap: int = 4096  # requests asking for more are rejected
    max_sessions: int = 100_000  # named sessions remembered; least recently used forgotten beyond
    default_gamma_policy: str = "adaptive"  # used when a request leaves gamma_policy empty
    default_draft_top_k: int = DEFAULT_DRAFT_TOP_K  # for requests that set no draft_top_k; 0: dense q
    gamma_max: int = 16  # static:N above this is rejected; heuristic never exceeds it
    call_timeout_s: float = 60.0  # deadline of every Propose / Verify call
    info_timeout_s: float = 10.0  # deadline of GetModelInfo / EndSession calls
    max_workers: int = 64  # threads running round loops (one per in-flight Generate)
    max_message_bytes: int = 64 * MiB
    drain_grace_s: float = 30.0  # on SIGTERM: how long in-flight Generate streams may take
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.port is None:
            self.port = DEFAULT_PORTS["coordinator"]
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        check_limits(self, positive=("max_new_tokens_cap", "max_sessions", "max_workers", "max_message_bytes",
                                     "call_timeout_s", "info_timeout_s"),
                     non_negative=("gamma_max", "drain_grace_s", "default_draft_top_k"))

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> "CoordinatorConfig":
        return load_config(cls, role_prefixes("coordinator"), overrides, environ)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
