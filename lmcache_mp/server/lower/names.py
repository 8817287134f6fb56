"""What names a chunk's bytes in every lower tier: the digests its disk and L2 keys are made of."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable


def digest(*parts: object) -> str:
    """A short hex digest of `parts` (by their repr): a name that tells nothing of them."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def namespace(model: str, geometry: Hashable) -> str:
    """The digest of what makes a chunk's bytes differ for the same tokens."""
    return digest(model, geometry)
