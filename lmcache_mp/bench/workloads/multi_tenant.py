"""multi-tenant: two steady tenants and a flooder, without and with a quota on the flooder."""

from __future__ import annotations

import random
from collections.abc import Iterator

from ...client import CacheClient
from ..harness.engine import Request, random_tokens
from ..harness.steps import Workload
from ..shapes import KVShape


class MultiTenantWorkload(Workload):
    """Two steady tenants that reuse their prompts, and a third that floods the cache.

    Phases: `baseline` (steady tenants alone), `flood` (a flood of new prompts, no
    quota), `flood+quota` (the flooder capped at a quarter of the pool). Each steady
    tenant's working set is 30% of the pool, so both fit; without a quota the flood
    evicts them. Per phase: a clean slate, one warm-up pass (not counted), then
    `rounds` counted passes over the working sets.
    """

    phases = ("baseline", "flood", "flood+quota")
    steady_share = 0.30
    flood_cap_share = 0.25

    def __init__(self, shape: KVShape, chunks: int, engines: int, salt: str, seed: int,
                 rounds: int = 3, flood_per_step: int = 2):
        super().__init__(shape, engines, salt, seed)
        self.chunks = chunks
        self.rounds = rounds
        self.flood_per_step = flood_per_step
        self.steady = [f"{salt}-steady-a", f"{salt}-steady-b"]
        self.flooder = f"{salt}-flood"
        self.tenant_names = {f"{salt}-{name}": name for name in ("steady-a", "steady-b", "flood")}
        self.working_set: dict[tuple[str, int], list[list[int]]] = {}  # by (salt, engine)

    def prepare(self, phase: str, client: CacheClient, capacity: int) -> None:
        for salt in self.salts():
            client.clear(salt)
        if phase == "flood+quota":
            client.quota_set(self.flooder, int(capacity * self.flood_cap_share))
        else:
            client.quota_delete(self.flooder)
        prompt_bytes = self.chunks * self.shape.chunk_bytes
        prompts = max(1, int(capacity * self.steady_share / prompt_bytes) // self.engines)
        rng = random.Random(f"{self.seed}-tenants-{phase}")
        tokens = self.chunks * self.shape.chunk_size + self.shape.block_size
        self.working_set = {(salt, engine): [random_tokens(rng, tokens) for _ in range(prompts)]
                            for salt in self.steady for engine in range(self.engines)}

    def stream(self, phase: str, engine: int) -> Iterator[list[Request]]:
        rng = random.Random(f"{self.seed}-flood-{phase}-{engine}")
        prompts = len(self.working_set[self.steady[0], engine])
        flood_tokens = self.chunks * self.shape.chunk_size + self.shape.block_size
        for round_index in range(self.rounds + 1):  # round 0 is the warm-up
            for position in range(prompts):
                batch = [Request(f"e{engine}-{phase}-{salt}-{round_index}-{position}",
                                 self.working_set[salt, engine][position], salt,
                                 tenant=self.tenant_names[salt], counted=round_index > 0)
                         for salt in self.steady]
                if phase != "baseline":
                    batch += [Request(f"e{engine}-{phase}-flood-{round_index}-{position}-{i}",
                                      random_tokens(rng, flood_tokens), self.flooder,
                                      tenant="flood", counted=round_index > 0)
                              for i in range(self.flood_per_step)]
                yield batch

    def salts(self) -> list[str]:
        return [*self.steady, self.flooder]
