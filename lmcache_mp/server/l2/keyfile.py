"""--l2-key-file: the secrets that sign and verify L2 values, in a file only the server can change.

One key a line: the first signs every value this server writes and verifies; an optional
second verifies only, so that a rotation can be rolled out to every server sharing L2
before any of them signs with the new key (docs/l2.md, Key rotation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..net.access import AccessError, read_secret_file

MIN_KEY_CHARS = 32  # `openssl rand -hex 32` writes 64
MAX_KEYS = 2  # the key that signs, and one being rolled in or out
KEY_FILE_MODE = 0o640  # a group of servers may read it; no one but its owner may change it


@dataclass(frozen=True)
class L2Keys:
    signing: bytes  # signs what this server writes; verifies too
    accepted: bytes | None  # verifies only: the key a rotation rolls in, or out

    def verifying(self) -> tuple[bytes, ...]:
        return (self.signing,) if self.accepted is None else (self.signing, self.accepted)


def read_key_file(path: str) -> L2Keys:
    """The keys in `path`; raises ValueError saying what is wrong with the file, never what
    it holds."""
    try:
        text = read_secret_file(Path(path), "L2 key", KEY_FILE_MODE, owned=True)
    except AccessError as exc:
        raise ValueError(f"--l2-key-file: {exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--l2-key-file {path} is not text: write each key as a line of "
                         f"characters, e.g. `openssl rand -hex 32`") from None
    keys = [line.strip() for line in text.splitlines()]
    if not 1 <= len(keys) <= MAX_KEYS:
        raise ValueError(f"--l2-key-file {path} holds {len(keys)} lines: it holds the key "
                         f"that signs and at most one more that still verifies during a "
                         f"rotation (docs/l2.md, Key rotation)")
    for number, key in enumerate(keys, 1):
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"--l2-key-file {path}: line {number} holds {len(key)} "
                             f"characters; a key needs at least {MIN_KEY_CHARS} random ones, "
                             f"e.g. `openssl rand -hex 32`")
    return L2Keys(keys[0].encode(), keys[1].encode() if len(keys) == MAX_KEYS else None)
