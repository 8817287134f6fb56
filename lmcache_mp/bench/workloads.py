"""What the simulated engines are asked to prefill, step by step: uniform, chat and multi-tenant."""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from ..client import CacheClient
from .shapes import KVShape

VOCABULARY = 32000


@dataclass(frozen=True)
class Request:
    """One prompt an engine prefills in one step."""

    request_id: str
    token_ids: list[int]
    cache_salt: str
    tenant: str = ""  # who sent it, for per-tenant hit rates
    counted: bool = True  # False for warm-up requests, left out of hit rates


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCABULARY) for _ in range(count)]


class Workload(ABC):
    """A workload: named phases, and per phase one stream of step batches per engine.

    Streams are per engine so that a prompt repeated for a hit comes in a later step of
    the engine that stored it; documents shared between engines still meet in the cache.
    """

    phases: tuple[str, ...] = ("run",)

    def __init__(self, shape: KVShape, engines: int, salt: str, seed: int,
                 requests: int | None = None):
        self.shape = shape
        self.engines = engines
        self.salt = salt
        self.seed = seed
        self.requests = requests  # over every engine; None: until the run's duration is up

    def share(self, engine: int) -> int | None:
        """The requests (or prompts) this engine sends: an even split of `requests`."""
        if self.requests is None:
            return None
        return self.requests // self.engines + (engine < self.requests % self.engines)

    def planned_requests(self) -> int | None:
        """Requests a single-phase run sends, for the progress bar; None: not known ahead."""
        return self.requests if len(self.phases) == 1 else None

    # Not abstract: a hook that most workloads leave empty.
    def prepare(self, phase: str, client: CacheClient, capacity: int) -> None:  # noqa: B027
        """Before a phase, from the benchmark's own client (quotas, a clean slate)."""

    @abstractmethod
    def stream(self, phase: str, engine: int) -> Iterator[list[Request]]:
        """Step batches for one engine; the phase ends when every engine's stream ends."""

    def salts(self) -> list[str]:
        """Every cache_salt this workload uses: the benchmark clears them when it ends."""
        return [self.salt]


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

class ChatWorkload(Workload):
    """Multi-turn conversations over shared documents, documents picked with Zipf popularity.

    A conversation opens on a document (a system prompt, a file, a web page); each turn's
    prompt is the document, every earlier turn (user message and reply) and the new
    message. Conversations run `turns_min`..`turns_max` turns, or until the prompt would
    pass `max_prompt_chunks`; each engine keeps `batch` conversations going at once.
    """

    def __init__(self, shape: KVShape, batch: int, requests: int | None, engines: int,
                 salt: str, seed: int, documents: int = 24, zipf_s: float = 1.1,
                 document_chunks: tuple[int, int] = (1, 6), turns: tuple[int, int] = (2, 6),
                 message_tokens: tuple[int, int] = (32, 384),
                 reply_tokens: tuple[int, int] = (64, 512), max_prompt_chunks: int = 24):
        super().__init__(shape, engines, salt, seed, requests)
        self.batch = batch
        self.turns = turns
        self.message_tokens = message_tokens
        self.reply_tokens = reply_tokens
        self.max_prompt_tokens = max_prompt_chunks * shape.chunk_size
        rng = random.Random(f"{seed}-documents")
        self.documents = [random_tokens(rng, rng.randint(*document_chunks) * shape.chunk_size)
                          for _ in range(documents)]
        self.popularity = [1 / (rank + 1) ** zipf_s for rank in range(documents)]

    def stream(self, phase: str, engine: int) -> Iterator[list[Request]]:
        rng = random.Random(f"{self.seed}-chat-{engine}")
        share = self.share(engine)
        # Open conversations: (number, turn, history, turns left).
        conversations: list[tuple[int, int, list[int], int]] = []
        opened = itertools.count()
        sent = 0
        while share is None or sent < share:
            while len(conversations) < self.batch:
                document = rng.choices(self.documents, self.popularity)[0]
                conversations.append((next(opened), 0, list(document), rng.randint(*self.turns)))
            count = self.batch if share is None else min(self.batch, share - sent)
            batch: list[Request] = []
            still_open: list[tuple[int, int, list[int], int]] = []
            for conversation in conversations:
                number, turn, history, left = conversation
                if len(batch) == count:
                    still_open.append(conversation)
                    continue
                prompt = history + random_tokens(rng, rng.randint(*self.message_tokens))
                batch.append(Request(f"e{engine}-c{number}-t{turn}", prompt, self.salt))
                history = prompt + random_tokens(rng, rng.randint(*self.reply_tokens))
                longest_next = len(history) + self.message_tokens[1]
                if left > 1 and longest_next <= self.max_prompt_tokens:
                    still_open.append((number, turn + 1, history, left - 1))
            conversations = still_open
            sent += len(batch)
            yield batch

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
