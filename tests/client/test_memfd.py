import ctypes
import fcntl
import gc
import mmap
import os

import pytest
import torch

from lmcache_mp.client import SharedKVCache
from lmcache_mp.client.memfd import SharedSegment, find_segment, memfd_handles, segment_of
from lmcache_mp.memory import page_span
from lmcache_mp.protocol import MemfdHandle

PAGE = mmap.PAGESIZE


def test_layers_live_back_to_back_in_one_segment_described_by_handles():
    with SharedKVCache("mha", 3, 10, 16, 2, 8, torch.bfloat16) as cache:
        layer_bytes = 2 * 10 * 16 * 2 * 8 * 2
        assert cache.segment.size == 3 * layer_bytes and cache.name == cache.segment.name
        handles = cache.handles()
        assert all(isinstance(h, MemfdHandle) and h.ticket == b"" and h.name == cache.name
                   for h in handles)
        assert [h.offset for h in handles] == [0, layer_bytes, 2 * layer_bytes]
        assert all(h.shape == [2, 10, 16, 2, 8] and h.dtype == "bfloat16" for h in handles)
        assert handles[0].strides == list(cache.layers[0].stride())
        cache.layers[1][0, 3].fill_(1.5)
        assert cache.blocks([3]).shape == (3, 2, 1, 16, 2, 8)
        assert float(cache.blocks([3])[1, 0].sum()) == 1.5 * 16 * 2 * 8
        fd = cache.segment.fd
        assert os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{cache.name}")
    assert cache.segment.fd == -1 and cache.layers == []
    with pytest.raises(OSError):
        os.fstat(fd)
    cache.close()  # a second close is harmless


def test_mla_layout():
    with SharedKVCache("mla", 2, 4, 16, 1, 576, torch.bfloat16) as cache:
        assert cache.layers[0].shape == (4, 16, 576)
        assert cache.blocks([0, 2]).shape == (2, 2, 16, 576)
    with pytest.raises(ValueError, match="heads must be 1"):
        SharedKVCache("mla", 2, 4, 16, 2, 576)
    with pytest.raises(ValueError, match="layout"):
        SharedKVCache("gqa", 2, 4, 16, 2, 64)


