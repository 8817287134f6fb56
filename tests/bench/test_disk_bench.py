"""`lmcache-mp-bench --workload disk` and `--workload chat --disk-size` end to end, tiny: real
servers with a disk tier in a temporary directory, real ranks, real files.

No timing is asserted: every figure must be there, positive where it measures something,
held against its bound (ratios are measured / bound), and every byte check passed.
"""

import json
import math
from pathlib import Path

import pytest

from lmcache_mp.bench.harness import disk_bound
from lmcache_mp.server.disk.reader import READ_THREADS

from .test_cli import TINY, bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_disk_workload_holds_the_tier_against_the_raw_disk(tmp_path):
    out = tmp_path / "disk.json"
    result = bench("--workload", "disk", "--requests", "6", "--chunks", "4", "--batch", "1",
                   "--cpu-size", "8MiB", "--restart-chunks", "1000", "--disk-dir",
                   str(tmp_path / "disks"), "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    for row in ("| raw write, 1 thread |", f"| raw read, {READ_THREADS} threads |", "| tier write",
                "| tier read", "| chunks served after a restart | 24 of 24 |",
                "served again, byte for byte", "start to index whole"):
        assert row in result.stdout, row
    data = json.loads(out.read_text())
    assert data["passed"]
    raw, tier, restart = data["raw"], data["tier"], data["restart"]
    # Three passes (before, between and after the tier's phases) at 1 thread and at the
    # tier's read threads.
    assert sorted(sample["threads"] for sample in raw["samples"]) == [1] * 3 + [READ_THREADS] * 3
    assert raw["total_bytes"] == tier["chunks"] * tier["chunk_bytes"] == 24 * 512 * 1024
    assert all(sample["write_gbps"] > 0 and sample["read_gbps"] > 0
               for sample in raw["samples"])
    # The raw bound says which I/O it used, as the tier does (the same filesystem).
    assert raw["direct"] == disk_bound.direct_io(tmp_path)
    assert ("direct" in tier["io"]) == raw["direct"]
    # The target's write figure is the tier's rate while it had work: its busy seconds
    # are within the phase, so that rate is at least the end-to-end one.
    assert math.isclose(data["write_ratio"], tier["busy_gbps"] / raw["write_gbps"])
    assert math.isclose(data["end_to_end_ratio"], tier["write_gbps"] / raw["write_gbps"])
    assert 0 < tier["busy_seconds"] <= tier["write_seconds"]
    assert tier["busy_gbps"] >= tier["write_gbps"]
    assert math.isclose(data["read_ratio"], tier["read_gbps"] / raw["read_gbps"])
    # Everything stored reached the disk, and came back from it byte for byte.
    assert tier["chunks_written"] == 24 and tier["dropped"] == 0
    assert tier["bytes_written"] == tier["bytes_read"] == 24 * 512 * 1024
    assert tier["served_chunks"] == tier["verified_chunks"] == 24 and tier["byte_exact"]
    assert tier["write_seconds"] > tier["store_seconds"] > 0 and tier["read_seconds"] > 0
    # SIGKILL: rounded up to prompts of 64, then a burst of one more prompt.
    assert restart["chunks"] == 1024 and restart["burst_chunks"] == 64
    assert restart["completed_base"] == restart["served_base"] == 1024
    assert restart["served_share"] == 1.0 and restart["byte_exact"]
    assert restart["mismatched"] == restart["disk_corrupt"] == 0
    assert restart["completed_base"] <= restart["written_at_kill"] <= restart["loaded_chunks"]
    assert 0 < restart["first_lookup_seconds"] <= restart["loaded_seconds"]
    assert restart["bound_first_lookup_seconds"] > 0 and restart["index_bytes_per_chunk"] > 0
    # The run's directory is gone; the one it was made in stays.
    assert list((tmp_path / "disks").iterdir()) == []


def test_chat_with_a_disk_tier_reports_three_hit_rates(tmp_path):
    out = tmp_path / "chat.json"
    result = bench("--workload", "chat", "--requests", "40", "--batch", "2", "--disk-size",
                   "64MiB", "--disk-dir", str(tmp_path / "disks"), *TINY, "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| hit rate: the same pool alone |" in result.stdout
    assert "| write-through wrote / the pool evicted" in result.stdout
    data = json.loads(out.read_text())
    disk, hit = data["disk"], data["figures"]["hit_rate"]
    assert 0 < disk["pool_only_hit_rate"] <= hit["measured"] <= hit["bound"] <= 1
    assert 0 < disk["pool_share"] < 1
    # Write-through wrote what the pool took (nothing dropped on a disk that keeps up).
    assert disk["chunks_written"] > 0 and disk["dropped"] == 0
    assert disk["pool_evictions"] > 0
    assert data["checks"]["corrupt_chunks"] == 0 and data["checks"]["failed_load_blocks"] == 0
    assert list((tmp_path / "disks").iterdir()) == []


def test_chat_with_a_disk_tier_takes_the_servers_admission_policy(tmp_path):
    """--disk-admission reused: a chunk is written only once the pool let it go and a STORE
    brought it again, so the disk writes no more chunks than the pool evicted."""
    out = tmp_path / "chat.json"
    result = bench("--workload", "chat", "--requests", "40", "--batch", "2", "--disk-size",
                   "64MiB", "--disk-admission", "reused", *TINY, "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    disk = json.loads(out.read_text())["disk"]
    assert disk["pool_evictions"] > 0 and disk["dropped"] == 0
    assert disk["chunks_written"] <= disk["pool_evictions"]


@pytest.mark.parametrize("args, message", [
    (["--workload", "W2", "--disk-size", "1GiB"], "--disk-size runs the chat workload"),
    (["--workload", "chat", "--disk-size", "1GiB", "--url"], "spawns its own server"),
    (["--workload", "chat", "--disk-size", "lots"], "--disk-size: invalid size"),
    (["--workload", "chat", "--disk-dir", "/tmp"], "--disk-dir needs --disk-size"),
    (["--workload", "disk", "--disk-size", "1GiB"], "does not apply to --workload disk"),
    (["--workload", "W2", "--disk-admission", "reused"], "--disk-admission needs --disk-size"),
])
def test_disk_flags_are_refused_before_anything_starts(args, message):
    result = bench(*args, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


def test_the_raw_bound_reads_and_writes_the_bytes_it_says(tmp_path: Path):
    sample = disk_bound.measure(tmp_path, 64 * 1024, 8, 4)
    assert sample.threads == 4 and sample.write_gbps > 0 and sample.read_gbps > 0
    assert list(tmp_path.iterdir()) == []  # its file is gone
    assert disk_bound.filesystem(tmp_path)
