"""Worker KV caches in sealed memfd segments, so the server can map them by descriptor, never
by name."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import uuid
import weakref

import torch

from ..memory import move_into, page_span, populate, why_not_movable
from ..protocol import MemfdHandle, span_bytes

SEGMENT_PREFIX = "lmcache_mp_"

# Every open SharedSegment of this process by its mapping's base address, so that
# memfd_handles can tell which one a tensor lies in; closed or collected ones drop out.
_LIVE: weakref.WeakValueDictionary[int, SharedSegment] = weakref.WeakValueDictionary()


class SharedSegment:
    """Memory the server may map: a memfd sealed against shrinking, growing and new seals.

    Workers allocate KV caches here and hand `fd` to the server's fd channel
    (lmcache_mp.fdpass.send_fds). The seals are why the server accepts it: no later
    ftruncate can pull pages out from under the server's mapping. There is no name in any
    file system; the memory is freed when the last descriptor and mapping are gone.
    """

    def __init__(self, nbytes: int, name: str = "", *, over: int | None = None):
        """A new segment of `nbytes`; or, with `over`, the memory this process already uses
        at [over, over + nbytes), moved into the segment in place (memory.move_into): every
        pointer into it stays valid and keeps its bytes, and its owner still unmaps it
        (close() then only closes the descriptor). ValueError unless that memory is
        anonymous, from the start of a mapping on (memory.why_not_movable)."""
        if nbytes <= 0:
            raise ValueError(f"a SharedSegment needs a positive size, got {nbytes} bytes")
        self._name = name or f"{SEGMENT_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"
        if find_segment(self._name) is not None:
            # Handles name their segment, and the client finds its fd by that name.
            raise ValueError(f"a SharedSegment named {self._name!r} is open in this process "
                             f"already")
        why = None if over is None else why_not_movable(over, nbytes)
        if why is not None:
            raise ValueError(f"cannot move {nbytes} bytes at {over:#x} into a segment: {why}")
        fd = os.memfd_create(self._name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes if over is None else page_span(nbytes))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            if over is None:
                self._mapping: mmap.mmap | None = mmap.mmap(fd, nbytes)
            else:
                self._mapping = None
                move_into(fd, over, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._size = nbytes
        self._base = over if over is not None else self._map()
        self._close_fd = weakref.finalize(self, os.close, fd)
        _LIVE[self._base] = self

    def _map(self) -> int:
        """Fault the new mapping in; its base address."""
        assert self._mapping is not None
        # Allocate every page now, as the torch.zeros it stands in for would: otherwise the
        # first pass that reads KV the server wrote faults each page into this process.
        populate(self._mapping)
        # A ctypes view exports the mapping's buffer; dropping it at once lets close() unmap.
        anchor = ctypes.c_char.from_buffer(self._mapping)
        base = ctypes.addressof(anchor)
        del anchor
        return base

    @property
    def fd(self) -> int:
        """The memfd to send to the server; -1 once closed."""
        return self._fd

    @property
    def name(self) -> str:
        """The memfd's label (shown in /proc/<pid>/fd and in server messages); not a path."""
        return self._name

    @property
    def size(self) -> int:
        return self._size

    @property
    def mapping(self) -> mmap.mmap:
        """This process's mapping. Tensors made with torch.frombuffer(mapping) do not keep it
        mapped: use tensor() so that close() cannot unmap memory a tensor still uses."""
        if self._mapping is None:
            raise ValueError(f"SharedSegment {self._name!r} was moved over memory its owner "
                             f"maps: use that memory")
        return self._mapping

    def tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The whole segment as a flat tensor that keeps the mapping alive while it lives."""
        return torch.frombuffer(memoryview(self.mapping), dtype=dtype)

    def contains(self, address: int, length: int) -> int | None:
        """The offset of [address, address + length) in this segment; None unless all inside."""
        if self._fd < 0 or address < self._base or address + length > self._base + self._size:
            return None
        return address - self._base

    def close(self) -> None:
        """Close the descriptor, and the mapping unless tensors still use it: then it is unmapped
        when the last of them is collected. A second close is harmless."""
        if self._fd < 0:
            return
        _LIVE.pop(self._base, None)
        try:
            if self._mapping is not None:
                self._mapping.close()
        except BufferError:
            pass  # views remain; the mmap object unmaps itself when they are gone
        self._close_fd()
        self._fd = -1

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def find_segment(name: str) -> SharedSegment | None:
    """The open SharedSegment of this process with this name: CacheClient looks up the fd to
    send for a MemfdHandle that has no ticket yet."""
    for segment in list(_LIVE.values()):
        if segment.name == name:
            return segment
    return None


def segment_of(tensor: torch.Tensor) -> SharedSegment | None:
    """The open SharedSegment of this process in which the tensor's first element lies."""
    address = tensor.data_ptr()
    for segment in list(_LIVE.values()):
        if segment.contains(address, 1) is not None:
            return segment
    return None


