"""The simulated-engine workloads (W1, W2, W3, chat, multi-tenant), start to end: a server
(spawned, or given with --url), the bounds beside it (a copy, an echo, the Redis peer), the
engines, the phases, LOOKUP latency, and the report."""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import zmq

from ... import __version__, phases
from ...client import CacheClient
from ...protocol import StatsReply
from ...sizes import format_size
from ..harness import output
from ..harness.bounds import CopyBound, EchoProcess, LookupFigures, measure_lookups
from ..harness.engine import Engine, EngineSetup
from ..harness.redis_peer import RedisServer, check_redis_available
from ..harness.report import (
    Checks,
    DiskTierFigures,
    Figures,
    PhaseResult,
    Report,
    ServerFigures,
    render,
    render_profile,
    to_json,
)
from ..harness.server import BenchServer, settled_stats
from ..harness.stats import Compared, rate, ratio
from ..harness.steps import Workload, run_phases
from ..options import UNIFORM, BenchOptions
from ..shapes import MiB
from .chat import ChatWorkload
from .multi_tenant import MultiTenantWorkload
from .uniform import UniformWorkload


def main(options: BenchOptions) -> int:
    torch.set_num_threads(1)
    report = output.attempt(lambda: run(options, output.log))
    return report if isinstance(report, int) else finish(options, report)


def finish(options: BenchOptions, report: Report) -> int:
    """The report on stdout (and --json, --plot); the exit status."""
    table = render(report)
    if report.profile is not None:
        table += f"\n\n### Time per request, by phase (--profile)\n\n" \
                 f"{render_profile(report.profile)}"
    description = (
        f"{options.kv_shape.describe()}; {options.workers} engine(s) × TP {options.tp} × "
        f"PP {options.pp}{' MLA' if options.mla else ''}; server {report.server.url} "
        f"({'spawned' if report.server.spawned else 'given'}), pool "
        f"{report.meta['server_pool']}; {report.meta['cpus']} CPUs.")
    code = output.report(options, description, table, lambda: to_json(report),
                         report.checks.ok)
    if options.plot is not None:
        from ..harness.plot import draw

        draw(report, options.plot)
        output.log(f"wrote {options.plot}")
    return code


def _blocks_per_request(options: BenchOptions, workload: Workload) -> int:
    shape = options.kv_shape
    if isinstance(workload, ChatWorkload):
        return -(-workload.max_prompt_tokens // shape.block_size)
    return options.chunks * shape.blocks_per_chunk + 1


def _spawned_pool_size(options: BenchOptions) -> str:
    if options.cpu_size is not None:
        return options.cpu_size
    if options.workload == "multi-tenant":
        return "64MiB"
    if options.workload in UNIFORM and options.requests is not None:
        need = (options.requests * options.chunks * options.kv_shape.chunk_bytes
                * options.kv_world_size)
        return f"{(int(need * 1.1) + 64 * MiB) // MiB}MiB"
    return "2GiB"


def _workload(options: BenchOptions, salt: str) -> Workload:
    shape = options.kv_shape
    if options.workload in UNIFORM:
        return UniformWorkload(shape, options.chunks, options.batch, options.requests,
                               options.workers, salt, options.seed)
    if options.workload == "chat":
        return ChatWorkload(shape, options.batch, options.requests, options.workers, salt,
                            options.seed)
    return MultiTenantWorkload(shape, options.chunks, options.workers, salt, options.seed)


def _meta(options: BenchOptions, redis: RedisServer | None) -> dict[str, object]:
    flags = {name: str(value) if isinstance(value, Path) else value
             for name, value in asdict(options).items()}
    meta: dict[str, object] = {
        "command": " ".join(["lmcache-mp-bench", *sys.argv[1:]]),
        "options": flags,
        "shape": options.kv_shape.describe(),
        "lmcache_mp": __version__, "torch": torch.__version__, "pyzmq": zmq.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(),
    }
    if redis is not None:
        meta.update(redis_server=redis.version(), redis_py=check_redis_available())
    return meta


@dataclass
class _Setup:
    """What a run set up before its phases."""

    client: CacheClient  # the admin client: STATS, quotas, the LOOKUP latency
    url: str
    spawned: bool
    capacity: int
    echo: EchoProcess
    redis: RedisServer | None
    engines: list[Engine]


def run(options: BenchOptions, log: Callable[[str], None]) -> Report:
    run_id = uuid.uuid4().hex[:8]
    model = f"lmcache-mp-bench-{run_id}"
    workload = _workload(options, f"bench-{run_id}")
    profile: dict[str, list[int]] = {}
    with contextlib.ExitStack() as stack:
        profile_dir = _profiling(stack, options, profile)
        setup = _set_up(stack, options, workload, run_id, model, profile_dir, log)
        step_bytes = options.batch * options.chunks * options.kv_shape.chunk_bytes
        copy_bound = CopyBound(min(max(step_bytes, 64 * MiB), 1024 * MiB))
        log(f"single-thread copy bound: {copy_bound.gbs:.2f} GB/s (sampled again between steps)")
        results = run_phases(options, workload, setup.engines, setup.client, setup.capacity,
                             log, copy_bound)
        disk = None
        if options.disk_size is not None:
            disk = DiskTierFigures.of(settled_stats(setup.client, options.timeout))
        log(f"LOOKUP latency: {options.lookup_rounds} rounds × {options.lookup_iters}, "
            f"batched LOOKUP {options.lookup_seconds:g} s")
        prefixes = [prefix for engine in setup.engines for prefix in engine.recent_prefixes]
        lookups = measure_lookups(setup.client, setup.echo.url, model, options.kv_world_size,
                                  prefixes, options.lookup_rounds, options.lookup_iters,
                                  options.lookup_seconds)
        final = setup.client.stats()
        meta = _meta(options, setup.redis)
    report = _report(options, meta, copy_bound.gbs, results, lookups, final, setup)
    report.profile = profile if options.profile else None
    report.disk = disk
    return report


def _profiling(stack: contextlib.ExitStack, options: BenchOptions,
               profile: dict[str, list[int]]) -> str | None:
    """--profile: the directory every process writes its phase totals to; `profile` gets
    them all once the run's processes are closed."""
    if not options.profile:
        return None
    # Before the server starts: it inherits it and times itself (the ranks are told).
    profile_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="lmcache-mp-profile-"))
    os.environ[phases.ENV] = profile_dir
    stack.callback(os.environ.pop, phases.ENV, None)
    phases.enable(profile_dir)
    # Last out: every process has written its totals once the others are closed.
    stack.callback(lambda: profile.update(_read_profile(profile_dir)))
    return profile_dir


