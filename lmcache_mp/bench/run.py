"""One benchmark run, start to end: server, bounds, peer, engines, phases, lookups, report."""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict

import torch
import zmq
from tqdm import tqdm

from .. import __version__, phases
from ..client import CacheClient
from ..protocol import StatsReply
from ..sizes import format_size
from ..spawn import ServerProcess
from . import disk_chat
from .bounds import CopyBound, EchoProcess, LookupFigures, measure_lookups
from .engine import Engine, EngineSetup
from .options import UNIFORM, BenchOptions
from .redis_peer import RedisServer, check_redis_available
from .report import Checks, Figures, PhaseResult, Report, ServerFigures
from .shapes import MiB
from .stats import Compared, rate, ratio
from .workloads import ChatWorkload, MultiTenantWorkload, UniformWorkload, Workload


def _blocks_per_request(options: BenchOptions, workload: Workload) -> int:
    shape = options.shape
    if isinstance(workload, ChatWorkload):
        return -(-workload.max_prompt_tokens // shape.block_size)
    return options.chunks * shape.blocks_per_chunk + 1


def _spawned_pool_size(options: BenchOptions, kv_world_size: int) -> str:
    if options.cpu_size is not None:
        return options.cpu_size
    if options.workload == "multi-tenant":
        return "64MiB"
    if options.workload in UNIFORM and options.requests is not None:
        need = options.requests * options.chunks * options.shape.chunk_bytes * kv_world_size
        return f"{(int(need * 1.1) + 64 * MiB) // MiB}MiB"
    return "2GiB"


def _workload(options: BenchOptions, salt: str) -> Workload:
    if options.workload in UNIFORM:
        return UniformWorkload(options.shape, options.chunks, options.batch, options.requests,
                               options.workers, salt, options.seed)
    if options.workload == "chat":
        return ChatWorkload(options.shape, options.batch, options.requests, options.workers,
                            salt, options.seed)
    return MultiTenantWorkload(options.shape, options.chunks, options.workers, salt,
                               options.seed)


def _meta(options: BenchOptions, redis: RedisServer | None) -> dict[str, object]:
    meta: dict[str, object] = {
        "command": " ".join(["lmcache-mp-bench", *sys.argv[1:]]),
        "options": {**asdict(options), "shape": options.shape.name},
        "shape": options.shape.describe(),
        "lmcache_mp": __version__, "torch": torch.__version__, "pyzmq": zmq.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(),
    }
    if redis is not None:
        meta.update(redis_server=redis.version(), redis_py=check_redis_available())
    return meta


def run(options: BenchOptions, log: Callable[[str], None]) -> Report:
    run_id = uuid.uuid4().hex[:8]
    model, salt = f"lmcache-mp-bench-{run_id}", f"bench-{run_id}"
    world = options.tp * options.pp
    # An MLA cache is one shard per PP stage, whoever sends (see Engine._strategy).
    kv_world_size = options.pp if options.shape.layout == "mla" else world
    workload = _workload(options, salt)
    with contextlib.ExitStack() as stack:
        profile: dict[str, list[int]] = {}
        profile_dir = None
        if options.profile:
            # Before the server starts: it inherits it and times itself (the ranks are told).
            profile_dir = stack.enter_context(tempfile.TemporaryDirectory(
                prefix="lmcache-mp-profile-"))
            os.environ[phases.ENV] = profile_dir
            stack.callback(os.environ.pop, phases.ENV, None)
            phases.enable(profile_dir)
            # Last out: every process has written its totals once the others are closed.
            stack.callback(lambda: profile.update(_read_profile(profile_dir)))
        url, spawned = options.url, options.url is None
        server = None
        if spawned:
            pool = _spawned_pool_size(options, kv_world_size)
            args = ["--cpu-size", pool, "--log-level", "warning",
                    "--chunk-size", str(options.shape.chunk_size)]
            if options.disk_size is not None:  # chat --disk-size (disk_chat.py)
                if options.disk_dir is not None:
                    os.makedirs(options.disk_dir, exist_ok=True)
                disk_dir = tempfile.mkdtemp(prefix="lmcache-mp-bench-disk-",
                                            dir=options.disk_dir)
                stack.callback(shutil.rmtree, disk_dir, True)
                args += ["--disk-dir", os.path.join(disk_dir, "tier"), "--disk-size",
                         options.disk_size]
            server = ServerProcess(None, args)
            url = server.url
            stack.callback(server.close)
            log(f"starting a server on {url} with a {pool} pool")
            server.start()
        assert url is not None
        # Admin: the run sets quotas (multi-tenant) and clears its salts at the end.
        client = stack.enter_context(CacheClient(
            url, timeout=options.timeout, client_name="lmcache-mp-bench", admin=True,
            token=server.token(admin=True) if server is not None else None))
        chunk_size = client.hello().chunk_size
        if chunk_size != options.shape.chunk_size:
            raise SystemExit(f"lmcache-mp-bench: the server at {url} uses {chunk_size}-token "
                             f"chunks; the {options.shape.name} shape needs "
                             f"{options.shape.chunk_size}")
        if server is not None:
            log("waiting for the server to pre-fault its pool")
            server.wait_prefault(client)
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
        engines = []
        # The engine token: our own server's; else what runtime.find_token finds (needed on
        # a tcp:// endpoint: $LMCACHE_MP_TOKEN or the default runtime directory's file).
        token = server.token() if server is not None else None
        for index in range(options.workers):
            blocks = options.batch * _blocks_per_request(options, workload)
            # Each engine's own secret, shared by its scheduler and its ranks only.
            engine = Engine(EngineSetup(
                index, url, secrets.token_hex(16), token, options.shape, options.tp, options.pp,
                options.mla, blocks, model, options.timeout, options.verify,
                redis.url if redis else None, profile_dir), options.seed)
            stack.callback(engine.close)
            engines.append(engine)
        log(f"starting {options.workers} engine(s) × {world} rank process(es)")
        for engine in engines:
            engine.start()

        step_bytes = options.batch * options.chunks * options.shape.chunk_bytes
        copy_bound = CopyBound(min(max(step_bytes, 64 * MiB), 1024 * MiB))
        log(f"single-thread copy bound: {copy_bound.gbs:.2f} GB/s (sampled again between steps)")

        results = _run_phases(options, workload, engines, client, capacity, log, copy_bound)
        disk = None
        if options.disk_size is not None:
            disk = disk_chat.figures(disk_chat.settle(client, options.timeout))
        bound = copy_bound.gbs
        log(f"LOOKUP latency: {options.lookup_rounds} rounds × {options.lookup_iters}, "
            f"batched LOOKUP {options.lookup_seconds:g} s")
        prefixes = [prefix for engine in engines for prefix in engine.recent_prefixes]
        lookups = measure_lookups(client, echo.url, model, kv_world_size, prefixes,
                                  options.lookup_rounds, options.lookup_iters,
                                  options.lookup_seconds)
        final = client.stats()
        meta = _meta(options, redis)
    report = _report(options, meta, bound, results, lookups, final, url, spawned, capacity)
    report.profile = profile if options.profile else None
    report.disk = disk
    return report


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


def _run_phases(options: BenchOptions, workload: Workload, engines: list[Engine],
                client: CacheClient, capacity: int, log: Callable[[str], None],
                copy_bound: CopyBound) -> list[PhaseResult]:
    planned = workload.planned_requests()
    results = []
    phase_seconds = options.duration / len(workload.phases) if options.duration else None
    for phase in workload.phases:
        workload.prepare(phase, client, capacity)
        result = PhaseResult(phase)
        computed: set[bytes] = set()
        streams = [(engine, workload.stream(phase, engine.setup.index)) for engine in engines]
        before = client.stats()
        started = time.monotonic()
        with tqdm(total=planned, unit="req", desc=phase if phase != "run" else options.workload,
                  disable=not options.progress, file=sys.stderr, dynamic_ncols=True) as progress:
            while streams:
                if phase_seconds is not None and time.monotonic() - started > phase_seconds:
                    break
                batches = [(engine, next(stream, None)) for engine, stream in streams]
                streams = [pair for pair, (_, batch) in zip(streams, batches) if batch]
                active = [(engine, batch) for engine, batch in batches if batch]
                if not active:
                    break
                for engine, batch in active:
                    engine.send_lookups(batch)
                outcomes = [outcome for engine, _ in active
                            for outcome in engine.send_step(computed)]
                reports = [report for engine, _ in active
                           for report in engine.finish_step(computed)]
                result.add_step(time.monotonic() - started, reports, outcomes, len(active))
                progress.update(len(outcomes))
                copy_bound.sample()  # between steps: what the machine allows now
        result.seconds = time.monotonic() - started
        after = client.stats()
        result.server_cpu_seconds = after.cpu_seconds - before.cpu_seconds
        result.server_transfer_requests = sum(
            after.requests.get(op, 0) - before.requests.get(op, 0) for op in ("STORE", "RETRIEVE"))
        results.append(result)
        log(f"{phase}: {result.requests} requests in {result.seconds:.1f} s")
    return results


def _report(options: BenchOptions, meta: dict[str, object], bound: float,
            phases: list[PhaseResult], lookups: LookupFigures, final: StatsReply, url: str,
            spawned: bool,
            capacity: int) -> Report:
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
    server = ServerFigures(url, spawned, capacity, cpu, ratio(cpu, seconds), final.peak_rss_bytes)
    checks = Checks(int(total("verified_chunks")), int(total("corrupt_chunks")),
                    int(total("peer_corrupt_chunks")), int(total("failed_load_blocks")))
    meta["server_pool"] = format_size(capacity)
    meta["batched_lookup"] = {"keys_per_message": lookups.keys_per_message,
                              "hit_fraction": lookups.batched_hit_fraction}
    return Report(meta, figures, bound, lookups.lookup, lookups.echo, server, checks, phases,
                  lookups.lookup_samples_us, lookups.echo_samples_us)
