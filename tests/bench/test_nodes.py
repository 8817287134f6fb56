"""`lmcache-mp-bench --nodes 2`: two real servers sharing a real redis-server, on a tiny chat run.

No timing is asserted: the figures must be there, positive where they measure something,
consistent with each other, and every chunk loaded (across nodes too) byte-exact.
"""

import json
import os
import shutil

import pytest

from tests.bench.test_cli import TINY, bench
from tests.redis_servers import redis_cluster, redis_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None and not os.environ.get("CI"),
                       reason="redis-server is not installed (apt-get install redis-server); "
                              "CI installs it"),
]

SMALL = ["--workload", "chat", "--nodes", "2", "--requests", "24", "--batch", "4",
         "--cpu-size", "256MiB", "--no-progress",
         # each wait of the bench well under pytest's 120 s, so a stuck one reports itself
         "--timeout", "40"]


def run_nodes(tmp_path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "nodes.json"
    result = bench(*SMALL, *args, "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def check_hits(hits: dict) -> None:
    assert hits["chunks"] > 0
    # What hit was computed earlier somewhere; what a node alone could hit is a part of that.
    assert 0 < hits["hit_chunks"] <= hits["ideal_hit_chunks"] <= hits["chunks"]
    assert hits["local_ideal_chunks"] <= hits["ideal_hit_chunks"]
    assert hits["cross_node_chunks"] <= hits["hit_chunks"]


def test_two_nodes_with_a_spawned_redis_and_a_warm_restart(tmp_path):
    data, stdout = run_nodes(tmp_path, "--adopt-restart")
    assert "| hit rate, 2 nodes sharing L2 |" in stdout and "| byte-exact checks |" in stdout
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
    assert not any(name.startswith("lmcache-mp-bench-") for name in os.listdir("/dev/shm"))


def test_a_given_l2(tmp_path):
    with redis_server() as redis:
        data, _ = run_nodes(tmp_path, "--l2", redis.url)
        assert not data["l2_spawned"] and data["l2_url"] == redis.url
        assert data["cross_node_whole_hits"] > 0 and data["restart"] is None
        # The run's SET probe removed its keys; what stays is the nodes' chunks.
        assert not redis.client().keys("lmcache-mp-bench:*")


def test_a_redis_cluster_as_l2(tmp_path):
    """--l2 takes what the server's --l2 takes: a cluster, named by its seed nodes."""
    with redis_cluster() as nodes:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in nodes)
        data, _ = run_nodes(tmp_path, "--l2", url)
        assert not data["l2_spawned"] and data["l2_url"] == url
        assert data["cross_node_whole_hits"] > 0 and data["l2_chunks_written"] > 0
        assert data["redis_set_chunks_per_s"] > 0
        # The run's SET probe removed its keys, one by one across the cluster's slots.
        for node in nodes:
            assert not node.client().keys("lmcache-mp-bench:*")


@pytest.mark.parametrize("args, message", [
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
    for flag in ("--nodes N", "--l2 URL", "--adopt-restart"):
        assert flag in result.stdout
