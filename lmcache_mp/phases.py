"""Per-phase time of requests, for `lmcache-mp-bench --profile`: off unless asked for.

With LMCACHE_MP_PROFILE naming a directory (the bench sets it for the server it starts),
every process that imports this module adds perf_counter_ns() spans per "OP phase" and
writes its totals there as JSON when it exits; a process forked rather than started (the
bench's ranks, a server forked by spawn.py) calls configure() and dump() itself. Off, a
stamp is a call and a flag test: no clock read, no formatting; where a call is too much
(the Python calls around a LOOKUP, ~3% of its own work), the caller tests `enabled` first.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path

ENV = "LMCACHE_MP_PROFILE"

enabled = False
_directory: Path | None = None
_totals: dict[str, list[int]] = {}  # "OP\tside phase" -> [nanoseconds, spans, items]


def enable(directory: str | os.PathLike[str]) -> None:
    """Start timing in this process; its totals go to `directory` when it exits."""
    global enabled, _directory
    _directory = Path(directory)
    if not enabled:
        atexit.register(dump)
    enabled = True


def disable() -> None:
    """Write this process's totals now, then stop timing and forget them."""
    global enabled
    dump()
    enabled = False
    _totals.clear()


def configure(directory: str | None) -> None:
    """Time into `directory`, or not at all: a process forked from one that imported this
    module under another environment sets what its own run asks for."""
    if directory:
        enable(directory)
    else:
        disable()


def now() -> int:
    """A start stamp: perf_counter_ns() when timing, else 0 (no clock read)."""
    return time.perf_counter_ns() if enabled else 0


def add(op: str | bytes, phase: str, since: int, items: int = 1) -> int:
    """Count the span from `since` (a now() stamp) under `op`'s `phase` ("server decode"),
    covering `items` (keys, chunks); returns the end stamp, for the next phase to start
    from. The key is built only when timing: off, the call costs no formatting."""
    if not enabled:
        return 0
    end = time.perf_counter_ns()
    key = f"{op.decode() if isinstance(op, bytes) else op}\t{phase}"
    total = _totals.get(key)
    if total is None:
        total = _totals[key] = [0, 0, 0]
    total[0] += end - since
    total[1] += 1
    total[2] += items
    return end


def totals() -> dict[str, list[int]]:
    return {phase: list(total) for phase, total in _totals.items()}


def dump() -> None:
    """Write this process's totals to the directory (a no-op when not timing)."""
    if enabled and _directory is not None and _totals:
        (_directory / f"{os.getpid()}.json").write_text(json.dumps(totals()))


def read(directory: str | os.PathLike[str]) -> dict[str, list[int]]:
    """Every process's totals in `directory`, summed per phase."""
    merged: dict[str, list[int]] = {}
    for path in sorted(Path(directory).glob("*.json")):
        for phase, values in json.loads(path.read_text()).items():
            into = merged.setdefault(phase, [0, 0, 0])
            for i, value in enumerate(values):
                into[i] += value
    return merged


configure(os.environ.get(ENV))
