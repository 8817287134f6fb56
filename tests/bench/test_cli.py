"""`lmcache-mp-bench` end to end on tiny configurations: real servers, ranks and redis-server.

No timing is asserted: figures must be present, positive where they measure something,
and consistent with each other (ratios are measured / bound).
"""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import run_server

# Above bench()'s own 240 s: a hung run fails its own test instead of ending the session.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BENCH = Path(sys.executable).parent / "lmcache-mp-bench"
TINY = ["--lookup-rounds", "1", "--lookup-iters", "20", "--lookup-seconds", "0.2",
        "--no-progress"]


def bench(*args: str, env: dict[str, str] | None = None, timeout: float = 240
          ) -> subprocess.CompletedProcess:
    assert BENCH.exists(), f"the console script is not installed next to {sys.executable}"
    return subprocess.run([str(BENCH), *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env=env)


def run_json(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    out = tmp_path / "out.json"
    result = bench(*args, *TINY, "--json", str(out), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| STORE |" in result.stdout and "byte-exact checks" in result.stdout
    return json.loads(out.read_text())


def assert_compared(compared: dict, *, positive: bool = True) -> None:
    assert set(compared) == {"measured", "bound", "ratio"}
    if positive:
        assert compared["measured"] > 0 and compared["bound"] > 0
    assert math.isclose(compared["ratio"], compared["measured"] / compared["bound"])


@pytest.mark.skipif(shutil.which("redis-server") is None and not os.environ.get("CI"),
                    reason="redis-server is not installed (apt-get install redis-server); "
                           "CI installs it")
def test_w2_with_redis_json_and_plot(tmp_path):
    plot = tmp_path / "out.png"
    data = run_json(tmp_path, "--workload", "W2", "--requests", "6", "--chunks", "2",
                    "--batch", "3", "--peer", "redis", "--plot", str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = data["figures"]
    assert set(figures) == {"store", "retrieve", "store_vs_redis", "retrieve_vs_redis",
                            "lookup_p50", "lookup_p99", "lookup_p999", "lookup_keys_per_s",
                            "hit_rate", "tokens_saved", "requests_per_s",
                            "transfer_requests_per_step"}
    for name in ("store", "retrieve", "store_vs_redis", "retrieve_vs_redis", "lookup_p50",
                 "lookup_p99", "lookup_p999", "lookup_keys_per_s"):
        assert_compared(figures[name])
    assert figures["store"]["bound"] == data["copy_bound_gbps"]
    assert figures["store_vs_redis"]["measured"] == figures["store"]["measured"]
    assert data["lookup"]["p50_us"] <= data["lookup"]["p99_us"] <= data["lookup"]["p999_us"]
    assert data["lookup"]["samples"] == data["echo"]["samples"] == 20
    # Six prompts of two chunks: stored once, hit once; an unbounded cache does no better.
    assert figures["hit_rate"] == {"measured": 0.5, "bound": 0.5, "ratio": 1.0}
    assert 0.4 < figures["tokens_saved"] < 0.5  # the last block of each prompt is computed
    assert figures["requests_per_s"] > 0
    # One engine, one rank: a STORE per step that stores, a RETRIEVE per step that hits.
    assert figures["transfer_requests_per_step"] == 1.0
    (phase,) = data["phases"]
    assert phase["requests"] == 12
    assert phase["stored_bytes"] == phase["retrieved_bytes"] == 12 * 512 * 1024
    assert phase["peer_stored_bytes"] == phase["peer_fetched_bytes"] == 12 * 512 * 1024
    assert data["checks"] == {"verified_chunks": 12, "corrupt_chunks": 0,
                              "peer_corrupt_chunks": 0, "failed_load_blocks": 0}
    server = data["server"]
    assert server["spawned"] and server["url"].startswith("ipc://")
    assert server["peak_rss_bytes"] > 0 and server["cpu_seconds"] > 0
    assert data["meta"]["redis_server"] and data["meta"]["options"]["workload"] == "W2"


def test_w1_moves_its_32_mib_chunks_both_ways(tmp_path):
    data = run_json(tmp_path, "--workload", "W1", "--requests", "2", "--chunks", "1",
                    "--batch", "2")
    (phase,) = data["phases"]
    chunk = 32 * 2**20
    assert phase["stored_bytes"] == phase["retrieved_bytes"] == 2 * chunk
    assert data["checks"]["verified_chunks"] == 2 and data["checks"]["corrupt_chunks"] == 0
    assert data["figures"]["hit_rate"] == {"measured": 0.5, "bound": 0.5, "ratio": 1.0}
    assert data["meta"]["options"]["shape"] == "W1" and data["meta"]["options"]["mla"] is False


def test_w3_tp2_mla_fills_both_ranks(tmp_path):
    data = run_json(tmp_path, "--workload", "W3", "--tp", "2", "--requests", "2",
                    "--chunks", "1", "--batch", "2")
    (phase,) = data["phases"]
    chunk = 9 * 2**20
    assert phase["stored_bytes"] == 2 * chunk  # only the leader sends STORE
    assert phase["retrieved_bytes"] == 2 * 2 * chunk  # the server fills the follower too
    assert data["checks"]["verified_chunks"] == 4 and data["checks"]["corrupt_chunks"] == 0
    assert data["meta"]["options"]["mla"] is True
    assert data["figures"]["transfer_requests_per_step"] == 1.0  # the leader's alone


def test_w3_every_rank_sends_without_mla(tmp_path):
    data = run_json(tmp_path, "--workload", "W3", "--tp", "2", "--no-mla", "--requests", "2",
                    "--chunks", "1", "--batch", "2")
    assert data["figures"]["transfer_requests_per_step"] == 2.0
    (phase,) = data["phases"]
    chunk = 9 * 2**20
    # Both ranks STORE the same two chunks; the server copies them once, so they count once.
    assert phase["stored_bytes"] == 2 * chunk
    assert phase["retrieved_bytes"] == 2 * 2 * chunk  # each rank RETRIEVEs its own copy
    assert data["checks"]["verified_chunks"] == 4 and data["checks"]["corrupt_chunks"] == 0


def test_chat_hit_rate_is_held_against_an_unbounded_cache(tmp_path):
    data = run_json(tmp_path, "--workload", "chat", "--requests", "24", "--batch", "4")
    hit = data["figures"]["hit_rate"]
    assert 0 < hit["measured"] <= hit["bound"] <= 1
    assert 0 < data["figures"]["tokens_saved"] < 1
    assert data["checks"]["corrupt_chunks"] == 0 and data["checks"]["verified_chunks"] > 0


def test_warm_restart_measures_both_ways_and_adopts_every_chunk(tmp_path):
    out = tmp_path / "restart.json"
    result = bench("--workload", "warm-restart", "--restart-chunks", "640", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| start to serving |" in result.stdout and "| index memory a chunk |" in result.stdout
    figures = json.loads(out.read_text())
    assert figures["chunks"] == figures["adopted"] == 640 and figures["byte_exact"]
    assert figures["chunk_bytes"] == 8192
    for name in ("stop_seconds", "snapshot_seconds", "start_seconds", "verify_seconds",
                 "verify_cpu_seconds", "verified_gbps_per_core"):
        assert figures[name] > 0, name
    assert figures["snapshot_seconds"] <= figures["stop_seconds"]
    assert figures["verify_seconds"] <= figures["start_seconds"]
    # 640 chunks are too few for the heap to say what a chunk costs: only that it says.
    assert all(math.isfinite(figures[name]) for name in ("stored_index_bytes",
                                                          "adopted_index_bytes"))


def test_multi_tenant_quota_keeps_steady_tenants_hitting(tmp_path):
    data = run_json(tmp_path, "--workload", "multi-tenant")
    phases = {phase["name"]: phase["tenants"] for phase in data["phases"]}
    assert list(phases) == ["baseline", "flood", "flood+quota"]
    for tenant in ("steady-a", "steady-b"):
        assert phases["baseline"][tenant]["hit_rate"] == 1.0
        assert phases["flood+quota"][tenant]["hit_rate"] == 1.0
        assert phases["flood"][tenant]["hit_rate"] < 1.0
    assert phases["flood"]["flood"]["hit_rate"] == 0.0


def test_a_running_server_is_left_as_it_was_found(tmp_path):
    """`--url` alone: the server at this user's default endpoint (here the test server's
    runtime directory stands for it), its credentials read from that directory."""
    with run_server("--cpu-size", "128MiB") as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_MP_")}
        env["LMCACHE_MP_RUNTIME_DIR"] = str(server.runtime_dir)
        data = run_json(tmp_path, "--url", "--workload", "W2", "--requests", "2",
                        "--chunks", "1", env=env)
        assert not data["server"]["spawned"] and data["server"]["url"] == server.url
        assert data["checks"]["verified_chunks"] == 2
        with server.client(admin=True) as client:  # quotas and tenants are the admin's to see
            stats = client.stats()
            assert stats.chunks == 0 and stats.tenants == {} and stats.registrations == 0
            assert client.quota_list().quotas == []


def test_a_tcp_server_is_reached_with_the_tokens_from_the_environment(tmp_path):
    """On tcp:// every client needs the engine token (the admin client the admin token):
    without them the run fails; with them in the environment its engines work."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with run_server("--cpu-size", "128MiB", url=f"tcp://127.0.0.1:{port}") as server:
        args = ["--url", server.url, "--workload", "W3", "--tp", "2", "--requests", "2",
                "--chunks", "1", "--batch", "2", "--timeout", "10", *TINY]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_MP_")}
        # No token anywhere (this user's runtime directory is not the server's).
        env["LMCACHE_MP_RUNTIME_DIR"] = str(tmp_path / "nowhere")
        refused = bench(*args, env=env, timeout=120)
        assert refused.returncode == 3 and "Traceback" not in refused.stderr
        assert "token" in refused.stderr, refused.stderr[-2000:]
        env.update(LMCACHE_MP_TOKEN=server.token(), LMCACHE_MP_ADMIN_TOKEN=server.token(admin=True))
        out = tmp_path / "out.json"
        result = bench(*args, "--json", str(out), env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        data = json.loads(out.read_text())
        assert data["server"]["url"] == server.url and not data["server"]["spawned"]
        # MLA: the follower rank joined its leader's group (one engine secret for both).
        assert data["checks"]["verified_chunks"] == 4 and data["checks"]["corrupt_chunks"] == 0


def test_redis_missing_says_how_to_install_it(tmp_path):
    env = {**os.environ, "PATH": str(BENCH.parent)}  # our venv, without /usr/bin
    result = bench("--workload", "W2", "--requests", "1", "--peer", "redis", *TINY, env=env)
    assert result.returncode == 2
    assert "apt-get install redis-server" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--workload", "W1", "--mla"], "--mla needs an MLA shape"),
    (["--workload", "chat", "--chunks", "2"], "--chunks does not apply to chat"),
    (["--workload", "W2", "--requests", "0"], "must be at least 1"),
    (["--workload", "W2", "--requests", "3", "--duration", "5"], "not allowed with"),
    (["--workload", "W1", "--shape", "W2"], "W1 is its own shape"),
])
def test_bad_flags_are_refused_before_anything_starts(args, message):
    result = bench(*args, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--workload", "W1", "--mla"], 2),
                                        (["--workload", "chat", "--nodes", "2", "--url"], 2)])
def test_help_and_flag_errors_come_without_importing_torch(argv, code):
    """torch takes seconds to import: --help and a typo are answered without it."""
    probe = ("import sys\n"
             "from lmcache_mp.bench.cli import main\n"
             "try:\n"
             f"    main({argv!r})\n"
             "except SystemExit as exc:\n"
             "    print('exit', exc.code, 'torch' in sys.modules, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.stderr.splitlines()[-1] == f"exit {code} False", done.stderr


def test_a_server_that_does_not_answer_fails_the_run_in_bounded_time():
    nobody = "ipc:///tmp/lmcache-mp-test-nobody-listens.sock"
    result = bench("--url", nobody, "--workload", "W2", "--requests", "1", "--timeout", "2",
                   *TINY, timeout=60)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "the run failed" in result.stderr and "Traceback" not in result.stderr


def test_profile_prints_time_per_phase(tmp_path):
    """--profile: every process's phases, from a real run, add up per request and op."""
    data = run_json(tmp_path, "--workload", "W2", "--requests", "4", "--chunks", "2",
                    "--batch", "2", "--profile")
    profile = data["profile"]
    for op in ("STORE", "RETRIEVE", "LOOKUP"):
        trips = profile[f"{op}\tclient round trip"][1]
        assert trips > 0
        # one span per request on each side, whatever the process that stamped it
        for phase in ("client encode", "server decode", "server handle", "server reply",
                      "client decode"):
            assert profile[f"{op}\t{phase}"][1] == trips, (op, phase)
        server = sum(profile[f"{op}\t{phase}"][0] for phase in (
            "server decode", "server handle", "server reply"))
        assert 0 < server < profile[f"{op}\tclient round trip"][0]
    for op in ("STORE", "RETRIEVE"):  # every chunk went through one copy
        assert profile[f"{op}\tserver copy"][2] == profile[f"{op}\tserver submit"][2] > 0
    assert profile["LOOKUP\tserver index"][2] >= profile["LOOKUP\tserver index"][1]
    # Every round trip starts at its send, HELLO's (queued by the client itself) too: not
    # at the clock's zero, which made HELLO's hours long.
    assert profile["HELLO\tclient round trip"][1] > 0
    for key, (nanoseconds, spans, _) in profile.items():
        if key.endswith("\tclient round trip"):
            assert nanoseconds / spans < 60e9, key
    assert data["figures"]["store"]["measured"] > 0


def test_phases_cost_nothing_when_off():
    from lmcache_mp import phases

    assert not phases.enabled  # only LMCACHE_MP_PROFILE or --profile turns it on
    assert phases.now() == 0 and phases.add("STORE", "server copy", 0) == 0
    assert phases.totals() == {}
