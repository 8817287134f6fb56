"""CLEAR and the QUOTA ops (admins only), and the quota file's reload on SIGHUP."""

from __future__ import annotations

from collections.abc import Awaitable

from ...errors import BadRequest
from ...protocol import (
    ClearReply,
    ClearRequest,
    QuotaDeleteRequest,
    QuotaGetRequest,
    QuotaInfo,
    QuotaListReply,
    QuotaListRequest,
    QuotaSetRequest,
    validate_salt,
)
from ..cache.chunk import Chunk
from ..cache.quotas import Quota, QuotaError, load_quota_file
from ..net.access import Session
from .context import OpContext


class AdminOps:
    def __init__(self, ctx: OpContext):
        self.ctx = ctx

    def clear(self, session: Session, req: ClearRequest) -> ClearReply | Awaitable[ClearReply]:
        if req.cache_salt is not None:
            validate_salt(req.cache_salt, "cache_salt")
        if self.ctx.disk is None:
            return ClearReply(self.ctx.store.clear(req.cache_salt))
        gone: list[Chunk] = []
        removed = self.ctx.store.clear(req.cache_salt, gone)
        # A chunk in memory and on disk is one chunk: counted once.
        return self._clear_disk(req.cache_salt, removed - self.ctx.disk.on_disk(gone))

    async def _clear_disk(self, cache_salt: str | None, removed: int) -> ClearReply:
        """A disk holds millions of chunks: they go a slice at a time, and the reply waits
        (a bounded time) until their removal is in the disk's journal, so that it lasts."""
        assert self.ctx.disk is not None  # clear() comes here only with a disk tier
        from_disk = [0]
        await self.ctx.slices.run(self.ctx.disk.clearing(cache_salt, from_disk))
        await self.ctx.disk.removals_recorded()
        return ClearReply(removed + from_disk[0])

    def _quota_info(self, salt: str) -> QuotaInfo:
        store = self.ctx.store
        quota = store.quotas.get(salt)
        usage = store.tenants.get(salt)
        return QuotaInfo(salt, quota.cap, quota.reserve, store.quotas.has_own(salt),
                         usage.bytes_used if usage else 0)

    def quota_set(self, session: Session, req: QuotaSetRequest
                  ) -> QuotaInfo | Awaitable[QuotaInfo]:
        salt = validate_salt(req.cache_salt)
        try:
            self.ctx.store.quotas.set(salt, Quota(req.cap, req.reserve))
        except QuotaError as exc:
            raise BadRequest(f"quota for {salt!r} refused: {exc}") from None
        return self._under_cap(salt)

    def _under_cap(self, salt: str) -> QuotaInfo | Awaitable[QuotaInfo]:
        """The salt brought under its cap, then its quota; what the disk evicted is in its
        journal before the reply (a bounded wait), so that it stays evicted after a crash."""
        self.ctx.store.enforce_cap(salt)
        if self.ctx.disk is None or not self.ctx.disk.enforce_cap(salt):
            return self._quota_info(salt)
        return self._info_once_recorded(salt)

    async def _info_once_recorded(self, salt: str) -> QuotaInfo:
        assert self.ctx.disk is not None  # _under_cap comes here only with a disk tier
        await self.ctx.disk.removals_recorded()
        return self._quota_info(salt)

    def quota_get(self, session: Session, req: QuotaGetRequest) -> QuotaInfo:
        return self._quota_info(validate_salt(req.cache_salt))

    def quota_delete(self, session: Session, req: QuotaDeleteRequest
                     ) -> QuotaInfo | Awaitable[QuotaInfo]:
        """Drop the run-time quota; the file's, the flags' or the default applies again."""
        salt = validate_salt(req.cache_salt)
        try:
            self.ctx.store.quotas.delete(salt)
        except QuotaError as exc:
            raise BadRequest(f"quota for {salt!r} not deleted: {exc}") from None
        return self._under_cap(salt)

    def quota_list(self, session: Session, req: QuotaListRequest) -> QuotaListReply:
        quotas = self.ctx.store.quotas
        return QuotaListReply(quotas.default.cap,
                              [self._quota_info(salt) for salt in sorted(quotas.configured())])

    def reload_quota_file(self) -> None:
        """Read --quota-file again (on SIGHUP); raises QuotaError and keeps the old quotas."""
        config, store = self.ctx.config, self.ctx.store
        if config.quota_file is None:
            raise QuotaError("no --quota-file to reload")
        store.quotas.replace_file(load_quota_file(config.quota_file))
        store.enforce_caps()
        if self.ctx.disk is not None:
            for salt in list(self.ctx.disk.space.salt_ids):
                self.ctx.disk.enforce_cap(salt)
