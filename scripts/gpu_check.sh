#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md): the model-running tests with their models on a
# CUDA device, then a short `specdec bench` with both models on it. CI never runs
# this (it has no GPU); run it by hand on a machine with one:
#
#     bash scripts/gpu_check.sh            # DEVICE=cuda:0, results under gpu-check/
#
# Each step has its own time limit, so a hang in one still leaves the other's results.
set -uo pipefail
DEVICE=${DEVICE:-cuda:0}
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-gpu-check}
BENCH_ARGS=${BENCH_ARGS:---quick --rtts 0,10}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__); print(torch.cuda.get_device_name('$DEVICE') if '$DEVICE' != 'cpu' else 'cpu')" \
    2>&1 | tee "$RESULTS/env.txt"

# Every test here puts its models on $DEVICE: the cache adapter, the lean forward,
# greedy equality with target-only decoding, the chi-square losslessness check, the
# bundled pair, and the services (host<->device copies of q included).
# The chi-square check draws 5,000 samples per setting instead of 20,000; its
# negative control needs the full count for its power and is not about devices.
SPECDEC_TEST_DEVICE=$DEVICE SPECDEC_LOSSLESS_SAMPLES=5000 timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/test_kv_cache.py tests/test_lean_llama.py tests/test_decoder.py tests/test_bundled_pair.py \
    tests/test_lossless.py tests/test_services.py --durations=8 --deselect tests/test_lossless.py::test_the_check_has_power 2>&1 | tee "$RESULTS/pytest.log"
tests_rc=${PIPESTATUS[0]}

# shellcheck disable=SC2086
timeout 200 "$PYTHON" -m specdec.cli bench $BENCH_ARGS --device-target "$DEVICE" --out "$RESULTS/bench" \
    2>&1 | tee "$RESULTS/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc bench rc=$bench_rc" | tee -a "$RESULTS/env.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
