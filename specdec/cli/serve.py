"""``specdec serve``: draft, target and coordinator on loopback, in one command.

    specdec serve [--draft-model DIR] [--target-model DIR] [--device-draft cuda:0] [--device-target cuda:1]

Each service runs as its own process (``specdec draft-service`` ...), exactly as
it would on separate machines: no shared interpreter lock between the models, and
what is tested here is what is deployed. This command starts them, waits until all
three report SERVING on their health checks, and on SIGTERM / Ctrl-C drains the
coordinator first (its in-flight streams still need the models), then the two
model services.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import time

from specdec.serving.config import (
    DEFAULT_PORTS,
    BaseServiceConfig,
    CoordinatorConfig,
    DraftConfig,
    TargetConfig,
    command_line,
    env_names,
)

HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = CoordinatorConfig.model_fields["http_port"].default


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``serve`` and ``demo``."""
    p.add_argument("--draft-model", metavar="DIR", default=None, help="draft model directory (default: bundled)")
    p.add_argument("--target-model", metavar="DIR", default=None, help="target model directory (default: bundled)")
    p.add_argument("--device-draft", default="cpu", help="torch device of the draft model (default cpu)")
    p.add_argument("--device-target", default="cpu", help="torch device of the target model (default cpu)")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="coordinator's tokenizer directory (default: the target model's)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--coordinator-port", type=int, default=DEFAULT_PORTS["coordinator"],
                   help=f"coordinator port (default {DEFAULT_PORTS['coordinator']})")
    p.add_argument("--draft-port", type=int, default=DEFAULT_PORTS["draft"],
                   help=f"draft service port (default {DEFAULT_PORTS['draft']})")
    p.add_argument("--target-port", type=int, default=DEFAULT_PORTS["target"],
                   help=f"target service port (default {DEFAULT_PORTS['target']})")
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, metavar="PORT",
                   help=f"the coordinator's OpenAI-compatible HTTP API (http://127.0.0.1:PORT/v1; "
                        f"docs/openai-api.md); default {DEFAULT_HTTP_PORT}, 0: off")
    drain_grace = BaseServiceConfig.model_fields["drain_grace_s"]
    p.add_argument("--drain-grace", type=float, default=drain_grace.default, metavar="SECONDS",
                   help=f"{drain_grace.description} (default {drain_grace.default:g})")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve Prometheus /metrics: the coordinator on PORT, the draft service on PORT+1, "
                        "the target service on PORT+2 (deploy/prometheus/prometheus-local.yml scrapes "
                        "9464-9466); default 0: off")
    p.add_argument("--trace-file", default=None, metavar="PATH",
                   help="all three services append their spans to PATH as JSON lines (for specdec "
                        "trace-report); OTEL_* variables configure other exporters")


def model_dirs(args: argparse.Namespace) -> tuple[pathlib.Path, pathlib.Path]:
    """(target, draft) directories: the flags, else the bundled pair."""
    target, draft = args.target_model, args.draft_model
    if target is None or draft is None:
        from specdec.models import bundled

        if not bundled.is_available():
            raise ValueError(
                f"the bundled models are missing from {bundled.models_dir()} (run `specdec train-models`), "
                "or pass --target-model DIR and --draft-model DIR"
            )
        target = target or bundled.target_path()
        draft = draft or bundled.draft_path()
    for name, path in (("--target-model", target), ("--draft-model", draft)):
        if not (pathlib.Path(path) / "config.json").is_file():
            raise ValueError(f"{name} {path} is not a model directory (no config.json)")
    return pathlib.Path(target), pathlib.Path(draft)


