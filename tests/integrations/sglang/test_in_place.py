"""A layer_first host pool moved into memory the server maps, against a real server: SGLang's
own pool keeps its addresses and bytes, and the server copies pages straight into and out of
it (one STORE, one RETRIEVE a batch, no staging segment), byte for byte with pools that go
through staging; parts that do not split, zero_copy off and page_first pools use staging; a
pool moves once, whoever attaches again; a miss mid-batch; on CUDA, the pool pinned
again; moving it holds one step of memory more at most (a get and a set at once in place:
test_pipeline.py)."""

import mmap
import subprocess
import sys
import textwrap

import pytest
import torch

from lmcache_mp.memory import mappings

from ...utils import run_server
from .hostpools import mha_pool, mla_pool
from .test_backend import PAGE, backend, kv_at, page_keys
from .test_pipeline import SOURCE_PAGES, TARGET_PAGES, instance

POOL_PAGES = 16


def filled_pool(make, layout, page=PAGE):
    pool = make(layout, POOL_PAGES * page, page)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.dtype))
    return pool


def pages_at(page):
    """Host indices of these host pages (of `page` tokens), in this order."""
    return lambda pages: torch.cat([torch.arange(p * page, (p + 1) * page, dtype=torch.int64)
                                    for p in pages])


def mapped_file(address):
    """What /proc/self/maps names the mapping holding `address`."""
    return next(name for start, stop, _, name in mappings() if start <= address < stop)


def test_a_layer_first_pool_moves_into_a_segment_keeping_its_addresses_and_bytes(server):
    pool = filled_pool(mha_pool, "layer_first")
    address, before = pool.kv_buffer.data_ptr(), pool.kv_buffer.clone()
    storage = backend(pool, server.url)
    segment = storage.link._pool
    assert segment is not None and mapped_file(address) == f"/memfd:{segment.name} (deleted)"
    assert pool.kv_buffer.data_ptr() == address and torch.equal(pool.kv_buffer, before)
    # What SGLang writes into the pool is in the pages the server maps.
    pool.kv_buffer.view(torch.uint8).reshape(-1)[:4096].fill_(7)
    seen = mmap.mmap(segment.fd, segment.size)
    assert seen[:4096] == b"\7" * 4096
    seen.close()
    storage.close()


@pytest.mark.parametrize("make,page,layout_to", [
    (mha_pool, PAGE, "page_first"), (mha_pool, PAGE, "layer_first"),
    (mla_pool, 16, "page_first"), (mla_pool, 16, "layer_first")])
def test_the_server_copies_pages_straight_out_of_and_into_the_pool(server, make, page,
                                                                    layout_to):
    """One STORE and one RETRIEVE a batch, whatever the host pages; a page_first pool reads
    the same pages through its staging segment, byte for byte."""
    mla, at = make is mla_pool, pages_at(page)
    source, target = filled_pool(make, "layer_first", page), filled_pool(make, layout_to, page)
    writer, reader = backend(source, server.url, mla=mla), backend(target, server.url, mla=mla)
    keys = page_keys(len(SOURCE_PAGES))
    assert writer.batch_set_v1(keys, at(SOURCE_PAGES)) == [True] * len(keys)
    assert writer.link._in_place and instance(server, writer).stores == 1
    assert reader.batch_exists(keys) == len(keys)
    assert reader.batch_get_v1(keys, at(TARGET_PAGES)) == [True] * len(keys)
    assert torch.equal(kv_at(source, at(SOURCE_PAGES)), kv_at(target, at(TARGET_PAGES)))
    assert reader.link._in_place == (layout_to == "layer_first")
    if reader.link._in_place:
        assert instance(server, reader).retrieves == 1
    writer.close()
    reader.close()


def test_pages_whose_parts_do_not_split_into_chunk_rows_go_through_staging(server):
    """An MLA page of 4 tokens is 320 bytes a layer, not whole rows of a 256-token chunk:
    the pool moves, but its pages go through the staging segment, byte for byte."""
    source, target = filled_pool(mla_pool, "layer_first"), filled_pool(mla_pool, "layer_first")
    writer = backend(source, server.url, mla=True)
    reader = backend(target, server.url, mla=True)
    assert writer.link._pool is not None and not writer.link._in_place
    keys, at = page_keys(5), pages_at(PAGE)
    assert writer.batch_set_v1(keys, at(range(5))) == [True] * 5
    assert reader.batch_get_v1(keys, at(range(6, 11))) == [True] * 5
    assert torch.equal(kv_at(source, at(range(5))), kv_at(target, at(range(6, 11))))
    writer.close()
    reader.close()


