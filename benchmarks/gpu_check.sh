#!/usr/bin/env bash
# The GPU check, in one call that ends within 7 minutes: imports, a smoke test of CUDA IPC
# (memory and events) and pinning, the GPU tests, then the GPU benchmark (only if the tests
# passed). Where CUDA IPC is refused, what needs no IPC still runs and is reported.
#
# Through the device tool, in one call (its $OUT is set there; logs and JSON come back):
#
#   run(command="benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=420)
#
# then call the device tool's give_back unless you rerun at once: an idle machine keeps
# spending the session's device time.
#
# Before that, once, here (with network): scripts/gpu_wheels, which fills .whl/ (git-ignored)
# with the pyzmq, msgspec and blake3 wheels for the machine's CPython 3.12; the rest (torch, cupy,
# msgpack, uvloop, pytest, pytest-timeout) is there already. The project needs no wheel: it
# runs from the working tree (PYTHONPATH). Sized for a 15-minute device budget: one call of at
# most 7 minutes plus the machine's start, leaving room to run it again.
#
# Stages, each under its own `timeout` (nvidia-smi's too), stopping at the first that fails
# except as noted:
#   1. wheels   install .whl/*.whl into /tmp/site when `import zmq, msgspec, blake3` fails (seconds)
#   2. imports  torch with CUDA, cupy, zmq, msgpack, msgspec, uvloop, pytest_timeout, lmcache_mp
#   3. smoke    benchmarks/gpu_smoke.py (~10 s): CUDA IPC between two processes (memory and an
#               interprocess event), 1 GiB pinned with cudaHostRegister. Its verdict says
#               what failed: the spawn (6), the child's CUDA start (7), the IPC open (3) or
#               the IPC event (8); the check then goes on without IPC (below). Pinning
#               refused only (status 4): go on, the server runs unpinned.
#   4. tests    pytest tests/gpu, each test bounded by --timeout. Without IPC: the tests
#               that need none (test_allocators, test_copier, and test_in_process: the
#               dispatcher and the stream copier on real streams in one process).
#   5. bench    benchmarks/gpu_bench.py (W1 and W3, medians of 5 repeats), only if the
#               tests passed. Without IPC: gpu_bench.py --raw-only (the raw pinned bound).
# Then one summary block: each stage ok/failed/skipped with its time, the smoke verdict,
# and the benchmark's figures. Exit status: 0 when all passed, else the first failure's.
# Without a run() call: benchmarks/gpu_check.sh from anywhere; $OUT defaults to
# gpu-check-out/ in the repository.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export OUT
PYTHON=${PYTHON:-python3}
BUDGET=380  # seconds for the whole script; every stage's limit is cut to what is left
START=$SECONDS

declare -a NAMES=() STATES=() TIMES=() NOTES=()
status=0
stopped=""

record() {  # name state seconds note
    NAMES+=("$1"); STATES+=("$2"); TIMES+=("$3"); NOTES+=("$4")
    if [ "$2" = failed ] && [ "$status" -eq 0 ]; then
        status=$5
    fi
}