def _set_up(stack: contextlib.ExitStack, options: BenchOptions, workload: Workload,
            run_id: str, model: str, profile_dir: str | None,
            log: Callable[[str], None]) -> _Setup:
    """The server, the echo, the Redis peer and the engines, each closed by `stack`."""
    client, server = _server(stack, options, log)
    url = server.url if server is not None else options.url
    assert url is not None
    capacity = client.stats().capacity_bytes
    echo = EchoProcess(url, f"/tmp/lmcache-mp-bench-{run_id}-echo.sock")
    stack.callback(echo.stop)
    echo.start()
    redis = None
    if options.peer == "redis":
        redis = RedisServer()
        stack.callback(redis.stop)
        redis.start()
        log(f"redis-server on {redis.url}")
    stack.callback(_forget, client, workload)
    # The engine token: our own server's; else what runtime.find_token finds (needed on a
    # tcp:// endpoint: $LMCACHE_MP_TOKEN or the default runtime directory's file).
    token = server.token() if server is not None else None
    engines = []
    for index in range(options.workers):
        blocks = options.batch * _blocks_per_request(options, workload)
        # Each engine's own secret, shared by its scheduler and its ranks only.
        engine = Engine(EngineSetup(
            index, url, secrets.token_hex(16), token, options.kv_shape, options.tp, options.pp,
            bool(options.mla), blocks, model, options.timeout, options.verify,
            redis.url if redis else None, profile_dir), options.seed)
        stack.callback(engine.close)
        engines.append(engine)
    log(f"starting {options.workers} engine(s) × {options.tp * options.pp} rank process(es)")
    for engine in engines:
        engine.start()
    return _Setup(client, url, server is not None, capacity, echo,
                  redis, engines)


