"""One real server for the protocol document's tests that need no special flags; tests use
distinct keys, salts and engines."""

from collections.abc import Iterator

import pytest

from lmcache_mp.spawn import ServerProcess

from .wire import running_server


@pytest.fixture(scope="package")
def server() -> Iterator[ServerProcess]:
    with running_server() as running:
        yield running
