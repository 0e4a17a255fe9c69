"""scripts/gpu_realsize.py, the GPU check's real-size passes, runs its own code
on a CPU with shapes shrunk (--tiny): every family builds, goes through the
batched forward, and is timed against the bound."""

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_realsize.py"


def test_the_real_size_run_works_shrunk_on_a_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--sessions", "1,3",
                          "--context", "40", "--passes", "2", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for name in ("llama-3.1-8b", "qwen2.5-7b", "llama-3.2-1b"):
        assert f"{name}: " in out.stdout
    assert "measured / bound" in out.stdout
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert len(rows) == 6 and all(r["ms"] > 0 and r["bound_ms"] > 0 for r in rows)
