import pytest

from lmcache_mp.client import CacheClient

from .utils import run_server


@pytest.fixture(scope="module")
def server():
    """One server shared by a test module; tests use distinct keys or salts."""
    with run_server("--worker-timeout", "5", "--lease-timeout", "30") as srv:
        yield srv


@pytest.fixture
def client(server):
    with CacheClient(server.url, timeout=10.0) as c:
        yield c