limit() {  # the smaller of $1 and the seconds left in the budget (at least 5)
    local left=$((BUDGET - (SECONDS - START)))
    [ "$left" -lt 5 ] && left=5
    [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

summary() {
    echo
    echo "==================== gpu_check summary ===================="
    local i
    for i in "${!NAMES[@]}"; do
        printf '%-8s %-8s %5ss  %s\n' "${NAMES[$i]}" "${STATES[$i]}" "${TIMES[$i]}" "${NOTES[$i]}"
    done
    for name in wheels imports smoke tests bench; do
        if [[ ! " ${NAMES[*]} " =~ " $name " ]]; then
            printf '%-8s %-8s %5s   %s\n' "$name" skipped - "${stopped:-not run}"
        fi
    done
    if [ -f "$OUT/gpu_bench.json" ]; then
        timeout 20 "$PYTHON" - "$OUT/gpu_bench.json" <<'EOF' 2>/dev/null || echo "bench    (gpu_bench.json unreadable)"
import json, sys
data = json.load(open(sys.argv[1]))
for r in data["results"]:
    raw = r["raw"] or {}
    print(f"bench    {r['workload']}: store {r['store_gbps']:.1f} GB/s ({r['store_ratio']:.0%} "
          f"of raw D2H {raw.get('d2h_gbps', 0):.1f}, device {raw.get('d2h_device_gbps', 0):.1f}),"
          f" retrieve {r['retrieve_gbps']:.1f} GB/s ({r['retrieve_ratio']:.0%} of raw H2D "
          f"{raw.get('h2d_gbps', 0):.1f}, device {raw.get('h2d_device_gbps', 0):.1f}); "
          f"{r['bytes_moved'] / 1e9:.1f} GB over {r['repeats']} repeats; bytes "
          f"{'exact' if r['bytes_match'] else 'WRONG'}")
print(f"bench    pinned_bytes {data['pinned_bytes']}; {data['device']}; server GPU memory "
      f"{data['server_gpu_mib']} MiB (staging at most {data['staging_mib']:.0f} MiB)")
EOF
    elif [ -f "$OUT/gpu_raw.json" ]; then
        grep -h '^raw ' "$OUT/gpu_bench.log" 2>/dev/null | sed 's/^/bench    /'
    fi
    echo "total    $((SECONDS - START)) s; exit status $status; logs in $OUT"
    echo "==========================================================="
}
trap 'summary' EXIT

# 1. wheels: pyzmq, msgspec and blake3 (and whatever else .whl/ holds) when python3 lacks it
t=$SECONDS
if timeout 60 "$PYTHON" -c "import zmq, msgspec, blake3" 2>/dev/null; then
    export PYTHONPATH=$PWD
    record wheels ok $((SECONDS - t)) "pyzmq, msgspec and blake3 already installed; .whl/ not needed" 0
elif ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: pyzmq, msgspec or blake3 is missing and .whl/ holds no wheels: run scripts/gpu_wheels" \
         "here, then carry .whl (run(..., carry=[\".whl\"]))" >&2
    record wheels failed $((SECONDS - t)) "pyzmq, msgspec or blake3 missing and no .whl/: run scripts/gpu_wheels" 1
    stopped="stopped: no pyzmq, msgspec or blake3"
    exit "$status"
else
    timeout 60 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl 2>&1 | tee "$OUT/wheels.log"
    rc=${PIPESTATUS[0]}
    export PYTHONPATH=/tmp/site:$PWD
    if [ "$rc" -ne 0 ]; then
        record wheels failed $((SECONDS - t)) "pip install of .whl/ failed (see wheels.log)" "$rc"
        stopped="stopped: wheels failed"
        exit "$status"
    fi
    record wheels ok $((SECONDS - t)) "installed: $(cd .whl && ls *.whl | tr '\n' ' ')" 0
fi

# 2. imports, all at once: one line each, then stop if any failed
t=$SECONDS
timeout -k 5 15 nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader >"$OUT/environment.txt" 2>&1 \
    || echo "nvidia-smi: not available, or timed out" >"$OUT/environment.txt"
timeout 90 "$PYTHON" - <<'EOF' 2>&1 | tee -a "$OUT/environment.txt"
import importlib, sys
failed = []
def check(name, test=None):
    try:
        module = importlib.import_module(name)
        note = test(module) if test else getattr(module, "__version__", "")
        print(f"import {name:<22} ok {note}")
    except Exception as error:  # noqa: BLE001
        print(f"import {name:<22} FAILED: {type(error).__name__}: {error}".splitlines()[0])
        failed.append(name)
def torch_cuda(torch):
    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
    return f"{torch.__version__} CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}"
def cupy_cuda(cupy):
    return f"{cupy.__version__}, {cupy.cuda.runtime.getDeviceCount()} device(s)"
print(f"python {sys.version.split()[0]} at {sys.executable}")
check("torch", torch_cuda)
for name, test in (("cupy", cupy_cuda), ("zmq", None), ("msgpack", None), ("msgspec", None),
                   ("uvloop", None), ("pytest", None), ("pytest_timeout", lambda m: ""),
                   ("lmcache_mp", None),
                   ("lmcache_mp.server.cli", lambda m: ""), ("lmcache_mp.cuda", lambda m: "")):
    check(name, test)
if failed:
    print(f"imports: FAILED: {', '.join(failed)}")
    sys.exit(1)
EOF
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
    missing=$(sed -n 's/^imports: FAILED: //p' "$OUT/environment.txt")
    echo "gpu_check: stopped: the imports failed (${missing:-timed out}); see above" >&2
    record imports failed $((SECONDS - t)) "failed: ${missing:-timed out or crashed}" 2
    stopped="stopped: imports failed"
    exit "$status"
fi
record imports ok $((SECONDS - t)) "torch+CUDA, cupy, zmq, msgpack, msgspec, uvloop, lmcache_mp" 0

# 3. the smoke test: CUDA IPC (memory, events) and pinning, ~10 s
t=$SECONDS
ipc=yes
timeout -k 5 "$(limit 60)" "$PYTHON" benchmarks/gpu_smoke.py 2>&1 | tee "$OUT/gpu_smoke.log"
rc=${PIPESTATUS[0]}
verdict=$(sed -n 's/^gpu_smoke: //p' "$OUT/gpu_smoke.log" | tail -1)
case "$rc" in
    0) record smoke ok $((SECONDS - t)) "$verdict" 0 ;;
    4) record smoke failed $((SECONDS - t)) "$verdict (going on: the server runs unpinned)" 4 ;;
    3|6|7|8)
        ipc=no
        record smoke failed $((SECONDS - t)) "$verdict (going on without IPC)" "$rc" ;;
    *)
        [ "$rc" -ge 124 ] && verdict="timed out after $(limit 60) s"
        record smoke failed $((SECONDS - t)) "${verdict:-exit $rc}" "$rc"
        stopped="stopped: the smoke test failed"
        exit "$status" ;;
esac

# 4. the GPU tests: one server per module; each test at most 60 s
# Only tests/gpu: the rest of the suite needs vLLM, and runs in CI without a GPU. Warnings
# are errors in this project's tests; those of cupy and torch's CUDA set-up (and of their
# submodules, which `-W` filters would miss) are ignored by tests/gpu/conftest.py.
t=$SECONDS
if [ "$ipc" = yes ]; then
    tests=(tests/gpu)
else
    tests=(tests/gpu/test_allocators.py tests/gpu/test_copier.py tests/gpu/test_in_process.py)
fi
timeout -k 10 "$(limit 180)" "$PYTHON" -m pytest "${tests[@]}" -m gpu -q -p no:cacheprovider \
    -rs --timeout 60 --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
rc=${PIPESTATUS[0]}
result=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|no tests ran' "$OUT/gpu_tests.log" \
         | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
[ "$ipc" = no ] && result="${result} (without IPC: ${tests[*]})"
if [ "$rc" -eq 0 ]; then
    record tests ok $((SECONDS - t)) "$result" 0
else
    [ "$rc" -ge 124 ] && result="timed out (${result:-no result line})"
    record tests failed $((SECONDS - t)) "${result:-exit $rc}" "$rc"
    if [ "$ipc" = yes ]; then
        stopped="skipped: the tests failed"
        exit "$status"
    fi
fi

# 5. the benchmark: W1 and W3, byte for byte, against raw pinned copies; without IPC, the
# raw bound alone
t=$SECONDS
bench_limit=$(limit 170)
if [ "$bench_limit" -lt 60 ]; then
    record bench failed 0 "not run: only $bench_limit s left of the ${BUDGET} s budget" 124
    exit "$status"
fi
if [ "$ipc" = yes ]; then
    timeout -k 10 "$bench_limit" "$PYTHON" benchmarks/gpu_bench.py --chunks 48 --repeats 5 \
        --timeout $((bench_limit - 30)) 2>&1 | tee "$OUT/gpu_bench.log"
    rc=${PIPESTATUS[0]}
    line=$(grep -E '^W1 target' "$OUT/gpu_bench.log" | tail -1)
else
    timeout -k 10 "$bench_limit" "$PYTHON" benchmarks/gpu_bench.py --raw-only --chunks 48 \
        --repeats 5 2>&1 | tee "$OUT/gpu_bench.log"
    rc=${PIPESTATUS[0]}
    line="raw bound only, no IPC: $(grep -E '^raw W1' "$OUT/gpu_bench.log" | tail -1)"
fi
if [ "$rc" -eq 0 ]; then
    record bench ok $((SECONDS - t)) "$line" 0
else
    [ "$rc" -ge 124 ] && line="timed out after $bench_limit s"
    record bench failed $((SECONDS - t)) "${line:-exit $rc}" "$rc"
fi
exit "$status"
