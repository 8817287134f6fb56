"""The `agents` fixture: worker and attacker processes, always stopped at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .agents import Agent


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
