"""W1, W2, W3: new prompts, then the same prompts again (STORE, then RETRIEVE of the same
bytes)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from ..harness.engine import Request, random_tokens
from ..harness.steps import Workload
from ..shapes import KVShape


class UniformWorkload(Workload):
    """W1, W2, W3: new prompts of `chunks` chunks, then the same prompts again.

    The first pass misses and stores every chunk, the second hits and retrieves them,
    so STORE and RETRIEVE move the same bytes. Each prompt has one block more than its
    chunks, as a prompt rarely ends on a chunk boundary.
    """

    def __init__(self, shape: KVShape, chunks: int, batch: int, requests: int | None,
                 engines: int, salt: str, seed: int):
        super().__init__(shape, engines, salt, seed, requests)
        self.chunks = chunks
        self.batch = batch

    def planned_requests(self) -> int | None:
        return None if self.requests is None else 2 * self.requests  # each prompt twice

    def prompt_tokens(self) -> int:
        return self.chunks * self.shape.chunk_size + self.shape.block_size

    def stream(self, phase: str, engine: int) -> Iterator[list[Request]]:
        rng = random.Random(f"{self.seed}-uniform-{engine}")
        share = self.share(engine)  # distinct prompts; each is sent twice
        sent = 0
        for step in itertools.count():
            count = self.batch if share is None else min(self.batch, share - sent)
            if count <= 0:
                return
            prompts = [random_tokens(rng, self.prompt_tokens()) for _ in range(count)]
            for attempt in ("store", "hit"):
                yield [Request(f"e{engine}-s{step}-r{i}-{attempt}", tokens, self.salt)
                       for i, tokens in enumerate(prompts)]
            sent += count
