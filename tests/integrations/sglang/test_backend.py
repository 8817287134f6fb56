"""LMCacheMPStorage built by SGLang's own dynamic backend factory over SGLang's own host pools
(hostpools.py) against a real server: pages set from one pool come back byte for byte into
another, whatever their layouts; the rules of LOOKUP, salts and MLA writers hold; a server
that dies gives misses, never an exception, and caching resumes when it is back."""

import hashlib
import os
import uuid

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from ...utils import server_process, started_process, wait_for
from .hostpools import mha_pool, mla_pool

PAGE = 4
TOKENS = 64  # 16 pages a pool


def backend(pool, url, *, mla=False, salt="", tp_rank=0, tp_size=1, timeout_s=2.0, **fields):
    """The backend SGLang builds for `--hicache-storage-backend dynamic`, given its pool;
    `fields`: more of the extra config."""
    extra = {"backend_name": "lmcache_mp", "module_path": "lmcache_mp.integrations.sglang",
             "class_name": "LMCacheMPStorage", "interface_v1": 1, "url": url,
             "cache_salt": salt, "timeout_s": timeout_s, **fields}
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first", model_name="tiny", extra_config=extra)
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage


def filled(make, layout):
    pool = make(layout, TOKENS, PAGE)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.dtype))
    return pool


def page_keys(count):
    """SGLang-like page keys: 64-hex SHA-256 strings, fresh for each call."""
    seed = uuid.uuid4().hex
    return [hashlib.sha256(f"{seed}:{i}".encode()).hexdigest() for i in range(count)]


def tokens_of(first_page, count):
    """Host indices of `count` pages from `first_page`, as SGLang passes them."""
    return torch.arange(first_page * PAGE, (first_page + count) * PAGE, dtype=torch.int64)


def kv_of_tokens(pool, first_page, count):
    return kv_at(pool, tokens_of(first_page, count))


def kv_at(pool, tokens):
    """The KV of these tokens, read from the pool's buffer by SGLang's layout
    (init_kv_buffer's dims) as [K/V,] layers, tokens, ...: comparable across layouts."""
    buffer = pool.kv_buffer
    if buffer.dim() == 5:  # MHA: [2, layers, size, ...] or [2, size, layers, ...]
        return (buffer[:, :, tokens] if pool.layout == "layer_first"
                else buffer[:, tokens].transpose(1, 2))
    return buffer[:, tokens] if pool.layout == "layer_first" else buffer[tokens].transpose(0, 1)


def same_pages(a, a_first, b, b_first, count):
    return torch.equal(kv_of_tokens(a, a_first, count), kv_of_tokens(b, b_first, count))


@pytest.mark.parametrize("make,layout_from,layout_to", [
    (mha_pool, "layer_first", "layer_first"), (mha_pool, "page_first", "page_first"),
    (mha_pool, "layer_first", "page_first"), (mla_pool, "layer_first", "layer_first"),
    (mla_pool, "page_first", "layer_first")])
def test_pages_set_from_one_pool_come_back_into_another_byte_exact(
        server, make, layout_from, layout_to):
    mla = make is mla_pool
    source, target = filled(make, layout_from), make(layout_to, TOKENS, PAGE)
    writer = backend(source, server.url, mla=mla)
    reader = backend(target, server.url, mla=mla)
    keys = page_keys(5)
    with server.client() as client:
        assert reader.batch_exists(keys) == 0
        assert writer.batch_set_v1(keys, tokens_of(1, 5)) == [True] * 5
        stored = client.stats().bytes_stored
        assert writer.batch_set_v1(keys, tokens_of(1, 5)) == [True] * 5  # SGLang sets again
        assert client.stats().bytes_stored == stored  # ... and nothing is copied twice
    assert reader.batch_exists(keys) == 5
    assert reader.batch_get_v1(keys, tokens_of(9, 5)) == [True] * 5
    assert same_pages(source, 1, target, 9, 5)
    writer.close()
    reader.close()


def test_a_partial_prefix_loads_its_leading_pages_only(server):
    source, target = filled(mha_pool, "layer_first"), filled(mha_pool, "layer_first")
    writer, reader = backend(source, server.url), backend(target, server.url)
    keys = page_keys(6)
    assert writer.batch_set_v1(keys[:3], tokens_of(0, 3)) == [True] * 3
    untouched = kv_of_tokens(target, 11, 3).clone()
    assert reader.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, tokens_of(8, 6)) == [True] * 3 + [False] * 3
    assert same_pages(source, 0, target, 8, 3)
    assert torch.equal(kv_of_tokens(target, 11, 3), untouched)
    # The chain's next batch names its parent through prefix_keys: it extends the prefix.
    extra = HiCacheStorageExtraInfo(prefix_keys=keys[:3])
    assert writer.batch_set_v1(keys[3:], tokens_of(3, 3), extra) == [True] * 3
    assert reader.batch_exists(keys) == 6
    writer.close()
    reader.close()


def test_two_salts_never_see_each_others_pages(server):
    source = filled(mha_pool, "page_first")
    tenant_a = backend(source, server.url, salt="tenant-a")
    tenant_b = backend(mha_pool("page_first", TOKENS, PAGE), server.url, salt="tenant-b")
    keys = page_keys(4)
    assert tenant_a.batch_set_v1(keys, tokens_of(0, 4)) == [True] * 4
    assert tenant_b.batch_exists(keys) == 0
    assert tenant_b.batch_get_v1(keys, tokens_of(4, 4)) == [False] * 4
    assert tenant_a.batch_exists(keys) == 4
    tenant_a.close()
    tenant_b.close()


