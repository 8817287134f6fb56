"""`lmcache-mp-bench --workload trace` end to end: real servers replaying traces the tests
write (hit counts worked out by hand), and the first 300 requests of the real one; the
trace file's checks and the flags it takes."""

import json
from pathlib import Path

import pytest

from lmcache_mp.bench.options import BenchOptions, FlagError, resolve
from lmcache_mp.bench.workloads.trace_file import TraceError, read_trace
from lmcache_mp.bench.workloads.trace_sim import simulate
from lmcache_mp.server.cache.eviction import EVICTIONS

from .test_cli import bench

CHUNK = 8192  # the replay's chunk: 512 tokens, 8 KiB
REAL_TRACE = Path(__file__).parent / "data" / "mooncake-conversation-300.jsonl"  # README there


def write_trace(path: Path, prompts: list[list[int]], tokens: list[int] | None = None) -> Path:
    lines = []
    for index, ids in enumerate(prompts):
        length = tokens[index] if tokens else 512 * len(ids)
        lines.append(json.dumps({"timestamp": index, "input_length": length,
                                 "output_length": 1, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def replay(tmp_path: Path, trace: Path, *flags: str) -> dict:
    out = tmp_path / "trace.json"
    result = bench("--workload", "trace", "--trace", str(trace), "--no-progress", "--json",
                   str(out), *flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASS:" in result.stdout and "| unbounded cache |" in result.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shared_prefixes_hit_as_counted_by_hand(tmp_path):
    # 0 hits, then 1 2; 1 2 3; 1: six of 13 blocks. The pool (1 MiB, 128 chunks) holds all.
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4, 5], [1, 2, 3, 6], [1, 7]],
                        [1536, 2000, 1600, 600])
    data = replay(tmp_path, trace)
    measured = data["measured"]
    assert data["blocks"] == 13 and data["distinct_blocks"] == 7
    assert measured["hit_blocks"] == data["unbounded"]["prefix"] == 6
    assert data["bound_pool"]["residency"] == 6
    assert measured["hit_tokens"] == 1024 + 1536 + 512 and data["tokens"] == 5736
    assert measured["refused_chunks"] == 0
    pool = measured["pool"]
    assert pool["capacity_chunks"] == 128 and pool["hit_blocks"] == 6
    assert pool["bytes_written"] == 7 * CHUNK and pool["bytes_read"] == 6 * CHUNK
    assert pool["evictions"] == 0 and measured["disk"] is None
    assert data["passed"] and data["hit_rates"]["measured"] == 6 / 13


def flood_trace(tmp_path: Path) -> Path:
    """A: 100 blocks, B: 100 others, A again: 200 distinct."""
    first, second = list(range(100)), list(range(100, 200))
    return write_trace(tmp_path / "flood.jsonl", [first, second, first])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pool_too_small_keeps_the_oldest_prompts_head(tmp_path):
    # A 128-chunk pool: B's STORE evicts 72 of A's chunks, its last first (the prefix rule),
    # so A again hits its first 28. Belady keeps A and lets B by: 100, as unbounded.
    data = replay(tmp_path, flood_trace(tmp_path), "--pool-share", "0.64")
    measured = data["measured"]
    assert measured["pool"]["capacity_chunks"] == 128
    assert measured["hit_blocks"] == 28
    assert data["bound_pool"]["residency"] == data["unbounded"]["prefix"] == 100
    # A's missing 72 stored again: 272 in all, each storing one evicted.
    assert measured["pool"]["bytes_written"] == 272 * CHUNK
    assert measured["pool"]["evictions"] == 272 - 128
    assert data["passed"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_disk_tier_serves_what_the_pool_evicted(tmp_path):
    data = replay(tmp_path, flood_trace(tmp_path), "--pool-share", "0.64", "--disk-share",
                  "1", "--disk-dir", str(tmp_path / "disks"))
    measured, alone = data["measured"], data["pool_only"]
    disk = measured["disk"]
    # Everything written through; A's head from the pool, its tail read back from disk.
    assert disk["capacity_chunks"] >= 200 and disk["chunks_written"] == 200
    assert disk["bytes_written"] == 200 * CHUNK and disk["dropped"] == 0
    assert measured["hit_blocks"] == 100
    assert measured["pool"]["hit_blocks"] == 28 and disk["hit_blocks"] == 72
    assert disk["bytes_read"] == 72 * CHUNK
    assert alone["hit_blocks"] == 28 and alone["disk"] is None
    assert data["bound_all"]["residency"] == 100 and data["passed"]
    assert list((tmp_path / "disks").iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_real_trace_first_300_requests(tmp_path):
    data = replay(tmp_path, REAL_TRACE, "--disk-share", "0.5")
    rates = data["hit_rates"]
    assert data["requests"] == 300 and data["passed"]
    assert 0 < rates["pool_only"] <= rates["measured"] <= rates["unbounded"]
    assert rates["measured"] <= rates["bound_all"] and rates["pool_only"] <= rates["bound_pool"]
    assert data["measured"]["disk"]["chunks_written"] > 0


@pytest.mark.parametrize("line, error", [
    ("not json", "not JSON"),
    ("[1]", "not a JSON object"),
    ('{"timestamp": -1, "input_length": 512, "output_length": 1, "hash_ids": [1]}',
     "`timestamp` must be a non-negative integer"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": []}',
     "`hash_ids` must be a non-empty list"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": ["a"]}',
     "integers in [0, 2**64)"),
    ('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 1]}',
     "repeats an id"),
    ('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}',
     "1 hash ids for 2000 input tokens"),
])
def test_a_malformed_trace_is_refused_naming_its_line(tmp_path, line, error):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}'
                    f"\n{line}\n")
    with pytest.raises(TraceError, match=f"{path}:2: .*") as raised:
        read_trace(path)
    assert error in str(raised.value)


def test_requests_are_replayed_in_timestamp_order(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": stamp, "input_length": 512, "output_length": 0,
                    "hash_ids": [stamp]}) + "\n" for stamp in (5, 1, 3)))
    assert [r.timestamp_ms for r in read_trace(path)] == [1, 3, 5]
    assert [r.timestamp_ms for r in read_trace(path, limit=2)] == [1, 5]


