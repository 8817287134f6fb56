"""SGLang's own HiCacheController, its storage threads and its dynamic backend loading,
driving LMCacheMPStorage against a real server: one controller backs pages up from its
layer_first host pool (write_storage, the backup thread), a second one with a page_first
pool finds them (prefetch, the prefetch thread's batch_exists) and loads them (the IO
thread's batch_get_v1), byte for byte. The test does, between the two prefetch threads,
what SGLang's scheduler does: it allocates host slots for the hit and hands them on.

A single-process gloo group stands in for the TP group (SGLang all-reduces the hit
counts over it), and get_parallel().override states the one-rank layout that a
launched engine publishes."""

import contextlib
import threading

import pytest
import torch
import torch.distributed as dist
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

from ...utils import free_port
from .hostpools import mha_pool

PAGE, TOKENS, LAYERS, HEADS, HEAD_DIM = 4, 64, 3, 2, 16
WAIT_S = 60  # ends a hang only


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                     attn_dcp_size=1, attn_dcp_rank=0):
            yield
    finally:
        dist.destroy_process_group()


def controller(url, layout):
    device = MHATokenToKVPool(TOKENS, PAGE, torch.float16, HEADS, HEAD_DIM, LAYERS, "cpu",
                              False)
    allocator = PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.float16, "cpu", device, False)
    host = mha_pool(layout, TOKENS, PAGE, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM)
    extra = {"backend_name": "lmcache_mp", "module_path": "lmcache_mp.integrations.sglang",
             "class_name": "LMCacheMPStorage", "interface_v1": 1, "url": url}
    return HiCacheController(allocator, host, PAGE, dist.group.WORLD, threading.Event(),
                             io_backend="direct", storage_backend="dynamic",
                             model_name="tiny", storage_backend_extra_config=extra), host


def test_hicache_controllers_back_up_and_prefetch_through_the_server(server, one_rank):
    writer, source = controller(server.url, "layer_first")
    reader, target = controller(server.url, "page_first")
    with contextlib.ExitStack() as stack:
        for made in (writer, reader):
            stack.callback(made.storage_backend.close)
            stack.callback(made._stop_storage_threads)
        source.kv_buffer.copy_(torch.randn(source.kv_buffer.shape).half())
        tokens = list(range(1000, 1024))  # 6 pages
        slots = source.alloc(len(tokens))
        writer.write_storage(slots, tokens,
                             hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
        assert writer.ack_backup_queue.get(timeout=WAIT_S).completed_tokens == len(tokens)

        reader.prefetch("request-1", tokens)
        hit = reader.prefetch_hit_queue.get(timeout=WAIT_S)
        assert hit.storage_hit_count == len(tokens)
        hit.host_indices = target.alloc(hit.storage_hit_count)  # the scheduler's part
        reader.prefetch_buffer.put(hit)
        assert reader.ack_prefetch_queue.get(timeout=WAIT_S).completed_tokens == len(tokens)
        assert torch.equal(source.kv_buffer[:, :, slots],
                           target.kv_buffer[:, hit.host_indices].transpose(1, 2))
