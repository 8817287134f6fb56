"""The dispatcher: admits each decoded request (session, role) and routes it to its op."""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ...errors import Forbidden
from ...protocol import (
    ADMIN_OPS,
    ROLE_ADMIN,
    ClearRequest,
    EndSessionRequest,
    LookupRequest,
    QuotaDeleteRequest,
    QuotaGetRequest,
    QuotaListRequest,
    QuotaSetRequest,
    RegisterKVCacheRequest,
    ReleaseRequest,
    RetrieveRequest,
    StatsRequest,
    StoreRequest,
    UnregisterKVCacheRequest,
)
from ..cache.pool import CpuPool, DevicePool
from ..cache.store import ChunkStore
from ..config import Config
from ..copy.engine import CopyEngine
from ..copy.streams import StreamCopier
from ..lower.front import in_order
from ..memory.registry import Registry
from ..net.access import Session, Sessions
from ..observe.metrics import ServerMetrics
from .admin import AdminOps
from .answer import Answer
from .context import OpContext
from .holds import HoldOps
from .lookup import LookupOp
from .retrieve import RetrieveOp
from .session import SessionOps
from .stats import StatsOp
from .store import StoreOp

if TYPE_CHECKING:
    import zmq

    from ..disk.tier import DiskTier
    from ..l2.tier import L2Tier


class Dispatcher:
    """Owns no socket: the server hands it decoded requests and sends what it returns.

    Fast ops return their reply (a LOOKUP an Answer: its holds follow the reply); LOOKUPs
    that wait for L2 or run in slices, STORE, RETRIEVE and an admin's STATS return an
    awaitable of it. Each op is a module of its own
    (lookup.py, store.py, retrieve.py, holds.py, stats.py, admin.py, session.py), sharing
    the server's parts through one OpContext.
    """

    def __init__(self, config: Config, store: ChunkStore, pool: CpuPool, registry: Registry,
                 copy_engine: CopyEngine, sessions: Sessions, fd_socket: str,
                 push: Callable[[bytes, Any], None],
                 copier: StreamCopier | None = None, gpu_pool: DevicePool | None = None,
                 metrics: ServerMetrics | None = None, l2: L2Tier | None = None,
                 disk: DiskTier | None = None):
        """`sessions`: who said HELLO, and may do what; `fd_socket`: the fd channel's path,
        told in HELLO replies;
        `push(client, message)` sends a message the client did not ask for (MLA loads);
        `copier` runs the copies of caches registered on a GPU (None without CUDA);
        `gpu_pool` is the GPU tier (--gpu-size), whose chunks the store places;
        `metrics` counts bytes and copy times, and keeps what STATS reports of replies;
        `disk` the disk tier (--disk-dir) and `l2` the shared second tier (--l2), each
        told of STOREs and asked before LOOKUPs, the disk first."""
        self.context = OpContext(config, store, pool, registry, copy_engine, sessions,
                                 fd_socket, push, metrics or ServerMetrics(), copier, gpu_pool,
                                 in_order(disk, l2), disk)
        self.store, self.registry, self.sessions = store, registry, sessions
        self.slices = self.context.slices
        self.requests_served: Counter[str] = Counter()
        self.session_ops = SessionOps(self.context)
        holds, self.admin_ops = HoldOps(self.context), AdminOps(self.context)
        self.stats = StatsOp(self.context, self.requests_served)
        self._handlers: dict[type, Callable[[Session, Any], Any]] = {
            RegisterKVCacheRequest: self.session_ops.register,
            UnregisterKVCacheRequest: self.session_ops.unregister,
            LookupRequest: LookupOp(self.context),
            StoreRequest: StoreOp(self.context),
            RetrieveRequest: RetrieveOp(self.context),
            ReleaseRequest: holds.release,
            EndSessionRequest: holds.end_session,
            ClearRequest: self.admin_ops.clear,
            StatsRequest: self.stats,
            QuotaSetRequest: self.admin_ops.quota_set,
            QuotaGetRequest: self.admin_ops.quota_get,
            QuotaDeleteRequest: self.admin_ops.quota_delete,
            QuotaListRequest: self.admin_ops.quota_list,
        }
        self.snapshot = self.stats.snapshot
        self.snapshot_without_tenants = self.stats.snapshot_without_tenants
        self.reload_quota_file = self.admin_ops.reload_quota_file

    def note_request(self, client: bytes, op: str) -> None:
        """A request for `op` arrived from `client` (before its payload is decoded)."""
        self.requests_served[op] += 1
        self.registry.seen(client)
        self.sessions.seen(client)

    def admit(self, client: bytes, op: str) -> Session | None:
        """The session that may send `op` (None for HELLO and PING, which need none);
        raises Unauthenticated or Forbidden. Cheap: the server asks before decoding."""
        if op in ("HELLO", "PING"):  # heartbeats only keep registrations alive
            return None
        session = self.sessions.get(client)
        if op in ADMIN_OPS and session.role != ROLE_ADMIN:
            raise Forbidden(f"{op} is an admin op: HELLO with the admin token first (the "
                            f"runtime directory's admin.token, or LMCACHE_MP_ADMIN_TOKEN)")
        return session

    def handle(self, client: bytes, op: str, request: Any) -> Any | Awaitable[Any]:
        """admit(), then serve(): the reply (an Answer's work done), or an awaitable of it."""
        result = self.serve(client, op, request, self.admit(client, op))
        if isinstance(result, Answer):
            result.then()
            return result.reply
        return result

    def serve(self, client: bytes, op: str, request: Any, session: Session | None,
              peer: zmq.Frame | None = None) -> Any | Awaitable[Any]:
        """The reply to a request admit() let in as `session`, an Answer (the reply, and
        work to do just after it is sent), or an awaitable of the reply;
        `peer`: the request's first frame, whose metadata HELLO reads the peer's uid from."""
        if op == "HELLO":
            return self.session_ops.hello(client, request, peer)
        if op == "PING":
            return self.session_ops.ping()
        assert session is not None  # admit() gives every other op one
        return self._handlers[type(request)](session, request)
