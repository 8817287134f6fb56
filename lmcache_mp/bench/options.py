"""What a run is asked for: the workloads and BenchOptions. Torch-free, like shapes.py, so
that the CLI answers --help and refuses bad flags before importing what runs."""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import KVShape

UNIFORM = ("W1", "W2", "W3")
WORKLOADS = (*UNIFORM, "chat", "multi-tenant")


@dataclass(frozen=True)
class BenchOptions:
    """Everything a run needs; the CLI fills it from flags and per-workload defaults."""

    workload: str
    shape: KVShape
    url: str | None  # None: spawn a server of our own
    workers: int  # engines, each with tp × pp rank processes
    tp: int
    pp: int
    mla: bool
    requests: int | None  # None with a duration
    duration: float | None
    batch: int  # requests each engine prefills per step
    chunks: int  # chunks per prompt (uniform and multi-tenant)
    seed: int
    peer: str | None
    cpu_size: str | None  # for a spawned server; None: sized for the workload
    verify: bool
    lookup_rounds: int
    lookup_iters: int
    lookup_seconds: float
    timeout: float
    progress: bool
    profile: bool = False  # time each phase of a request in every process (phases.py)
    disk_size: str | None = None  # chat: a disk tier of this size under the spawned server
    disk_dir: str | None = None  # where it goes (a fresh directory inside); None: the temp dir
