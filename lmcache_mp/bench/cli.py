"""`lmcache-mp-bench`: flags, per-workload defaults and checks, then one run and its report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import LMCacheMPError
from ..runtime import default_url
from ..sizes import parse_size
from .options import UNIFORM, WORKLOADS, BenchOptions
from .redis_peer import PeerUnavailable, check_redis_available
from .shapes import SHAPES

DESCRIPTION = """\
Measure an lmcache-mp server on this machine, honestly: simulated vLLM engines (real
processes with paged KV caches in sealed shared memory, driving the client library the way the
vLLM connector does) prefill a workload; every figure is printed next to a bound
measured in the same run (a single-thread copy of the same bytes, a raw pyzmq
DEALER/ROUTER echo between two processes) and, with --peer redis, next to Redis moving
the same chunks. Progress goes to stderr, the table to stdout.

workloads:
  W1, W2, W3    new prompts, then the same prompts again: STORE, then RETRIEVE of the
                same bytes (shapes in docs/benchmarks.md: W1 32 MiB chunks, W2 512 KiB,
                W3 MLA 9 MiB)
  chat          multi-turn conversations over shared documents with Zipf popularity:
                realistic prefix sharing; hit rate against an unbounded cache's
  multi-tenant  two steady tenants and a flooder, without and with a quota on the
                flooder: per-tenant hit rates per phase
  engine        real vLLM engines (its CPU build, from .venv-engine: scripts/bootstrap
                --vllm) on a spawned server: time to first token of a 1,500-token prompt
                cold, loaded from the server, and from vLLM's own prefix cache (median of
                --requests rounds, default 5; only --requests, --seed, --json, --timeout
                apply); skipped, with the reason, where vLLM's CPU build is missing
  warm-restart  a spawned server with --pool-segment filled with --restart-chunks chunks
                (--shape, default 8KiB), stopped with SIGTERM and started again: seconds
                each way, pool verified per second and thread, index memory a chunk when
                stored and when adopted (only --restart-chunks, --shape, --seed, --json,
                --timeout apply)
  disk          a spawned server with a small pool and a disk tier (--disk-dir, default a
                temporary directory: point it at the NVMe the server would use): the raw
                bound (sequential O_DIRECT writes and reads of the same bytes in the same
                directory, 1 and 4 threads), tier write bandwidth (--requests prompts of
                --chunks chunks, default 64 × 32 of --shape W2, through a --cpu-size pool,
                default 256MiB), tier read bandwidth after a restart, byte for byte, and a
                restart after SIGKILL at --restart-chunks 8KiB chunks (only --requests,
                --chunks, --batch, --shape, --cpu-size, --disk-dir, --restart-chunks,
                --seed, --json, --timeout and --no-verify apply)

  chat with --disk-size: the same conversations twice, with a disk tier under a pool of an
  eighth of the working set and with that pool alone: hit rates with the disk, pool-only
  and unbounded, and chunks written through against chunks the pool evicted
"""

EPILOG = """\
examples:
  lmcache-mp-bench --workload W1 --peer redis
  lmcache-mp-bench --workload W3 --tp 2 --json w3.json
  lmcache-mp-bench --workload chat --duration 60 --plot chat.png
  lmcache-mp-bench --workload chat --nodes 2 --adopt-restart   # two servers, one Redis
  lmcache-mp-bench --workload disk --disk-dir /mnt/nvme/bench
  lmcache-mp-bench --workload chat --disk-size 4GiB
  lmcache-mp-bench --workload W2 --url   # the server running at this user's default endpoint
  LMCACHE_MP_TOKEN=... LMCACHE_MP_ADMIN_TOKEN=... \
    lmcache-mp-bench --workload W2 --url tcp://127.0.0.1:5555

