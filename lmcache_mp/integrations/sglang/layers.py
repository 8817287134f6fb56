"""The layers a page's chunk is registered as: the page's parts, one block a page each."""

from __future__ import annotations

from ...protocol import MemfdHandle
from ...protocol.limits import MAX_LAYERS
from .pages import PageCodec


def splits(codec: PageCodec, chunk_size: int) -> bool:
    """Whether a page registers as its parts (each layer's K and V, or its latent), one
    layer each of `chunk_size` rows a block: each part must be whole rows. Its chunk is then
    exactly the page's bytes in canonical order, wherever the pages lie, so that a page
    stored through the staging segment loads into a host pool the server maps, and the
    other way round. Otherwise a page is one padded block of one layer (staging only)."""
    return codec.part_bytes % chunk_size == 0 and codec.parts <= MAX_LAYERS


def part_handles(codec: PageCodec, name: str, chunk_size: int, blocks: int, part_step: int,
                 block_step: int) -> list[MemfdHandle]:
    """The layers of a segment holding `blocks` pages, part p of block b at byte
    p × part_step + b × block_step (splits() must hold)."""
    width = codec.part_bytes // chunk_size
    return [MemfdHandle(ticket=b"", offset=part * part_step, shape=[blocks, chunk_size, width],
                        strides=[block_step, width, 1], dtype="uint8", name=name)
            for part in range(codec.parts)]
