"""HELLO, PING, REGISTER_KV_CACHE, UNREGISTER_KV_CACHE: a session and its caches."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ... import __version__
from ...errors import UnsupportedVersion
from ...protocol import (
    PROTOCOL_VERSION,
    HelloReply,
    HelloRequest,
    PingReply,
    RegisterKVCacheReply,
    RegisterKVCacheRequest,
    UnregisterKVCacheReply,
    UnregisterKVCacheRequest,
)
from ...zmq_io import peer_uid
from ..net.access import Session
from .context import OpContext

if TYPE_CHECKING:
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

    def register(self, session: Session, req: RegisterKVCacheRequest) -> RegisterKVCacheReply:
        instance = self.ctx.registry.register(session.client, session.engine, req, session.uid)
        return RegisterKVCacheReply(instance.instance_id, instance.num_blocks,
                                    instance.geometry.blocks_per_chunk,
                                    instance.geometry.chunk_bytes)

    def unregister(self, session: Session, req: UnregisterKVCacheRequest
                   ) -> UnregisterKVCacheReply:
        self.ctx.registry.get(req.instance_id, session.client)
        self.ctx.registry.unregister(req.instance_id)
        return UnregisterKVCacheReply()
