"""What every workload ends with: its table on stdout, its figures in --json, its exit status;
progress lines on stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from ...errors import LMCacheMPError
from ..options import BenchOptions
from .redis_peer import PeerUnavailable

T = TypeVar("T")


def log(message: str) -> None:
    print(f"lmcache-mp-bench: {message}", file=sys.stderr, flush=True)


def attempt(measure: Callable[[], T]) -> T | int:
    """measure()'s figures, or the exit status of a run that could not finish, said on
    stderr: 2 for a peer that cannot run here, 3 for a run that failed (a server, rank or
    reply that did not come in time)."""
    try:
        return measure()
    except PeerUnavailable as exc:
        log(str(exc))
        return 2
    except (LMCacheMPError, RuntimeError, TimeoutError) as exc:
        log(f"the run failed: {exc}")
        return 3


def report(options: BenchOptions, description: str, table: str, to_json: Callable[[], str],
           passed: bool, title: str | None = None) -> int:
    """The heading, the description and the table on stdout; the figures in --json; 0 when
    every check passed, else 1."""
    print(f"\n## {title or f'lmcache-mp-bench --workload {options.workload}'}\n\n"
          f"{description}\n")
    print(table)
    if options.json is not None:
        options.json.write_text(to_json())
        log(f"wrote {options.json}")
    return 0 if passed else 1
