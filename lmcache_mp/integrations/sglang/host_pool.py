"""The host pool moved, in place, into a sealed memfd the server maps: pages then move in one
copy each way, the server's."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator

import torch
from sglang.srt.mem_cache.pool_host import common

from ...client.memfd import SharedSegment
from ...protocol.limits import MAX_REGISTERED_BYTES_PER_CONNECTION
from .pages import PageCodec

logger = logging.getLogger(__name__)

# Each moved pool's segment by the pool buffer's address, while that buffer lives: a backend
# attached again (after a detach) finds its pool there, already moved.
_MOVED: dict[int, SharedSegment] = {}


def moved_pool(codec: PageCodec) -> SharedSegment | None:
    """The segment that now holds a layer_first host pool's buffer, at the same addresses
    (SGLang's tensors, views and pointer tables stay valid, and its bytes stay); None, with
    the reason logged, where pages go through the staging segment instead: a page_first
    pool (its parts are not contiguous), ROCm, a pool past what one connection may
    register, or memory that is not anonymous memory from the start of a mapping on
    (hugepages).

    On CUDA the pool is pinned (cudaHostRegister): it is unpinned for the move and pinned
    again after it, with SGLang's own calls, so that its device copies reach the new pages.
    SGLang builds the backend while no request is in flight (at start-up, or an attach
    that waits for an idle scheduler), so nothing else touches the pool meanwhile."""
    buffer = codec.pool_buffer
    nbytes = buffer.numel() * buffer.element_size()
    if codec.layout != "layer_first" or buffer.data_ptr() in _MOVED:
        return _MOVED.get(buffer.data_ptr())
    if torch.version.hip or nbytes > MAX_REGISTERED_BYTES_PER_CONNECTION:
        logger.info("lmcache-mp: the host pool stays where it is (%s): pages go through the "
                    "staging segment", "ROCm" if torch.version.hip else f"{nbytes} bytes")
        return None
    with _unpinned(buffer) as movable:
        if not movable:
            return None
        try:
            segment = SharedSegment(nbytes, over=buffer.data_ptr())
        except (ValueError, OSError) as exc:
            logger.warning("lmcache-mp: the host pool stays where it is, pages go through the "
                           "staging segment: %s", exc)
            return None
    _MOVED[buffer.data_ptr()] = segment
    weakref.finalize(buffer, _MOVED.pop, buffer.data_ptr(), None)  # its descriptor closes too
    return segment


@contextlib.contextmanager
def _unpinned(buffer: torch.Tensor) -> Iterator[bool]:
    """Unpin a pinned pool for the length of the block, and pin it again after it; yields
    False if it could not be unpinned (then it must not move: CUDA would keep copying to
    its old pages)."""
    pinned = getattr(buffer, common._CUDA_HOST_REGISTERED_RANGES_ATTR, None)
    if not pinned:
        yield True
        return
    common._cuda_host_unregister(buffer)
    if getattr(buffer, common._CUDA_HOST_REGISTERED_RANGES_ATTR):
        yield False  # SGLang logged which range stayed pinned; nothing moves
        return
    try:
        yield True
    finally:
        common._cuda_host_register(buffer)  # raises if it fails: SGLang needs it pinned
