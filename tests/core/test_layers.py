"""specdec.core is the bottom layer: importing it and its modules loads no RPC,
telemetry or model-hub library, and the round loop's types
(specdec.core.interfaces) load no torch either. The imports run in fresh
interpreters, so nothing another test imported can hide a dependency.
(`lint-imports` checks the static imports; this checks what really loads.)"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import specdec.core

HEAVY = ("grpc", "opentelemetry", "prometheus_client", "transformers")
CORE_MODULES = ["specdec.core"] + sorted(
    f"specdec.core.{m.name}" for m in pkgutil.iter_modules(specdec.core.__path__)
)

# Imports each module named in argv in turn and prints, per module, the watched
# top-level packages that its import added to sys.modules.
_PROBE = """
import importlib, json, sys
watched = set(json.loads(sys.argv[1]))
report = {}
for module in sys.argv[2:]:
    before = {m.split(".")[0] for m in sys.modules} & watched
    importlib.import_module(module)
    report[module] = sorted(({m.split(".")[0] for m in sys.modules} & watched) - before)
print(json.dumps(report))
"""


def loaded_by(modules: list[str], watched: tuple[str, ...]) -> dict[str, list[str]]:
    """Import ``modules`` in order in a fresh interpreter: which of ``watched``
    each one brought in (a package appears under the first module that loaded it)."""
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(watched), *modules],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_every_core_module_is_checked():
    assert {"specdec.core.sampling", "specdec.core.verification", "specdec.core.rounds", "specdec.core.gamma",
            "specdec.core.interfaces", "specdec.core.text", "specdec.core.vocabulary"} <= set(CORE_MODULES)


def test_core_imports_no_rpc_telemetry_or_model_hub_library():
    report = loaded_by(CORE_MODULES, HEAVY)
    assert list(report) == CORE_MODULES
    assert {module: found for module, found in report.items() if found} == {}


def test_the_interfaces_load_no_torch():
    """Clients, configuration and ``--help`` name these types cheaply."""
    assert loaded_by(["specdec.core.interfaces"], ("torch", *HEAVY)) == {"specdec.core.interfaces": []}


def test_the_check_sees_what_a_module_loads():
    """Negative control: the same check on modules that do load watched packages,
    credited to the first that loads each."""
    report = loaded_by(["specdec.core.interfaces", "grpc", "grpc.aio"], ("grpc", "torch"))
    assert report == {"specdec.core.interfaces": [], "grpc": ["grpc"], "grpc.aio": []}
