"""SGLang host-pool pages in one byte order, whatever the pool's layout: what a chunk holds."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

SUPPORTED_LAYOUTS = ("layer_first", "page_first")


class PageCodec:
    """Host-pool pages as byte views in canonical order: MHA [2 (K, V), layers, page_size,
    heads × head_dim × itemsize], MLA [layers, page_size, dim × itemsize]. A page stored
    from a layer_first pool loads into a page_first one of the same geometry, and the
    other way round.

    Its views are numpy arrays of bytes: numpy copies them on the calling thread alone,
    with the GIL released, where a torch copy would split each one across torch's
    intra-op threads (5 to 10 times slower than one thread on a busy machine) and a
    setting of torch's thread count would reach the whole SGLang process.

    Raises ValueError at start-up, naming the flag to change, for a layout or a pool class
    it does not read (page_first_direct, page_head, page_unified; hybrid and sparse pools)."""

    def __init__(self, pool: Any):
        layout = getattr(pool, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(f"lmcache-mp reads host pools laid out as "
                             f"{' or '.join(SUPPORTED_LAYOUTS)}, not {layout!r}: start SGLang "
                             f"with --hicache-mem-layout layer_first (or page_first)")
        if type(pool) is MHATokenToKVPoolHost:
            self._init_mha(pool, layout)
        elif type(pool) is MLATokenToKVPoolHost:
            self._init_mla(pool, layout)
        else:
            raise ValueError(f"lmcache-mp stores the pages of MHA and MLA host pools, not of "
                             f"{type(pool).__name__} (a hybrid or sparse model's pool)")
        self.layout: str = layout
        self.page_size: int = pool.page_size
        self.pool_tokens: int = pool.size
        self.pool_pages: int = pool.size // pool.page_size
        self.pool_buffer: torch.Tensor = pool.kv_buffer
        self.dtype: torch.dtype = pool.dtype
        self.page_bytes = int(np.prod(self.page_shape))
        # A page's parts, in canonical order: each layer's K then each layer's V, or each
        # layer's latent; each is page_size rows, contiguous in a layer_first pool.
        self.parts = int(np.prod(self.page_shape[:-2]))
        self.part_bytes = self.page_bytes // self.parts

    def _init_mha(self, pool: MHATokenToKVPoolHost, layout: str) -> None:
        if pool.v_head_dim != pool.head_dim:
            raise ValueError(f"lmcache-mp needs equal K and V head dims, got {pool.head_dim} "
                             f"and {pool.v_head_dim}")
        layers, heads, dim, page = pool.layer_num, pool.head_num, pool.head_dim, pool.page_size
        pages, row = pool.size // page, heads * dim * pool.dtype.itemsize
        self.page_shape: tuple[int, ...] = (2, layers, page, row)
        self.geometry = f"mha-{_dtype(pool.dtype)}-l{layers}-h{heads}x{dim}-p{page}"
        if layout == "layer_first":  # [2, layers, pages, page, row], pages to the front
            self._by_page = _bytes(pool.kv_buffer, (2, layers, pages, page, row))
            self._order: tuple[int, ...] = (2, 0, 1, 3, 4)
        else:  # [2, pages, page, layers, row]
            self._by_page = _bytes(pool.kv_buffer, (2, pages, page, layers, row))
            self._order = (1, 0, 3, 2, 4)

    def _init_mla(self, pool: MLATokenToKVPoolHost, layout: str) -> None:
        layers, dim, page = pool.layer_num, pool.kv_cache_dim, pool.page_size
        pages, row = pool.size // page, dim * pool.dtype.itemsize
        self.page_shape = (layers, page, row)
        self.geometry = f"mla-{_dtype(pool.dtype)}-l{layers}-d{dim}-p{page}"
        if layout == "layer_first":  # [layers, pages, page, row]
            self._by_page = _bytes(pool.kv_buffer, (layers, pages, page, row))
            self._order = (1, 0, 2, 3)
        else:  # [pages, page, layers, row]
            self._by_page = _bytes(pool.kv_buffer, (pages, page, layers, row))
            self._order = (0, 2, 1, 3)

    def pages_of(self, host_indices: torch.Tensor, count: int) -> list[int] | None:
        """The host pages of `count` SGLang pages, from their token indices (page_size a
        page, the first of each page-aligned); None unless there are that many, all in the
        pool."""
        if host_indices.numel() != count * self.page_size:
            return None
        firsts = host_indices[::self.page_size].tolist()
        if any(first % self.page_size or not 0 <= first < self.pool_tokens
               for first in firsts):
            return None
        return [first // self.page_size for first in firsts]

    def run(self, first: int, count: int) -> np.ndarray:
        """Host pages first .. first + count - 1 as a (strided) byte view
        [count, canonical page]."""
        run = [slice(None)] * self._by_page.ndim
        run[self._order[0]] = slice(first, first + count)  # the page axis comes first
        return self._by_page[tuple(run)].transpose(self._order)

    def slots(self, staging: np.ndarray) -> np.ndarray:
        """Staging blocks ([blocks, block bytes], each block at least page_bytes) as
        [blocks, canonical page]: one page a block."""
        return np.reshape(staging[:, :self.page_bytes], (len(staging), *self.page_shape),
                          copy=False)


def runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """`pages` as runs of consecutive host pages: (position in `pages`, first page, count),
    so that each run moves in one copy."""
    found: list[tuple[int, int, int]] = []
    for position, page in enumerate(pages):
        if found and page == found[-1][1] + found[-1][2]:
            start, first, count = found[-1]
            found[-1] = (start, first, count + 1)
        else:
            found.append((position, page, 1))
    return found


def _bytes(buffer: torch.Tensor, shape: tuple[int, ...]) -> np.ndarray:
    """A contiguous pool buffer's bytes, as a numpy view of `shape` (the last dim in bytes)."""
    if not buffer.is_contiguous():  # SGLang allocates it whole: a view here would be a copy
        raise ValueError("lmcache-mp needs the host pool's kv_buffer contiguous")
    return buffer.reshape(-1).view(torch.uint8).numpy().reshape(shape)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