exit status: 0 when every byte check passed, 1 when one failed (the table says which),
2 for bad flags or a peer that cannot run here (the message says what to install),
3 when the run itself failed (a server, rank or reply that did not come in time).
"""

# requests, chunks per prompt, requests per engine step, default KV shape
DEFAULTS = {
    "W1": (16, 4, 4, "W1"),
    "W2": (128, 8, 8, "W2"),
    "W3": (16, 4, 4, "W3"),
    "chat": (240, 0, 8, "W2"),
    "multi-tenant": (None, 4, 4, "W2"),
}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-mp-bench", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=(*WORKLOADS, "engine", "warm-restart", "disk"),
                        default="W1",
                        help="what the engines prefill (default W1)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--spawn", action="store_true",
                       help="start a server of our own on the ipc:// socket of a private "
                            "runtime directory, sized for the workload, and stop it at the "
                            "end (the default)")
    where.add_argument("--url", metavar="URL", nargs="?", const="",
                       help="use a server already running at URL instead (without URL: the "
                            "server's default endpoint, $LMCACHE_MP_URL or the ipc:// socket "
                            "in this user's runtime directory); the run uses a model name and "
                            "cache salts of its own and clears them at the end, so it needs "
                            "the admin token ($LMCACHE_MP_ADMIN_TOKEN, else the runtime "
                            "directory's admin.token) and, on tcp://, the engine token "
                            "($LMCACHE_MP_TOKEN, else the runtime directory's token)")
    parser.add_argument("--workers", type=positive_int, default=1, metavar="N",
                        help="simulated engines, each with --tp × --pp rank processes "
                             "(default 1)")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor-parallel ranks per engine (default 1)")
    parser.add_argument("--pp", type=positive_int, default=1,
                        help="pipeline-parallel stages per engine (default 1)")
    mla = parser.add_mutually_exclusive_group()
    mla.add_argument("--mla", dest="mla", action="store_true", default=None,
                     help="MLA: only each TP group's leader sends STORE and RETRIEVE and the "
                          "server fills the other ranks (default for W3; needs an MLA shape)")
    mla.add_argument("--no-mla", dest="mla", action="store_false",
                     help="with an MLA shape, let every rank send its own requests, as a "
                          "connector unaware of MLA would")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--requests", type=positive_int, metavar="N",
                        help="distinct prompts over all engines (W1/W2/W3: each is sent "
                             "twice, to store and to hit; default W1/W3 16, W2 128, chat 240; "
                             "multi-tenant sizes itself from the pool)")
    length.add_argument("--duration", type=positive_float, metavar="SECONDS",
                        help="run for this long instead (split between multi-tenant's phases)")
    parser.add_argument("--batch", type=positive_int, metavar="N",
                        help="requests each engine prefills per step (default W1/W3 4, W2 8, "
                             "chat 8, multi-tenant 4)")
    parser.add_argument("--chunks", type=positive_int, metavar="N",
                        help="chunks per prompt, for W1/W2/W3 and multi-tenant (default 4, "
                             "W2 8)")
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="KV-cache shape for chat and multi-tenant (default W2)")
    parser.add_argument("--peer", choices=("redis",),
                        help="also move the same chunks through a redis-server on loopback "
                             "(started here; redis-py with hiredis, pipelined) and report our "
                             "GB/s over Redis's")
    parser.add_argument("--cpu-size", metavar="SIZE",
                        help="pool of a spawned server, e.g. 4GiB (default: what the workload "
                             "stores, plus slack; multi-tenant 64MiB)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for prompts and block ids (default 0)")
    parser.add_argument("--json", metavar="PATH", type=Path,
                        help="also write every figure, per phase and per step, to this JSON file")
    parser.add_argument("--plot", metavar="PATH", type=Path,
                        help="also draw throughput per step and LOOKUP latency to this PNG "
                             "(needs matplotlib: pip install 'lmcache-mp[plot]')")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the byte-for-byte check of every loaded chunk (not timed "
                             "either way)")
    parser.add_argument("--lookup-rounds", type=positive_int, default=5,
                        help="interleaved LOOKUP/echo latency rounds (default 5)")
    parser.add_argument("--lookup-iters", type=positive_int, default=1000,
                        help="round trips per latency round and side, LOOKUP and echo in "
                             "turn (default 1000: p99.9 rests on 5 samples a side)")
    parser.add_argument("--lookup-seconds", type=positive_float, default=4.0,
                        help="seconds of batched LOOKUP throughput, half of it echo (default 4)")
    parser.add_argument("--timeout", type=positive_float, default=120.0,
                        help="seconds any one server reply or rank step may take (default 120)")
    parser.add_argument("--profile", action="store_true",
                        help="also time each phase of a request in every process (client "
                             "encode, server decode, validation, index, copy submission, copy, "
                             "completion, reply, client decode) and print time per request "
                             "per phase; the figures include the stamps' own small cost")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar (it is off anyway when stderr is not a terminal)")
    parser.add_argument("--nodes", type=positive_int, default=1, metavar="N",
                        help="chat only: spread the conversations over N spawned servers "
                             "sharing one Redis as L2 (--workers engines each) and report "
                             "the hit rate across nodes against a node alone's and an "
                             "unbounded cache's, LOOKUP latency of a cross-node hit (L2 "
                             "prefetch) against an L1 hit, write-behind throughput against "
                             "Redis's own pipelined SET, and tokens loaded (default 1)")
    parser.add_argument("--l2", metavar="URL",
                        help="with --nodes: the Redis the nodes share (redis://host:port[/db] "
                             "or rediss://; default: a redis-server started here on a free "
                             "loopback port); the run's chunks stay there for an hour (TTL)")
    parser.add_argument("--restart-chunks", type=positive_int, default=100_000, metavar="N",
                        help="warm-restart and disk: chunks the server holds when it is "
                             "stopped (warm-restart) or killed (disk) (rounded up to prompts "
                             "of 64; default 100000; warm-restart's targets are for 1000000, "
                             "which needs a pool of 8 GiB of 8KiB chunks in /dev/shm)")
    parser.add_argument("--disk-dir", metavar="DIR", type=Path,
                        help="disk and chat --disk-size: where the spawned server's disk tier "
                             "(and the raw bound's files) go, in a fresh directory removed at "
                             "the end (default: the system's temporary directory; point it at "
                             "the NVMe a server would use)")
    parser.add_argument("--disk-size", metavar="SIZE",
                        help="chat only: give the spawned server a disk tier of SIZE (e.g. "
                             "4GiB: it should hold the working set) under a pool of an eighth "
                             "of the working set (or --cpu-size), run the same conversations "
                             "with that pool alone too, and report both hit rates beside the "
                             "unbounded cache's")
    parser.add_argument("--adopt-restart", action="store_true",
                        help="with --nodes: keep each node's pool in a shared-memory segment "
                             "(--pool-segment), SIGTERM the last node halfway through and "
                             "start it again with --adopt require; report its hit rate before "
                             "and after")
    return parser


def check_nodes_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--nodes, --l2 and --adopt-restart against the rest of the command line."""
    if args.nodes == 1:
        if args.l2 is not None or args.adopt_restart:
            parser.error("--l2 and --adopt-restart need --nodes 2 or more")
        return
    if args.workload != "chat":
        parser.error("--nodes runs the chat workload: add --workload chat")
    if args.url is not None or args.peer is not None or args.profile or args.plot is not None:
        parser.error("--nodes spawns its own servers: --url, --peer, --profile and --plot "
                     "do not apply")
    if args.l2 is not None and not args.l2.startswith(("redis://", "rediss://")):
        parser.error("--l2: a redis:// or rediss:// URL")
    if args.l2 is None:
        try:
            check_redis_available()
        except PeerUnavailable as exc:
            parser.error(str(exc))


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchOptions:
    requests, chunks, batch, shape_name = DEFAULTS[args.workload]
    if args.workload in UNIFORM:
        if args.shape is not None and args.shape != args.workload:
            parser.error(f"--shape: {args.workload} is its own shape")
        shape = SHAPES[args.workload]
    else:
        shape = SHAPES[args.shape or shape_name]
    mla = shape.layout == "mla" if args.mla is None else args.mla
    if mla and shape.layout != "mla":
        parser.error(f"--mla needs an MLA shape (W3); {shape.name} is {shape.layout.upper()}")
    if args.workload == "chat" and args.chunks is not None:
        parser.error("--chunks does not apply to chat: its prompts grow turn by turn")
    if args.workload == "multi-tenant" and args.requests is not None:
        parser.error("--requests does not apply to multi-tenant: it sizes itself from the pool")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'lmcache-mp[plot]'")
    if args.peer == "redis":
        try:
            check_redis_available()
        except PeerUnavailable as exc:
            parser.error(str(exc))
    return BenchOptions(
        workload=args.workload, shape=shape,
        url=default_url() if args.url == "" else args.url, workers=args.workers, tp=args.tp,
        pp=args.pp, mla=mla,
        requests=None if args.duration else (args.requests or requests),
        duration=args.duration, batch=args.batch or batch, chunks=args.chunks or chunks or 1,
        seed=args.seed, peer=args.peer, cpu_size=args.cpu_size, verify=args.verify,
        lookup_rounds=args.lookup_rounds, lookup_iters=args.lookup_iters,
        lookup_seconds=args.lookup_seconds, timeout=args.timeout,
        progress=args.progress and sys.stderr.isatty(), profile=args.profile,
        disk_size=args.disk_size, disk_dir=None if args.disk_dir is None else str(args.disk_dir))