def layer_shape(layout: str, num_blocks: int, block_size: int, heads: int, head_dim: int
                ) -> tuple[int, ...]:
    """vLLM's per-layer shapes: MHA [2, blocks, block_size, heads, head_dim], MLA [blocks,
    block_size, dim]."""
    if layout == "mha":
        return (2, num_blocks, block_size, heads, head_dim)
    if layout == "mla":
        if heads != 1:
            raise ValueError(f"an MLA cache has one latent vector per token: heads must be 1, "
                             f"got {heads}")
        return (num_blocks, block_size, head_dim)
    raise ValueError(f"layout must be 'mha' or 'mla', got {layout!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SharedKVCache:
    """A paged KV cache whose layers live back to back in one SharedSegment.

    Tests, benchmarks and engines without their own allocator use it; handles() describe
    the layers for REGISTER_KV_CACHE once the segment's fd has been traded for a ticket.
    """

    def __init__(self, layout: str, num_layers: int, num_blocks: int, block_size: int,
                 heads: int, head_dim: int, dtype: torch.dtype = torch.float16):
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        shape = layer_shape(layout, num_blocks, block_size, heads, head_dim)
        elements = 1
        for dim in shape:
            elements *= dim
        layer_bytes = elements * dtype.itemsize
        self._segment = SharedSegment(layer_bytes * num_layers)
        whole = self._segment.tensor(dtype)
        self.layers: list[torch.Tensor] = list(whole.view(num_layers, *shape).unbind(0))
        self._handles = [
            MemfdHandle(ticket=b"", offset=i * layer_bytes, shape=list(shape),
                        strides=list(layer.stride()), dtype=_dtype_name(dtype),
                        name=self._segment.name)
            for i, layer in enumerate(self.layers)]
        del whole

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def segment(self) -> SharedSegment:
        return self._segment

    def handles(self) -> list[MemfdHandle]:
        """One handle per layer, without a ticket yet (ticket=b"")."""
        return list(self._handles)

    def block_dim(self) -> int:
        return 1 if self.layout == "mha" else 0

    def blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the given blocks of every layer, stacked: handy for comparing bytes."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        return torch.stack([layer.index_select(self.block_dim(), ids) for layer in self.layers])

    def close(self) -> None:
        """Drop the layers and close the segment; memory outlives it only in views still held."""
        self.layers = []
        self._segment.close()

    def __enter__(self) -> SharedKVCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def memfd_handles(tensors: list[torch.Tensor]) -> list[tuple[MemfdHandle, SharedSegment]]:
    """The handle of each CPU tensor that lies in an open SharedSegment of this process (a
    SharedKVCache layer, any strided view of one, or a tensor over SharedSegment.tensor()),
    with the segment whose fd the caller must send to the server for the handle's ticket.

    Raises ValueError naming the tensor (by position) and what is wrong: not on the CPU, not
    in a SharedSegment (plain torch allocations are private to the process, and the server
    maps memory only by sealed descriptor), or extending past its segment.
    """
    found = []
    for i, tensor in enumerate(tensors):
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {i} is on {tensor.device}, not in a SharedSegment on the CPU")
        segment = segment_of(tensor)
        if segment is None:
            raise ValueError(f"tensor {i} (shape {list(tensor.shape)}) is not in a SharedSegment "
                             f"of this process: the server maps worker memory only through a "
                             f"sealed memfd; allocate it with lmcache_mp.client.SharedSegment")
        address = tensor.data_ptr()
        span = span_bytes(list(tensor.shape), list(tensor.stride()), tensor.itemsize)
        offset = segment.contains(address, span)
        if offset is None:
            start = segment.contains(address, 1)
            raise ValueError(f"tensor {i} (shape {list(tensor.shape)}) starts at byte {start} of "
                             f"SharedSegment {segment.name!r} and spans {span} bytes, past its "
                             f"end at {segment.size}")
        found.append((MemfdHandle(ticket=b"", offset=offset, shape=list(tensor.shape),
                                  strides=list(tensor.stride()), dtype=_dtype_name(tensor.dtype),
                                  name=segment.name), segment))
    return found
