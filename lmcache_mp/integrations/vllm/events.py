"""KV events: the chunks an engine can load from the server, as vLLM's BlockStored/BlockRemoved."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
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

# The medium of each server tier in the order LookupReply.hit_tiers counts them, as
# vLLM's own offloading tiers name theirs: the server's memory pool (CPU, or a GPU tier of
# its own: not the engine's GPU, which vLLM's "GPU" names) is "CPU", like vLLM's CPU tier;
# its disk tier and L2 (a store shared over the network) are "STORAGE", like vLLM's
# file-system and object-store tiers. A chunk this engine stored lands in the pool: "CPU".
TIER_MEDIA = (MEDIUM_CPU, MEDIUM_STORAGE, MEDIUM_STORAGE)
STORED_MEDIUM = MEDIUM_CPU
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
    prefix cache's BlockStored does, with the `medium` of the server tier that held the
    chunk (TIER_MEDIA) and `locality` "LOCAL". A router that indexes vLLM's GPU events
    therefore matches a prompt against our chunks with the same hashes, told apart by
    medium, at vLLM's block granularity (a chunk is chunk_size / block_size blocks,
    announced together). A chunk a LOOKUP finds in another tier than the one it was
    announced under is withdrawn under the old medium, then announced under the new one;
    a BlockRemoved always names the medium its chunk was announced under.

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
        # prefix), with every block hash in it and the medium it was announced under;
        # oldest first
        self._announced: OrderedDict[ExternalBlockHash, _Announced] = OrderedDict()
        self._events: list[KVCacheEvent] = []  # for the next take()

    def stored(self, request: Request, first_chunk: int, num_chunks: int) -> None:
        """Scheduler, in the step whose workers send the STORE of these chunks."""
        for index in range(first_chunk, first_chunk + num_chunks):
            self._announce(request, index, STORED_MEDIUM)

    def looked_up(self, request: Request, from_chunk: int, hit: int, num_chunks: int,
                  tiers: tuple[int, int, int] | None) -> None:
        """Scheduler, when a LOOKUP of chunks from_chunk..num_chunks-1 found the first
        `hit`: those are announced with the medium of the tier each was found in (`tiers`:
        the hit chunks in memory, read back from disk, pulled from L2, in prompt order;
        None, from a server that does not count them: all "CPU"); announced ones from the
        first miss on are withdrawn. The same answer again (vLLM asks until it admits the
        request) changes nothing."""
        media = [medium for medium, count in zip(TIER_MEDIA, tiers or (hit, 0, 0))
                 for _ in range(count)]
        for index, medium in zip(range(from_chunk, from_chunk + hit), media):
            self._announce(request, index, medium)
        removed: dict[str, list[ExternalBlockHash]] = {}
        for index in range(from_chunk + hit, num_chunks):
            hashes = self._block_hashes(request, index)
            if hashes is not None and hashes[-1] in self._announced:
                gone = self._announced.pop(hashes[-1])
                removed.setdefault(gone.medium, []).extend(gone.hashes)
        for medium, block_hashes in removed.items():
            self._events.append(_removed(block_hashes, medium))

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

    def _announce(self, request: Request, index: int, medium: str) -> None:
        """Announce the chunk under `medium`; one announced under another is withdrawn
        under that one first, in the same step."""
        hashes = self._block_hashes(request, index)
        if hashes is None:
            return
        announced = self._announced.get(hashes[-1])
        if announced is not None and announced.medium == medium:
            self._announced.move_to_end(hashes[-1])
            return
        if announced is not None:
            del self._announced[hashes[-1]]
            self._events.append(_removed(list(announced.hashes), announced.medium))
        self._announced[hashes[-1]] = _Announced(hashes, medium)
        self._events.append(self._stored(request, index, hashes, medium))
        while len(self._announced) > self.max_chunks:
            _, oldest = self._announced.popitem(last=False)
            self._events.append(_removed(list(oldest.hashes), oldest.medium))

    def _stored(self, request: Request, index: int, hashes: tuple[ExternalBlockHash, ...],
                medium: str) -> BlockStored:
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
            medium=medium,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            group_idx=0,
            locality=LOCALITY,
            session_id=request.session_id)


class _Announced(NamedTuple):
    """An announced chunk: its block hashes and the medium it was announced under."""

    hashes: tuple[ExternalBlockHash, ...]
    medium: str


def _removed(block_hashes: list[ExternalBlockHash], medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium=medium, group_idx=0,
                        locality=LOCALITY)
