"""`lmcache-mp-bench`: the parser (its flags from options.BenchOptions), then the workload."""

from __future__ import annotations

import argparse
import sys

from . import options as flags

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
                directory, on 1 thread and on the tier's 8 read threads), tier write
                bandwidth (--requests prompts of --chunks chunks, default 64 × 32 of
                --shape W2, through a --cpu-size pool, default 256MiB), tier read
                bandwidth after a restart, byte for byte, and a restart after SIGKILL at
                --restart-chunks 8KiB chunks (only --requests, --chunks, --batch, --shape,
                --cpu-size, --disk-dir, --restart-chunks, --seed, --json, --timeout and
                --no-verify apply)
  trace         a request trace replayed (--trace FILE, Mooncake's JSONL: 512-token
                blocks by hash id, one chunk each), each request's LOOKUP then STORE of
                what it missed, in timestamp order, through a spawned server whose pool
                holds --pool-share of the trace's distinct blocks (and, with
                --disk-share, a disk tier; then the pool alone too): hit rates per tier
                in blocks and tokens, bytes written and read, evictions, beside an
                unbounded cache's and the optimal bound at the same capacities (only
                --trace, --trace-limit, --pool-share, --disk-share, --disk-admission,
                --eviction, --disk-dir, --json, --plot, --timeout and --no-progress
                apply)
  sglang        SGLang 0.5.23's HiCache storage path (its own host pool and backend
                factory; scripts/bootstrap installs it) on a spawned server: pages a second
                and GB/s through our backend's batch_set_v1 and batch_exists +
                batch_get_v1 at --page-sizes tokens of a Llama-3-8B (default 4, 16, 64:
                512 KiB, 2 MiB, 8 MiB pages), beside the copy bound and SGLang's own file
                backend on the same pages, every page loaded checked byte for byte; and
                batch_exists of 128 pages against the echo (only --page-sizes,
                --sglang-bytes, --batch, --seed, --json, --timeout, --lookup-rounds,
                --lookup-iters and --no-progress apply)

  chat with --disk-size: the same conversations twice, with a disk tier under a pool of an
  eighth of the working set and with that pool alone: hit rates with the disk, pool-only
  and unbounded, and chunks written through against chunks the pool evicted (the
  server's admission policy: --disk-admission)
"""

EPILOG = """\
examples:
  lmcache-mp-bench --workload W1 --peer redis
  lmcache-mp-bench --workload W3 --tp 2 --json w3.json
  lmcache-mp-bench --workload chat --duration 60 --plot chat.png
  lmcache-mp-bench --workload chat --nodes 2 --adopt-restart   # two servers, one Redis
  lmcache-mp-bench --workload disk --disk-dir /mnt/nvme/bench
  lmcache-mp-bench --workload chat --disk-size 4GiB
  lmcache-mp-bench --workload trace --trace conversation.jsonl --disk-share 0.5
  lmcache-mp-bench --workload sglang --page-sizes 64 --sglang-bytes 1GiB
  lmcache-mp-bench --workload W2 --url   # the server running at this user's default endpoint
  LMCACHE_MP_TOKEN=... LMCACHE_MP_ADMIN_TOKEN=... \
    lmcache-mp-bench --workload W2 --url tcp://127.0.0.1:5555

exit status: 0 when every byte check passed, 1 when one failed (the table says which),
2 for bad flags or a peer (or, for --workload sglang, SGLang) that cannot run here (the
message says what to install),
3 when the run itself failed (a server, rank or reply that did not come in time).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-mp-bench", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        options = flags.resolve(flags.from_namespace(parser.parse_args(argv)))
    except flags.FlagError as exc:
        parser.error(str(exc))
    # What runs imports torch: seconds that --help and a flag error do without.
    from .workloads.main import main as run

    return run(options)


if __name__ == "__main__":
    sys.exit(main())
