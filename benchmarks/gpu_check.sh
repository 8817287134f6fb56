#!/usr/bin/env bash
# The GPU check: the GPU tests, then the GPU benchmark, on one CUDA machine, in under 5 minutes.
#
# Needs python3 with torch (CUDA), cupy (cupy-cuda12x or cupy-cuda13x, matching torch's
# CUDA), msgpack, uvloop, pytest and pytest-timeout. pyzmq is installed from the wheels in
# .whl/ when python3 lacks it (machines without network). Fill .whl/ once, on a machine
# with network, from the repository root (pyzmq for CPython 3.12, manylinux x86_64):
#
#   python3 -m pip download pyzmq --only-binary=:all: --no-deps --python-version 3.12 \
#       --implementation cp --abi cp312 --abi abi3 --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
#
# (.whl/ is git-ignored: carry it to the GPU machine with the working tree.)
# Run from anywhere: benchmarks/gpu_check.sh. Logs and gpu_bench.json go to $OUT
# (default: gpu-check-out/ in the repository). Exit status: 0 when the tests passed, every
# byte matched and W1 met its target; otherwise the first failure's status.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export OUT

if python3 -c "import zmq" 2>/dev/null; then
    export PYTHONPATH=$PWD
else
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "pyzmq is not installed and .whl/ holds no wheels: see the top of $0" >&2
        exit 1
    fi
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, cupy, zmq; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, '| cupy', cupy.__version__, '| pyzmq', zmq.__version__)"
} 2>&1 | tee "$OUT/environment.txt"

if ! python3 -c "import cupy, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "no usable CUDA here (torch.cuda and cupy are both needed): nothing to check" >&2
    exit 1
fi

status=0
# Only tests/gpu: the rest of the suite needs vLLM, and runs in CI without a GPU. Warnings
# are errors in this project's tests; those of cupy and torch's CUDA set-up (and of their
# submodules, which `-W` filters would miss) are ignored by tests/gpu/conftest.py.
timeout 180 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -rs 2>&1 \
    | tee "$OUT/gpu_tests.log"
test_status=${PIPESTATUS[0]}
[ "$test_status" -ne 0 ] && status=$test_status

timeout 200 python3 benchmarks/gpu_bench.py --chunks 48 2>&1 | tee "$OUT/gpu_bench.log"
bench_status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] && [ "$bench_status" -ne 0 ] && status=$bench_status

echo "gpu_check: tests exit $test_status, benchmark exit $bench_status; logs in $OUT"
exit "$status"