def test_segment_is_sealed_so_nobody_can_shrink_grow_or_unseal_it():
    with SharedSegment(8192, name="sealed_test") as segment:
        seals = fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS)
        assert seals == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(segment.fd, 4096)
        with pytest.raises(PermissionError):
            os.ftruncate(segment.fd, 16384)
        with pytest.raises(PermissionError):
            fcntl.fcntl(segment.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert os.fstat(segment.fd).st_size == segment.size == 8192
        assert segment.name == "sealed_test"
        # Writes through the mapping are writes to the memfd the server will map.
        segment.mapping[100:105] = b"hello"
        assert os.pread(segment.fd, 5, 100) == b"hello"
        assert find_segment("sealed_test") is segment
        with pytest.raises(ValueError, match="named 'sealed_test' is open in this process already"):
            SharedSegment(4096, name="sealed_test")
    assert find_segment("sealed_test") is None
    with pytest.raises(ValueError, match="positive size"):
        SharedSegment(0)


def test_tensors_keep_the_mapping_alive_past_close():
    segment = SharedSegment(4096)
    flat = segment.tensor(torch.int32)
    flat.fill_(7)
    segment.close()  # the descriptor goes; the mapping stays while `flat` uses it
    assert segment.fd == -1 and segment_of(flat) is None
    assert int(flat.sum()) == 7 * 1024
    del flat
    gc.collect()


def test_memfd_handles_of_a_layer_and_of_a_strided_view():
    with SharedKVCache("mha", 2, 8, 16, 2, 8) as cache:
        layer = cache.layers[1]
        ((handle, segment),) = memfd_handles([layer])
        assert segment is cache.segment and segment_of(layer) is cache.segment
        assert handle == cache.handles()[1]

        view = layer[:, 2:5, :, 1]  # blocks 2..4 of head 1: not contiguous
        assert not view.is_contiguous()
        ((handle, segment),) = memfd_handles([view])
        assert segment is cache.segment and handle.ticket == b"" and handle.name == cache.name
        assert handle.offset == cache.handles()[1].offset + (2 * 16 * 2 * 8 + 8) * 2
        assert handle.shape == [2, 3, 16, 8] and handle.strides == list(view.stride())
        assert handle.dtype == "float16"


def test_memfd_handles_refuse_private_memory_and_tensors_past_the_segment():
    with SharedKVCache("mha", 1, 4, 16, 1, 8) as cache:
        layer = cache.layers[0]
        with pytest.raises(ValueError, match=r"tensor 1 \(shape \[4\]\) is not in a SharedSegment"):
            memfd_handles([layer, torch.zeros(4)])
        with pytest.raises(ValueError, match="tensor 0 is on meta"):
            memfd_handles([torch.zeros(4, device="meta")])
        # A tensor that starts 16 bytes before the segment's end and claims 64 bytes. Only its
        # address is read, never its memory.
        end = layer.data_ptr() + cache.segment.size
        past = torch.frombuffer((ctypes.c_char * 64).from_address(end - 16), dtype=torch.uint8)
        start = cache.segment.size - 16
        with pytest.raises(ValueError,
                           match=rf"tensor 0 .* starts at byte {start} .* spans 64 bytes, past"):
            memfd_handles([past])
    with pytest.raises(ValueError, match="not in a SharedSegment"):
        memfd_handles([layer])  # closed: its fd is gone, so it can no longer be sent


def test_a_segments_pages_are_allocated_when_it_is_made():
    """As the torch.zeros it stands in for: a pass reading KV the server wrote into it
    then takes no page fault per page."""
    def shared_kib() -> int:
        with open("/proc/self/status") as status:
            return int(status.read().split("RssShmem:")[1].split()[0])
    before = shared_kib()
    segment = SharedSegment(32 * 1024 * 1024)
    try:
        assert shared_kib() - before >= 32 * 1024
    finally:
        segment.close()


def test_a_cache_in_more_segments_than_one_fd_message_carries_registers():
    """vLLM on CPU allocates a segment per KV tensor: a model of 80 layers hands the fd
    channel 80 descriptors, more than MAX_FDS_PER_MESSAGE; the client sends them in turn."""
    from lmcache_mp.client import CacheClient, StoreStatus, TransferItem
    from lmcache_mp.protocol import MAX_FDS_PER_MESSAGE

    from ..utils import run_server
    from ..workers import MODEL, chunk_blocks, prompt

    layers = MAX_FDS_PER_MESSAGE + 16
    shape = (2, 16, 16, 1, 8)  # [2, blocks, block size, heads, head dim]: 16 blocks, one chunk
    segments = [SharedSegment(torch.Size(shape).numel() * 2) for _ in range(layers)]
    try:
        tensors = [segment.tensor(torch.uint8).view(torch.float16).view(shape)
                   for segment in segments]
        for n, tensor in enumerate(tensors):
            tensor.view(torch.int16).fill_(n + 1)
        handles = [handle for handle, _ in memfd_handles(tensors)]
        with run_server() as server, CacheClient(server.url, timeout=20) as client:
            registration = client.register_kv_cache(handles, model=MODEL, layout="mha",
                                                     block_size=16)
            hashes = prompt(tag=3410, num_chunks=1)
            assert client.store(registration, [TransferItem.build("r", hashes, chunk_blocks(
                [0]))]) == [bytes([StoreStatus.STORED])]
            for tensor in tensors:
                tensor.zero_()
            assert client.retrieve(registration, [TransferItem.build("r", hashes, chunk_blocks(
                [0]))]) == [1]
            assert all(bool((tensor.view(torch.int16) == n + 1).all())
                       for n, tensor in enumerate(tensors))
            client.unregister(registration)
    finally:
        for segment in segments:
            segment.close()


def private_mapping_of_its_own(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping of `nbytes` at the returned offset of the returned region,
    between two PROT_NONE pages: the kernel merges an anonymous mapping into a neighbour of
    the same protection, and this one must start a mapping of its own."""
    span = page_span(nbytes)
    region = mmap.mmap(-1, span + 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    for guard in (base, base + PAGE + span):
        assert libc.mprotect(ctypes.c_void_p(guard), ctypes.c_size_t(PAGE), 0) == 0, \
            os.strerror(ctypes.get_errno())
    return region, PAGE


def test_memory_moved_into_a_segment_keeps_its_address_and_bytes_and_outlives_the_segment():
    """A private anonymous mapping (as SGLang's parallel allocation makes) moves in place:
    the segment's memfd holds its bytes, writes through the old address reach the memfd,
    and closing the segment leaves the memory to its owner."""
    region, offset = private_mapping_of_its_own(3 * PAGE + 100)
    memory = torch.frombuffer(region, dtype=torch.uint8, offset=offset, count=3 * PAGE + 100)
    memory.copy_(torch.arange(memory.numel()) % 251)
    before = memory.clone()
    segment = SharedSegment(memory.numel(), over=memory.data_ptr())
    assert torch.equal(memory, before) and segment_of(memory) is segment
    memory[7] = 99
    assert os.pread(segment.fd, 8, 0)[7] == 99
    with pytest.raises(ValueError, match="moved over memory its owner maps"):
        segment.tensor()
    segment.close()
    assert memory[7] == 99 and torch.equal(memory[8:], before[8:])


def test_memory_that_is_not_why_not_movable_mappings_is_not_moved(tmp_path):
    inside = torch.zeros(1 << 20, dtype=torch.uint8)  # malloc's: not a mapping of its own
    with pytest.raises(ValueError, match="cannot move"):
        SharedSegment(inside.numel(), over=inside.data_ptr())
    path = tmp_path / "file"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(path, "r+b") as file:
        mapped = mmap.mmap(file.fileno(), mmap.PAGESIZE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        with pytest.raises(ValueError, match="not anonymous memory"):
            SharedSegment(mmap.PAGESIZE, over=address)
    region = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    with pytest.raises(ValueError, match="does not start a mapping"):
        SharedSegment(mmap.PAGESIZE, over=start + mmap.PAGESIZE)  # the second half of one
