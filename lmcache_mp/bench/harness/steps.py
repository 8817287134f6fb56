"""A workload of simulated engines (its phases, and per phase a stream of step batches per
engine), and the loop that runs them, a step of every engine at once: each phase's totals."""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

from tqdm import tqdm

from ...client import CacheClient
from ..options import BenchOptions
from ..shapes import KVShape
from .bounds import CopyBound
from .engine import Engine, Request
from .report import PhaseResult


class Workload(ABC):
    """A workload: named phases, and per phase one stream of step batches per engine.

    Streams are per engine so that a prompt repeated for a hit comes in a later step of
    the engine that stored it; documents shared between engines still meet in the cache.
    """

    phases: tuple[str, ...] = ("run",)

    def __init__(self, shape: KVShape, engines: int, salt: str, seed: int,
                 requests: int | None = None):
        self.shape = shape
        self.engines = engines
        self.salt = salt
        self.seed = seed
        self.requests = requests  # over every engine; None: until the run's duration is up

    def share(self, engine: int) -> int | None:
        """The requests (or prompts) this engine sends: an even split of `requests`."""
        if self.requests is None:
            return None
        return self.requests // self.engines + (engine < self.requests % self.engines)

    def planned_requests(self) -> int | None:
        """Requests a single-phase run sends, for the progress bar; None: not known ahead."""
        return self.requests if len(self.phases) == 1 else None

    # Not abstract: a hook that most workloads leave empty.
    def prepare(self, phase: str, client: CacheClient, capacity: int) -> None:  # noqa: B027
        """Before a phase, from the benchmark's own client (quotas, a clean slate)."""

    @abstractmethod
    def stream(self, phase: str, engine: int) -> Iterator[list[Request]]:
        """Step batches for one engine; the phase ends when every engine's stream ends."""

    def salts(self) -> list[str]:
        """Every cache_salt this workload uses: the benchmark clears them when it ends."""
        return [self.salt]


def run_phases(options: BenchOptions, workload: Workload, engines: list[Engine],
               client: CacheClient, capacity: int, log: Callable[[str], None],
               copy_bound: CopyBound) -> list[PhaseResult]:
    """Every phase of `workload` (--duration split evenly between them)."""
    results = []
    phase_seconds = options.duration / len(workload.phases) if options.duration else None
    for phase in workload.phases:
        workload.prepare(phase, client, capacity)
        before = client.stats()
        result = _steps(options, workload, phase, engines, phase_seconds, copy_bound)
        after = client.stats()
        result.server_cpu_seconds = after.cpu_seconds - before.cpu_seconds
        result.server_transfer_requests = sum(
            after.requests.get(op, 0) - before.requests.get(op, 0) for op in ("STORE", "RETRIEVE"))
        results.append(result)
        log(f"{phase}: {result.requests} requests in {result.seconds:.1f} s")
    return results


def _steps(options: BenchOptions, workload: Workload, phase: str, engines: list[Engine],
           seconds: float | None, copy_bound: CopyBound) -> PhaseResult:
    """One phase: a step of every engine whose stream goes on, until they all end (or
    `seconds` passed)."""
    result = PhaseResult(phase)
    computed: set[bytes] = set()
    streams = [(engine, workload.stream(phase, engine.setup.index)) for engine in engines]
    started = time.monotonic()
    with tqdm(total=workload.planned_requests(), unit="req",
              desc=phase if phase != "run" else options.workload,
              disable=not options.progress, file=sys.stderr, dynamic_ncols=True) as progress:
        while streams:
            if seconds is not None and time.monotonic() - started > seconds:
                break
            batches = [(engine, next(stream, None)) for engine, stream in streams]
            streams = [pair for pair, (_, batch) in zip(streams, batches) if batch]
            active = [(engine, batch) for engine, batch in batches if batch]
            if not active:
                break
            for engine, batch in active:
                engine.send_lookups(batch)
            outcomes = [outcome for engine, _ in active
                        for outcome in engine.send_step(computed)]
            reports = [report for engine, _ in active
                       for report in engine.finish_step(computed)]
            result.add_step(time.monotonic() - started, reports, outcomes, len(active))
            progress.update(len(outcomes))
            copy_bound.sample()  # between steps: what the machine allows now
    result.seconds = time.monotonic() - started
    return result
