"""The backend's pipeline through its staging segment's two halves, against a real server:
batches larger than the segment move byte for byte both ways, whatever the host pages and
layouts, one STORE a slice; a miss in the middle of a batch ends it, writes nothing after
it and leaves no hold; a get and a set at once share the segment (and, a pool in place,
each names its own host pages); the segment's default size follows the page size. The
tests set zero_copy false, so that layer_first pools go through staging too."""

import concurrent.futures

import pytest
import torch

from lmcache_mp.integrations.sglang import BackendConfig

from ...utils import run_server
from .hostpools import mha_pool, mla_pool
from .test_backend import PAGE, backend, filled, kv_at, page_keys


def tokens_at(pages):
    """Host indices of these host pages, in this order, as SGLang passes them."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64)
                      for p in pages])


def instance(server, storage):
    """STATS of the staging segment's registration (an admin sees every engine's)."""
    with server.client(admin=True) as admin:
        wanted = storage.link.registration.instance_id
        return next(i for i in admin.stats().instances if i.instance_id == wanted)


# Host pages in runs and out of order: each run of consecutive pages moves in one copy.
SOURCE_PAGES = [0, 1, 2, 5, 6, 9, 3, 4, 12, 13, 14]
TARGET_PAGES = [15, 7, 8, 10, 11, 0, 1, 2, 3, 4, 6]


# 3 staging pages: halves of 2 and 1 page, so 11 pages go in 7 slices, taken in turn;
# 1 staging page: one half, 11 slices one after the other.
@pytest.mark.parametrize("make,layout_from,layout_to,staging_pages,slices", [
    (mha_pool, "layer_first", "page_first", 3, 7), (mha_pool, "page_first", "layer_first", 3, 7),
    (mla_pool, "layer_first", "page_first", 3, 7), (mha_pool, "layer_first", "layer_first", 1, 11)])
def test_a_batch_larger_than_the_staging_segment_moves_byte_exact_through_its_halves(
        server, make, layout_from, layout_to, staging_pages, slices):
    mla = make is mla_pool
    source, target = filled(make, layout_from), filled(make, layout_to)
    writer = backend(source, server.url, mla=mla, staging_pages=staging_pages,
                     zero_copy=False)
    reader = backend(target, server.url, mla=mla, staging_pages=staging_pages,
                     zero_copy=False)
    keys = page_keys(len(SOURCE_PAGES))
    assert writer.batch_set_v1(keys, tokens_at(SOURCE_PAGES)) == [True] * 11
    assert instance(server, writer).stores == slices
    assert reader.batch_exists(keys) == 11
    assert reader.batch_get_v1(keys, tokens_at(TARGET_PAGES)) == [True] * 11
    assert instance(server, reader).retrieves == slices
    assert torch.equal(kv_at(source, tokens_at(SOURCE_PAGES)),
                       kv_at(target, tokens_at(TARGET_PAGES)))
    writer.close()
    reader.close()


def test_a_miss_in_the_middle_of_a_pipelined_get_ends_it_and_leaves_no_hold():
    with run_server("--lease-timeout", "600") as server:
        source, target = filled(mha_pool, "layer_first"), filled(mha_pool, "page_first")
        writer = backend(source, server.url, staging_pages=4, zero_copy=False)
        reader = backend(target, server.url, staging_pages=4, zero_copy=False)  # halves of 2 pages
        keys = page_keys(10)
        # Page 5 is missing: its slice (pages 4, 5) lands one page, while the next slice
        # (pages 6, 7, stored) is already in flight into the other half.
        assert writer.batch_set_v1(keys[:5], tokens_at(range(5))) == [True] * 5
        assert writer.batch_set_v1(keys[6:], tokens_at(range(6, 10))) == [True] * 4
        untouched = kv_at(target, tokens_at(range(11, 16))).clone()
        assert reader.batch_exists(keys) == 5
        with server.client() as client:
            assert client.stats().leases_held == 1
            got = reader.batch_get_v1(keys, tokens_at(range(6, 16)))
            assert got == [True] * 5 + [False] * 5
            assert torch.equal(kv_at(source, tokens_at(range(5))),
                               kv_at(target, tokens_at(range(6, 11))))
            assert torch.equal(kv_at(target, tokens_at(range(11, 16))), untouched)
            assert client.stats().leases_held == 0
        # The next batch goes through both halves again.
        assert reader.batch_get_v1(keys[6:], tokens_at(range(12, 16))) == [True] * 4
        assert torch.equal(kv_at(source, tokens_at(range(6, 10))),
                           kv_at(target, tokens_at(range(12, 16))))
        writer.close()
        reader.close()


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_get_and_a_set_at_once_are_both_byte_exact(server, zero_copy):
    """SGLang's prefetch and backup threads call one backend at once: through staging, each
    call takes the halves free when it starts and waits for the others; in place, each
    transfer names its own host pages. Neither sees the other's bytes."""
    pool, fresh = filled(mha_pool, "layer_first"), filled(mha_pool, "layer_first")
    storage = backend(pool, server.url, staging_pages=4, zero_copy=zero_copy)
    assert storage.link._in_place == zero_copy
    loaded, stored = page_keys(6), page_keys(6)
    assert storage.batch_set_v1(loaded, tokens_at(range(6))) == [True] * 6
    assert storage.batch_exists(loaded) == 6
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        get = threads.submit(storage.batch_get_v1, loaded, tokens_at(range(8, 14)))
        put = threads.submit(storage.batch_set_v1, stored, tokens_at(range(6)))
        assert get.result(timeout=60) == [True] * 6
        assert put.result(timeout=60) == [True] * 6
    assert torch.equal(kv_at(pool, tokens_at(range(6))), kv_at(pool, tokens_at(range(8, 14))))
    reader = backend(fresh, server.url)
    assert reader.batch_exists(stored) == 6
    assert reader.batch_get_v1(stored, tokens_at(range(10, 16))) == [True] * 6
    assert torch.equal(kv_at(pool, tokens_at(range(6))), kv_at(fresh, tokens_at(range(10, 16))))
    storage.close()
    reader.close()


def test_the_staging_segment_holds_64_mib_of_pages_unless_told():
    settings = BackendConfig()
    assert [settings.staging_pages_for(kib << 10) for kib in (64, 512, 2048, 8192, 65536)] \
        == [128, 128, 32, 8, 2]
    assert BackendConfig(staging_pages=5).staging_pages_for(8192 << 10) == 5
