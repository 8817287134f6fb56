"""Mapping cuda_ipc handles: each allocation opened once per registration, on its GPU."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from ...errors import BadRequest, InternalError
from ...protocol import CUDA_IPC_HANDLE_BYTES, CudaIpcHandle

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Allocation(Protocol):
    """An opened allocation (lmcache_mp.cuda.IpcAllocation): its bytes, and how to let go."""

    data: torch.Tensor  # uint8, the whole allocation, on its device

    def close(self) -> None: ...


class SharedAllocations:
    """Opened allocations, counted by the registrations that use them.

    CUDA opens an IPC handle only once per process: a worker that registers the same memory
    again while its old registration is still mapped (it timed out with copies in flight)
    shares the opened allocation, which is closed when its last registration lets go.
    """

    def __init__(self, open_allocation: Callable[[bytes, int], Allocation],
                 close_later: Callable[[Callable[[], None]], None] | None = None):
        """`close_later(close)`: runs an allocation's close, e.g. on the MappingThread that
        opens them (None: at once, on the caller's thread)."""
        self._open = open_allocation
        self._close_later = close_later
        self._opened: dict[tuple[bytes, int], tuple[Allocation, int]] = {}
        # open() runs on the mapping thread, a release on the loop's.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._opened)

    def open(self, handle: bytes, device: int) -> Allocation:
        key = (handle, device)
        with self._lock:
            found = self._opened.get(key)
            if found is not None:
                self._opened[key] = (found[0], found[1] + 1)
                return _Use(found[0], lambda: self._release(key))
        # Not under the lock: it may take long. One thread opens, so no two open one handle.
        allocation = self._open(handle, device)
        with self._lock:
            self._opened[key] = (allocation, 1)
        return _Use(allocation, lambda: self._release(key))

    def _release(self, key: tuple[bytes, int]) -> None:
        with self._lock:
            allocation, users = self._opened[key]
            if users > 1:
                self._opened[key] = (allocation, users - 1)
                return
            del self._opened[key]
        if self._close_later is None:
            allocation.close()
        else:
            self._close_later(allocation.close)


class MappingThread:
    """One thread for the CUDA calls that map and unmap workers' memory: cupy's import, IPC
    opens and closes, a lane's event, streams and staging chunks. Each may take long (a new
    GPU's context, a driver that tears a mapping down), and on the event loop it would hold
    up every client's replies. One thread, so they run in order: a handle's close has always
    finished before the same handle is opened again (CUDA maps a handle once per process)."""

    def __init__(self, timeout: float):
        """`timeout`: how long a registration waits for its mapping."""
        self.timeout = timeout
        self._ident: int | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-map",
                                            initializer=self._started)

    def _started(self) -> None:
        self._ident = threading.get_ident()

    def close_later(self, close: Callable[[], None]) -> None:
        """Run `close` after everything queued so far (at once when called on the thread
        itself, or after shutdown()); a failure is logged."""
        def run() -> None:
            try:
                close()
            except Exception:  # noqa: BLE001 (the driver's and cupy's own types)
                logger.exception("closing a CUDA IPC allocation failed")
        if threading.get_ident() == self._ident:
            run()
            return
        try:
            self._executor.submit(run)
        except RuntimeError:  # shut down: the server is exiting, nothing else runs there
            run()

    async def run(self, work: Callable[[], T], undo: Callable[[T], None]) -> T:
        """work()'s result, computed on the thread. If it takes longer than `timeout`, or
        the caller is cancelled, raise, and undo() the result once it comes."""
        future: Future[T] = self._executor.submit(work)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                          self.timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            def late(done: Future[T]) -> None:
                if not done.cancelled() and done.exception() is None:
                    undo(done.result())
            future.add_done_callback(late)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise InternalError(f"the GPU did not map the KV cache within {self.timeout:g} s; "
                                f"what it maps late is closed again") from None

    def shutdown(self) -> None:
        """Wait for the opens and closes queued."""
        self._executor.shutdown(wait=True)


class _Use:
    """One registration's use of a shared allocation; close() lets go of it once."""

    def __init__(self, allocation: Allocation, release: Callable[[], None]):
        self.data = allocation.data
        self._release: Callable[[], None] | None = release

    def close(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            self.data = self.data.new_empty(0)  # no view of memory about to be unmapped
            release()


@dataclass(frozen=True)
class CudaIpcSupport:
    """What registering cuda_ipc handles takes; the server builds it from CUDA, tests from fakes."""

    open_allocation: Callable[[bytes, int], Allocation]  # (cudaIpcMemHandle_t, device index)
    device_index: Callable[[str], int | None]  # the visible device with this UUID
    new_lane: Callable[[torch.device, Any, bytes], Any]  # (device, Geometry, store_event) -> Lane
    # Where REGISTER_KV_CACHE maps the handles (ops/session.py); None: on the loop's thread.
    thread: MappingThread | None = None


@dataclass
class CudaMapping:
    """A cuda_ipc registration's opened allocations (by IPC handle) and its streams.Lane."""

    allocations: dict[bytes, Allocation]
    lane: Any

    def close(self) -> None:
        for allocation in self.allocations.values():
            allocation.close()
        self.allocations, self.lane = {}, None


def open_allocations(handles: list[CudaIpcHandle], support: CudaIpcSupport
                     ) -> dict[bytes, Allocation]:
    """Every distinct allocation the handles name, opened once, all on one GPU.

    Raises BadRequest naming the handle that is wrong; nothing stays open then.
    """
    opened: dict[bytes, Allocation] = {}
    try:
        for i, handle in enumerate(handles):
            path = f"layers[{i}]"
            if handle.ipc_handle in opened:
                continue
            if len(handle.ipc_handle) != CUDA_IPC_HANDLE_BYTES:
                raise BadRequest(f"`{path}.ipc_handle`: expected {CUDA_IPC_HANDLE_BYTES} bytes "
                                 f"(a cudaIpcMemHandle_t), got {len(handle.ipc_handle)}")
            try:
                index = support.device_index(handle.device_uuid)
            except ValueError as exc:
                raise BadRequest(f"`{path}.device_uuid`: {exc}") from None
            if index is None:
                raise BadRequest(f"`{path}.device_uuid`: no GPU with UUID "
                                 f"{handle.device_uuid!r} is visible to the server")
            try:
                opened[handle.ipc_handle] = support.open_allocation(handle.ipc_handle, index)
            except Exception as exc:  # noqa: BLE001 (cupy and the driver raise their own types)
                raise BadRequest(f"`{path}.ipc_handle`: cannot open it on GPU {index} "
                                 f"({type(exc).__name__}: {exc}); the worker must run on this "
                                 f"machine, CUDA IPC must be allowed between the two processes, "
                                 f"and the handle must come from cudaIpcGetMemHandle of "
                                 f"cudaMalloc memory, not from a cuMem or pool allocator "
                                 f"(expandable_segments, cudaMallocAsync, vLLM's sleep mode), "
                                 f"which lmcache_mp.client.cuda.cuda_ipc_handles refuses") from None
            devices = {a.data.device for a in opened.values()}
            if len(devices) > 1:
                raise BadRequest(f"`{path}.device_uuid`: the layers of one KV cache must be on "
                                 f"one GPU, got {sorted(map(str, devices))}")
    except BaseException:
        for allocation in opened.values():
            allocation.close()
        raise
    return opened
