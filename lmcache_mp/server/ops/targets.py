"""How chunks move between the pools and a registered cache: one copy-target type per kind of cache.

A cache on a GPU copies through its lane (the stream copier); a cache in CPU memory whose
strides allow rows copies them with one memmove a row (HostRows); any other CPU cache
copies with torch's index kernels. STORE and RETRIEVE ask copies_for() and call
store() or retrieve(): neither branches on where a cache lives.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial

import torch

from ...protocol import LoadProgress
from ..cache.chunk import GPU_TIER, Demotion
from ..copy.engine import attempt, expired
from ..memory.instance import KVCacheInstance
from .context import OpContext
from .transfers import Place, Transfer, copy_runs, message_rows, per_chunk

Outcome = BaseException | None  # a copy's: None when it succeeded
Jobs = tuple[list[tuple[int, int]], Callable[[tuple[int, int]], Callable]]  # runs, job of a run


class CacheCopies(ABC):
    """One kind of cache's copies. store(): out of the sending cache's blocks into the
    chunks just reserved; retrieve(): out of held chunks into the blocks of every target
    (the sender and, under MLA, its TP group's followers, all of the sender's kind). Both
    call `submitted()` once their jobs are built, as the copying starts."""

    @abstractmethod
    async def store(self, ctx: OpContext, instance: KVCacheInstance,
                    transfers: Sequence[Transfer], pending: Sequence[Place],
                    demotions: Sequence[Demotion], deadline: float | None,
                    submitted: Callable[[], None]) -> list[Outcome]:
        """Outcomes of the demotions' moves (GPU tier only), then of each pending chunk."""

    @abstractmethod
    async def retrieve(self, ctx: OpContext, targets: Sequence[KVCacheInstance],
                       transfers: Sequence[Transfer], flat: Sequence[Place],
                       deadline: float | None, progress_tag: int,
                       submitted: Callable[[], None]) -> list[Outcome]:
        """Outcomes per target, then per chunk of `flat`, in that order."""


class DeviceCopies(CacheCopies):
    """A cache on a GPU: (block ids, chunk) pairs for the stream copier, which waits on the
    worker's events, stages and commits by CUDA events (copy/streams.py)."""

    async def store(self, ctx: OpContext, instance: KVCacheInstance,
                    transfers: Sequence[Transfer], pending: Sequence[Place],
                    demotions: Sequence[Demotion], deadline: float | None,
                    submitted: Callable[[], None]) -> list[Outcome]:
        jobs: list = []
        await ctx.each(pending, lambda p: (torch.from_numpy(transfers[p[0]].block_ids[p[1]]),
                                           ctx.chunk_tensor(p[2], instance)), jobs)
        moves: list[tuple[torch.Tensor, torch.Tensor]] = []
        if demotions:
            gpu_pool = ctx.gpu_pool
            assert gpu_pool is not None  # demotions are of GPU-tier chunks
            moves = [(ctx.chunk_bytes(d.chunk), gpu_pool.view(d.gpu_offset, d.chunk.nbytes))
                     for d in demotions]
        submitted()
        assert ctx.copier is not None  # a cache on a GPU: the server has CUDA
        return await ctx.copier.store(instance, jobs, moves, deadline)

    async def retrieve(self, ctx: OpContext, targets: Sequence[KVCacheInstance],
                       transfers: Sequence[Transfer], flat: Sequence[Place],
                       deadline: float | None, progress_tag: int,
                       submitted: Callable[[], None]) -> list[Outcome]:
        jobs: list = []
        leader = targets[0]
        await ctx.each(flat, lambda f: (torch.from_numpy(transfers[f[0]].block_ids[f[1]]),
                                        ctx.chunk_tensor(f[2], leader),
                                        transfers[f[0]].skips[f[1]]), jobs)
        submitted()
        assert ctx.copier is not None  # a cache on a GPU: the server has CUDA
        per_target = await ctx.copier.retrieve(targets, jobs, deadline)
        return [error for errors in per_target for error in errors]


class _HostCopies(CacheCopies):
    """A cache in CPU memory: jobs for the copy engine's threads, a run of chunks a job
    where the chunks lie back to back in the pool (transfers.copy_runs)."""

    @abstractmethod
    def gather_jobs(self, ctx: OpContext, instance: KVCacheInstance,
                    transfers: Sequence[Transfer], pending: Sequence[Place]) -> Jobs:
        """The runs of `pending` a job copies, and what makes the job of a run."""

    @abstractmethod
    def scatter_jobs(self, ctx: OpContext, target: KVCacheInstance,
                     transfers: Sequence[Transfer], flat: Sequence[Place], merge: bool) -> Jobs:
        """The runs of `flat` a job copies into `target` (a chunk each unless `merge`), and
        what makes the job of a run; a job of one chunk may be called with a layer."""

    async def store(self, ctx: OpContext, instance: KVCacheInstance,
                    transfers: Sequence[Transfer], pending: Sequence[Place],
                    demotions: Sequence[Demotion], deadline: float | None,
                    submitted: Callable[[], None]) -> list[Outcome]:
        runs, gather = self.gather_jobs(ctx, instance, transfers, pending)
        jobs: list = []
        await ctx.each(runs, gather, jobs)
        submitted()
        return per_chunk(runs, await ctx.copy_engine.run(jobs, deadline))

    async def retrieve(self, ctx: OpContext, targets: Sequence[KVCacheInstance],
                       transfers: Sequence[Transfer], flat: Sequence[Place],
                       deadline: float | None, progress_tag: int,
                       submitted: Callable[[], None]) -> list[Outcome]:
        # Layer by layer into the sender alone, when its rows allow and no chunk is in HBM.
        by_layer = (progress_tag and len(targets) == 1 and isinstance(self, RowsCopies)
                    and all(chunk.tier != GPU_TIER for _, _, chunk in flat))
        jobs: list = []
        target_runs = []
        for target in targets:  # per target, then per run: the order outcomes are read in
            copies = copies_for(target)
            assert isinstance(copies, _HostCopies)  # every target is of the sender's kind
            runs, scatter = copies.scatter_jobs(ctx, target, transfers, flat, not by_layer)
            theirs: list = []
            await ctx.each(runs, scatter, theirs)
            jobs.extend(theirs)
            target_runs.append(runs)
        submitted()
        per_run = await (by_layers(ctx, targets[0], jobs, deadline, progress_tag) if by_layer
                         else ctx.copy_engine.run(jobs, deadline))
        outcomes, done = [], 0
        for runs in target_runs:
            outcomes += per_chunk(runs, per_run[done:done + len(runs)])
            done += len(runs)
        return outcomes


