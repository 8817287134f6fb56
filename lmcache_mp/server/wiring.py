"""Wiring: every part of a server built from its Config into one typed record, before start."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import cuda, runtime
from .cache.chunk import GPU_TIER, Chunk
from .cache.pool import ALIGNMENT, CpuPool, CudaPinner, DevicePool
from .cache.quotas import QuotaBook
from .cache.store import ChunkStore
from .config import Config
from .copy.device import CudaDevice
from .copy.engine import CopyEngine
from .copy.streams import StreamCopier
from .lower.front import in_order
from .memory.cuda_ipc import CudaIpcSupport, MappingThread, SharedAllocations
from .memory.registry import Registry
from .net.access import Sessions, load_or_create_token, prepare_runtime_dir, read_token_file
from .net.endpoints import check_free
from .net.fd_channel import FdChannel
from .net.router import Router
from .observe.metrics import ServerMetrics
from .ops.dispatcher import Dispatcher
from .private_dir import PrivateDir, UnsafePath
from .warm.segment import KEY_NAME, WarmStart

if TYPE_CHECKING:
    from .disk.tier import DiskTier
    from .l2.tier import L2Tier
    from .lower.front import LowerTier

_GPU_COPY_TIMEOUT_S = 60.0  # one request's device work; a GPU that takes longer has failed
_GPU_MAP_TIMEOUT_S = 60.0  # one registration's IPC opens and set-up, a new GPU's context included


@dataclass(frozen=True)
class Components:
    """A server's parts, each built once: the lifecycle (server.py) starts them in order and
    stops them in the reverse one."""

    config: Config
    sessions: Sessions
    label_key: bytes  # keys the tenant labels' digests: the admin token
    fd_channel: FdChannel
    warm: WarmStart | None  # the named pool segment (--pool-segment)
    pool: CpuPool
    gpu_pool: DevicePool | None  # the GPU tier (--gpu-size)
    store: ChunkStore
    registry: Registry
    copy_engine: CopyEngine
    copier: StreamCopier | None  # copies of caches on GPUs (a server with CUDA)
    disk: DiskTier | None  # the disk tier (--disk-dir)
    l2: L2Tier | None  # the shared second tier (--l2)
    metrics: ServerMetrics
    dispatcher: Dispatcher
    router: Router

    @property
    def lower(self) -> tuple[LowerTier, ...]:
        """The lower tiers there are, in the order the ops ask them: the disk tier, then L2."""
        return in_order(self.disk, self.l2)


def wire(config: Config) -> Components:
    """Build every part; a warm start adopts its chunks here. What may refuse the start is
    asked before anything is made outside the runtime directory: the quotas, the addresses
    to serve on, then the disk directory (claimed: checked and locked, made if need be, its
    files made last), then the pool segment; a refused start leaves none of them. Raises
    AccessError, QuotaError, OSError, DiskTierError or WarmStartError for what keeps a
    server from starting."""
    # Every connection and registration costs a descriptor: take all the system allows.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    access = _access(config)
    # The pools' capacity, as their allocators round it (checked once they are made).
    capacity = sum(size - size % ALIGNMENT for size in (config.cpu_size, config.gpu_size or 0))
    quotas = config.quota_book(capacity)
    check_free(config, access.fd_channel)
    disk_dir = _claim_disk_dir(config)
    try:
        return _build(config, access, quotas, disk_dir)
    except BaseException:
        if disk_dir is not None:
            disk_dir.discard()
        raise


def _build(config: Config, access: _Access, quotas: QuotaBook,
           disk_dir: PrivateDir | None) -> Components:
    # Parallelism comes from the copy threads; torch's own pool would oversubscribe the cores.
    torch.set_num_threads(1)
    has_cuda = torch.cuda.is_available()
    warm = _warm_start(config)
    pool = CpuPool(config.cpu_size, CudaPinner() if has_cuda else None,
                   warm.open() if warm is not None else None)
    gpu_pool = DevicePool(config.gpu_size, torch.device("cuda", 0)) if config.gpu_size else None
    assert quotas.capacity == pool.capacity + (gpu_pool.capacity if gpu_pool else 0)
    store = ChunkStore(pool.allocator, config.lease_timeout, quotas,
                       gpu_allocator=gpu_pool.allocator if gpu_pool is not None else None,
                       eviction=config.eviction)
    if warm is not None:
        warm.restore(store, pool)
    copier = cuda_ipc = None
    if has_cuda:
        copier = StreamCopier(CudaDevice(), config.copy_threads, _GPU_COPY_TIMEOUT_S)
        mapping = MappingThread(_GPU_MAP_TIMEOUT_S)
        cuda_ipc = CudaIpcSupport(SharedAllocations(cuda.open_allocation, mapping.close_later).open,
                                  cuda.device_index, copier.new_lane, mapping)
    fd_channel = access.fd_channel
    registry = Registry(config.chunk_size, time.monotonic, fd_channel, cuda_ipc,
                        fd_channel.watch)
    copy_engine = CopyEngine(config.copy_threads)

    def chunk_bytes(chunk: Chunk) -> torch.Tensor:
        tier_pool = gpu_pool if chunk.tier == GPU_TIER else pool
        assert tier_pool is not None  # GPU-tier chunks exist only with a GPU pool
        return tier_pool.view(chunk.offset, chunk.nbytes)
    metrics = ServerMetrics()
    disk = None
    if disk_dir is not None:
        from .disk.tier import DiskTier
        from .lower.admission import admission_policy

        assert config.disk_size is not None  # Config.validate() requires it
        key_file, key = _disk_key(disk_dir.path, config.disk_key_file, config.runtime_dir)
        disk = DiskTier(disk_dir, config.disk_size, config.disk_queue_size,
                        config.disk_prefetch_wait, store, registry, pool, chunk_bytes,
                        metrics.disk_read, key, key_file,
                        admission_policy(config.disk_admission, config.disk_size,
                                         config.disk_write_budget))
    l2 = None
    if config.l2 is not None:
        from .l2.tier import L2Tier  # redis-py is needed only with --l2

        l2 = L2Tier.from_config(config, store, registry, pool, chunk_bytes)
    # The router sends what the dispatcher pushes (LOAD_DONE), and hands it every request.
    dispatcher = Dispatcher(config, store, pool, registry, copy_engine, access.sessions,
                            fd_channel.path, push=lambda client, message: router.push(
                                client, message),
                            copier=copier, gpu_pool=gpu_pool, metrics=metrics, l2=l2,
                            disk=disk)
    router = Router(config, dispatcher, access.sessions, metrics)
    return Components(config, access.sessions, access.admin_token.encode(), fd_channel, warm,
                      pool, gpu_pool, store, registry, copy_engine, copier, disk, l2, metrics,
                      dispatcher, router)


def _claim_disk_dir(config: Config) -> PrivateDir | None:
    """--disk-dir, checked and locked for this server (disk/tier.py); None without one."""
    if config.disk_dir is None:
        return None
    from .disk.tier import claim_directory  # the disk tier's code only where it is used

    return claim_directory(Path(config.disk_dir))


@dataclass(frozen=True)
class _Access:
    sessions: Sessions
    admin_token: str
    fd_channel: FdChannel


def _access(config: Config) -> _Access:
    """The runtime directory, the tokens and the fd channel; raises AccessError."""
    gid = config.socket_gid
    directory = Path(config.runtime_dir)
    prepare_runtime_dir(directory, gid)
    shared_mode = 0o640 if gid is not None else 0o600
    engine_token = (read_token_file(Path(config.token_file)) if config.token_file else
                    load_or_create_token(directory / runtime.TOKEN_NAME, shared_mode, gid))
    admin_token = (read_token_file(Path(config.admin_token_file), 0o600)
                   if config.admin_token_file else
                   load_or_create_token(directory / runtime.ADMIN_TOKEN_NAME, 0o600, None))
    # Only a socket file has permissions to decide who connects: tcp:// and abstract
    # ipc://@ sockets need the token.
    path_socket = runtime.ipc_socket_path(config.bind_url) is not None
    sessions = Sessions(engine_token, admin_token, token_required=not path_socket)
    channel = FdChannel(str(directory / runtime.FD_SOCKET_NAME),
                        0o660 if gid is not None else 0o600, gid, bindings=sessions.bound)
    return _Access(sessions, admin_token, channel)


def _warm_start(config: Config) -> WarmStart | None:
    if config.pool_segment is None:
        return None
    # The key that signs snapshots lives apart from them, in the runtime directory: whoever
    # can write /dev/shm (a container sharing it, say) cannot read it.
    key = load_or_create_token(Path(config.runtime_dir) / KEY_NAME, 0o600, None)
    return WarmStart(config.pool_segment, config.cpu_size, config.chunk_size, key.encode(),
                     config.adopt,
                     Path(config.pool_segment_dir) if config.pool_segment_dir else None,
                     config.copy_threads)


def _disk_key(disk_dir: Path, key_file: str | None, runtime_dir: str) -> tuple[Path, bytes]:
    """The disk tier's key file and key: --disk-key-file, else the runtime directory's key
    for this --disk-dir; made 0600 at the first start. Raises AccessError or DiskTierError."""
    from .disk.tier import DiskTierError, key_name

    # As the snapshot's, the key lives apart from what it signs (Config.validate() keeps
    # --disk-key-file out of --disk-dir): whoever could write the tier's files cannot read it.
    if key_file is None:
        path = Path(runtime_dir) / key_name(disk_dir)
    else:
        path = Path(key_file)
        try:  # a directory anyone else could write to could have the key swapped
            PrivateDir(path.parent).close()
        except UnsafePath as exc:
            raise DiskTierError(f"--disk-key-file's directory: {exc}") from None
    try:
        return path, load_or_create_token(path, 0o600, None).encode()
    except OSError as exc:
        raise DiskTierError(f"its key file {path}: {exc.strerror or exc}") from None