def test_under_mla_only_the_writer_rank_stores_and_every_rank_loads(server):
    leader_pool, follower_pool = filled(mla_pool, "layer_first"), filled(mla_pool, "page_first")
    leader = backend(leader_pool, server.url, mla=True, tp_rank=0, tp_size=2)
    follower = backend(follower_pool, server.url, mla=True, tp_rank=1, tp_size=2)
    keys = page_keys(3)
    # A non-writer rank has nothing to store: it reports success and sends nothing.
    assert follower.batch_set_v1(keys, tokens_of(0, 3)) == [True] * 3
    assert leader.batch_exists(keys) == 0
    assert leader.batch_set_v1(keys, tokens_of(0, 3)) == [True] * 3
    assert follower.batch_exists(keys) == 3
    assert follower.batch_get_v1(keys, tokens_of(5, 3)) == [True] * 3
    assert same_pages(leader_pool, 0, follower_pool, 5, 3)
    leader.close()
    follower.close()


def test_host_indices_that_are_not_whole_pages_of_the_pool_move_nothing(server):
    pool = filled(mha_pool, "layer_first")
    storage = backend(pool, server.url)
    keys = page_keys(2)
    before = pool.kv_buffer.clone()
    for indices in (tokens_of(0, 1), tokens_of(0, 2) + 1, tokens_of(15, 2)):
        assert storage.batch_set_v1(keys, indices) == [False, False]
        assert storage.batch_get_v1(keys, indices) == [False, False]
    assert storage.batch_exists(keys) == 0
    assert torch.equal(pool.kv_buffer, before)
    storage.close()


def test_layouts_it_cannot_read_are_refused_at_start_up_naming_the_flag(server):
    pool = mha_pool("page_first_direct", TOKENS, PAGE)
    with pytest.raises(ValueError, match="--hicache-mem-layout"):
        backend(pool, server.url)


@pytest.mark.parametrize("fields,refusal", [
    ({}, "interface_v1"), ({"interface_v1": 1, "urll": "x"}, "urll"),
    ({"interface_v1": 1, "timeout_s": 0}, "timeout_s"),
    ({"interface_v1": 1, "staging_pages": 0}, "staging_pages"),
    ({"interface_v1": 1, "staging_pages": "8"}, "staging_pages"),
    ({"interface_v1": 1, "zero_copy": "yes"}, "zero_copy")])
def test_a_wrong_extra_config_is_refused_naming_the_field(fields, refusal):
    extra = {"backend_name": "lmcache_mp", "class_name": "LMCacheMPStorage",
             "module_path": "lmcache_mp.integrations.sglang", **fields}
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="tiny", extra_config=extra)
    with pytest.raises(ValueError, match=refusal):
        StorageBackendFactory.create_backend("dynamic", config, None)


def test_a_killed_server_gives_misses_and_caching_resumes_after_its_restart(tmp_path):
    runtime_dir = str(tmp_path / "runtime")
    os.makedirs(runtime_dir, mode=0o700)
    first = server_process(None, ["--cpu-size", "64MiB", "--log-level", "warning"], runtime_dir)
    first.start()
    source, target = filled(mha_pool, "layer_first"), filled(mha_pool, "layer_first")
    writer = backend(source, first.url, timeout_s=1.0)
    reader = backend(target, first.url, timeout_s=1.0)
    keys = page_keys(4)
    try:
        assert writer.batch_set_v1(keys[:2], tokens_of(0, 2)) == [True] * 2
        started_process(first).kill()
        started_process(first).wait()
        # Dead server: every call answers, as a miss or a failed store.
        assert reader.batch_exists(keys) == 0
        assert reader.batch_get_v1(keys[:2], tokens_of(8, 2)) == [False] * 2
        assert writer.batch_set_v1(keys[2:], tokens_of(2, 2)) == [False] * 2
    finally:
        first.close()
    with server_process(first.url, ["--cpu-size", "64MiB", "--log-level", "warning"],
                        runtime_dir):
        # The client reconnects in the background: the first calls may still miss.
        wait_for(lambda: writer.batch_set_v1(keys, tokens_of(0, 4)) == [True] * 4,
                 "stores to the restarted server")
        wait_for(lambda: reader.batch_exists(keys) == 4, "lookups on the restarted server")
        assert reader.batch_get_v1(keys, tokens_of(8, 4)) == [True] * 4
        assert same_pages(source, 0, target, 8, 4)
        writer.close()
        reader.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])  # staging, in place
def test_under_sglangs_failure_injector_every_page_reported_loaded_is_byte_exact(
        server, monkeypatch, layout):
    """SGLang's HiCacheStorageFailureInjector (its test hook) fails half the calls before
    they reach the backend: stores go missing, chains break. No call raises, and a page
    batch_get_v1 reports True always holds the bytes that were set for its key."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    source, target = filled(mha_pool, layout), mha_pool(layout, TOKENS, PAGE)
    writer, reader = backend(source, server.url), backend(target, server.url)
    assert type(writer).__name__ == "HiCacheStorageFailureInjector"
    loaded = 0
    rounds = 0
    while loaded < 6:  # a round loads pages when its set, lookup and get all get through:
        rounds += 1    # 1 in 8; 300 rounds without 6 pages is below one chance in 10^10
        assert rounds <= 300
        keys = page_keys(3)
        writer.batch_set_v1(keys, tokens_of(0, 3))
        hits = reader.batch_exists(keys)
        got = reader.batch_get_v1(keys[:hits], tokens_of(8, hits))
        landed = got.index(False) if False in got else len(got)
        assert same_pages(source, 0, target, 8, landed)
        loaded += landed
    writer._backend.close()
    reader._backend.close()
