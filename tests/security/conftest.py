"""The `agents` fixture: worker and attacker processes, always stopped at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .agents import NOBODY, Agent


@pytest.fixture
def agents() -> Iterator:
    """agents(name, uid=None) starts an Agent; all are stopped (or killed) at the end."""
    started: list[Agent] = []

    def start(name: str, uid: int | None = None) -> Agent:
        agent = Agent(name, uid)
        started.append(agent)
        return agent
    yield start
    for agent in started:  # all at once: each takes a moment to close and exit
        agent.stop()
    for agent in started:
        agent.close()


@pytest.fixture(scope="module")
def outsider(server):
    """One process as `nobody` (in nogroup) for a module's attacks on its `server`; each
    test uses its own names in it, and closes its clients."""
    agent = Agent("outsider", uid=NOBODY)
    yield agent
    agent.close()


@pytest.fixture
def admin(server):
    """An admin client of the module's `server`."""
    with server.client(admin=True, timeout=20) as client:
        yield client
