"""`lmcache-mp-bench --workload sglang` end to end, tiny: a real server, SGLang 0.5.23's own host
pools and storage backend factory, our backend and SGLang's file backend on the same pages.

No timing is asserted: every figure must be there, positive where it measures something,
held against its bound, and every page loaded byte for byte.
"""

import importlib.util
import json
import math
import os

import pytest

from .test_cli import bench


def sglang_installed() -> bool:
    """Without importing it: SGLang imports torch and thousands of modules (seconds) at
    collection otherwise; the workload itself says when an installed SGLang fails to import."""
    return importlib.util.find_spec("sglang") is not None


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not sglang_installed(), reason="sglang (scripts/bootstrap) is not installed")
def test_sglang_workload_moves_pages_byte_exact_beside_the_file_backend(tmp_path):
    out = tmp_path / "sglang.json"
    result = bench("--workload", "sglang", "--page-sizes", "1,4", "--sglang-bytes", "2MiB",
                   "--batch", "4", "--lookup-rounds", "1", "--lookup-iters", "20",
                   "--no-progress", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for row in ("| **1-token pages (128.0KiB)**: copy bound, 1 thread |",
                "| **4-token pages (512.0KiB)**: copy bound, 1 thread |",
                "|   store (batch_set_v1) |", "|   load (batch_exists + batch_get_v1) |",
                "| batch_exists of 128 pages, p50 |", "| batch_exists of 128 pages, p99 |"):
        assert row in result.stdout, row
    assert "FAIL" not in result.stdout
    data = json.loads(out.read_text())
    assert data["passed"] and data["layout"] == "layer_first" and data["rounds"] == 3
    assert data["file_root"] and data["file_filesystem"]
    assert [size["page_tokens"] for size in data["sizes"]] == [1, 4]
    for size, page_bytes in zip(data["sizes"], (128 * 1024, 512 * 1024)):
        pages = 2 * 1024 * 1024 // page_bytes
        assert size["page_bytes"] == page_bytes and size["pages"] == pages
        assert size["batch"] == 4 and size["byte_exact"]
        assert size["copy_gbps"] > 0 and len(size["copy_samples"]) == 3 + 3  # 3, then a round each
        assert size["target"] == 0.5  # pages under 2 MiB
        for name in ("ours_store", "ours_load", "file_store", "file_load"):
            moved = size[name]
            # Every round's pages, each moved once, and loaded ones all the same bytes.
            assert moved["pages"] == 3 * pages, name
            assert moved["missing"] == moved["mismatched"] == 0, name
            assert moved["seconds"] > 0 and moved["gbps"] > 0 and moved["pages_per_s"] > 0
            assert math.isclose(moved["copy_ratio"], moved["gbps"] / size["copy_gbps"])
        assert math.isclose(size["store_vs_file"],
                            size["ours_store"]["gbps"] / size["file_store"]["gbps"])
        assert math.isclose(size["load_vs_file"],
                            size["ours_load"]["gbps"] / size["file_load"]["gbps"])
    exists = data["exists"]
    assert exists["pages"] == exists["hits"] == 128
    assert exists["exists"]["samples"] == exists["echo"]["samples"] == 20  # 1 round of 20
    assert 0 < exists["exists"]["p50_us"] <= exists["exists"]["p99_us"]
    assert 0 < exists["echo"]["p50_us"] <= exists["echo"]["p99_us"]
    assert math.isclose(exists["p50_ratio"], exists["exists"]["p50_us"] / exists["echo"]["p50_us"])


def test_without_sglang_the_workload_says_what_to_install(tmp_path):
    broken = tmp_path / "sglang"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('not installed here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = bench("--workload", "sglang", "--no-progress", env=env, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    message = [line for line in result.stderr.splitlines() if "lmcache-mp-bench:" in line]
    assert len(message) == 1 and "scripts/bootstrap" in message[0], result.stderr[-2000:]
    assert "sglang==0.5.23" in message[0]


@pytest.mark.parametrize("args, message", [
    (["--workload", "sglang", "--requests", "4"], "--requests: not for --workload sglang"),
    (["--workload", "sglang", "--sglang-bytes", "lots"], "--sglang-bytes: invalid size"),
    (["--workload", "sglang", "--page-sizes", "4,x"], "expected token counts"),
    (["--workload", "W2", "--page-sizes", "4"], "are for --workload sglang"),
])
def test_sglang_flags_are_refused_before_anything_starts(args, message):
    result = bench(*args, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(not sglang_installed(), reason="sglang (scripts/bootstrap) is not installed")
def test_the_byte_check_finds_a_page_missing_or_one_byte_different():
    # As tests/integrations/sglang: SGLang imports vLLM, which picks its platform once a process.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch

    from lmcache_mp.bench.harness.sglang_pools import Geometry, import_sglang
    from lmcache_mp.bench.workloads.sglang import HostPools
    from lmcache_mp.bench.workloads.sglang_report import Moved

    import_sglang()
    tiny = Geometry(2, 1, 8, torch.bfloat16)
    pools = HostPools(tiny, 4, 2, 4, seed=0)  # 4 pages of 2 tokens, one call of 4
    pools.target.kv_buffer.copy_(pools.source.kv_buffer)
    moved = Moved(tiny.page_bytes(2))
    pools.check(4, 4, moved)
    assert moved.missing == moved.mismatched == 0
    # One bit of page 2: its V, last layer, last token, last byte.
    pools.target.get_data_page(2 * 2, flat=False).view(torch.uint8)[1, 1, 1, 0, 15] ^= 1
    pools.check(4, 4, moved)
    assert moved.missing == 0 and moved.mismatched == 1
    pools.check(2, 4, moved)  # two pages loaded of four: pages 2 and 3 missing
    assert moved.missing == 2 and moved.mismatched == 1
    pools.next_round()  # every source byte changed: no page left equal
    pools.check(4, 4, moved)
    assert moved.mismatched == 1 + 4
