#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md): the model-running tests with their models on a
# CUDA device, then a short `specdec bench` with both models on it. CI never runs
# this (it has no GPU); run it by hand on a machine with one:
#
#     bash scripts/gpu_check.sh            # DEVICE=cuda:0, results under gpu-check/
#
# Each step has its own time limit, so a hang in one still leaves the other's results.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export DEVICE=${DEVICE:-cuda:0}
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-gpu-check}
BENCH_ARGS=${BENCH_ARGS:---quick --rtts 0,10}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

# Stop here, with the reason, if the device is not there.
"$PYTHON" - <<'EOF' 2>&1 | tee "$RESULTS/env.txt"
import os, torch, transformers
from specdec.models.runner import parse_device
device = parse_device(os.environ["DEVICE"])
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print(torch.cuda.get_device_name(device) if device.type == "cuda" else device)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

# Every test here puts its models on $DEVICE: the paged KV store, every family's
# batched forward against its own (varlen kernel, CUDA graphs of whole passes), the
# lean Llama layers, greedy equality with target-only decoding, the chi-square
# losslessness check, the bundled pair, and the services (host<->device copies of q
# included). The chi-square check draws 5,000 samples per setting instead of
# 20,000: each draw costs several kernel launches here, and 5,000 still detect its
# negative control.
SPECDEC_TEST_DEVICE=$DEVICE SPECDEC_LOSSLESS_SAMPLES=5000 timeout -k 10 240 "$PYTHON" -m pytest -q \
    -p no:cacheprovider --durations=8 \
    tests/models/test_paged_kv.py tests/models/test_batched.py tests/models/test_lean_llama.py \
    tests/models/test_decoder.py tests/models/test_bundled_pair.py tests/models/test_lossless.py \
    tests/services/test_services.py 2>&1 | tee "$RESULTS/pytest.log"
tests_rc=${PIPESTATUS[0]}

# Real sizes, no download: Llama-3.1-8B-, Qwen2.5-7B- and Llama-3.2-1B-shaped models
# with random bfloat16 weights, a decode pass at 1, 16 and 64 sessions of 1024
# positions against the bandwidth bound (weights + KV read per pass / the device's
# copy bandwidth).
timeout -k 10 300 "$PYTHON" scripts/gpu_realsize.py --device "$DEVICE" --json "$RESULTS/realsize.json" 2>&1 \
    | tee "$RESULTS/realsize.txt"
realsize_rc=${PIPESTATUS[0]}

# CUDA graphs: a decode step of the bundled target with and without them, taking
# turns, in one run.
timeout -k 10 120 "$PYTHON" - <<'EOF' 2>&1 | tee "$RESULTS/cuda-graphs.txt"
import os, statistics
from specdec.models import bundled
from specdec.models.runner import ModelRunner
from specdec.tools.eval_pair import decode_latency_ms
runners = {g: ModelRunner(bundled.target_path(), os.environ["DEVICE"], lean=True, cuda_graphs=g) for g in (False, True)}
prompt = list(range(3, 131))
ms = {g: [] for g in runners}
for _ in range(5):
    for g, runner in runners.items():
        ms[g].append(decode_latency_ms(runner, prompt, 64))
off, on = statistics.median(ms[False]), statistics.median(ms[True])
print(f"decode step: {off:.2f} ms without CUDA graphs, {on:.2f} ms with them ({off / on:.2f}x)")
EOF

# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout -k 10 200 "$PYTHON" -m specdec.cli bench $BENCH_ARGS --device-target "$DEVICE" --out "$RESULTS/bench" \
    2>&1 | tee "$RESULTS/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc realsize rc=$realsize_rc bench rc=$bench_rc" | tee -a "$RESULTS/env.txt"
[ "$tests_rc" = 0 ] && [ "$realsize_rc" = 0 ] && [ "$bench_rc" = 0 ]
