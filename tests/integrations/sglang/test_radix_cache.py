"""SGLang's own UnifiedRadixCache, HiCache on LMCacheMPStorage (radix.py), against a real
server: one radix cache writes a sequence back (device -> host -> server), a fresh one
prefetches it (server -> host) and loads it onto its device pool, byte for byte, in layouts
layer_first and page_first, MHA and MLA; and a server pool too small for what is written
leaves each sequence a prefix, every page of which loads byte for byte."""

import pytest

from ...utils import run_server
from .radix import PAGE, Engine, prefetch_and_load, same, write_back


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout_from,layout_to", [
    ("layer_first", "layer_first"), ("page_first", "page_first"),
    ("layer_first", "page_first")])
def test_one_radix_cache_writes_back_and_a_fresh_one_prefetches_byte_exact(
        server, kit, mla, layout_from, layout_to):
    tokens = kit.sequence(5)
    written = write_back(kit, Engine(server.url, layout_from, mla), tokens)
    _, matched, loaded = prefetch_and_load(kit, Engine(server.url, layout_to, mla), tokens,
                                           "load")
    assert matched == len(tokens)
    assert same(loaded, written.kv)


# 48 KiB pages (4 tokens x 3 layers x K/V x 8 heads x 128 x fp16) into a 1 MiB pool: it
# holds 21 of the 40 pages written, so the oldest sequences go, one of them in part.
SEQUENCES, PAGES_EACH = 8, 5


def test_a_pool_too_small_leaves_each_sequence_a_loadable_prefix(kit):
    with run_server("--cpu-size", "1MiB", "--lease-timeout", "30") as small:
        engine = Engine(small.url, heads=8, head_dim=128)
        sequences = [kit.sequence(PAGES_EACH) for _ in range(SEQUENCES)]
        written = [write_back(kit, engine, tokens) for tokens in sequences]
        with small.client(admin=True) as admin:
            usage = admin.stats().tenants[""]
        assert usage.evictions > 0 and usage.chunks < SEQUENCES * PAGES_EACH
        pages_found = []
        for n, (tokens, wrote) in enumerate(zip(sequences, written, strict=True)):
            reader, matched, loaded = prefetch_and_load(kit, engine, tokens, f"read-{n}")
            pages = matched // PAGE
            assert same(loaded, wrote.first(pages * PAGE))  # each page counted is byte-exact
            storage = reader.cache_controller.storage_backend
            assert storage.batch_exists(wrote.keys) == pages  # the leading run
            # ... and no page after it is left: each is looked up alone.
            found = [storage.batch_exists([key]) for key in wrote.keys]
            assert found == [1] * pages + [0] * (PAGES_EACH - pages)
            pages_found.append(pages)
        assert sum(pages_found) == usage.chunks
        assert any(0 < pages < PAGES_EACH for pages in pages_found)  # a prefix, not all