class RowsCopies(_HostCopies):
    """A cache in CPU memory whose strides allow rows (memory/host_rows.py): one index array
    a message, one np.take or assignment a run. A cache whose rows lie in several parts
    (per-layer tensors) holds a chunk's rows part by part: its chunks copy one by one, as
    do chunks with skipped blocks and chunks in the GPU tier (through torch)."""

    def gather_jobs(self, ctx, instance, transfers, pending):
        host = instance.host_rows
        rows, first = message_rows(host, transfers)
        one_part = len(host.parts) == 1
        runs = copy_runs(pending, lambda place: one_part)

        def gather(run: tuple[int, int]) -> Callable[[], None]:
            start, count = run
            i, c, chunk = pending[start]
            return partial(host.gather, rows[first[i] + c:first[i] + c + count].reshape(-1),
                           host.chunk(ctx.pool.array_view(chunk.offset, count * chunk.nbytes)))
        return runs, gather

    def scatter_jobs(self, ctx, target, transfers, flat, merge):
        host = target.host_rows
        rows, first = message_rows(host, transfers)
        merge = merge and len(host.parts) == 1
        runs = copy_runs(flat, lambda place: merge and place[2].tier != GPU_TIER
                         and not transfers[place[0]].skips[place[1]])

        def scatter(run: tuple[int, int]) -> Callable:
            start, count = run
            i, c, chunk = flat[start]
            transfer = transfers[i]
            if chunk.tier == GPU_TIER:
                return TENSORS.scatter_one(ctx, target, transfer, c, chunk)
            src = host.chunk(ctx.pool.array_view(chunk.offset, count * chunk.nbytes))
            if transfer.skips[c]:
                return partial(host.scatter_skipping, transfer.block_ids[c], src)
            return partial(host.scatter, rows[first[i] + c:first[i] + c + count].reshape(-1),
                           src)
        return runs, scatter


class TensorCopies(_HostCopies):
    """A cache in CPU memory whose strides allow no rows: torch's index kernels, a chunk a
    job (KVCacheInstance.gather and scatter)."""

    def gather_jobs(self, ctx, instance, transfers, pending):
        def gather(run: tuple[int, int]) -> Callable[[], None]:
            i, c, chunk = pending[run[0]]
            return partial(instance.gather, torch.from_numpy(transfers[i].block_ids[c]),
                           ctx.chunk_tensor(chunk, instance))
        return [(index, 1) for index in range(len(pending))], gather

    def scatter_jobs(self, ctx, target, transfers, flat, merge):
        def scatter(run: tuple[int, int]) -> Callable:
            i, c, chunk = flat[run[0]]
            return self.scatter_one(ctx, target, transfers[i], c, chunk)
        return [(index, 1) for index in range(len(flat))], scatter

    @staticmethod
    def scatter_one(ctx: OpContext, target: KVCacheInstance, transfer: Transfer, c: int,
                    chunk) -> Callable:
        return partial(target.scatter, torch.from_numpy(transfer.block_ids[c]),
                       ctx.chunk_tensor(chunk, target), transfer.skips[c])


DEVICE, ROWS, TENSORS = DeviceCopies(), RowsCopies(), TensorCopies()


def copies_for(instance: KVCacheInstance) -> CacheCopies:
    """The copies of the kind of cache `instance` is."""
    if instance.lane is not None:
        return DEVICE
    return ROWS if instance.host_rows is not None else TENSORS


async def by_layers(ctx: OpContext, target: KVCacheInstance, chunk_jobs: list,
                    deadline: float | None, tag: int) -> list[Outcome]:
    """Run a RETRIEVE's per-chunk row jobs (each called with a layer) one layer at a time on
    one copy thread, pushing LoadProgress(tag, n) to the target's owner as the first n
    layers settle; return per chunk its failure, or None. One thread: the engine's forward
    pass reads the layers meanwhile, on the same CPUs."""
    layers = len(target.layers)
    outcomes: list[Outcome] = [None] * len(chunk_jobs)
    loop = asyncio.get_running_loop()

    def copy_layer(layer: int) -> None:
        for c, job in enumerate(chunk_jobs):
            if outcomes[c] is None:  # a chunk that failed stays failed
                outcomes[c] = expired(deadline) or attempt(partial(job, layer=layer))
        if layer + 1 < layers:  # the reply itself says that all of them settled
            loop.call_soon_threadsafe(ctx.push, target.owner, LoadProgress(tag, layer + 1))
    per_layer = await ctx.copy_engine.run(
        [partial(copy_layer, layer) for layer in range(layers)], deadline, threads=1)
    # A layer not copied at all (its deadline passed first) fails every chunk.
    missed = next((error for error in per_layer if error is not None), None)
    return [outcome or missed for outcome in outcomes]
