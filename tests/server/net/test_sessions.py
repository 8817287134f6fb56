"""Sessions at their cap: idle ones make room, and a flood of HELLOs costs no scan each;
and a session's fd binding names it for as long as it lasts."""

import pytest

from lmcache_mp.errors import Unauthenticated
from lmcache_mp.server.net import access
from lmcache_mp.server.net.access import SESSION_IDLE_S, Sessions

from ...utils import FakeClock, counted


def full_sessions(monkeypatch, cap):
    monkeypatch.setattr(access, "MAX_SESSIONS", cap)
    clock = FakeClock()
    sessions = Sessions("e" * 32, "a" * 32, token_required=False, clock=clock)
    for i in range(cap):
        sessions.open(b"client-%d" % i, "", "")
    return sessions, clock


def test_a_hello_at_the_cap_forgets_idle_sessions(monkeypatch):
    sessions, clock = full_sessions(monkeypatch, 50)
    with pytest.raises(Unauthenticated, match="already has 50 sessions"):
        sessions.open(b"newcomer", "", "")
    clock.now += SESSION_IDLE_S + 1
    sessions.get(b"client-7")  # still in use
    sessions.open(b"newcomer", "", "")
    assert len(sessions) == 2 and sessions.get(b"client-7")


def test_a_flood_of_hellos_at_the_cap_looks_at_every_session_once_a_second(monkeypatch):
    sessions, clock = full_sessions(monkeypatch, 200)
    scans: list[int] = []
    monkeypatch.setattr(sessions, "expire", counted(scans, sessions.expire))
    for i in range(1000):
        with pytest.raises(Unauthenticated):
            sessions.open(b"flood-%d" % i, "", "")
    assert len(scans) == 1
    clock.now += access.FULL_SCAN_INTERVAL_S
    with pytest.raises(Unauthenticated):
        sessions.open(b"flood-again", "", "")
    assert len(scans) == 2
    sessions.open(b"client-3", "", "")  # a known connection says HELLO again: no cap, no scan
    assert len(scans) == 2


def test_a_sessions_fd_binding_lasts_as_long_as_the_session():
    clock = FakeClock()
    sessions = Sessions("e" * 32, "a" * 32, token_required=False, clock=clock)
    first = sessions.open(b"worker", "", "engine", uid=1000)
    assert (first.uid, len(first.binding)) == (1000, 16) and sessions.bound(first.binding) is first
    again = sessions.open(b"worker", "", "engine", uid=1000)  # a new HELLO: a new binding
    assert again.binding != first.binding and sessions.bound(first.binding) is None
    assert sessions.bound(again.binding) is again
    sessions.drop(b"worker", "a test")
    assert sessions.bound(again.binding) is None
    idle = sessions.open(b"idle", "", "", uid=None)
    clock.now += SESSION_IDLE_S + 1
    assert sessions.expire() == 1 and sessions.bound(idle.binding) is None
