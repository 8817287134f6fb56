"""chat: multi-turn conversations over shared documents with Zipf popularity."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from ..harness.engine import Request, random_tokens
from ..harness.steps import Workload
from ..shapes import KVShape


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
