"""Where an external hit came from: a LOOKUP's hits by server tier, as vLLM's CacheHitSource."""

from __future__ import annotations

from vllm.v1.metrics.cache_hit_source import CacheHitSource

# The server's tiers in the order LookupReply.hit_tiers counts them, and vLLM's name for
# each: its memory pool (CPU, or a GPU tier of its own) is the node's host memory, its
# disk tier is disk, and L2 (a store shared over the network) has no member of its own.
TIER_SOURCES = (CacheHitSource.HOST, CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED)


def hit_sources(tiers: tuple[int, int, int] | None, from_chunk: int, chunk_size: int,
                start: int, count: int) -> dict[CacheHitSource, int]:
    """vLLM's get_external_cache_hit_sources: the `count` tokens loaded from position
    `start` on, split by the tier each one's chunk was in. `tiers` counts the LOOKUP's hit
    chunks from `from_chunk` on, in prompt order (in memory, read back from disk, pulled
    from L2); None (not counted): all external_unspecified. Only non-zero counts, summing
    to `count`."""
    if count <= 0:
        return {}
    if tiers is None:
        return {CacheHitSource.EXTERNAL_UNSPECIFIED: count}
    sources: dict[CacheHitSource, int] = {}
    end, tier_start = start + count, from_chunk * chunk_size
    for source, chunks in zip(TIER_SOURCES, tiers):
        tier_end = tier_start + chunks * chunk_size
        overlap = min(end, tier_end) - max(start, tier_start)
        if overlap > 0:
            sources[source] = sources.get(source, 0) + overlap
        tier_start = tier_end
    rest = count - sum(sources.values())
    if rest > 0:  # beyond what the LOOKUP counted: never, as vLLM loads only our hit
        sources[CacheHitSource.EXTERNAL_UNSPECIFIED] = (
            sources.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + rest)
    return sources