def test_with_zero_copy_off_the_pool_stays_where_sglang_put_it(server):
    pool = filled_pool(mha_pool, "layer_first")
    storage = backend(pool, server.url, zero_copy=False)
    assert storage.link._pool is None and not storage.link._in_place
    assert not mapped_file(pool.kv_buffer.data_ptr()).startswith("/memfd:")
    storage.close()


def test_a_backend_attached_again_finds_its_pool_moved_already(server):
    pool = filled_pool(mha_pool, "layer_first")
    first = backend(pool, server.url)
    segment = first.link._pool
    keys, at = page_keys(3), pages_at(PAGE)
    assert first.batch_set_v1(keys, at([1, 2, 3])) == [True] * 3
    first.close()  # SGLang's detach
    again = backend(pool, server.url)
    assert again.link._pool is segment and again.link._in_place
    expected = kv_at(pool, at([1, 2, 3])).clone()
    assert again.batch_get_v1(keys, at([7, 8, 9])) == [True] * 3
    assert torch.equal(kv_at(pool, at([7, 8, 9])), expected)
    again.close()


def test_a_miss_in_the_middle_of_a_get_in_place_ends_it_and_leaves_no_hold():
    with run_server("--lease-timeout", "600") as server:
        source, target = filled_pool(mha_pool, "layer_first"), filled_pool(mha_pool,
                                                                           "layer_first")
        writer, reader = backend(source, server.url), backend(target, server.url)
        keys, at = page_keys(10), pages_at(PAGE)
        assert writer.batch_set_v1(keys[:5], at(range(5))) == [True] * 5
        assert writer.batch_set_v1(keys[6:], at(range(6, 10))) == [True] * 4
        assert reader.batch_exists(keys) == 5
        with server.client() as client:
            assert client.stats().leases_held == 1
            assert reader.batch_get_v1(keys, at(range(6, 16))) == [True] * 5 + [False] * 5
            assert torch.equal(kv_at(source, at(range(5))), kv_at(target, at(range(6, 11))))
            assert client.stats().leases_held == 0
        writer.close()
        reader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pool's pinning needs CUDA")
def test_a_pinned_pool_is_pinned_again_and_the_gpu_reads_the_pages_that_landed(server):
    """SGLang pins its pool with cudaHostRegister on CUDA: the move unpins it and pins the
    new pages, so that a device copy reads what a RETRIEVE wrote (the old pages, pinned
    still, would hold the bytes from before)."""
    from sglang.srt.mem_cache.pool_host import common

    pool, source = filled_pool(mha_pool, "layer_first"), filled_pool(mha_pool, "layer_first")
    buffer = pool.kv_buffer
    common._cuda_host_register(buffer)  # as SGLang's alloc_with_host_register does
    storage, writer = backend(pool, server.url), backend(source, server.url)
    try:
        assert storage.link._in_place
        assert getattr(buffer, common._CUDA_HOST_REGISTERED_RANGES_ATTR) == [
            (buffer.data_ptr(), buffer.numel() * buffer.element_size())]
        keys, at = page_keys(3), pages_at(PAGE)
        assert writer.batch_set_v1(keys, at([0, 1, 2])) == [True] * 3
        assert storage.batch_get_v1(keys, at([5, 6, 7])) == [True] * 3
        on_device = buffer.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), buffer)
        assert torch.equal(kv_at(pool, at([5, 6, 7])), kv_at(source, at([0, 1, 2])))
    finally:
        storage.close()
        writer.close()
        common._cuda_host_unregister(buffer)


MOVE = textwrap.dedent("""
    import mmap, torch
    from lmcache_mp.client.memfd import SharedSegment
    size = 512 << 20
    region = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    pool = torch.frombuffer(region, dtype=torch.uint8)
    pool.fill_(5)
    def status(field):
        with open("/proc/self/status") as lines:
            return next(int(l.split()[1]) << 10 for l in lines if l.startswith(field))
    with open("/proc/self/clear_refs", "w") as reset:
        reset.write("5")  # the peak RSS starts again from now
    before = status("VmRSS:")
    segment = SharedSegment(size, over=pool.data_ptr())
    print(status("VmHWM:") - before, status("VmRSS:") - before)
    assert pool.min().item() == pool.max().item() == 5
""")


def test_moving_a_pool_holds_one_step_of_memory_more_at_most():
    """512 MiB move in steps of 64 MiB, each copied before its old pages are given back: the
    process's peak resident memory grows by one step at most."""
    done = subprocess.run([sys.executable, "-c", MOVE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    peak, after = (int(n) for n in done.stdout.split())
    assert peak <= (64 << 20) + (16 << 20), peak
    assert abs(after) <= 16 << 20, after
