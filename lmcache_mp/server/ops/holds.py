"""RELEASE and END_SESSION: an engine lets go of its lookup holds."""

from __future__ import annotations

from ...protocol import EndSessionReply, EndSessionRequest, ReleaseReply, ReleaseRequest
from ..net.access import Session
from .context import OpContext
from .transfers import lease_owner


class HoldOps:
    def __init__(self, ctx: OpContext):
        self.ctx = ctx

    def release(self, session: Session, req: ReleaseRequest) -> ReleaseReply:
        owners = [lease_owner(session, ref.cache_salt, ref.request_id, f"items[{i}].")
                  for i, ref in enumerate(req.items)]
        return ReleaseReply(sum(self.ctx.store.release(owner) for owner in owners))

    def end_session(self, session: Session, req: EndSessionRequest) -> EndSessionReply:
        return EndSessionReply(self.ctx.store.release(
            lease_owner(session, req.cache_salt, req.request_id)))