def log(message: str) -> None:
    print(f"lmcache-mp-bench: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workload == "engine":
        return engine_main(args)
    if args.workload == "warm-restart":
        return warm_restart_main(args)
    if args.workload == "disk":
        return disk_main(args, parser)
    check_nodes_flags(args, parser)
    check_disk_flags(args, parser)
    options = options_from(args, parser)
    # What runs imports torch: seconds that --help and a flag error do without.
    import torch

    from . import nodes
    from .report import render, render_profile, to_json
    from .run import run

    torch.set_num_threads(1)
    try:
        if args.nodes > 1:
            return nodes.nodes_main(args, options, log)
        if options.disk_size is not None:
            from .disk_chat import run_with_disk

            report = run_with_disk(options, log)
        else:
            report = run(options, log)
    except PeerUnavailable as exc:
        print(f"lmcache-mp-bench: {exc}", file=sys.stderr)
        return 2
    except (LMCacheMPError, RuntimeError, TimeoutError) as exc:
        print(f"lmcache-mp-bench: the run failed: {exc}", file=sys.stderr)
        return 3
    print(f"\n## lmcache-mp-bench --workload {options.workload}\n")
    print(f"{options.shape.describe()}; {options.workers} engine(s) × TP {options.tp} × "
          f"PP {options.pp}{' MLA' if options.mla else ''}; server {report.server.url} "
          f"({'spawned' if report.server.spawned else 'given'}), pool "
          f"{report.meta['server_pool']}; {report.meta['cpus']} CPUs.\n")
    print(render(report))
    if report.profile is not None:
        print(f"\n### Time per request, by phase (--profile)\n\n{render_profile(report.profile)}")
    if args.json is not None:
        args.json.write_text(to_json(report))
        log(f"wrote {args.json}")
    if args.plot is not None:
        from .plot import draw

        draw(report, args.plot)
        log(f"wrote {args.plot}")
    return 0 if report.checks.ok else 1


def engine_main(args: argparse.Namespace) -> int:
    from . import vllm_ttft

    reason = vllm_ttft.skip_reason()
    if reason is not None:
        log(f"--workload engine skipped: {reason}")
        return 0
    return _run_standalone(
        args, lambda: vllm_ttft.measure(args.requests or 5, args.seed, args.timeout, log),
        vllm_ttft.describe, vllm_ttft.render, vllm_ttft.to_json,
        lambda figures: figures.mismatches == 0 and figures.disk_mismatches == 0)


def check_disk_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--disk-size and --disk-dir against the rest of the command line (not --workload disk)."""
    if args.disk_size is None:
        if args.disk_dir is not None:
            parser.error("--disk-dir needs --disk-size (with --workload chat) or "
                         "--workload disk")
        return
    if args.workload != "chat":
        parser.error("--disk-size runs the chat workload: add --workload chat")
    if args.url is not None or args.nodes > 1:
        parser.error("--disk-size spawns its own server: --url and --nodes do not apply")
    if args.duration is not None and args.cpu_size is None:
        parser.error("--disk-size with --duration needs --cpu-size: the pool is an eighth of "
                     "the working set of --requests")
    try:
        parse_size(args.disk_size)
    except ValueError as exc:
        parser.error(f"--disk-size: {exc}")


def disk_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.disk_size is not None:
        parser.error("--disk-size does not apply to --workload disk: it sizes its tier to "
                     "hold every chunk")
    if args.cpu_size is not None:
        try:
            parse_size(args.cpu_size)
        except ValueError as exc:
            parser.error(f"--cpu-size: {exc}")
    from . import disk

    shape = SHAPES[args.shape or "W2"]
    return _run_standalone(
        args, lambda: disk.measure(shape, args.requests or 64, args.chunks or 32,
                                   args.batch or 4, args.cpu_size, args.disk_dir,
                                   args.restart_chunks, args.seed, args.timeout, args.verify,
                                   log),
        disk.describe, disk.render, disk.to_json, lambda figures: figures.passed)


def warm_restart_main(args: argparse.Namespace) -> int:
    from . import warm_restart

    shape = SHAPES[args.shape or "8KiB"]
    return _run_standalone(
        args, lambda: warm_restart.measure(shape, args.restart_chunks, args.seed, args.timeout,
                                           log),
        lambda figures: shape.describe(), warm_restart.render, warm_restart.to_json,
        lambda figures: figures.byte_exact and figures.adopted == figures.chunks)


def _run_standalone(args: argparse.Namespace, measure: Callable[[], Any],
                    describe: Callable[[Any], str], render: Callable[[Any], str],
                    to_json: Callable[[Any], str], passed: Callable[[Any], bool]) -> int:
    """A workload with a run and a report of its own (engine, warm-restart): its table on
    stdout, its figures in --json; exit 0 when its checks passed, 1 if not, 3 if it failed."""
    try:
        figures = measure()
    except (LMCacheMPError, RuntimeError, TimeoutError) as exc:
        print(f"lmcache-mp-bench: the run failed: {exc}", file=sys.stderr)
        return 3
    print(f"\n## lmcache-mp-bench --workload {args.workload}\n\n{describe(figures)}\n")
    print(render(figures))
    if args.json is not None:
        args.json.write_text(to_json(figures))
        log(f"wrote {args.json}")
    return 0 if passed(figures) else 1


if __name__ == "__main__":
    sys.exit(main())
