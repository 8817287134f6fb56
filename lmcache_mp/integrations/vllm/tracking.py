"""The scheduler's record of one vLLM request: a RequestTracker over its growing token ids."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgpack

from ...client import hashing
from ...client.tracker import RequestTracker

if TYPE_CHECKING:
    from vllm.v1.request import Request


class StoredTokens(enum.Enum):
    """Whose KV an engine stores (VllmRequestTracker.stored_tokens), from kv_role and
    store_generated."""

    NONE = "none"  # kv_consumer: it loads, and never stores
    PROMPT = "prompt"  # store_generated false: the prompt's full chunks only
    ALL = "all"  # the prompt's and the generated tokens' full chunks (multi-turn reuse)


def chunk_extra_keys(request: Request, num_chunks: int, chunk_size: int) -> list[bytes]:
    """Per chunk, what its KV depends on besides its tokens, as vLLM's own prefix cache
    keys its blocks: the LoRA adapter (name and path) in every chunk, and each image (or
    other multimodal item) by its content hash (`identifier`) and its offset from the
    chunk's start in every chunk its placeholder tokens overlap. b"" for a chunk without."""
    lora = request.lora_request
    lora_keys: list[list[str | int]] = ([["lora", lora.lora_name, lora.lora_path or ""]]
                                        if lora else [])
    keys: list[bytes] = []
    for index in range(num_chunks):
        start, end = index * chunk_size, (index + 1) * chunk_size
        chunk_keys = list(lora_keys)
        for feature in request.mm_features:
            offset, length = feature.mm_position.offset, feature.mm_position.length
            if offset < end and start < offset + length:
                chunk_keys.append(["mm", feature.identifier, offset - start, length])
        keys.append(msgpack.packb(chunk_keys) if chunk_keys else b"")
    return keys


@dataclass(eq=False)
class VllmRequestTracker(RequestTracker):
    """RequestTracker for a vLLM request, whose tokens grow as it generates.

    With StoredTokens.ALL the tracker follows `request.all_token_ids`: each full chunk the
    request completes by generating gets its key (the chained hash over every token
    before it), so it is stored once computed, like a prompt chunk, and the next turn of
    a conversation (this prompt, the answer, a new message) finds it by LOOKUP. With
    PROMPT it keys the prompt alone, as vLLM's prompt_token_ids; with NONE it stores
    nothing (num_token_blocks is 0) and only loads.
    """

    stored_tokens: StoredTokens = StoredTokens.ALL
    # the live vLLM request (vLLM appends each generated token to it in place)
    request: Request | None = field(default=None, repr=False)
    num_groups: int = 1  # vLLM's KV cache groups (groups.py); the tracker plans on group 0's
    # the blocks of groups 1 and on, as allocated_block_ids holds group 0's: vLLM gives
    # every group of one block size as many blocks (a window group its null block for
    # those it keeps no KV in)
    more_block_ids: list[list[int]] = field(default_factory=list, repr=False)
    # the last LOOKUP's hit chunks by server tier (SchedulerAdapter.hit_tiers), if counted
    hit_tiers: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.more_block_ids = [[] for _ in range(self.num_groups - 1)]

    @classmethod
    def of(cls, request: Request, layout, cache_salt: str, stored_tokens: StoredTokens,
           num_groups: int = 1) -> VllmRequestTracker:
        """The tracker of a request vLLM asks about for the first time."""
        tokens = (request.all_token_ids if stored_tokens is StoredTokens.ALL
                  else request.prompt_token_ids)
        assert tokens is not None  # the scheduler side never tracks prompt embeddings
        return cls(request.request_id, tokens, layout, cache_salt,
                   chunk_extra_keys(request, len(tokens) // layout.chunk_size,
                                    layout.chunk_size),
                   stored_tokens=stored_tokens, request=request, num_groups=num_groups)

    @property
    def group_block_ids(self) -> list[list[int]]:
        """Every group's blocks, in vLLM's group order."""
        return [self.allocated_block_ids, *self.more_block_ids]

    def allocate_groups(self, block_ids: Sequence[Sequence[int]], new: bool = False) -> None:
        """Scheduler: vLLM's block ids of every group: all the request's blocks (allocation:
        those not recorded yet are appended), or with `new` this step's new ones."""
        first = block_ids[0]
        self.allocate(first if new else first[len(self.allocated_block_ids):])
        for have, ids in zip(self.more_block_ids, block_ids[1:]):
            have.extend(ids if new else ids[len(have):])

    def _restart(self) -> None:
        super()._restart()
        self.more_block_ids = [[] for _ in range(self.num_groups - 1)]

    @property
    def num_token_blocks(self) -> int:
        """Blocks that may be stored: those the tracked tokens fill (none for a consumer)."""
        if self.stored_tokens is StoredTokens.NONE:
            return 0
        return len(self.token_ids) // self.layout.block_size

    def follow(self, *, looking_up: bool = False) -> None:
        """Scheduler, before each lookup and each plan of the request's steps: with
        StoredTokens.ALL, take in the tokens it generated once they complete a chunk (the
        hashes are chained, so the earlier chunks keep their keys), and all of them at a
        lookup (`looking_up`: after a preemption vLLM computes them again, and a hit of
        them all leaves only the last one to compute). Between chunks nothing is copied:
        only full chunks are ever stored or looked up."""
        if self.stored_tokens is not StoredTokens.ALL:
            return
        request = self.request
        assert request is not None  # of() gives every tracker its request
        chunk_size = self.layout.chunk_size
        num_chunks = request.num_tokens // chunk_size
        grew = num_chunks > len(self.chunk_hashes)
        if grew or (looking_up and request.num_tokens != len(self.token_ids)):
            self.token_ids = tuple(request.all_token_ids)
        if grew:
            self.extra_keys = chunk_extra_keys(request, num_chunks, chunk_size)
            self.chunk_hashes = tuple(hashing.chunk_hashes(self.token_ids, chunk_size,
                                                           self.extra_keys))
