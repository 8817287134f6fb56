"""SGLang host-pool pages in one byte order, whatever the pool's layout: what a chunk holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

SUPPORTED_LAYOUTS = ("layer_first", "page_first")


class PageCodec:
    """One host-pool page as a view in canonical order: MHA [2 (K, V), layers, page_size,
    heads, head_dim], MLA [layers, page_size, dim]. A page stored from a layer_first pool
    loads into a page_first one of the same geometry, and the other way round.

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
        self.page_size: int = pool.page_size
        self.pool_tokens: int = pool.size
        self.dtype: torch.dtype = pool.dtype
        self.page_bytes = self.page_shape.numel() * self.dtype.itemsize

    def _init_mha(self, pool: MHATokenToKVPoolHost, layout: str) -> None:
        if pool.v_head_dim != pool.head_dim:
            raise ValueError(f"lmcache-mp needs equal K and V head dims, got {pool.head_dim} "
                             f"and {pool.v_head_dim}")
        layers, heads, dim, page = pool.layer_num, pool.head_num, pool.head_dim, pool.page_size
        pages = pool.size // page
        self.page_shape = torch.Size((2, layers, page, heads, dim))
        self.geometry = f"mha-{_dtype(pool.dtype)}-l{layers}-h{heads}x{dim}-p{page}"
        buffer = pool.kv_buffer
        if layout == "layer_first":
            by_page = buffer.view(2, layers, pages, page, heads, dim)
            self._view = lambda p: by_page.select(2, p)
        else:
            by_page = buffer.view(2, pages, page, layers, heads, dim)
            self._view = lambda p: by_page.select(1, p).permute(0, 2, 1, 3, 4)

    def _init_mla(self, pool: MLATokenToKVPoolHost, layout: str) -> None:
        layers, dim, page = pool.layer_num, pool.kv_cache_dim, pool.page_size
        pages = pool.size // page
        self.page_shape = torch.Size((layers, page, dim))
        self.geometry = f"mla-{_dtype(pool.dtype)}-l{layers}-d{dim}-p{page}"
        buffer = pool.kv_buffer
        if layout == "layer_first":
            by_page = buffer.view(layers, pages, page, dim)
            self._view = lambda p: by_page.select(1, p)
        else:
            by_page = buffer.view(pages, page, layers, dim)
            self._view = lambda p: by_page.select(0, p).permute(1, 0, 2)

    _view: Callable[[int], torch.Tensor]

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

    def page(self, page: int) -> torch.Tensor:
        """Host page `page` as a (strided) view in canonical order."""
        return self._view(page)

    def staged(self, slot: torch.Tensor) -> torch.Tensor:
        """A staging block (uint8, at least page_bytes) as one page in canonical order."""
        return slot.view(-1)[:self.page_bytes].view(self.dtype).view(self.page_shape)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
