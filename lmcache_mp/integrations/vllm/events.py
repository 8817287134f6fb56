"""KV events: the chunks an engine can load from the server, as vLLM's BlockStored/BlockRemoved."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from ...client.tracker import ChunkLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import ExternalBlockHash
    from vllm.v1.request import Request

# vLLM's own name for a tier in the node's CPU memory, which routers know: vLLM's
# OffloadingConnector and LMCache's MP connector publish it too. Where the server keeps a
# chunk (its CPU pool, a GPU or disk tier) is the server's business; a chunk announced
# is one this engine can load from the node's server.
MEDIUM = MEDIUM_CPU
LOCALITY = "LOCAL"  # the server runs on this engine's node (vLLM's Locality.LOCAL)


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """vLLM publishes KV events (--kv-events-config with enable_kv_cache_events)."""
    config = vllm_config.kv_events_config
    return bool(config is not None and config.enable_kv_cache_events)


class ChunkEvents:
    """The scheduler's KV events for routers: a BlockStored for each chunk this engine
    stored on the server or found there by LOOKUP (once, while it stays announced), a
    BlockRemoved for an announced chunk a LOOKUP shows gone.

    Events name chunks as vLLM names the blocks in them: vLLM's own block hashes
    (request.block_hashes), parent, token ids, LoRA and extra keys, exactly as its GPU
    prefix cache's BlockStored does, with `medium` "CPU" and `locality` "LOCAL". A router
    that indexes vLLM's GPU events therefore matches a prompt against our chunks with the
    same hashes, told apart by medium, at vLLM's block granularity (a chunk is
    chunk_size / block_size blocks, announced together).

    One server is shared by every engine on the node and evicts on its own, telling no
    one: an announced chunk is withdrawn (BlockRemoved) when a LOOKUP of this engine
    misses it, or any chunk of a prefix after it (the server evicts a prompt's later
    chunks first, so what follows a missing chunk is gone or unreachable), and when more
    than `max_chunks` are announced (the oldest first, to bound this engine's memory: it
    can no longer tell when that one goes). Between an eviction and the next LOOKUP a
    router may see a chunk that is gone: it costs that request a miss, never wrong KV.
    """

    def __init__(self, layout: ChunkLayout, max_chunks: int):
        self.layout = layout
        self.max_chunks = max_chunks
        # each announced chunk by its last block's hash (chained: it names the whole
        # prefix), with every block hash in it; oldest first
        self._announced: OrderedDict[ExternalBlockHash, tuple[ExternalBlockHash, ...]] = \
            OrderedDict()
        self._events: list[KVCacheEvent] = []  # for the next take()

    def stored(self, request: Request, first_chunk: int, num_chunks: int) -> None:
        """Scheduler, in the step whose workers send the STORE of these chunks."""
        for index in range(first_chunk, first_chunk + num_chunks):
            self._announce(request, index)

    def looked_up(self, request: Request, from_chunk: int, hit: int,
                  num_chunks: int) -> None:
        """Scheduler, when a LOOKUP of chunks from_chunk..num_chunks-1 found the first
        `hit`: those are announced; announced ones from the first miss on are withdrawn.
        The same answer again (vLLM asks until it admits the request) changes nothing."""
        for index in range(from_chunk, from_chunk + hit):
            self._announce(request, index)
        removed: list[ExternalBlockHash] = []
        for index in range(from_chunk + hit, num_chunks):
            hashes = self._block_hashes(request, index)
            if hashes is not None and hashes[-1] in self._announced:
                removed.extend(self._announced.pop(hashes[-1]))
        if removed:
            self._events.append(_removed(removed))

    def take(self) -> list[KVCacheEvent]:
        """Scheduler, once per step (vLLM's take_events): the events since the last call."""
        events, self._events = self._events, []
        return events

    def _block_hashes(self, request: Request, index: int) -> tuple[ExternalBlockHash, ...] | None:
        """The chunk's blocks as vLLM's events name them; None where vLLM did not hash them
        (a request without a block hasher)."""
        per_chunk = self.layout.blocks_per_chunk
        end = (index + 1) * per_chunk
        if len(request.block_hashes) < end:
            return None
        return tuple(maybe_convert_block_hash(h) for h in request.block_hashes[end - per_chunk:end])

    def _announce(self, request: Request, index: int) -> None:
        hashes = self._block_hashes(request, index)
        if hashes is None:
            return
        if hashes[-1] in self._announced:
            self._announced.move_to_end(hashes[-1])
            return
        self._announced[hashes[-1]] = hashes
        self._events.append(self._stored(request, index, hashes))
        while len(self._announced) > self.max_chunks:
            _, oldest = self._announced.popitem(last=False)
            self._events.append(_removed(list(oldest)))

    def _stored(self, request: Request, index: int, hashes: tuple[ExternalBlockHash, ...]
                ) -> BlockStored:
        block_size, per_chunk = self.layout.block_size, self.layout.blocks_per_chunk
        first_block = index * per_chunk
        start = first_block * block_size
        extra_keys = []
        mm_index = 0
        for block in range(first_block, first_block + per_chunk):
            keys, mm_index = generate_block_hash_extra_keys(
                request, block * block_size, (block + 1) * block_size, mm_index)
            extra_keys.append(keys)
        lora = request.lora_request
        return BlockStored(
            block_hashes=list(hashes),
            parent_block_hash=(maybe_convert_block_hash(request.block_hashes[first_block - 1])
                               if first_block else None),
            token_ids=list(request.all_token_ids[start:start + self.layout.chunk_size]),
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            group_idx=0,
            locality=LOCALITY,
            session_id=request.session_id)


def _removed(block_hashes: list[ExternalBlockHash]) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium=MEDIUM, group_idx=0,
                        locality=LOCALITY)
