"""A real Mooncake Store for the L2 tests: mooncake_master and an HTTP metadata server.

Both bind 127.0.0.1 on free ports and are always stopped; the master can be killed and
started again on its port (it comes back empty). The bench's harness starts them
(lmcache_mp/bench/harness/l2_stores.py). Tests are skipped where Mooncake's client cannot
be imported (and fail under CI=true, where scripts/test installs it).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import pytest

from lmcache_mp.bench.harness.l2_stores import MooncakeStore
from lmcache_mp.bench.harness.redis_peer import PeerUnavailable


class TestStore(MooncakeStore):
    """The harness's store, and a Mooncake client of it in the test's process."""

    __test__ = False  # not a test class

    def client(self, segment: int = 0):
        """A Mooncake client of this store in this process, lending `segment` bytes."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        status = store.setup("127.0.0.1", self.metadata_url, segment, 96 * 1024**2, "tcp", "",
                             f"127.0.0.1:{self.master_port}")
        assert status == 0, f"setup failed: {status}"
        return store


def _store(directory: str) -> TestStore:
    """A store not yet started; skip without Mooncake, except under CI=true."""
    try:
        return TestStore(directory)
    except PeerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@contextlib.contextmanager
def mooncake_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[TestStore]:
    """A running store; servers started meanwhile bind their transfer engine to loopback."""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # not eth0's address
    with tempfile.TemporaryDirectory(prefix="lmcache-mp-mooncake-") as directory:
        store = _store(directory)
        try:
            store.start()
            yield store
        finally:
            store.stop()
