"""Multi-tenant benchmark: do two steady tenants keep their hit rate while a third floods the cache?

Runs three scenarios against a real server, each with a fresh server process:
  baseline      the two steady tenants alone
  flood         the same, plus a tenant storing new chunks it never reads again, no quotas
  flood+quota   the same flood, with the flooding tenant capped (--quota)
and reports each steady tenant's hit rate (chunks found by LOOKUP / chunks looked up,
after a warm-up). Target: with quotas, no steady tenant loses more than 5 points against
its baseline.

The benchmark process acts as the worker: one W2-shaped cache in shared memory
(DESIGN.md), registered once per server. Every request is a real LOOKUP, and every miss is
followed by a real STORE of the missing chunks, as an engine would do after prefill.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lmcache_mp.client import CacheClient, LookupItem, SharedKVCache, TransferItem
from lmcache_mp.client import chunk_hashes
from lmcache_mp.server.spawn import ServerProcess

CHUNK_SIZE = 256
BLOCK_SIZE = 16
BLOCKS_PER_CHUNK = CHUNK_SIZE // BLOCK_SIZE
CHUNK_BYTES = 512 * 1024  # W2: 4 layers x 2 x 16 tokens x 2 heads x 64 x fp16 x 16 blocks
MODEL = "bench-w2"
STEADY = ("steady-a", "steady-b")
FLOOD = "flood"


@dataclass
class TenantResult:
    looked_up: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.looked_up if self.looked_up else 0.0


@dataclass
class ScenarioResult:
    name: str
    server_args: list[str]
    tenants: dict[str, TenantResult] = field(default_factory=dict)
    flood_chunks_stored: int = 0


def documents(salt_seed: int, count: int, chunks: int) -> list[list[bytes]]:
    """`count` prompts of `chunks` chunks each, distinct per tenant."""
    return [chunk_hashes([(salt_seed * 1_000_003 + d * 7919 + i) % 50_000
                          for i in range(chunks * CHUNK_SIZE)], CHUNK_SIZE)
            for d in range(count)]


def run_scenario(name: str, args: argparse.Namespace, flood: bool, quota: bool) -> ScenarioResult:
    server_args = ["--cpu-size", f"{args.pool_chunks * CHUNK_BYTES}", "--log-level", "warning"]
    if quota:
        server_args += ["--quota", f"{FLOOD}={args.flood_cap_chunks * CHUNK_BYTES}"]
    result = ScenarioResult(name, server_args, {salt: TenantResult() for salt in STEADY})
    rng = random.Random(args.seed)
    docs = {salt: documents(n + 1, args.documents, args.doc_chunks) for n, salt in enumerate(STEADY)}
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.documents)]
    url = f"ipc:///tmp/lmcache-mp-bench-tenants-{uuid.uuid4().hex[:12]}.sock"
    with ServerProcess(url, server_args) as server:
        with CacheClient(server.url, timeout=30) as client, SharedKVCache(
                "mha", 4, max(args.doc_chunks, args.flood_chunks) * BLOCKS_PER_CHUNK, BLOCK_SIZE,
                2, 64) as cache:
            registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                    block_size=BLOCK_SIZE)
            blocks = list(range(args.doc_chunks * BLOCKS_PER_CHUNK))
            flood_blocks = list(range(args.flood_chunks * BLOCKS_PER_CHUNK))
            for step in range(args.warmup + args.steps):
                for salt in STEADY:
                    (doc,) = rng.choices(docs[salt], weights)
                    (hit,) = client.lookup(MODEL, 1, [LookupItem.build("q", doc, salt)])
                    if step >= args.warmup:
                        result.tenants[salt].looked_up += len(doc)
                        result.tenants[salt].hits += hit
                    if hit < len(doc):
                        client.store(registration, [TransferItem.build(
                            "s", doc, blocks[:len(doc) * BLOCKS_PER_CHUNK], salt)])
                if flood:
                    hashes = [rng.randbytes(16) for _ in range(args.flood_chunks)]
                    (statuses,) = client.store(registration, [TransferItem.build(
                        "f", hashes, flood_blocks, FLOOD)])
                    result.flood_chunks_stored += statuses.count(0)
            client.unregister(registration)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool-chunks", type=int, default=64,
                        help="server pool size in W2 chunks of 512 KiB (default 64 = 32 MiB)")
    parser.add_argument("--documents", type=int, default=12,
                        help="distinct prompts per steady tenant (default 12)")
    parser.add_argument("--doc-chunks", type=int, default=2,
                        help="chunks per prompt (default 2): working set = documents x "
                             "doc-chunks chunks per steady tenant")
    parser.add_argument("--zipf", type=float, default=0.8,
                        help="Zipf exponent of prompt popularity (default 0.8)")
    parser.add_argument("--flood-chunks", type=int, default=8,
                        help="new chunks the flooding tenant stores per step (default 8)")
    parser.add_argument("--flood-cap-chunks", type=int, default=16,
                        help="the flooding tenant's cap with quotas on, in chunks (default 16)")
    parser.add_argument("--warmup", type=int, default=100, help="steps before counting (default 100)")
    parser.add_argument("--steps", type=int, default=400, help="counted steps (default 400)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()

    started = time.monotonic()
    scenarios = [run_scenario("baseline", args, flood=False, quota=False),
                 run_scenario("flood, no quotas", args, flood=True, quota=False),
                 run_scenario("flood, flood capped", args, flood=True, quota=True)]
    baseline = scenarios[0]
    print(f"\n## Multi-tenant hit rates ({time.monotonic() - started:.0f} s)\n")
    print(f"Pool {args.pool_chunks} chunks; each steady tenant: {args.documents} prompts x "
          f"{args.doc_chunks} chunks, Zipf {args.zipf}; flood: {args.flood_chunks} new chunks "
          f"per step, capped at {args.flood_cap_chunks} with quotas; {args.steps} steps after "
          f"{args.warmup} of warm-up.\n")
    print("| scenario | " + " | ".join(f"{s} hit rate" for s in STEADY) +
          " | worst drop vs baseline | target |")
    print("| --- | " + " | ".join("---" for _ in STEADY) + " | --- | --- |")
    worst_with_quota = 0.0
    for scenario in scenarios:
        drops = [100 * (baseline.tenants[s].hit_rate - scenario.tenants[s].hit_rate)
                 for s in STEADY]
        target = "—"
        if scenario is scenarios[2]:
            worst_with_quota = max(drops)
            target = "≤ 5 points → " + ("PASS" if worst_with_quota <= 5 else "MISS")
        rates = " | ".join(f"{100 * scenario.tenants[s].hit_rate:.1f}%" for s in STEADY)
        print(f"| {scenario.name} | {rates} | {max(drops):.1f} points | {target} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args),
            "scenarios": [{**asdict(s), "hit_rates": {k: v.hit_rate for k, v in s.tenants.items()}}
                          for s in scenarios]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
