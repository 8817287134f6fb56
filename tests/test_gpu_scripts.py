"""The GPU check's scripts, on a machine without a GPU: their structure, and what runs on a CPU.

benchmarks/gpu_check.sh is run on a lent GPU, once or twice a session, with no second
chance inside its budget: a syntax error, a stage without a time limit or a benchmark whose
client logic has never run would cost that chance. Here: the script parses, every command
of it that can hang runs under `timeout`, its budget fits one 7-minute call, it says to give
the machine back; it stops at the imports without CUDA with a summary; gpu_smoke.py says
in one line that there is no CUDA; gpu_bench.py --cpu runs its whole client logic (both
workloads, the MLA follower, the repeats, the JSON) on sealed-memfd caches, at the chunk
count and repeats gpu_check.sh gives it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "benchmarks" / "gpu_check.sh"
# Commands in the script that may hang: the interpreter, nvidia-smi, pip (through python).
_HANGS = re.compile(r'(^|[\s;(|&])("\$PYTHON"|nvidia-smi)\s')


def script_lines() -> list[tuple[int, str]]:
    """The script's shell lines (not comments, not the Python of its heredocs), with their
    continuation lines joined."""
    lines, heredoc, joined, first = [], None, "", 0
    for number, line in enumerate(CHECK.read_text().splitlines(), 1):
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        if not joined:
            first = number
        joined += line.rstrip("\\") + " "
        if line.endswith("\\"):
            continue
        found = re.search(r"<<'(\w+)'", joined)
        if found:
            heredoc = found.group(1)
        if not joined.lstrip().startswith("#"):
            lines.append((first, joined))
        joined = ""
    return lines


def test_the_check_parses_and_bounds_every_stage():
    assert subprocess.run(["bash", "-n", str(CHECK)]).returncode == 0
    unbounded = [(number, line.strip()) for number, line in script_lines()
                 if _HANGS.search(line) and not re.search(r"\btimeout\b[^|;]*("
                                                          r'"\$PYTHON"|nvidia-smi)', line)]
    assert unbounded == []
    text = CHECK.read_text()
    budget_line = re.search(r"^BUDGET=(\d+)", text, re.M)
    call_line = re.search(r"timeout_s=(\d+)", text)
    assert budget_line and call_line
    budget, call = int(budget_line.group(1)), int(call_line.group(1))
    # The stages' limits are cut to what is left of the budget, each kill grace on top.
    assert budget + 4 * 10 <= call <= 7 * 60
    assert "give_back" in text
    docs = (ROOT / "docs" / "gpu.md").read_text()
    assert f"timeout_s={call}" in docs and "give_back" in docs


def test_the_check_without_cuda_stops_at_the_imports_with_a_summary(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run for real")
    done = subprocess.run([str(CHECK)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)})
    assert done.returncode == 2, done.stdout + done.stderr
    summary = done.stdout[done.stdout.index("gpu_check summary"):]
    assert re.search(r"^imports\s+failed .*torch", summary, re.M), summary
    for stage in ("smoke", "tests", "bench"):
        assert re.search(rf"^{stage}\s+skipped", summary, re.M), summary
    assert (tmp_path / "environment.txt").exists()


def test_the_smoke_test_says_in_one_line_that_there_is_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("gpu_smoke: no CUDA here, nothing checked")
    assert done.stderr.count("\n") == 1


def gpu_check_bench_sizes() -> tuple[int, int]:
    """The --chunks and --repeats gpu_check.sh runs gpu_bench.py with on a GPU."""
    found = re.search(r"gpu_bench\.py --chunks (\d+) --repeats (\d+)", CHECK.read_text())
    assert found, "gpu_check.sh no longer runs gpu_bench.py --chunks N --repeats N"
    return int(found.group(1)), int(found.group(2))


@pytest.mark.timeout(360)
def test_the_benchmark_runs_its_clients_on_memfd_caches_at_the_gpu_checks_sizes(tmp_path):
    """Both workloads, the W3 follower's loads, every repeat; bytes compared on both sides;
    at the chunk count and repeats gpu_check.sh runs on a GPU (two layers a cache instead of
    32, so that it fits a CPU test): the warm-up and every batch of a phase go through the
    same client logic a GPU run's do, so a first GPU run cannot lose its figures to it."""
    chunks, repeats = gpu_check_bench_sizes()
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--cpu", "--chunks",
         str(chunks), "--layers", "2", "--repeats", str(repeats), "--timeout", "300"],
        capture_output=True, text=True, timeout=330, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    w1, w3 = data["results"]
    assert data["cpu"] and data["measured"] == (repeats >= 5)
    assert w1["bytes_match"] and w3["bytes_match"] and w3["follower_bytes_match"]
    assert [r["workload"] for r in (w1, w3)] == ["W1", "W3"]
    assert all(r["chunks"] == chunks for r in (w1, w3))
    assert all(len(r["store_wall_s"]) == len(r["retrieve_wall_s"]) == repeats
               for r in (w1, w3))
    assert w1["bytes_moved"] == repeats * chunks * w1["chunk_bytes"] and w1["raw"] is None
    assert w1["chunk_bytes"] == 2 * 2 * 256 * 8 * 128 * 2  # K and V, 2 layers, float16
    assert w1["server_store_copy_s"] > 0 and w1["server_retrieve_copy_s"] > 0
    assert "--cpu: memfd caches, no GPU" in done.stdout


def test_a_few_repeats_are_reported_as_samples(tmp_path):
    """Under five repeats and 10 GB the figures are called samples, not measurements."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--cpu", "--chunks", "3",
         "--layers", "2", "--repeats", "2", "--timeout", "60"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert not data["measured"] and all(r["bytes_match"] for r in data["results"])
    assert "samples, not measurements" in done.stdout
