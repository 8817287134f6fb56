"""`lmcache-mp-bench --workload engine`: real engines where vLLM's CPU build is installed, a
clean skip where it is not."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from lmcache_mp.bench.vllm_engine import TinyLlama
from lmcache_mp.bench.workloads import engine as vllm_ttft

from .conftest import CHUNK_SIZE


def test_skips_with_the_reason_without_vllm(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "lmcache_mp.bench.cli", "--workload", "engine", "--json",
         str(tmp_path / "out.json")], capture_output=True, text=True, timeout=60,
        env=os.environ | {"LMCACHE_MP_ENGINE_PYTHON": str(tmp_path / "no-python")})
    assert result.returncode == 0, result.stderr
    assert "--workload engine skipped" in result.stderr
    assert "scripts/bootstrap --vllm" in result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "out.json").exists()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)  # it may be the first test to wait for the engines to start
def test_a_round_on_real_engines_reports_every_figure(engines, admin):
    """The CLI runs this on engines of its own (measure); here it runs on the tests' engines."""
    figures = vllm_ttft.measure_with(engines.writer, engines.reader, admin, rounds=2,
                                     rng=random.Random(5), timeout=120.0, log=lambda _: None,
                                     prompt_tokens=5 * CHUNK_SIZE + 30, vocab=TinyLlama().vocab,
                                     salt="e2e-bench")
    assert figures.mismatches == 0
    assert all(len(samples) == 2 and min(samples) > 0
               for samples in (figures.cold, figures.vllm_prefix_cache, figures.loaded,
                               figures.turn2_vllm_prefix_cache, figures.turn2_loaded,
                               figures.turn2_recomputed))
    table = vllm_ttft.render(figures)
    assert "| TTFT, prefix loaded from lmcache-mp |" in table and "| TTFT, cold |" in table
    assert "| TTFT turn 2, question and answer loaded from lmcache-mp |" in table
    assert json.loads(vllm_ttft.to_json(figures))["medians"] == figures.medians