def test_trace_flags(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [[1]])
    resolve(BenchOptions(workload="trace", trace=trace, disk_share=0.5, trace_limit=3))
    for options, message in [
            (BenchOptions(workload="trace"), "needs --trace FILE"),
            (BenchOptions(trace=trace), "add --workload trace"),
            (BenchOptions(workload="trace", trace=tmp_path / "missing"), "is not a file"),
            (BenchOptions(workload="trace", trace=trace, disk_dir=tmp_path),
             "--disk-dir and --disk-admission need --disk-share"),
            (BenchOptions(workload="trace", trace=trace, requests=3, cpu_size="1GiB"),
             "--requests, --cpu-size: not for --workload trace")]:
        with pytest.raises(FlagError, match=message):
            resolve(options)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reused_admission_writes_what_comes_back_after_the_pool_let_it_go(tmp_path):
    # A and B are stored once each: nothing written. A again misses its last 72 chunks
    # (the pool evicted them) and stores them a second time: those 72 are written.
    data = replay(tmp_path, flood_trace(tmp_path), "--pool-share", "0.64", "--disk-share",
                  "1", "--disk-admission", "reused")
    measured = data["measured"]
    assert measured["disk"]["chunks_written"] == 72 and measured["disk"]["dropped"] == 0
    assert measured["hit_blocks"] == 28 and measured["disk"]["hit_blocks"] == 0


def test_a_malformed_trace_ends_the_run_with_status_2(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, '
                    '"hash_ids": [1, 2]}\n')
    result = bench("--workload", "trace", "--trace", str(path), "--no-progress")
    assert result.returncode == 2
    assert f"{path}:1: 2 hash ids for 512 input tokens" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("eviction", EVICTIONS)
def test_the_model_hits_what_the_server_hits_under_each_eviction(tmp_path, eviction):
    """The server's --eviction through the replay, against trace_sim's model of the same
    pool: the same hits, block for block; and --plot draws the curves."""
    plot = tmp_path / "trace.png"
    data = replay(tmp_path, REAL_TRACE, "--eviction", eviction, "--plot", str(plot))
    assert data["meta"]["options"]["eviction"] == eviction
    pool = data["measured"]["pool"]
    modelled = simulate(read_trace(REAL_TRACE), pool["capacity_chunks"], eviction=eviction)
    assert pool["evictions"] > 0 and data["measured"]["hit_blocks"] == modelled.hits
    assert pool["evictions"] == modelled.pool_evictions
    assert plot.read_bytes().startswith(b"\x89PNG")
