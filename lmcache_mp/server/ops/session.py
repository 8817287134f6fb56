"""HELLO, PING, REGISTER_KV_CACHE, UNREGISTER_KV_CACHE: a session and its caches."""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING

from ... import __version__
from ...errors import UnsupportedVersion
from ...protocol import (
    PROTOCOL_VERSION,
    CudaIpcHandle,
    HelloReply,
    HelloRequest,
    PingReply,
    RegisterKVCacheReply,
    RegisterKVCacheRequest,
    UnregisterKVCacheReply,
    UnregisterKVCacheRequest,
)
from ...zmq_io import peer_uid
from ..memory.cuda_ipc import CudaMapping
from ..memory.handles import validate_handles
from ..memory.instance import KVCacheInstance
from ..net.access import Session
from .context import OpContext

if TYPE_CHECKING:
    from collections.abc import Awaitable

    import zmq


class SessionOps:
    def __init__(self, ctx: OpContext):
        self.ctx = ctx

    def hello(self, client: bytes, req: HelloRequest, peer: zmq.Frame | None = None
              ) -> HelloReply:
        """`peer`: the request's first frame, whose metadata names a unix peer's uid."""
        if req.protocol_version != PROTOCOL_VERSION:
            raise UnsupportedVersion(f"client speaks protocol {req.protocol_version}, "
                                     f"this server speaks {PROTOCOL_VERSION}")
        config = self.ctx.config
        # Unix sockets carry the peer's credentials; on tcp:// the uid stays unknown.
        uid = (peer_uid(peer) if peer is not None and config.bind_url.startswith("ipc://")
               else None)
        session = self.ctx.sessions.open(client, req.token, req.engine, uid)
        return HelloReply(PROTOCOL_VERSION, __version__, config.chunk_size,
                          config.max_message_bytes, config.max_chunks_per_message,
                          config.lease_timeout, config.worker_timeout,
                          session.role, self.ctx.fd_socket, fd_binding=session.binding)

    @staticmethod
    def ping() -> PingReply:
        return PingReply(time.time())

    def register(self, session: Session, req: RegisterKVCacheRequest
                 ) -> RegisterKVCacheReply | Awaitable[RegisterKVCacheReply]:
        cuda_ipc = self.ctx.registry.cuda_ipc
        if (cuda_ipc is not None and cuda_ipc.thread is not None and req.layers
                and req.layers[0].kind == CudaIpcHandle.KIND):
            return self._register_mapped(session, req)
        return self._reply(self.ctx.registry.register(session.client, session.engine, req,
                                                      session.uid))

    async def _register_mapped(self, session: Session, req: RegisterKVCacheRequest
                               ) -> RegisterKVCacheReply:
        """A cuda_ipc registration: its handles opened and its lane set up on the mapping
        thread, the rest on the loop, which serves everyone else meanwhile."""
        registry = self.ctx.registry
        assert registry.cuda_ipc is not None and registry.cuda_ipc.thread is not None
        registry.check_room(session.client)  # refused before any CUDA work
        geometry, _ = validate_handles(req, registry.chunk_size)
        mapped = await registry.cuda_ipc.thread.run(partial(registry.map_cuda_ipc, req, geometry),
                                                    CudaMapping.close)
        # The counts may have changed meanwhile: register() checks them again.
        return self._reply(registry.register(session.client, session.engine, req, session.uid,
                                             mapped))

    @staticmethod
    def _reply(instance: KVCacheInstance) -> RegisterKVCacheReply:
        return RegisterKVCacheReply(instance.instance_id, instance.num_blocks,
                                    instance.geometry.blocks_per_chunk,
                                    instance.geometry.chunk_bytes)

    def unregister(self, session: Session, req: UnregisterKVCacheRequest
                   ) -> UnregisterKVCacheReply:
        self.ctx.registry.get(req.instance_id, session.client)
        self.ctx.registry.unregister(req.instance_id)
        return UnregisterKVCacheReply()