def cpu_threads(devices: dict[str, str]) -> dict[str, int | None]:
    """CPU threads per model service. Two models on the CPU each taking every core
    oversubscribe it: OpenMP workers of the idle model spin while the other runs,
    and speculative rounds slow down several-fold. So they split the cores, unless
    OMP_NUM_THREADS says otherwise (None: leave the default)."""
    on_cpu = [role for role, device in devices.items() if device.startswith("cpu")]
    if "OMP_NUM_THREADS" in os.environ or not on_cpu:
        return {role: None for role in devices}
    share = max(1, len(os.sched_getaffinity(0)) // len(on_cpu))  # the cores this process may use
    return {role: share if role in on_cpu else None for role in devices}


def split_cores(devices: dict[str, str]) -> dict[str, set[int]] | None:
    """Which CPU cores each process runs on when both models are on the CPU: the
    draft on the first half of the cores this process may use, the target on
    the rest, and the coordinator beside the target (its work happens while the
    target waits for it: receiving drafts, forwarding them, streaming tokens
    out). Both models keep a core of their own, so drafting ahead runs while the
    target verifies. None (no pinning) with fewer than two cores or a model on
    another device."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2 or not all(device.startswith("cpu") for device in devices.values()):
        return None
    half = len(allowed) // 2
    draft, target = set(allowed[:half]), set(allowed[half:])
    return {"draft": draft, "target": target, "coordinator": target}


def draft_shares_target_cores(cpus: dict[str, set[int]] | None = None) -> bool:
    """Whether drafting ahead would take compute from the target's verification:
    when the two services' processes have fewer than two CPU cores between them,
    whatever their devices. Python drives each model's passes from a core, on a
    GPU too, so that core is what the two compete for.

    One GPU shared by both is not counted. With the bundled pair on one H200,
    drafting ahead raised greedy static:4 from 1.03x to 1.67x target-only and
    adaptive from 1.62x to 1.96x (docs/gpu-check.md, one run). A small model's
    kernels leave the GPU idle between launches. A target that keeps the GPU busy
    may differ: measure, or start the draft service with --no-draft-ahead."""
    allowed = os.sched_getaffinity(0)
    cores = (cpus or {}).get("draft", allowed) | (cpus or {}).get("target", allowed)
    return len(cores) < 2


def child_env(threads: int | None = None) -> dict[str, str]:
    """This environment, plus: unbuffered output (the services' logs interleave as
    they happen), the directory holding the specdec package on PYTHONPATH (a
    source checkout works from any working directory) and the thread count."""
    root = str(pathlib.Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{root}{os.pathsep}{path}" if path else root}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


# specdec serve --metrics-port PORT: where each role's /metrics goes.
METRICS_PORT_OFFSETS = {"coordinator": 0, "draft": 1, "target": 2}

# The share of a GPU's free memory each model service's KV pool takes when both
# services are on that one GPU (each measures what is free when it loads).
KV_SHARE = {"draft": 0.25, "target": 0.6}
# The variables that set the draft service's --draft-ahead (most specific first).
DRAFT_AHEAD_ENV = env_names(DraftConfig, "draft_ahead")


class Stack:
    """The three service processes. ``log`` is where their output goes (None:
    this process's stdout/stderr); ``cpus`` pins a role's process to CPUs (None:
    inherited); ``metrics_ports`` / ``trace_file``: each role's ``--metrics-port``,
    every role's ``--trace-file``; ``http_port``: the coordinator's ``--http-port``,
    given always (0, the default: no HTTP API, whatever SPECDEC_COORDINATOR_HTTP_PORT
    says, so stacks side by side do not all take 8000)."""

    def __init__(self, *, target: pathlib.Path, draft: pathlib.Path, ports: dict[str, int],
                 devices: dict[str, str], tokenizer: str | None = None, drain_grace: float = 30.0,
                 log: pathlib.Path | None = None, cpus: dict[str, set[int]] | None = None,
                 metrics_ports: dict[str, int] | None = None, trace_file: str | None = None,
                 http_port: int = 0):
        self.ports, self.http_port, self.target, self.draft = ports, http_port, target, draft
        self.log_path = log
        out = open(log, "ab") if log is not None else None
        metrics_ports = metrics_ports or {}
        common = dict(host=HOST, drain_grace_s=drain_grace, trace_file=trace_file)
        cli = [sys.executable, "-m", "specdec.cli"]
        self.procs: dict[str, subprocess.Popen] = {}
        # Own process group: a Ctrl-C reaches this process only, which then stops
        # the services in order.
        kw = dict(stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)
        threads = cpu_threads(devices)
        draft_env = child_env(threads["draft"])
        if draft_shares_target_cores(cpus) and not set(DRAFT_AHEAD_ENV) & set(draft_env):
            draft_env[DRAFT_AHEAD_ENV[0]] = "0"  # it would take compute from the target's verification
        envs = {"draft": draft_env, "target": child_env(threads["target"])}

        def pinned(role: str) -> dict:
            mask = (cpus or {}).get(role)
            return {"preexec_fn": lambda: os.sched_setaffinity(0, mask)} if mask else {}

        self._launch: dict[str, tuple[list[str], dict]] = {}  # how each role is started (again)
        self._started: dict[str, float] = {}
        self._failures: dict[str, int] = {}  # restarts since the role last ran a minute
        self._due: dict[str, float] = {}  # when a dead role is started again
        shared_gpu = devices["draft"] == devices["target"] and devices["target"].startswith("cuda")
        for role, config, model in (("draft", DraftConfig, draft), ("target", TargetConfig, target)):
            # On one GPU each takes a share of the free memory for its KV pool, not 0.8 each.
            fraction = {"kv_memory_fraction": KV_SHARE[role]} if shared_gpu else {}
            flags = command_line(config, model=model, device=devices[role], port=ports[role],
                                 metrics_port=metrics_ports.get(role), **common, **fraction)
            self._launch[role] = ([*cli, f"{role}-service", *flags], dict(env=envs[role], **kw, **pinned(role)))
        flags = command_line(CoordinatorConfig, draft=self.address("draft"), target=self.address("target"),
                             tokenizer=tokenizer, port=ports["coordinator"], http_port=http_port,
                             metrics_port=metrics_ports.get("coordinator"), **common)
        self._launch["coordinator"] = ([*cli, "coordinator", *flags], dict(env=child_env(1), **kw,
                                                                           **pinned("coordinator")))
        try:
            for role in ("draft", "target", "coordinator"):
                self._spawn(role)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, role: str) -> None:
        argv, kw = self._launch[role]
        self.procs[role] = subprocess.Popen(argv, **kw)
        self._started[role] = time.monotonic()

    RESTART_MAX_S = 30.0  # the longest wait before starting a dead service again
    RESTART_LIMIT = 5  # restarts in a row, each dying within a minute, before giving up

    def keep_alive(self, say) -> None:
        """Start again a service that exited: after 1 s, then 2, 4 ... up to
        RESTART_MAX_S while it keeps dying; once it has run a minute, after 1 s
        again. The others go on serving meanwhile (the coordinator answers
        UNAVAILABLE naming the missing service). ValueError after RESTART_LIMIT
        restarts in a row that each died within a minute."""
        now = time.monotonic()
        for role, proc in self.procs.items():
            if proc.poll() is None:
                if now - self._started[role] > 60:
                    self._failures[role] = 0
                continue
            failures = self._failures.get(role, 0)
            if failures >= self.RESTART_LIMIT:  # dies each time, within a minute: a bad setting, a busy port
                raise ValueError(f"the {role} service exited with status {proc.returncode} again, {failures} "
                                 f"restarts in a row each within a minute of starting: giving up{self._tail()}")
            if role not in self._due:
                delay = min(self.RESTART_MAX_S, 2.0 ** failures)
                self._due[role] = now + delay
                say(f"specdec serve: the {role} service exited with status {proc.returncode}; starting it again "
                    f"in {delay:.0f} s{self._tail() if failures == 0 else ''}")
            if now >= self._due[role]:
                say(f"specdec serve: starting the {role} service again (restart {failures + 1})")
                self._failures[role] = failures + 1
                del self._due[role]
                self._spawn(role)

    def address(self, role: str) -> str:
        return f"{HOST}:{self.ports[role]}"

    def http_url(self) -> str | None:
        """Where the coordinator's OpenAI-compatible API answers (None: off)."""
        return f"http://{HOST}:{self.http_port}/v1" if self.http_port else None

    def wait_serving(self, timeout: float = 300.0, stop_requested=lambda: False) -> bool:
        """Until every service's health check says SERVING (True), or a stop is
        requested meanwhile (False); ValueError (with the log's tail) if a service
        exits first or takes longer than ``timeout``."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        # Quick reconnects: the services are starting, the first attempts fail.
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]
        deadline = time.monotonic() + timeout
        for role in ("draft", "target", "coordinator"):
            with grpc.insecure_channel(self.address(role), options=options) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                while True:
                    self.check_alive()
                    if stop_requested():
                        return False
                    try:
                        if health.Check(health_pb2.HealthCheckRequest(), timeout=0.5, wait_for_ready=True).status \
                                == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise ValueError(f"the {role} service did not start within {timeout:.0f} s{self._tail()}")
                    time.sleep(0.05)
        return True

    def check_alive(self) -> None:
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                raise ValueError(f"the {role} service exited with status {proc.returncode}{self._tail()}")

    def _tail(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-15:]
        return f" (log {self.log_path}):\n" + "\n".join(lines)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the coordinator, let it drain, then the model services. Returns
        0 if every process exited cleanly."""
        status = 0
        for group in (["coordinator"], ["draft", "target"]):
            procs = [self.procs[r] for r in group if r in self.procs]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    status |= proc.wait(timeout) != 0
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    status = 1
        return status


def service_ports(args: argparse.Namespace) -> tuple[dict[str, int], dict[str, int] | None]:
    """(each service's port, each role's /metrics port or None), checked: no two
    alike, the HTTP API's included."""
    ports = {"coordinator": args.coordinator_port, "draft": args.draft_port, "target": args.target_port}
    if len(set(ports.values())) != 3:
        raise ValueError(f"the three ports must differ, got {ports}")
    if not 0 <= args.http_port <= 65535:
        raise ValueError(f"--http-port {args.http_port}: give a port in [1, 65535], or 0 for no HTTP API")
    if args.http_port and args.http_port in ports.values():
        raise ValueError(f"--http-port {args.http_port}: the HTTP API needs a port of its own, not a service's "
                         f"({ports})")
    metrics_ports = None
    if args.metrics_port:
        if not 0 < args.metrics_port <= 65535 - 2:
            raise ValueError(f"--metrics-port {args.metrics_port}: give a port in [1, 65533] (PORT+2 is used too)")
        metrics_ports = {role: args.metrics_port + offset for role, offset in METRICS_PORT_OFFSETS.items()}
        clash = set(metrics_ports.values()) & {*ports.values(), args.http_port}
        if clash:
            raise ValueError(f"--metrics-port {args.metrics_port}: /metrics ports {sorted(metrics_ports.values())} "
                             f"overlap the services' ports {sorted({*ports.values(), args.http_port} - {0})}")
    return ports, metrics_ports


def banner(args: argparse.Namespace, stack: Stack, metrics_ports: dict[str, int] | None) -> str:
    """What ``serve`` prints once every service answers SERVING."""
    ports, http = stack.ports, stack.http_url()
    parts = [f"specdec serve: coordinator on {stack.address('coordinator')} (gRPC)"
             + (f", OpenAI-compatible HTTP API on {http}" if http else ", no HTTP API (--http-port 0)"),
             f"draft {stack.draft} on {args.device_draft} at :{ports['draft']}, "
             f"target {stack.target} on {args.device_target} at :{ports['target']}"]
    if metrics_ports:
        parts.append("/metrics on " + ", ".join(f":{metrics_ports[role]}" for role in METRICS_PORT_OFFSETS))
    if args.trace_file:
        parts.append(f"spans to {args.trace_file}")
    return "; ".join([*parts, "Ctrl-C to stop"])


def run(args: argparse.Namespace) -> int:
    ports, metrics_ports = service_ports(args)
    target, draft = model_dirs(args)
    stack = Stack(target=target, draft=draft, ports=ports, tokenizer=args.tokenizer,
                  devices={"draft": args.device_draft, "target": args.device_target}, drain_grace=args.drain_grace,
                  metrics_ports=metrics_ports, trace_file=args.trace_file, http_port=args.http_port)
    # From here on SIGTERM / Ctrl-C mean "drain and exit": handled below, not by raising.
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: stopping.append(s))
    try:
        if not stack.wait_serving(stop_requested=lambda: bool(stopping)):
            print("specdec serve: stopping before all services started", file=sys.stderr, flush=True)
            return stack.stop()
        print(banner(args, stack, metrics_ports), file=sys.stderr, flush=True)
        say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
        while not stopping:
            stack.keep_alive(say)
            time.sleep(0.2)
    except ValueError as e:
        stack.stop()
        print(f"specdec serve: error: {e}", file=sys.stderr)
        return 1
    except BaseException:
        stack.stop()
        raise
    print("specdec serve: stopping (draining in-flight requests)", file=sys.stderr, flush=True)
    return stack.stop()

