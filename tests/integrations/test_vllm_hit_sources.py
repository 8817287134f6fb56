"""vLLM 0.33's prefix-cache metrics by source (get_external_cache_hit_sources) through its
real scheduler, against a real server with a disk tier: a hit the server held in memory is
host, one it read back from disk is disk; and the split of a hit over the tiers."""

from functools import partial

import pytest

# First: test_vllm imports vLLM for the CPU, its import-time warnings silenced.
from .test_vllm import Engine, prompt, stats  # isort: skip
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmcache_mp.integrations.vllm.sources import hit_sources

from ..utils import run_server, wait_for

HOST, DISK, UNSPECIFIED = (CacheHitSource.HOST, CacheHitSource.DISK,
                           CacheHitSource.EXTERNAL_UNSPECIFIED)
CHUNK = 256


def written_at_least(server, chunks: int) -> bool:
    """Whether the server has written `chunks` chunks to its disk tier (wait_for's test)."""
    return stats(server).disk_chunks_written >= chunks


def hits_by_source(engine) -> dict:
    """What vLLM's metrics got from the engine's steps (SchedulerStats)."""
    return engine.hits_by_source


def test_hits_from_the_servers_memory_are_host_and_from_its_disk_disk(model_dir, tmp_path):
    # A pool of 4 MiB holds 8 chunks of this model (512 KiB each); 12 are stored.
    with run_server("--cpu-size", "4MiB", "--disk-dir", str(tmp_path / "disk"),
                    "--disk-size", "64MiB", "--disk-prefetch-wait", "30") as server:
        writer = Engine(model_dir, server.url)
        prompts = {name: prompt(90 + i, 3 * CHUNK + 40)
                   for i, name in enumerate(["old", "q0", "q1", "recent"])}
        try:
            for count, (name, tokens) in enumerate(prompts.items(), start=1):
                writer.add(name, tokens)
                writer.run_until_idle()
                wait_for(partial(written_at_least, server, 3 * count),
                         "the prompt's chunks on disk")
        finally:
            writer.close()
        assert stats(server).chunks <= 8  # "old" is on disk only

        reader = Engine(model_dir, server.url, log_stats=True)
        try:
            reader.add("old", prompts["old"])
            reader.run_until_idle()
            assert reader.first_computed["old"] == 3 * CHUNK
            reader.assert_kv("old", prompts["old"])
            assert hits_by_source(reader) == {DISK: 3 * CHUNK}
            assert stats(server).disk_hits >= 3

            reader.add("recent", prompts["recent"])
            reader.run_until_idle()
            assert reader.first_computed["recent"] == 3 * CHUNK
            assert hits_by_source(reader) == {DISK: 3 * CHUNK, HOST: 3 * CHUNK}
        finally:
            reader.close()


@pytest.mark.parametrize("tiers,from_chunk,start,count,expected", [
    ((3, 0, 0), 0, 0, 3 * CHUNK, {HOST: 3 * CHUNK}),
    ((1, 1, 1), 0, 0, 3 * CHUNK, {HOST: CHUNK, DISK: CHUNK, UNSPECIFIED: CHUNK}),
    # vLLM's own cache covers a block of the first chunk; it takes all but the last token
    ((1, 2, 0), 1, CHUNK + 16, 3 * CHUNK - 17, {HOST: CHUNK - 16, DISK: 2 * CHUNK - 1}),
    ((0, 0, 2), 2, 2 * CHUNK, 2 * CHUNK, {UNSPECIFIED: 2 * CHUNK}),
    (None, 0, 0, CHUNK, {UNSPECIFIED: CHUNK}),  # a server that does not count tiers
    ((2, 0, 0), 0, 0, 0, {}),
])
def test_a_hit_splits_over_the_tiers_its_chunks_were_in(tiers, from_chunk, start, count,
                                                         expected):
    sources = hit_sources(tiers, from_chunk, CHUNK, start, count)
    assert sources == expected and sum(sources.values()) == count