def _server(stack: contextlib.ExitStack, options: BenchOptions, log: Callable[[str], None]
            ) -> tuple[CacheClient, BenchServer | None]:
    """The admin client of the server the run uses: --url's, else one spawned here (sized
    for the workload; with chat --disk-size, a disk tier in a fresh directory)."""
    shape = options.kv_shape
    server = None
    if options.url is not None:
        # Admin: the run sets quotas (multi-tenant) and clears its salts at the end.
        client = stack.enter_context(CacheClient(
            options.url, timeout=options.timeout, client_name="lmcache-mp-bench", admin=True))
    else:
        pool = _spawned_pool_size(options)
        server = BenchServer(pool, shape.chunk_size, _disk_tier_args(stack, options))
        stack.callback(server.close)
        log(f"starting a server on {server.url} with a {pool} pool; waiting for it to "
            f"pre-fault its pool")
        client = server.ready(options.timeout)
    chunk_size = client.hello().chunk_size
    if chunk_size != shape.chunk_size:
        where = server.url if server is not None else options.url
        raise SystemExit(f"lmcache-mp-bench: the server at {where} uses {chunk_size}-token "
                         f"chunks; the {shape.name} shape needs {shape.chunk_size}")
    return client, server


def _disk_tier_args(stack: contextlib.ExitStack, options: BenchOptions) -> list[str]:
    """chat --disk-size (disk_chat.py): a disk tier in a fresh directory, removed at the end."""
    if options.disk_size is None:
        return []
    if options.disk_dir is not None:
        os.makedirs(options.disk_dir, exist_ok=True)
    disk_dir = tempfile.mkdtemp(prefix="lmcache-mp-bench-disk-", dir=options.disk_dir)
    stack.callback(shutil.rmtree, disk_dir, True)
    return ["--disk-dir", os.path.join(disk_dir, "tier"), "--disk-size", options.disk_size,
            "--disk-admission", options.disk_admission]


def _read_profile(directory: str) -> dict[str, list[int]]:
    phases.disable()  # writes this process's own: the LOOKUP latency and batched clients
    return phases.read(directory)


def _forget(client: CacheClient, workload: Workload) -> None:
    """Leave the server as we found it: our salts' chunks and quotas go."""
    with contextlib.suppress(Exception):  # the server may be gone: nothing left to clean
        for salt in workload.salts():
            client.clear(salt)
            if client.quota_get(salt).own:
                client.quota_delete(salt)


def _report(options: BenchOptions, meta: dict[str, object], bound: float,
            phases: list[PhaseResult], lookups: LookupFigures, final: StatsReply,
            setup: _Setup) -> Report:
    def total(name: str) -> float:
        return sum(getattr(phase, name) for phase in phases)

    store = rate(total("stored_bytes"), total("store_seconds")) / 1e9
    retrieve = rate(total("retrieved_bytes"), total("retrieve_seconds")) / 1e9
    store_vs_redis = retrieve_vs_redis = None
    if options.peer:
        store_vs_redis = Compared.of(
            store, rate(total("peer_stored_bytes"), total("peer_store_seconds")) / 1e9)
        retrieve_vs_redis = Compared.of(
            retrieve, rate(total("peer_fetched_bytes"), total("peer_fetch_seconds")) / 1e9)
    seconds = total("seconds")
    counted = total("counted_chunks")
    figures = Figures(
        store=Compared.of(store, bound), retrieve=Compared.of(retrieve, bound),
        store_vs_redis=store_vs_redis, retrieve_vs_redis=retrieve_vs_redis,
        lookup_p50=Compared.of(lookups.lookup.p50_us, lookups.echo.p50_us),
        lookup_p99=Compared.of(lookups.lookup.p99_us, lookups.echo.p99_us),
        lookup_p999=Compared.of(lookups.lookup.p999_us, lookups.echo.p999_us),
        lookup_keys_per_s=Compared.of(lookups.keys_per_s, lookups.echo_keys_per_s),
        hit_rate=Compared.of(ratio(total("hit_chunks"), counted),
                             ratio(total("ideal_hit_chunks"), counted)),
        tokens_saved=ratio(total("loaded_tokens"), total("prompt_tokens")),
        requests_per_s=rate(total("requests"), seconds),
        transfer_requests_per_step=ratio(total("server_transfer_requests"),
                                         total("engine_steps")))
    cpu = total("server_cpu_seconds")
    server = ServerFigures(setup.url, setup.spawned, setup.capacity, cpu, ratio(cpu, seconds),
                           final.peak_rss_bytes)
    checks = Checks(int(total("verified_chunks")), int(total("corrupt_chunks")),
                    int(total("peer_corrupt_chunks")), int(total("failed_load_blocks")))
    meta["server_pool"] = format_size(setup.capacity)
    meta["batched_lookup"] = {"keys_per_message": lookups.keys_per_message,
                              "hit_fraction": lookups.batched_hit_fraction}
    return Report(meta, figures, bound, lookups.lookup, lookups.echo, server, checks, phases,
                  lookups.lookup_samples_us, lookups.echo_samples_us)
